"""Build the sample corpus (the Python standard library's sources, tokenized) if it is missing.

python tools/prepare_sample_data.py [--output-dir sample_data]
"""

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from data.sample_corpus import ensure_sample_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the corpus and print where it is; 0 done, 2 bad input (one `error:` line), as every tool."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "sample_data"))
    args = p.parse_args(argv)
    try:
        info = ensure_sample_corpus(args.output_dir, progress=True)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
