"""Data parallelism: dp = 2 / 4 and the distributed optimizer match dp = 1 step for step; the dp reduction
is launched bucket by bucket during the last micro-batch's backward only; pp = 2 with a tied embedding
(finalize_model_grads over the embedding group) matches one process.

Every iteration runs through the trainer's own `training.train_step.train_step` (executor, dp buckets,
finalize_model_grads, optimizer). The helpers here (tiny model, batches) are also used by
tests/training/test_optimizer.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from config.schema import OptimConfig, TrainConfig
from data.microbatch import Microbatch
from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.param_info import param_info
from optim.optimizer import build_optimizer
from parallel.data_parallel import DataParallel
from parallel.layout import Layout
from parallel.state import ParallelState
from tests.conftest import run_ranks
from tests.tiny_models import tiny_config
from training.train_step import StepContext, train_step

pytestmark = pytest.mark.tier("fast")

GLOBAL_BATCH, SEQ = 8, 16


def tiny_cfg(num_layers: int = 2) -> ModelConfig:
    return tiny_config(num_layers=num_layers, seq_length=SEQ, vocab_size=100, make_vocab_size_divisible_by=64)


def tiny_model(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, layer_ids=None, pre: bool = True, post: bool = True
) -> GPTModel:
    """A GPT chunk with the layout-independent init (same weights whatever the cut)."""
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size(), layer_ids=layer_ids, pre_process=pre, post_process=post)
    initialize_parameters(model, cfg, seed=1234, dtype=dtype)
    return model


def global_batch(step: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The same [GLOBAL_BATCH, SEQ] batch on every rank for a given step; the loss mask drops ~1/4."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=gen) > 0.25).float()
    mask[:, 0] = 1.0
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": mask,
        "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ),
    }


def micro_batches(batch: dict, dp_rank: int, dp_size: int) -> list[dict]:
    """This dp rank's rows of the global batch, one row per micro-batch."""
    per_rank = GLOBAL_BATCH // dp_size
    rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [{k: v[r : r + 1] for k, v in batch.items()} for r in rows]


def step_context(
    chunks: list[GPTModel], ddp: DataParallel, optimizer, state: ParallelState, num_microbatches: int
) -> StepContext:
    """The trainer's StepContext for a tp = 1 layout of micro-batches of one sequence."""
    layout = Layout(
        tp_size=1,
        pp_size=state.pp_size,
        vp_size=1,
        dp_size=state.dp_size,
        num_microbatches=num_microbatches,
        schedule="1f1b",
    )
    dtype = next(chunks[0].parameters()).dtype
    return StepContext(
        chunks=chunks,
        state=state,
        layout=layout,
        ddp=ddp,
        optimizer=optimizer,
        activation_shape=(SEQ, 1, chunks[0].cfg.hidden_size),
        activation_dtype=dtype,
        device=torch.device("cpu"),
        scatter_gather=False,
        overlap_p2p_comm=False,
    )


def run_train_step(ctx: StepContext, micros: list[dict]):
    """One iteration of the real train_step on these micro-batches at the optimizer's lr; its StepResult."""
    loader_batches = [
        Microbatch.of(mb["input_ids"], mb["labels"], mb["loss_mask"], mb["position_ids"]) for mb in micros
    ]
    return train_step(ctx, loader_batches, ctx.optimizer.lr)


def run_step(model: GPTModel, ddp: DataParallel, optimizer, state: ParallelState, micros: list[dict]):
    """train_step on one chunk with one micro-batch per entry of `micros`: (global mean loss, StepResult)."""
    result = run_train_step(step_context([model], ddp, optimizer, state, len(micros)), micros)
    return result.loss, result


# The key bias of attention has an exactly-zero gradient in theory (softmax ignores a constant shift), so
# in practice it gets rounding noise (~1e-10) that Adam with eps=1e-8 would blow up to lr-sized steps whose
# sign depends on summation order. eps=1e-6 damps that noise; every real gradient here is >> 1e-6.
EPS = 1e-6


def optim_config(lr: float = 1e-2, **overrides) -> OptimConfig:
    """The optim section these tests step with: weight decay 0.1 on matrices, eps EPS (above), `overrides`
    (the loss scaler's keys under fp16)."""
    return OptimConfig(lr=lr, weight_decay=0.1, adam_eps=EPS, **overrides)


def build(cfg, state, dtype=torch.float32, distributed=False, precision="fp32", bucket_mb=0.01, lr=1e-2, **optim):
    """A tiny model, its DataParallel and optimizer (clip 1.0) at `precision`; `optim`: OptimConfig keys."""
    model = tiny_model(cfg, dtype)
    ddp = DataParallel([model], state, bucket_size_mb=bucket_mb, distributed_optimizer=distributed)
    train = TrainConfig(precision=precision, clip_grad=1.0)
    optimizer = build_optimizer([model], ddp, state, optim_config(lr, **optim), train, overlap_param_gather=False)
    return model, ddp, optimizer


