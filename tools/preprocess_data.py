"""Tokenize a JSONL corpus into Megatron indexed datasets: {output_prefix}_{key}_document.bin/.idx.

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2
"""

import argparse
import os
import sys
from typing import NoReturn

from data.indexed_dataset import IndexedDatasetError
from data.preprocess import PreprocessError, preprocess_jsonl
from data.tokenizers import TOKENIZER_TYPES


def parse_args(argv=None) -> argparse.Namespace:
    """Megatron's command line (the options that apply to GPT pretraining data)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, or a tokenizer.json (or its folder)")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="NullTokenizer (text = space-separated ids 0..V-1): V, as Megatron's flag; the end-of-document id "
        "is V, so train with model.vocab_size = V + 1",
    )
    p.add_argument("--append-eod", action="store_true", help="append end-of-document to each document")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=1000)
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="count and skip lines that are not UTF-8 / JSON / lack a key, instead of stopping",
    )
    p.add_argument(
        "--parse-special-tokens",
        action="store_true",
        help="treat a literal <|endoftext|> in the text as the end-of-document id (Megatron's "
        "HF-based tokenizer does); default: plain text, so scraped text cannot inject it",
    )
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="write an empty dataset when the input holds no documents (default: error)",
    )
    return p.parse_args(argv)


def usage_error(args: argparse.Namespace) -> str | None:
    """The first bad option, in one line naming it, or None; checked before any process is forked."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.workers < 1:
        return f"--workers {args.workers} must be >= 1"
    if args.workers > cores:  # every worker holds a tokenizer: 100000 of them would exhaust the machine
        return f"--workers {args.workers} is more than the {cores} cores this process may use: give at most {cores}"
    if args.vocab_size is not None and args.vocab_size < 1:
        return f"--vocab-size {args.vocab_size} must be >= 1 (NullTokenizer's ids are 0 .. V-1)"
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        return "--tokenizer-type NullTokenizer needs --vocab-size V (its ids are 0 .. V-1, the end of document V)"
    if args.log_interval < 0:
        return f"--log-interval {args.log_interval} must be >= 0 (0: no progress lines)"
    return None


def fail(message: str) -> NoReturn:
    """One `error:` line on stderr, exit status 2 (bad input, as the trainer's)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None) -> None:
    """Run preprocessing; errors exit 2 with one line."""
    args = parse_args(argv)
    problem = usage_error(args)
    if problem is not None:
        fail(problem)
    try:
        preprocess_jsonl(
            args.input,
            args.output_prefix,
            args.tokenizer_type,
            args.vocab_file,
            args.merge_file,
            args.tokenizer_model,
            args.json_keys,
            args.append_eod,
            args.workers,
            args.log_interval,
            args.skip_bad_lines,
            parse_special_tokens=args.parse_special_tokens,
            allow_empty=args.allow_empty,
            vocab_size=None if args.vocab_size is None else args.vocab_size + 1,
        )
    except (PreprocessError, IndexedDatasetError, ValueError, OSError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        raise SystemExit("interrupted: no output written") from None


if __name__ == "__main__":
    main()
