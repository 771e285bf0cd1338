"""Compare two runs' metrics iteration by iteration: the parity check between a parallel layout and one process.

    python tools/compare_runs.py RUN_DIR_A RUN_DIR_B [--rtol 1e-5] [--strict-iters 20] [--drift-rtol 1e-2]
                                 [--key lm_loss] [--key grad_norm]

Reads RUN_DIR/metrics.jsonl of both runs, pairs the training lines (those with lm_loss) by iteration, and the
validation lines (val_loss) too when both runs have them, prints a table (iteration, a, b, relative difference)
and a verdict. Exit status: 0 within tolerance everywhere, 1 past it (the first differing iteration and its
values are named), 2 for bad input (missing run dir or metrics file, a malformed line, no common iterations).

Two tolerances, because two correct layouts sum in different orders: their rounding differs by ~1e-7 and that
difference grows as training amplifies it. Measured on configs/gpt_tiny.yaml, tp 2 x pp 2 x vp 2 x dp 2 against
one process (fp32): 1.2e-7 at iteration 10, 2.0e-6 at 20, 2.6e-4 at 30, at most 4.0e-3 up to iteration 300;
the same process run with 1 thread against 2 threads is bitwise equal up to iteration 20, then differs by
6e-7 at 30 and 2.4e-5 at 50. So iterations up to --strict-iters must agree
within --rtol (a wrong reduction shows from the first iteration, far above 1e-5), later ones within
--drift-rtol. `--strict-iters -1` applies --rtol everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from config.cli import numbers_as_values


class BadInput(Exception):
    """A run that cannot be compared: the message says which file and why."""


def read_metrics_file(run_dir: str) -> tuple[dict[int, dict], dict[int, dict]]:
    """(training lines, validation lines) of run_dir/metrics.jsonl, each keyed by iteration (last line wins)."""
    if not os.path.isdir(run_dir):
        raise BadInput(f"run directory {run_dir} does not exist")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise BadInput(f"no metrics file {path}")
    train: dict[int, dict] = {}
    valid: dict[int, dict] = {}
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise BadInput(
                    f"{path}:{number}: not UTF-8 text (byte {err.start}): give a run's metrics.jsonl"
                ) from None
            except json.JSONDecodeError as err:
                raise BadInput(f"{path}:{number}: malformed JSON ({err.msg})") from None
            except RecursionError:
                raise BadInput(f"{path}:{number}: JSON nested too deeply to be a metrics record") from None
            if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
                raise BadInput(f"{path}:{number}: not a metrics record with an integer 'iteration'")
            if "lm_loss" in record:
                train[record["iteration"]] = record
            if "val_loss" in record:
                valid[record["iteration"]] = record
    return train, valid


def relative_difference(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def tolerance_at(iteration: int, rtol: float, strict_iters: int, drift_rtol: float) -> float:
    """--rtol up to strict_iters (all iterations when negative), the looser drift tolerance after."""
    if strict_iters < 0 or iteration <= strict_iters:
        return rtol
    return max(rtol, drift_rtol)


def compare(rows_a: dict[int, dict], rows_b: dict[int, dict], key: str, tolerance, out) -> tuple[int, list[str]]:
    """Print one table for `key`; `tolerance(iteration)` gives the rtol there. Returns (number of compared
    iterations, failure messages)."""
    common = sorted(i for i in set(rows_a) & set(rows_b) if key in rows_a[i] and key in rows_b[i])
    failures: list[str] = []
    if not common:
        return 0, failures
    print(f"{key}:", file=out)
    print(f"  {'iteration':>9}  {'a':>14}  {'b':>14}  {'rel diff':>9}", file=out)
    for iteration in common:
        a, b = float(rows_a[iteration][key]), float(rows_b[iteration][key])
        diff = relative_difference(a, b)
        rtol = tolerance(iteration)
        flag = "" if diff <= rtol else "  <-- over rtol"
        print(f"  {iteration:>9}  {a:>14.8g}  {b:>14.8g}  {diff:>9.2e}{flag}", file=out)
        if diff > rtol:
            failures.append(
                f"{key} differs first at iteration {iteration}: {a!r} vs {b!r} "
                f"(relative difference {diff:.2e} > rtol {rtol:g})"
            )
    return len(common), failures[:1]


NUMBER_OPTIONS = ("--rtol", "--drift-rtol", "--strict-iters")


def check_tolerances(args: argparse.Namespace) -> None:
    """A negative or non-finite tolerance would pass or fail every comparison: BadInput naming the option."""
    for option, value in (("--rtol", args.rtol), ("--drift-rtol", args.drift_rtol)):
        if not 0 <= value < math.inf:
            raise BadInput(f"{option} {value} must be a finite number >= 0 (0: bitwise equal)")
    if args.strict_iters < -1:
        raise BadInput(f"--strict-iters {args.strict_iters} must be >= -1 (-1: --rtol at every iteration)")


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument(
        "--rtol", type=float, default=1e-5, help="largest relative difference up to --strict-iters (default 1e-5)"
    )
    parser.add_argument("--strict-iters", type=int, default=20, help="iterations held to --rtol; -1 = all (default 20)")
    parser.add_argument(
        "--drift-rtol", type=float, default=1e-2, help="largest relative difference after --strict-iters (default 1e-2)"
    )
    parser.add_argument(
        "--key", action="append", dest="keys", help="training metric to compare (repeatable; default lm_loss)"
    )
    args = parser.parse_args(numbers_as_values(sys.argv[1:] if argv is None else argv, NUMBER_OPTIONS))
    keys = args.keys or ["lm_loss"]
    try:
        check_tolerances(args)
        train_a, valid_a = read_metrics_file(args.run_a)
        train_b, valid_b = read_metrics_file(args.run_b)
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    def tolerance(iteration: int) -> float:
        return tolerance_at(iteration, args.rtol, args.strict_iters, args.drift_rtol)

    compared, failures = 0, []
    for key in keys:
        count, failed = compare(train_a, train_b, key, tolerance, out)
        if count == 0:
            print(
                f"error: no common training iterations with {key!r} in {args.run_a} and {args.run_b}", file=sys.stderr
            )
            return 2
        compared += count
        failures += failed
    if valid_a and valid_b:
        count, failed = compare(valid_a, valid_b, "val_loss", tolerance, out)
        compared += count
        failures += failed
    if failures:
        print(f"FAIL: {failures[0]}", file=out)
        return 1
    drift = (
        ""
        if args.strict_iters < 0
        else (f" up to iteration {args.strict_iters}, {max(args.rtol, args.drift_rtol):g} after")
    )
    print(
        f"OK: {compared} values ({', '.join(keys)}{', val_loss' if valid_a and valid_b else ''}) within "
        f"rtol {args.rtol:g}{drift}",
        file=out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
