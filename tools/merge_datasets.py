"""Merge indexed datasets (.bin/.idx prefixes) into one, as Megatron's tools/merge_datasets.py.

Example:
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document
    python tools/merge_datasets.py --input-dir shards/ --output-prefix all_text_document
"""

import argparse
import os
import sys

from data.indexed_dataset import IndexedDatasetError, merge_datasets


class InputError(Exception):
    """Bad input to the tool: its message is the one `error:` line (exit status 2)."""


def _prefixes_in(directory: str) -> list[str]:
    """Sorted prefixes of the .idx/.bin pairs in `directory`; a lone half of a pair is an error."""
    names = {os.path.splitext(f)[0] for f in os.listdir(directory) if f.endswith((".idx", ".bin"))}
    for name in sorted(names):
        for ext in (".idx", ".bin"):
            if not os.path.isfile(os.path.join(directory, name + ext)):
                raise InputError(f"{os.path.join(directory, name + ext)} is missing")
    return [os.path.join(directory, n) for n in sorted(names)]


def main(argv: list[str] | None = None) -> int:
    """Merge the given prefixes (in order), or every prefix in --input-dir (sorted); 0 done, 2 bad input (one
    `error:` line), as every tool."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        default=[],
        help="dataset prefixes, merged in this order; a directory (Megatron's usage) stands for "
        "every PREFIX.idx/.bin pair in it, in sorted order",
    )
    p.add_argument("--input-dir", help="same as giving this directory to --input")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    try:
        prefixes: list[str] = []
        for item in args.input + ([args.input_dir] if args.input_dir else []):
            prefixes += _prefixes_in(item) if os.path.isdir(item) else [item]
        if not prefixes:
            raise InputError("give --input prefixes or an --input-dir holding .idx/.bin pairs")
        merge_datasets(prefixes, args.output_prefix)
    except (InputError, IndexedDatasetError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a read-only folder: the file and the reason, not "[Errno 28] ..."
        print(f"error: cannot write {exc.filename or args.output_prefix}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin / .idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
