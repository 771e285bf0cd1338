"""train.compile=true (regional torch.compile of each transformer layer) trains the same model as eager: one
process with inductor, and tp2 x pp2 with sequence parallelism, full recompute and the fused kernels with the
aot_eager backend (dynamo and AOTAutograd tracing through the tp collectives and checkpointing, without the
minutes of C++ code generation that inductor needs per layer signature on a CPU)."""
from __future__ import annotations

import io

import pretrain_gpt
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tools import compare_runs

SMALL = ("model.num_layers=2", "train.train_iters=3", "train.eval_iters=0", "checkpoint.save=false")


def _rank_main(rank: int, world_size: int, argv: list[str]) -> None:
    assert pretrain_gpt.main(argv) == 0


def _run(corpus, run_dir: str, world_size: int, *extra: str) -> str:
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *SMALL, *extra)]
    run_ranks(world_size, _rank_main, argv, timeout=540.0)
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3]
    return run_dir


def _assert_same_losses(eager_dir: str, compiled_dir: str) -> None:
    out = io.StringIO()
    assert compare_runs.main([eager_dir, compiled_dir, "--key", "lm_loss", "--key", "grad_norm"], out=out) == 0, \
        out.getvalue()


def test_compiled_layers_match_eager_single_process(tiny_corpus, tmp_path):
    eager = _run(tiny_corpus, str(tmp_path / "eager"), 1)
    compiled = _run(tiny_corpus, str(tmp_path / "compiled"), 1, "train.compile=true")
    _assert_same_losses(eager, compiled)


def test_compiled_layers_match_eager_tp2_pp2_recompute_kernels(tiny_corpus, tmp_path):
    layout = ("parallel.tp_size=2", "parallel.pp_size=2", "parallel.sequence_parallel=true",
              "train.recompute=full", "model.fused_kernels=true")
    eager = _run(tiny_corpus, str(tmp_path / "eager"), 4, *layout)
    compiled = _run(tiny_corpus, str(tmp_path / "compiled"), 4, *layout, "train.compile=true",
                    "train.compile_backend=aot_eager")
    _assert_same_losses(eager, compiled)
