"""JSONL -> {prefix}_{key}_document.bin/.idx, as Megatron's tools/preprocess_data.py (no sentence splitting;
a value that is a list of strings, Megatron's sentence-split form, is one document of one sequence each).

Lines go to worker processes in batches; results come back in input order and are appended to builders
writing temporary files, renamed only when every line is done, so a failed or interrupted run never
leaves an output that looks complete.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from typing import ClassVar

import numpy as np

from data.indexed_dataset import IndexedDatasetBuilder, best_dtype, bin_path, idx_path
from data.tokenizers import EOD_TOKEN, Tokenizer, build_tokenizer

# What one line of the input becomes: (line number, {json key: token arrays of its sequences} or the reason the
# line is bad, bytes read)
EncodedLine = tuple[int, dict[str, list[np.ndarray]] | str, int]

# A task is up to this many lines or bytes: enough to amortise inter-process pickling, small enough that
# a corpus of a few thousand large documents still spreads evenly over the workers.
_BATCH_LINES = 256
_BATCH_BYTES = 1 << 18


class PreprocessError(ValueError):
    """A bad input line (message names file and line) or a bad setting."""


@dataclass
class PreprocessStats:
    """Totals of one preprocessing run."""

    documents: int = 0
    bytes: int = 0
    tokens: int = 0
    bad_lines: int = 0
    seconds: float = 0.0
    encode_cpu_seconds: float = 0.0  # CPU time of the encoding processes (the pool, or this process)
    outputs: list[str] = field(default_factory=list)


class _Encoder:
    """Encodes batches of raw lines; the tokenizer lives on the class so each worker builds it once."""

    tokenizer: ClassVar[Tokenizer | None] = None  # one of data/tokenizers.py's classes, built by initialize()
    settings: ClassVar[dict] = {}

    @classmethod
    def initialize(cls, settings: dict) -> None:
        cls.settings = settings
        cls.tokenizer = build_tokenizer(**settings["tokenizer_args"])

    @classmethod
    def encode_batch(cls, batch: tuple[int, list[bytes]]) -> list[EncodedLine]:
        """[(line_no, {key: tokens} or error message, n_bytes)] for one batch of lines."""
        first_line, lines = batch
        return [cls._encode_line(first_line + k, raw) for k, raw in enumerate(lines)]

    @classmethod
    def _encode_line(cls, line_no: int, raw: bytes) -> EncodedLine:
        settings, tokenizer = cls.settings, cls.tokenizer
        assert tokenizer is not None, "_Encoder.initialize builds the tokenizer first"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return line_no, f"not valid UTF-8 ({exc.reason} at byte {exc.start})", len(raw)
        except ValueError as exc:
            return line_no, f"not valid JSON ({exc})", len(raw)
        except RecursionError:  # json's decoder recurses once per nesting level
            return line_no, "JSON nested too deeply to be a document", len(raw)
        out = {}
        for key in settings["json_keys"]:
            if not isinstance(record, dict) or key not in record:
                return line_no, f"no key {key!r}", len(raw)
            value = record[key]
            # Megatron's sentence-split form: a list of strings is one document, one sequence per string.
            texts = value if isinstance(value, list) else [value]
            if not all(isinstance(t, str) for t in texts):
                return line_no, f"value of {key!r} is not a string or a list of strings", len(raw)
            try:
                sequences = [ids for ids in (cls._encode_text(t) for t in texts) if ids]
            except UnicodeEncodeError as exc:
                return line_no, f"value of {key!r} is not encodable as UTF-8 ({exc.reason})", len(raw)
            if sequences and settings["append_eod"]:
                sequences[-1].append(tokenizer.eod)
            out[key] = [np.asarray(ids, dtype=settings["dtype"]) for ids in sequences]
        return line_no, out, len(raw)

    @classmethod
    def _encode_text(cls, text: str) -> list[int]:
        """Token ids; with parse_special_tokens a literal end-of-document string becomes the eod id."""
        tokenizer = cls.tokenizer
        assert tokenizer is not None, "_Encoder.initialize builds the tokenizer first"
        if not cls.settings["parse_special_tokens"]:
            return tokenizer.encode(text)
        ids: list[int] = []
        for k, piece in enumerate(text.split(EOD_TOKEN)):
            if k:
                ids.append(tokenizer.eod)
            ids += tokenizer.encode(piece)
        return ids


def _read_batches(path: str) -> Iterator[tuple[int, list[bytes]]]:
    with open(path, "rb") as f:
        batch: list[bytes] = []
        first, size = 1, 0
        for line_no, raw in enumerate(f, 1):
            if not batch:
                first, size = line_no, 0
            batch.append(raw.rstrip(b"\r\n"))
            size += len(raw)
            if len(batch) == _BATCH_LINES or size >= _BATCH_BYTES:
                yield first, batch
                batch = []
        if batch:
            yield first, batch


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: {output_prefix}_{key}_document."""
    return f"{output_prefix}_{key}_document"


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer_type: str,
    vocab_file=None,
    merge_file=None,
    tokenizer_model=None,
    json_keys=("text",),
    append_eod=False,
    workers: int = 1,
    log_interval: int = 1000,
    skip_bad_lines: bool = False,
    log: Callable[[str], None] | None = None,
    parse_special_tokens: bool = False,
    allow_empty: bool = False,
    vocab_size: int | None = None,
) -> PreprocessStats:
    """Tokenize a JSONL file into indexed datasets, one per key; returns run totals.

    parse_special_tokens: a literal <|endoftext|> in the text becomes the end-of-document id (megatron-core's
    HF-based GPT-2 tokenizer does so); off by default: text that mentions it cannot cut documents.
    allow_empty: write an empty dataset when no document was read, instead of failing.
    vocab_size: NullTokenizer's size (the ids plus the end-of-document id); the other types ignore it.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    tokenizer = {"tokenizer_type": tokenizer_type, "vocab_file": vocab_file, "merge_file": merge_file}
    tokenizer.update(tokenizer_model=tokenizer_model, vocab_size=vocab_size)
    settings = _settings(input_path, tokenizer, json_keys, append_eod, parse_special_tokens)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    tmp = {key: (bin_path(p) + ".tmp", idx_path(p) + ".tmp") for key, p in prefixes.items()}
    builders: dict[str, IndexedDatasetBuilder] = {}
    stats, pool = PreprocessStats(), None
    out_dir = os.path.dirname(os.path.abspath(next(iter(prefixes.values()))))  # every key's files go here
    made_dir = not os.path.isdir(out_dir)  # removed again (when empty) if the run fails
    try:
        os.makedirs(out_dir, exist_ok=True)
        for key in json_keys:
            builders[key] = IndexedDatasetBuilder(tmp[key][0], settings["dtype"])
        pool, results = _start_encoding(input_path, settings, workers)
        cpu_before = _cpu_seconds(pool is not None)
        _consume(results, builders, stats, input_path, skip_bad_lines, log_interval, log)
        if pool is not None:
            pool.close()
            pool.join()  # reaped workers' CPU time shows up in RUSAGE_CHILDREN
        stats.encode_cpu_seconds = _cpu_seconds(pool is not None) - cpu_before
        _check_not_empty(stats, input_path, allow_empty, log)
        _publish(builders, prefixes, tmp, stats)
    finally:
        if pool is not None:
            pool.terminate()
        for builder in builders.values():
            builder.close()
        for paths in tmp.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
        if made_dir and not stats.outputs and os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
    _report(stats, workers, log)
    return stats


def _start_encoding(input_path: str, settings: dict, workers: int) -> tuple[Pool | None, Iterator[list[EncodedLine]]]:
    """(the worker pool or None, the encoded batches in input order): `workers` processes, or this one."""
    if workers > 1:
        pool = multiprocessing.get_context("fork").Pool(workers, _Encoder.initialize, (settings,))
        return pool, pool.imap(_Encoder.encode_batch, _read_batches(input_path), chunksize=1)
    _Encoder.initialize(settings)
    return None, map(_Encoder.encode_batch, _read_batches(input_path))


def _check_not_empty(stats: PreprocessStats, input_path: str, allow_empty: bool, log: Callable[[str], None]) -> None:
    """No document read: an error, or with allow_empty a warning (an empty dataset is then written)."""
    if stats.documents:
        return
    if not allow_empty:
        raise PreprocessError(
            f"{input_path}: no documents read (empty input or every line skipped); "
            "nothing written (--allow-empty writes an empty dataset)"
        )
    log(f"WARNING: {input_path}: no documents read; writing an EMPTY dataset (--allow-empty)")


def _publish(
    builders: dict[str, IndexedDatasetBuilder],
    prefixes: dict[str, str],
    tmp: dict[str, tuple[str, str]],
    stats: PreprocessStats,
) -> None:
    """Finish each key's .idx, then move .bin and .idx into place (whole files only, never half-written)."""
    for key, builder in builders.items():
        builder.finalize(tmp[key][1])
    for key, prefix in prefixes.items():
        os.replace(tmp[key][0], bin_path(prefix))
        os.replace(tmp[key][1], idx_path(prefix))
        stats.outputs.append(prefix)


