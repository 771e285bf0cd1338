"""Merge indexed datasets (.bin/.idx prefixes) into one, as Megatron's tools/merge_datasets.py.

Example:
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document
    python tools/merge_datasets.py --input-dir shards/ --output-prefix all_text_document
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.indexed_dataset import IndexedDatasetError, merge_datasets  # noqa: E402


def main(argv=None) -> None:
    """Merge the given prefixes (in order), or every prefix in --input-dir (sorted)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=[], help="dataset prefixes, merged in this order")
    p.add_argument("--input-dir", help="merge every PREFIX.idx/.bin pair found here, in sorted order")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    prefixes = list(args.input)
    if args.input_dir:
        names = sorted(f[:-4] for f in os.listdir(args.input_dir) if f.endswith(".idx"))
        prefixes += [os.path.join(args.input_dir, n) for n in names]
    if not prefixes:
        raise SystemExit("error: give --input prefixes or an --input-dir holding .idx/.bin pairs")
    try:
        merge_datasets(prefixes, args.output_prefix)
    except (IndexedDatasetError, ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin / .idx")


if __name__ == "__main__":
    main()
