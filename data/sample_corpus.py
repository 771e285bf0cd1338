"""The embedded sample corpus: the running interpreter's standard library sources, tokenized.

One document per .py file, in sorted relative-path order, from sysconfig's stdlib folder (site-packages
and dist-packages excluded), so every machine with the same Python builds the same corpus. The GPT-2 byte-level
BPE trainer runs on every 4th file with a vocabulary of 257 (the 256 bytes + <|endoftext|>: no merges), and
the corpus is preprocessed with --append-eod semantics. Why bytes: the default run must visibly learn in a few
minutes on 2 CPU cores. Measured with the tiny default model (8 layers, 300-800 iterations of 2,048 tokens),
validation loss / its iteration-0 value: 0.62 at 8192 entries, 0.61 at 512, 0.59 at 384 (merges remove
the easy, predictable runs such as indentation), 0.43 at 257 bytes. Users train real vocabularies with
tools/train_tokenizer.py.
Everything is built in a temporary sibling folder and renamed into place, so a half-built corpus is
never picked up; a second call finds the marker file and returns at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time

from data.atomic_files import honour_umask
from data.preprocess import preprocess_jsonl
from data.tokenizer_training import iter_jsonl_texts, train_gpt2_bpe

VOCAB_SIZE = 257  # byte level; see the module docstring
MARKER = "corpus.json"
_TRAIN_EVERY = 4
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files(stdlib_dir: str | None = None) -> list[str]:
    """Paths of the standard library's .py files, sorted by path relative to the stdlib folder."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        found += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return [os.path.join(root, rel) for rel in sorted(found)]


def write_stdlib_jsonl(path: str, stdlib_dir: str | None = None) -> tuple[int, int]:
    """Write one {"text": source} line per stdlib file; returns (documents, bytes of source)."""
    docs = total = 0
    with open(path, "w", encoding="utf-8") as out:
        for src in stdlib_source_files(stdlib_dir):
            with open(src, "rb") as f:
                raw = f.read()
            # A few test files are deliberately not UTF-8; replacement keeps the corpus deterministic.
            out.write(json.dumps({"text": raw.decode("utf-8", errors="replace")}, ensure_ascii=False) + "\n")
            docs += 1
            total += len(raw)
    return docs, total


def _result(root_dir: str) -> dict:
    return {
        "data_prefix": os.path.join(root_dir, "stdlib_text_document"),
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": os.path.join(root_dir, "vocab.json"),
        "merge_file": os.path.join(root_dir, "merges.txt"),
    }


def _build(build_dir: str, log, stdlib_dir: str | None) -> dict:
    start = time.perf_counter()
    jsonl = os.path.join(build_dir, "stdlib.jsonl")
    docs, size = write_stdlib_jsonl(jsonl, stdlib_dir)
    log(f"[sample corpus] {docs} stdlib files, {size / 1e6:.1f} MB -> {jsonl} ({time.perf_counter() - start:.1f} s)")
    # Every 4th file (~8 MB) trains a vocabulary about as well as all of them, 5x faster.
    sample = (text for k, text in enumerate(iter_jsonl_texts(jsonl)) if k % _TRAIN_EVERY == 0)
    train_gpt2_bpe(sample, VOCAB_SIZE, build_dir)
    log(f"[sample corpus] trained byte-level BPE, vocabulary {VOCAB_SIZE} ({time.perf_counter() - start:.1f} s)")
    workers = max(1, min(2, os.cpu_count() or 1))
    stats = preprocess_jsonl(
        jsonl,
        os.path.join(build_dir, "stdlib"),
        "GPT2BPETokenizer",
        os.path.join(build_dir, "vocab.json"),
        os.path.join(build_dir, "merges.txt"),
        append_eod=True,
        workers=workers,
        log_interval=500,
        log=lambda msg: log(f"[sample corpus] {msg}"),
    )
    info = dict(
        documents=docs,
        source_bytes=size,
        tokens=stats.tokens,
        vocab_size=VOCAB_SIZE,
        python=sys.version.split()[0],
        build_seconds=round(time.perf_counter() - start, 1),
    )
    with open(os.path.join(build_dir, MARKER), "w") as f:
        json.dump(info, f, indent=2)
    return info


