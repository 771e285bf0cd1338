"""Compile every Triton kernel configuration for every GPU target and write the table the AOT kernel test reads
(model/kernels/aot_results.json, see model/kernels/aot_results.py). Run it after changing a kernel, the block
configurations the launch code picks, Triton or its ptxas; commit the table with the change.

    python scripts/write_aot_results.py [--workers N] [--out PATH]

~313 CPU s with an empty Triton cache (543 compilations), seconds with a warm one. Exit status 1 when a
configuration does not compile (the table records the error and the test fails on it), else 0.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from model.kernels import aot, aot_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--out", type=Path, default=aot_results.RESULTS_PATH, help="default: %(default)s")
    args = parser.parse_args(argv)
    jobs = aot_results.all_jobs()
    results = aot.compile_jobs(jobs, args.workers)
    aot_results.write(jobs, results, aot_results.fingerprint_inputs(aot.supported_archs()), args.out)
    errors = [result for result in results if isinstance(result, str)]
    print(f"wrote {args.out}: {len(jobs)} compilations, {len(errors)} compile error(s)")
    for error in errors:
        print(error)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
