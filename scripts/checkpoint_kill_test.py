"""kill -9 during checkpoint saves, N times, and check after each kill that the tracker names a checkpoint that
verifies (every byte) and loads.

    python scripts/checkpoint_kill_test.py --kills 10 --mode sync  [--workdir DIR]
    python scripts/checkpoint_kill_test.py --kills 10 --mode async

Each round resumes the same run (checkpoint.load=true, a save every iteration), waits for training to be under
way, sends SIGKILL after a random delay, then: the tracker's checkpoint must pass the checksum verification
(every file's size and CRC-32, checkpoint/files.py) and every tensor must read back; a save folder left
by the killed process (*.tmp.<pid>) is removed by the next round's start. Prints how many kills landed while a save was in progress. Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from checkpoint import (  # noqa: E402
    TMP_RE,
    iter_name,
    read_global_tensors,
    read_meta,
    read_tracker,
    resolve_checkpoint,
    verify_files,
)
from data.sample_corpus import build_tiny_corpus  # noqa: E402

# A model whose save (write, fsync, checksum) takes a good share of an iteration, so kills land in saves.
MODEL = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.hidden_dropout=0.1",
    "model.attention_dropout=0.1",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_iters=0",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "optim.lr_warmup_iters=2",
    "data.num_workers=0",
]


def launch(run_dir: str, data_args: list[str], mode: str, train_iters: int) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        os.path.join(REPO, "pretrain_gpt.py"),
        *data_args,
        *MODEL,
        f"run.dir={run_dir}",
        f"train.train_iters={train_iters}",
        "checkpoint.save_interval=1",
        "checkpoint.load=true",
        f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
        "checkpoint.keep_last=3",
    ]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_latest(root: str) -> int:
    """The tracker's checkpoint verifies and every tensor reads back; returns its iteration."""
    iteration = read_tracker(root)
    iter_dir = resolve_checkpoint(root)
    if iteration is not None and not iter_dir.endswith(iter_name(iteration)):
        raise AssertionError(f"tracker names {iteration} but {iter_dir} is the latest complete checkpoint")
    verify_files(iter_dir)  # every byte against checksums.json
    tensors = read_global_tensors(iter_dir)  # every stored extent is inside its file
    if not tensors:
        raise AssertionError(f"{iter_dir} holds no tensors")
    return int(read_meta(iter_dir)["iteration"])


def one_round(run_dir: str, data_args: list[str], mode: str, rng: random.Random, max_delay: float) -> bool:
    """Start, wait for the first training line, kill -9 after a random delay; True if a save was in flight."""
    proc = launch(run_dir, data_args, mode, train_iters=10_000)
    assert proc.stdout is not None  # launched with stdout=PIPE
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("iter "):
            break
    else:
        raise AssertionError(f"the run ended before training (exit {proc.wait()}):\n{''.join(seen[-5:])}")

    time.sleep(rng.uniform(0.0, max_delay))
    root = os.path.join(run_dir, "checkpoints")
    in_save = any(TMP_RE.search(name) for name in os.listdir(root))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    return in_save


def run(
    kills: int,
    mode: str,
    workdir: str,
    data_args: list[str],
    seed: int = 0,
    max_delay: float = 3.0,
    final_resume: bool = True,
) -> dict:
    """`kills` rounds on one run in workdir; returns counts. Raises AssertionError on a bad checkpoint.
    Every round after the first starts by resuming the previous round's latest checkpoint in the trainer;
    final_resume adds such a resume after the last kill."""
    rng = random.Random(seed)
    run_dir = os.path.join(workdir, f"run_{mode}")
    first = launch(run_dir, data_args, mode, train_iters=2)  # a complete first checkpoint to protect
    out, _ = first.communicate()
    if first.returncode != 0:
        raise AssertionError(f"the first run failed:\n{out[-2000:]}")
    root = os.path.join(run_dir, "checkpoints")
    in_save = 0
    for _ in range(kills):
        in_save += one_round(run_dir, data_args, mode, rng, max_delay)
        check_latest(root)
    if final_resume:
        final = launch(run_dir, data_args, mode, train_iters=check_latest(root) + 1)  # a real trainer resume
        out, _ = final.communicate()
        if final.returncode != 0:
            raise AssertionError(f"resuming after the last kill failed:\n{out[-2000:]}")
    return {"kills": kills, "during_save": in_save, "latest": check_latest(root)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--workdir", default=None, help="default: a new temporary folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="ckpt_kill_")
    corpus = build_tiny_corpus(os.path.join(workdir, "corpus"))
    data_args = [
        f"data.data_path=[{corpus['data_prefix']}]",
        f"data.vocab_file={corpus['vocab_file']}",
        f"data.merge_file={corpus['merge_file']}",
        "model.make_vocab_size_divisible_by=8",
    ]
    try:
        result = run(args.kills, args.mode, workdir, data_args, args.seed)
    except AssertionError as err:
        print(f"FAILED: {err}")
        return 1
    print(json.dumps({"mode": args.mode, **result}))
    print(
        f"{args.mode}: {result['kills']} kills ({result['during_save']} during a save): the latest checkpoint "
        f"verified and loaded after every one"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