def _train_ranks(rank, world_size, out_dir, distributed, precision, steps):
    state = ParallelState.create(tp_size=1, pp_size=1)
    cfg = tiny_cfg()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model, ddp, optimizer = build(cfg, state, dtype, distributed, precision)
    ctx = step_context([model], ddp, optimizer, state, GLOBAL_BATCH // state.dp_size)
    losses, norms = [], []
    for step in range(steps):
        result = run_train_step(ctx, micro_batches(global_batch(step, cfg), state.dp_rank, state.dp_size))
        losses.append(result.loss)
        norms.append(result.grad_norm)
    params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    torch.save(
        {
            "params": params,
            "losses": losses,
            "norms": norms,
            "state_bytes": optimizer.state_bytes(),
            "grad_bytes": ddp.grad_buffer_bytes(),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def train_result(
    tmp_path, dp: int, distributed: bool = False, precision: str = "fp32", steps: int = 3, rank: int = 0
) -> dict:
    out = tmp_path / f"dp{dp}_{distributed}_{precision}"
    out.mkdir(exist_ok=True)
    run_ranks(dp, _train_ranks, str(out), distributed, precision, steps)
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def assert_close_params(result: dict, reference: dict, rtol: float) -> None:
    for name, ref in reference["params"].items():
        got = result["params"][name]
        rel = (got - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel <= rtol, f"{name}: relative difference {rel:.2e} > {rtol}"


@pytest.fixture(scope="module", autouse=True)
def warm_meta_init() -> None:
    """The first nn.init call on the meta device imports torch's _refs (~5 s); do it once in the parent so
    every forked rank inherits it instead of paying it again."""
    tiny_model(tiny_cfg(num_layers=1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The dp = 1 fp32 run every parity test compares with (computed once per module)."""
    return train_result(tmp_path_factory.mktemp("reference"), 1)


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_single_process(tmp_path, dp, reference):
    result = train_result(tmp_path, dp)
    for got, ref in zip(result["losses"], reference["losses"]):
        assert abs(got - ref) <= 1e-5 * abs(ref)
    for got, ref in zip(result["norms"], reference["norms"]):
        assert abs(got - ref) <= 1e-5 * abs(ref)
    assert_close_params(result, reference, 1e-5)


def test_distributed_optimizer_matches_plain(tmp_path):
    plain = train_result(tmp_path, 4, distributed=False)
    sharded = train_result(tmp_path, 4, distributed=True)
    assert_close_params(sharded, plain, 1e-5)
    for got, ref in zip(sharded["norms"], plain["norms"]):
        assert abs(got - ref) <= 1e-5 * abs(ref)
    # fp32 plain aliases params as masters (8 B/param of moments); distributed keeps 12 B/param / dp.
    numel = sum(p.numel() for p in plain["params"].values())  # named_parameters lists the tied weight once
    assert plain["state_bytes"] == 8 * numel
    assert abs(sharded["state_bytes"] - 12 * numel / 4) <= 12 * 4 * 16  # padding: < dp elements per bucket


def _overlap_ranks(rank, world_size, out_dir, unused_param=False):
    state = ParallelState.create(tp_size=1, pp_size=1)
    cfg = tiny_cfg()
    model = tiny_model(cfg)
    if unused_param:  # the root's own params come first in parameters(): it lands in the last bucket
        model.unused = torch.nn.Parameter(torch.ones(5))
    ddp = DataParallel([model], state, bucket_size_mb=0.01, distributed_optimizer=False)
    optimizer = build_optimizer([model], ddp, state, optim_config(), TrainConfig(), overlap_param_gather=False)
    events, phase = [], ["backward"]
    original_launch, original_enable, original_finish = ddp._launch, ddp.enable_grad_sync, ddp.finish_grad_sync

    def recording_launch(bucket):
        events.append((phase[0], bucket.index))
        original_launch(bucket)

    def recording_enable(chunk_index=0):  # the executor calls it just before the last backward
        phase[0] = "last_backward"
        original_enable(chunk_index)

    def recording_finish():  # train_step calls it after the last backward
        phase[0] = "after_backward"
        original_finish()

    ddp._launch, ddp.enable_grad_sync, ddp.finish_grad_sync = recording_launch, recording_enable, recording_finish
    micros = micro_batches(global_batch(0, cfg), state.dp_rank, state.dp_size)
    run_train_step(step_context([model], ddp, optimizer, state, len(micros)), micros)
    torch.save({"events": events, "num_buckets": len(ddp.buckets[0])}, os.path.join(out_dir, f"rank{rank}.pt"))
    if unused_param:
        assert torch.equal(model.unused.main_grad, torch.zeros(5))
        assert torch.equal(model.unused.detach(), torch.ones(5))  # zero grad, no decay on 1-D: unchanged


def test_reduction_overlaps_last_backward_only(tmp_path):
    run_ranks(2, _overlap_ranks, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        events, num_buckets = result["events"], result["num_buckets"]
        assert num_buckets >= 4
        assert [index for _, index in events] == list(range(num_buckets))  # each once, in bucket order
        assert {phase for phase, _ in events} == {"last_backward"}, events  # none earlier, none in finish


def test_param_without_grad_is_reduced_in_finish(tmp_path):
    """A param that never gets a gradient holds back its bucket (and, since buckets launch in order, every
    later one) until finish_grad_sync, which launches it; nothing hangs and the step still runs."""
    run_ranks(2, _overlap_ranks, str(tmp_path), True)
    events = torch.load(tmp_path / "rank0.pt", weights_only=True)["events"]
    assert [index for _, index in events] == list(range(len(events)))
    assert [phase for phase, _ in events[:-1]] == ["last_backward"] * (len(events) - 1)
    assert events[-1][0] == "after_backward"  # launched by finish_grad_sync


def _pipeline_ranks(rank, world_size, out_dir, distributed):
    """pp = 2 x dp = 2 with a tied embedding split over the stages, through the trainer's train_step."""
    state = ParallelState.create(tp_size=1, pp_size=2)
    cfg = tiny_cfg()
    first = state.is_first_stage
    model = tiny_model(cfg, layer_ids=[0] if first else [1], pre=first, post=not first)
    ddp = DataParallel([model], state, bucket_size_mb=0.01, distributed_optimizer=distributed)
    train = TrainConfig(clip_grad=1.0)
    optimizer = build_optimizer([model], ddp, state, optim_config(), train, overlap_param_gather=False)
    ctx = step_context([model], ddp, optimizer, state, GLOBAL_BATCH // state.dp_size)
    norms = []
    for step in range(3):
        result = run_train_step(ctx, micro_batches(global_batch(step, cfg), state.dp_rank, state.dp_size))
        norms.append(result.grad_norm)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.save({"params": params, "norms": norms}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("distributed", [False, True])
def test_pipeline_tied_embedding_matches_single_process(tmp_path, distributed, reference):
    run_ranks(4, _pipeline_ranks, str(tmp_path), distributed)
    first = torch.load(tmp_path / "rank0.pt", weights_only=True)  # pp_rank 0, dp_rank 0
    last = torch.load(tmp_path / "rank2.pt", weights_only=True)  # pp_rank 1, dp_rank 0
    for got, ref in zip(first["norms"], reference["norms"]):
        assert abs(got - ref) <= 1e-5 * ref
    merged = {**last["params"], **first["params"]}
    assert_close_params({"params": merged}, reference, 1e-5)
    # Both stages' copies of the tied weight took the same steps.
    torch.testing.assert_close(
        last["params"]["output_layer.weight"], first["params"]["embedding.word_embeddings.weight"], rtol=0, atol=0
    )


def test_distributed_layout_pads_and_tiles_buckets():
    """dp = 3 (no collectives needed to build): every bucket is padded to a multiple of dp, the dp shards
    tile it, each param's owned slices over the dp ranks tile the param, the tied embedding is alone."""
    cfg = tiny_cfg()
    model = tiny_model(cfg)
    owned: dict[str, list[tuple[int, int]]] = {}
    for dp_rank in range(3):
        state = ParallelState(world_size=3, rank=dp_rank, tp_size=1, pp_size=1, dp_size=3)
        ddp = DataParallel([model], state, bucket_size_mb=0.01, distributed_optimizer=True)
        for bucket in ddp.buckets[0]:
            assert bucket.numel % 3 == 0
            assert bucket.numel - sum(p.numel() for p in bucket.params) < 3
            if any(param_info(p).shared_embedding for p in bucket.params):
                assert len(bucket.params) == 1
        assert sum(b.numel for b in ddp.buckets[0]) == ddp.buffers[0].numel()
        for name, param in model.named_parameters():
            owned.setdefault(name, []).append(ddp.owned_param_slice(param))
        ddp.remove_hooks()
    for name, param in model.named_parameters():
        covered = sum(hi - lo for lo, hi in owned[name])
        assert covered == param.numel(), name
    first_stage = tiny_model(cfg, layer_ids=[0], pre=True, post=False)  # pp > 1: the tied weight is marked
    ddp = DataParallel([first_stage], ParallelState.single(), bucket_size_mb=1.0, distributed_optimizer=False)
    embedding = first_stage.embedding.word_embeddings.weight
    assert param_info(embedding).shared_embedding and ddp.param_ranges[embedding].bucket.params == [embedding]
    assert len(ddp.buckets[0]) >= 2  # 1 MiB would hold the whole chunk: the embedding was split off