def ensure_sample_corpus(root_dir: str, progress: bool = True, stdlib_dir: str | None = None) -> dict:
    """Build the sample corpus under root_dir unless already there; return its data_prefix and tokenizer.

    Returns {"data_prefix", "tokenizer_type", "vocab_file", "merge_file"}. `stdlib_dir` (tests only)
    replaces the interpreter's standard library folder.
    """
    root_dir = os.path.abspath(root_dir)
    if os.path.exists(os.path.join(root_dir, MARKER)):
        return _result(root_dir)
    parent = os.path.dirname(root_dir)
    os.makedirs(parent, exist_ok=True)
    # Ranks starting together on one machine: one builds, the others wait here and then find the marker.
    # (Across machines the rename below still keeps the result whole; at worst both build.)
    lock_path = os.path.join(parent, f".{os.path.basename(root_dir)}.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.exists(os.path.join(root_dir, MARKER)):
                _build_in_place(root_dir, progress, stdlib_dir)
        finally:
            # Safe to unlink while others wait on it: each re-checks the marker once it holds the lock.
            if os.path.exists(lock_path):
                os.remove(lock_path)
    return _result(root_dir)


def _build_in_place(root_dir: str, progress: bool, stdlib_dir: str | None) -> None:
    if os.path.isdir(root_dir) and os.listdir(root_dir):
        raise RuntimeError(
            f"{root_dir}: exists, is not empty and holds no {MARKER}; remove it to rebuild the sample corpus"
        )
    log = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    log(f"[sample corpus] building {root_dir} (first run only)")
    parent = os.path.dirname(root_dir)
    build_dir = tempfile.mkdtemp(prefix=os.path.basename(root_dir) + ".building-", dir=parent)
    try:
        honour_umask(build_dir, directory=True)  # mkdtemp makes it 0700: teammates could not read the corpus
        info = _build(build_dir, log, stdlib_dir)
        if os.path.isdir(root_dir) and not os.listdir(root_dir):
            os.rmdir(root_dir)
        try:
            os.rename(build_dir, root_dir)
        except OSError:
            if not os.path.exists(os.path.join(root_dir, MARKER)):
                raise  # not a concurrent builder finishing first: a real failure
        log(
            f"[sample corpus] ready: {info['documents']} documents, {info['tokens']} tokens "
            f"in {info['build_seconds']} s"
        )
    finally:
        if os.path.exists(build_dir):
            shutil.rmtree(build_dir, ignore_errors=True)


def build_tiny_corpus(root: str, num_files: int = 60) -> dict:
    """A small real corpus for tests and scripts (the first `num_files` top-level stdlib modules, sorted), a
    512-token BPE trained on it and its .bin/.idx; returns {"data_prefix", "vocab_file", "merge_file"}.
    Seconds to build, unlike the sample corpus; the same files on every machine with the same Python."""
    # Twin: tests/fixtures/checkpoint_format2/make_fixture.build_corpus repeats these steps at a smaller size,
    # because it must run against the code before issue 18, which has no such function.
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))[:num_files]
    texts = []
    for name in names:
        with open(os.path.join(stdlib, name), encoding="utf-8") as handle:
            texts.append(handle.read())
    os.makedirs(root, exist_ok=True)
    jsonl = os.path.join(root, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    vocab, merges = train_gpt2_bpe(texts, 512, root)
    preprocess_jsonl(
        jsonl,
        os.path.join(root, "tiny"),
        "GPT2BPETokenizer",
        vocab_file=vocab,
        merge_file=merges,
        append_eod=True,
        log=lambda msg: None,
    )
    return {"data_prefix": os.path.join(root, "tiny_text_document"), "vocab_file": vocab, "merge_file": merges}
