"""Train a tokenizer from JSONL: GPT-2-style byte-level BPE (vocab.json + merges.txt) or SentencePiece.

Examples:
    python tools/train_tokenizer.py --input corpus.jsonl --type gpt2bpe --vocab-size 8192 --output-dir tok/
    python tools/train_tokenizer.py --input corpus.jsonl --type sentencepiece --vocab-size 8000 \
        --output-dir tok/   # writes tok/tokenizer.model
"""

import argparse
import os
import sys

from data.tokenizer_training import iter_jsonl_texts, train_gpt2_bpe, train_sentencepiece


def main(argv=None) -> None:
    """Train and write the tokenizer files; errors exit 2 with one line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL file(s)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--type", choices=["gpt2bpe", "sentencepiece"], default="gpt2bpe")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2, help="BPE: least pair count to merge")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)

    def texts():
        for path in args.input:
            yield from iter_jsonl_texts(path, args.json_key)

    try:
        if args.type == "gpt2bpe":
            vocab, merges = train_gpt2_bpe(texts(), args.vocab_size, args.output_dir, args.min_frequency)
            print(f"wrote {vocab} and {merges}")
        else:
            model = train_sentencepiece(texts(), args.vocab_size, os.path.join(args.output_dir, "tokenizer"))
            print(f"wrote {model}")
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
