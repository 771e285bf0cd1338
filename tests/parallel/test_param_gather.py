"""parallel.overlap_param_gather: the distributed optimizer's param all-gathers run in the background after the
step and finish in the next forward's pre-hooks; losses, grad norms and params are bitwise those of the
blocking gather (dp 4, gloo)."""

from __future__ import annotations

import os

import pytest
import torch

from config.schema import TrainConfig
from optim.optimizer import build_optimizer
from parallel.data_parallel import DataParallel
from parallel.state import ParallelState
from tests.conftest import run_ranks
from tests.parallel.test_data_parallel import (
    GLOBAL_BATCH,
    global_batch,
    micro_batches,
    optim_config,
    run_train_step,
    step_context,
    tiny_cfg,
    tiny_model,
)

pytestmark = pytest.mark.tier("fast")


@pytest.fixture(scope="module", autouse=True)
def warm_meta_init() -> None:
    """Pay torch's one-time meta-init imports in the parent, before any rank is forked."""
    tiny_model(tiny_cfg(num_layers=1))


def _ranks(rank: int, world_size: int, out_dir: str, overlap: bool, precision: str) -> None:
    state = ParallelState.create(tp_size=1, pp_size=1)
    cfg = tiny_cfg()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = tiny_model(cfg, dtype)
    ddp = DataParallel([model], state, bucket_size_mb=0.01, distributed_optimizer=True)
    train = TrainConfig(precision=precision)
    optimizer = build_optimizer([model], ddp, state, optim_config(), train, overlap_param_gather=overlap)
    ctx = step_context([model], ddp, optimizer, state, GLOBAL_BATCH // state.dp_size)
    losses, norms, pending = [], [], []
    for step in range(3):
        result = run_train_step(ctx, micro_batches(global_batch(step, cfg), state.dp_rank, state.dp_size))
        losses.append(result.loss)
        norms.append(result.grad_norm)
        gather = getattr(optimizer, "param_gather", None)
        pending.append(len(gather.pending) if gather is not None else 0)
    optimizer.finish_param_gather()  # what the trainer does before a checkpoint save
    params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    buckets = len(ddp.buckets[0])
    torch.save(
        {"losses": losses, "norms": norms, "params": params, "pending": pending, "buckets": buckets},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overlap_param_gather_is_bitwise_equal(tmp_path, precision):
    results = {}
    for overlap in (False, True):
        out = tmp_path / f"overlap{overlap}"
        out.mkdir()
        run_ranks(4, _ranks, str(out), overlap, precision)
        results[overlap] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for off, on in zip(results[False], results[True]):
        assert on["losses"] == off["losses"]
        assert on["norms"] == off["norms"]
        for name, ref in off["params"].items():
            assert torch.equal(on["params"][name], ref), name
        # after each step every bucket's gather was still in flight: the next forward finished them
        assert on["buckets"] > 1 and on["pending"] == [on["buckets"]] * 3
        assert off["pending"] == [0, 0, 0]
