"""The fused kernels under tensor parallelism: the chunked vocabulary-parallel cross entropy against
vocab_parallel_cross_entropy on 2 ranks, and training with every kernel on vs off at tp2 x pp2 with sequence
parallelism through the real trainer (Triton's interpreter on CPU, see tests/conftest.py)."""

from __future__ import annotations

import io
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from model.kernels import reference
from model.kernels.backend import triton_installed
from model.kernels.cross_entropy import CrossEntropyReductions, chunked_linear_cross_entropy
from parallel.tp_layers import vocab_parallel_cross_entropy
from parallel.tp_mappings import TPComm, all_reduce
from tests.conftest import read_metrics, run_ranks, tiny_train_args
from tools import compare_runs

pytestmark = pytest.mark.tier("full")  # the training kernels in Triton's interpreter at tp2 x pp2

VOCAB, NUM_VALID, HIDDEN = 2 * 45, 83, 20  # the padding (7 ids) lies in rank 1's shard


def _vocab_parallel_rank(rank: int, world_size: int, use_triton: bool) -> None:
    torch.manual_seed(0)  # the same full tensors on both ranks; each keeps its shard of the weight
    hidden = torch.randn(5, 3, HIDDEN)
    weight_full = torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, NUM_VALID, (5, 3))
    comm = TPComm(group=dist.group.WORLD, rank=rank, size=world_size)
    rows = VOCAB // world_size
    start = rank * rows

    def run(fused: bool):
        h = hidden.clone().requires_grad_()
        w = weight_full[start : start + rows].clone().requires_grad_()
        if fused:
            reductions = CrossEntropyReductions(
                max=partial(all_reduce, comm=comm, phase="forward", op=dist.ReduceOp.MAX),
                sum=partial(all_reduce, comm=comm, phase="forward"),
            )
            loss = chunked_linear_cross_entropy(
                h, w, labels, start, NUM_VALID - start, reductions, chunk_tokens=4, use_triton=use_triton
            )
        else:
            logits = reference.mask_vocab_padding(torch.nn.functional.linear(h, w), NUM_VALID - start)
            loss = vocab_parallel_cross_entropy(logits, labels, comm)
        grad_loss = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
        grad_h, grad_w = torch.autograd.grad(loss, (h, w), grad_loss)
        # dhidden is partial per rank (the tp region's backward sums it): compare the sum
        dist.all_reduce(grad_h)
        return loss, grad_h, grad_w

    for actual, expected in zip(run(True), run(False)):
        scale = expected.abs().max()
        assert (actual - expected).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("use_triton", [False, True])
def test_chunked_cross_entropy_vocab_parallel_matches(use_triton):
    if use_triton and not triton_installed():
        pytest.skip("triton is not installed")
    run_ranks(2, _vocab_parallel_rank, use_triton, timeout=120.0)


def _train_rank(rank: int, world_size: int, argv: list[str]) -> None:
    assert pretrain_gpt.main(argv) == 0


def test_training_kernels_on_matches_off_tp2_pp2_sp(tiny_corpus, tmp_path):
    """20 iterations at tp2 x pp2 with sequence parallelism: the same losses (tools/compare_runs.py's
    tolerance) with every fused kernel on as with all off. Two layers (one per pipeline stage), not the tiny
    runs' four: each stage still runs every layer kernel (norms, bias-GeLU, bias-dropout-add) and the last the
    vocabulary-parallel cross entropy, at half the interpreter's launches per iteration."""
    layout = (
        "parallel.tp_size=2",
        "parallel.pp_size=2",
        "parallel.sequence_parallel=true",
        "train.train_iters=20",
        "train.eval_iters=0",
        "checkpoint.save=false",
        "train.micro_batch_size=4",
        "model.num_layers=2",
    )  # 2 micro-batches per iteration: the interpreter pays per launch
    run_dirs = {}
    for fused in ("false", "true"):
        run_dirs[fused] = str(tmp_path / f"fused_{fused}")
        argv = [
            "--config",
            pretrain_gpt.DEFAULT_CONFIG,
            *tiny_train_args(tiny_corpus, run_dirs[fused], *layout, f"model.fused_kernels={fused}"),
        ]
        run_ranks(4, _train_rank, argv, timeout=400.0)
        assert [r["iteration"] for r in read_metrics(run_dirs[fused])] == list(range(1, 21))
    out = io.StringIO()
    assert compare_runs.main([run_dirs["false"], run_dirs["true"]], out=out) == 0, out.getvalue()
    assert os.path.exists(os.path.join(run_dirs["true"], "metrics.jsonl"))
