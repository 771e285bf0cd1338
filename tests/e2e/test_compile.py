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
    assert compare_runs.main([eager_dir, compiled_dir, "--key", "lm_loss", "--key", "grad_norm"], out=out) == 0, (
        out.getvalue()
    )


def test_compiled_layers_match_eager_single_process(tiny_corpus, tmp_path):
    eager = _run(tiny_corpus, str(tmp_path / "eager"), 1)
    compiled = _run(tiny_corpus, str(tmp_path / "compiled"), 1, "train.compile=true")
    _assert_same_losses(eager, compiled)


def test_compiled_layers_match_eager_tp2_pp2_recompute_kernels(tiny_corpus, tmp_path):
    """Two micro-batches per iteration (global batch 4), not the tiny runs' four: the first stage's 1F1B still
    has a warm-up, a steady and a cool-down step, each compiled layer still runs forward, recomputed forward
    and backward on every micro-batch, and the same three iterations' losses and gradient norms are compared;
    the interpreter's kernel launches per iteration are halved."""
    layout = (
        "parallel.tp_size=2",
        "parallel.pp_size=2",
        "parallel.sequence_parallel=true",
        "train.recompute=full",
        "model.fused_kernels=true",
        "train.global_batch_size=4",
    )
    eager = _run(tiny_corpus, str(tmp_path / "eager"), 4, *layout)
    compiled = _run(
        tiny_corpus, str(tmp_path / "compiled"), 4, *layout, "train.compile=true", "train.compile_backend=aot_eager"
    )
    _assert_same_losses(eager, compiled)


def test_compiled_layers_with_selective_and_full_recompute_match_eager():
    """Selective recompute checkpoints inside a compiled layer (run eagerly there), full recompute checkpoints
    whole compiled layers: loss and gradients equal eager's."""
    import torch

    from model.config import ModelConfig
    from model.gpt import GPTModel
    from model.rank_spec import RankSpec, Recompute
    from parallel.random import RNGTracker, make_checkpoint_fn

    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=50,
        make_vocab_size_divisible_by=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    tracker = RNGTracker("cpu")
    tracker.add("model-parallel", 3)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, 8)
    for mode in ("selective", "full"):
        results = []
        for compiled in (False, True):
            torch.manual_seed(0)
            recompute = Recompute(mode, "uniform", 1, make_checkpoint_fn(tracker))
            model = GPTModel(cfg, 64, spec=RankSpec.one_process(cfg, recompute))
            if compiled:
                model.compile_layers("aot_eager")
            loss = model(ids, positions, labels=ids.roll(1, 1)).mean()
            loss.backward()
            results.append([loss.detach()] + [p.grad for p in model.parameters()])
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)
