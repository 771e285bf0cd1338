"""Every pipeline schedule is a load target: a resume into 1f1b, gpipe, interleaved, zb-h1 and zb-v (pp 2) from a
checkpoint of another schedule and from one process, and a weights-only fine-tune into each, train the model
the uninterrupted run trains (rtol 1e-5 on lm_loss and grad_norm; zb-v from zb-v at its own layout: bitwise).

zb-v is the schedule whose placement differs (rank 0 holds virtual stages 0 and 3: the embedding and the head's
copy of the tied embedding), so it is also the source of the cross-schedule resumes. Runs are tiny: 4 layers,
the checkpoint at iteration 2, two iterations after each load (the first shows the loaded weights, the second
the loaded optimizer state). The layout changes of tp / dp / vp: tests/e2e/test_checkpoint_layouts.py.
"""

from __future__ import annotations

import os

import pytest

import pretrain_gpt
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tests.e2e.test_layouts import assert_matches

pytestmark = pytest.mark.tier("fast")

PP2 = ("parallel.pp_size=2",)
SCHEDULES = {
    "1f1b": (*PP2, "parallel.schedule=1f1b"),
    "gpipe": (*PP2, "parallel.schedule=gpipe"),
    "interleaved": (*PP2, "parallel.vp_size=2", "parallel.schedule=interleaved"),
    "zb-h1": (*PP2, "parallel.schedule=zb-h1"),
    "zb-v": (*PP2, "parallel.vp_size=2", "parallel.schedule=zb-v"),
}
FAST = ("train.eval_iters=0", "train.train_iters=4")
SAVED_AT = "iter_0000002"


def _rank_main(rank: int, world_size: int, argv: list[str]) -> None:
    if world_size == 1:
        os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)  # one thread, like each parallel rank
    assert pretrain_gpt.main(argv) == 0


def _run(corpus: dict, run_dir: str, schedule: str | None, *extra: str) -> list[dict]:
    """The trainer on 2 ranks at `schedule` (None: one process); returns its training lines."""
    layout = SCHEDULES[schedule] if schedule else ()
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *FAST, *layout, *extra)]
    run_ranks(2 if schedule else 1, _rank_main, argv, timeout=240.0)
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def sources(tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    """Uninterrupted runs of 4 iterations saving at 2: one process, zb-v and 1f1b. {name: {dir, records}}."""
    out = {}
    for name, schedule in (("one", None), ("zb-v", "zb-v"), ("1f1b", "1f1b")):
        run_dir = str(tmp_path_factory.mktemp(f"source-{name}"))
        out[name] = {"dir": run_dir, "records": _run(tiny_corpus, run_dir, schedule, "checkpoint.save_interval=2")}
    return out


def _checkpoint(sources: dict, name: str) -> str:
    return os.path.join(sources[name]["dir"], "checkpoints", SAVED_AT)


RESUMES = [("zb-v", "zb-v"), ("zb-v", "1f1b"), ("zb-v", "one")] + [
    (target, source) for target in ("1f1b", "gpipe", "interleaved", "zb-h1") for source in ("zb-v", "one")
]


@pytest.mark.parametrize("target,source", RESUMES, ids=[f"{t}-from-{s}" for t, s in RESUMES])
def test_resume(tiny_corpus, tmp_path, sources, target, source):
    run_dir = str(tmp_path / "resumed")
    resumed = _run(tiny_corpus, run_dir, target, f"checkpoint.load={_checkpoint(sources, source)}")
    assert [r["iteration"] for r in resumed] == [3, 4]
    if target == source:  # same layout: each rank continues its own state, bit for bit
        expected = sources[source]["records"][2:]
        for key in ("lm_loss", "grad_norm"):
            assert [r[key] for r in resumed] == [r[key] for r in expected], key
    else:
        assert_matches(resumed, sources["one"]["records"][2:])


@pytest.fixture(scope="module")
def finetuned_one(tiny_corpus, tmp_path_factory, sources) -> list[dict]:
    """A weights-only fine-tune of the one-process checkpoint in one process (2 iterations)."""
    run_dir = str(tmp_path_factory.mktemp("finetune-one"))
    return _run(tiny_corpus, run_dir, None, f"checkpoint.finetune={_checkpoint(sources, 'one')}", "train.train_iters=2")


@pytest.mark.parametrize("target", list(SCHEDULES))
def test_finetune(tiny_corpus, tmp_path, sources, finetuned_one, target):
    source = _checkpoint(sources, "zb-v" if target != "zb-v" else "1f1b")  # always another schedule's
    run_dir = str(tmp_path / "finetuned")
    records = _run(tiny_corpus, run_dir, target, f"checkpoint.finetune={source}", "train.train_iters=2")
    assert [r["iteration"] for r in records] == [1, 2]
    assert_matches(records, finetuned_one)
