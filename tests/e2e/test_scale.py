"""Ranks at scale: 32-rank PTD-P runs train the same model as one process (issue 45).

Each case runs `pretrain_gpt.main` on 32 ranks of the rank pool (tests/conftest.run_ranks) for 5 iterations of
the tiny fp32, dropout-0 config and compares every iteration's lm_loss and grad_norm with a single-process run of
the same arguments (relative difference <= 1e-5), as tests/e2e/test_layouts.py does for up to 8 ranks. The first
layout under torchrun (32 new interpreters, ~3 CPU minutes) is scripts/benchmarks/bench_32_ranks_torchrun.py,
not a test: the 4-rank torchrun tests cover the launch path. On the pool each rank also writes what its start-up
took, its open files and its memory, which the test prints (docs/performance.md quotes them).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.e2e.test_layouts import EIGHT_LAYERS, FAST, INTERLEAVED, _rank_main, assert_matches, train

# 32 ranks on 2 shared cores: 15-30 s per case on the rank pool, ~1.5 min under torchrun (32 interpreters import
# torch), measured on the shared machine: more than the fast tier's budget for what 8-rank runs already show.
pytestmark = pytest.mark.tier("full")

WORLD_SIZE = 32
ITERATIONS = 5
# A rank's share of 2 cores among 32 is ~1/16 (less on a shared machine): 5x the slowest run measured (torchrun,
# ~90 s at a load average of 50), and a hang still ends here.
TIMEOUT_S = 450.0

# (model and batch overrides shared with the reference, parallel overrides). The global batch is micro-batch
# (2) x micro-batches x dp (4): 4 micro-batches per dp rank for the interleaved schedule (a multiple of pp = 4),
# 2 for pp = 2.
INTERLEAVED_32 = (
    (*EIGHT_LAYERS, "train.global_batch_size=32"),
    ("parallel.tp_size=2", "parallel.pp_size=4", *INTERLEAVED, "parallel.distributed_optimizer=true"),
)
CONTEXT_PARALLEL_32 = (
    ("train.global_batch_size=16",),
    ("parallel.cp_size=2", "parallel.tp_size=2", "parallel.pp_size=2"),
)
SCALE_LAYOUTS = [
    pytest.param(*INTERLEAVED_32, id="tp2-pp4-vp2-dp4-distopt"),
    pytest.param(*CONTEXT_PARALLEL_32, id="cp2-tp2-pp2-dp4"),
]


def _rank_main_measured(rank: int, world_size: int, argv: list[str], launched_at: float, out_dir: str) -> None:
    """`_rank_main`, writing to out_dir/rank<N>.json when this rank joined (its process group made), when its
    first training step began (seconds since `launched_at`, the test's clock), its open files then and its
    memory at the end."""
    import training.loop

    joined = time.time() - launched_at
    step = training.loop.train_step
    first_step: dict[str, float] = {}

    def timed_step(*args, **kwargs):
        if not first_step:  # every process group is up by now: its gloo sockets are among the open files
            first_step.update(first_step_s=time.time() - launched_at, fds=len(os.listdir("/proc/self/fd")))
        return step(*args, **kwargs)

    training.loop.train_step = timed_step  # this body's fork only: the pool puts its modules back after it
    _rank_main(rank, world_size, argv)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"joined_s": joined, **first_step, **_memory_kib()}, handle)


def _memory_kib() -> dict[str, int]:
    """This process's peak resident set (VmHWM, counting pages shared with the process it was forked from) and,
    now, its proportional (Pss: a shared page split among its sharers) and private resident memory, in KiB."""
    fields: dict[str, int] = {}
    for path, keys in (("/proc/self/status", ("VmHWM",)), ("/proc/self/smaps_rollup", ("Pss", "Private_Clean"))):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name in keys or name == "Private_Dirty":
                    fields[name] = int(value.split()[0])
    fields["Private"] = fields.pop("Private_Clean") + fields.pop("Private_Dirty")
    return fields


def _summary(out_dir: str) -> str:
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8")) for r in range(WORLD_SIZE)]

    def spread(key: str, scale: float = 1.0) -> str:
        values = [rank[key] / scale for rank in ranks]
        return f"{min(values):.1f}/{sum(values) / len(values):.1f}/{max(values):.1f}"

    total_pss = sum(rank["Pss"] for rank in ranks) / 1024
    return (
        f"{WORLD_SIZE} ranks (min/mean/max): joined {spread('joined_s')} s, first step {spread('first_step_s')} s "
        f"after launch; open files {spread('fds')}; VmHWM {spread('VmHWM', 1024)} MiB, Pss {spread('Pss', 1024)} MiB, private "
        f"{spread('Private', 1024)} MiB; Pss of all ranks {total_pss:.0f} MiB"
    )


@pytest.mark.parametrize("shared_overrides,parallel_overrides", SCALE_LAYOUTS)
def test_32_ranks_match_single_process(tiny_corpus, tmp_path, shared_overrides, parallel_overrides):
    reference = train(tiny_corpus, str(tmp_path / "reference"), 1, *FAST, *shared_overrides, iterations=ITERATIONS)
    run_dir, out_dir = str(tmp_path / "run"), str(tmp_path / "ranks")
    os.makedirs(out_dir)
    records = train(
        tiny_corpus,
        run_dir,
        WORLD_SIZE,
        *FAST,
        *shared_overrides,
        *parallel_overrides,
        iterations=ITERATIONS,
        timeout=TIMEOUT_S,
        rank_main=_rank_main_measured,
        rank_args=(time.time(), out_dir),
    )
    assert_matches(records, reference)
    print(_summary(out_dir))