def _settings(input_path, tokenizer_args: dict, json_keys, append_eod, parse_special_tokens) -> dict:
    """What each encoding process needs (picklable); checks the input and the tokenizer first.
    tokenizer_args: build_tokenizer's keyword arguments."""
    if not os.path.isfile(input_path):
        raise PreprocessError(f"{input_path}: input file not found")
    tokenizer_type = tokenizer_args["tokenizer_type"]
    if parse_special_tokens and tokenizer_type != "GPT2BPETokenizer":
        raise PreprocessError(f"--parse-special-tokens applies to GPT2BPETokenizer, not {tokenizer_type}")
    tokenizer = build_tokenizer(**tokenizer_args)
    return dict(
        tokenizer_args=tokenizer_args,
        json_keys=list(json_keys),
        append_eod=append_eod,
        dtype=best_dtype(tokenizer.vocab_size),
        parse_special_tokens=parse_special_tokens,
    )


def _consume(
    results: Iterator[list[EncodedLine]],
    builders: dict[str, IndexedDatasetBuilder],
    stats: PreprocessStats,
    input_path: str,
    skip_bad_lines: bool,
    log_interval: int,
    log: Callable[[str], None],
) -> None:
    start = time.perf_counter()
    for batch in results:
        for line_no, out, n_bytes in batch:
            stats.bytes += n_bytes
            if isinstance(out, str):
                if not skip_bad_lines:
                    raise PreprocessError(f"{input_path}:{line_no}: {out} (use --skip-bad-lines to skip such lines)")
                stats.bad_lines += 1
                continue
            for key, sequences in out.items():
                # Megatron: an empty document has no sequence, only a document boundary.
                for tokens in sequences:
                    builders[key].add_item(tokens)
                    stats.tokens += int(tokens.size)
                builders[key].end_document()
            stats.documents += 1
            if log_interval and stats.documents % log_interval == 0:
                elapsed = time.perf_counter() - start
                log(
                    f"processed {stats.documents} documents "
                    f"({stats.documents / elapsed:.1f} docs/s, {stats.bytes / elapsed / 1e6:.2f} MB/s)"
                )
    stats.seconds = time.perf_counter() - start


def _cpu_seconds(children: bool) -> float:
    if children:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime
    return time.process_time()


def _report(stats: PreprocessStats, workers: int, log: Callable[[str], None]) -> None:
    rate = stats.bytes / max(stats.seconds, 1e-9) / 1e6
    log(
        f"done: {stats.documents} documents, {stats.tokens} tokens, {stats.bytes / 1e6:.2f} MB in "
        f"{stats.seconds:.2f} s: {stats.documents / max(stats.seconds, 1e-9):.1f} docs/s, {rate:.2f} MB/s "
        f"({rate / max(workers, 1):.2f} MB/s per worker, {workers} workers)"
    )
    if stats.encode_cpu_seconds > 0:
        # Wall-clock rates fall when other jobs share the cores; MB per CPU-second of the encoding
        # processes is the per-worker speed on an otherwise idle core.
        log(
            f"encoding CPU time {stats.encode_cpu_seconds:.2f} s: "
            f"{stats.bytes / stats.encode_cpu_seconds / 1e6:.2f} MB per worker CPU-second"
        )
    if stats.bad_lines:
        log(f"skipped {stats.bad_lines} bad lines")
    for prefix in stats.outputs:
        log(f"wrote {prefix}.bin / .idx")
