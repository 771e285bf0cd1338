"""What one start of the trainer costs, in CPU seconds: a new interpreter importing torch, then the trainer, then a
2-iteration run of the default config (configs/gpt_tiny.yaml on the bundled sample corpus, no checkpoint). Every
torchrun rank, SLURM task and entry-point test pays this before its first real iteration.

    python scripts/benchmarks/bench_startup.py [--repeats 5]

Prints, for each step, the min and median CPU s (user + system of the new process) over --repeats runs, and
which packages the run imported after `import pretrain_gpt` (new top-level packages and torch subpackages:
tests/test_start_up_imports.py checks that dynamo, Triton and sympy are not among them). Run it on an otherwise
idle machine: start-up is mostly import work, which a busy neighbour slows by tens of percent.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

from bench_models import REPO_ROOT

# the packages a run imported after `import pretrain_gpt`: new top-level ones, and torch's new subpackages
RUN = """
import json, sys
import pretrain_gpt
before = set(sys.modules)
code = pretrain_gpt.main(sys.argv[1:])
new = {m.split(".")[0] if not m.startswith("torch.") else ".".join(m.split(".")[:2]) for m in set(sys.modules) - before}
print(json.dumps({"code": code, "imported": sorted(new)}))
"""


def child_cpu_seconds(argv: list[str]) -> tuple[float, str]:
    """(user + system CPU s, stdout) of one new process running argv to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv[:3])} ... exited {proc.returncode}: {proc.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="bench_startup_")
    run_argv = [
        sys.executable,
        "-c",
        RUN,
        "--config",
        os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"),
        "train.train_iters=2",
        "optim.lr_warmup_iters=1",
        "train.eval_iters=0",
        "checkpoint.save=false",
        "logging.tensorboard=false",
        f"run.dir={run_dir}",
    ]
    steps = {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "python -c 'import pretrain_gpt'": [sys.executable, "-c", "import pretrain_gpt"],
        "import + 2 iterations of gpt_tiny": run_argv,
    }
    child_cpu_seconds(run_argv)  # builds the sample corpus on a first run; warms the file cache
    print(f"CPU s of one new process ({args.repeats} runs each; OMP_NUM_THREADS=1)")
    print(f"{'step':<36} {'min':>6} {'median':>7}")
    imported: list[str] = []
    for name, argv in steps.items():
        seconds = []
        for _ in range(args.repeats):
            cpu, stdout = child_cpu_seconds(argv)
            seconds.append(cpu)
            if argv is run_argv:
                result = json.loads(stdout.strip().splitlines()[-1])
                if result["code"] != 0:
                    raise SystemExit(f"error: the trainer exited {result['code']}: {stdout[-2000:]}")
                imported = result["imported"]
        print(f"{name:<36} {min(seconds):6.2f} {statistics.median(seconds):7.2f}")
    print(f"packages the run imported after `import pretrain_gpt`: {', '.join(imported) or 'none'}")


if __name__ == "__main__":
    main()
