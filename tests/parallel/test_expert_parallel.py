"""Expert parallelism: the ep and expert-dp groups against megatron-core's rank generator, the layout's refusals,
the differentiable all-to-all of the collectives door, and the MoE layer at ep = 2 and 4 (2 and 4 gloo ranks,
with and without token dropping, plain dp and the distributed optimizer) equal to one process's layer over the
same tokens: outputs, reduced gradients, the gradient norm and two optimizer steps, within 1e-6.

The one-process reference runs each rank's tokens as one micro-batch of its own (the way dp at ep = 1 does):
token dropping is decided per rank on its local tokens, as in megatron-core (model/moe/dispatch.py).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from checkpoint.pieces import pieces_of, tp_blocks
from config.schema import OptimConfig, TrainConfig, load_config
from model.config import ModelConfig
from model.init import initialize_parameters
from model.moe.layer import MoELayer
from model.param_info import Span, param_info, set_param_info
from optim.optimizer import build_optimizer
from parallel.data_parallel import DataParallel
from parallel.expert_parallel import EPExchange
from parallel.layout import LayoutError, layout_from_config
from parallel.rank_grid import RankGrid
from parallel.state import ParallelState
from tests.conftest import REPO_ROOT, assert_entry_points_refuse, run_ranks

pytestmark = pytest.mark.tier("fast")

HIDDEN, FFN, SEQ, LOCAL_BATCH, EXPERTS, SEED = 16, 32, 6, 2, 8, 1234
TOLERANCE = 1e-6
# Adam divides each gradient by its own root mean square, so the last-bit differences of a gradient summed in
# another order (1e-9 here) become lr-relative ones in the weights of small gradients: measured up to 1.1e-6
# after one step at lr 1e-2. The weights after a step are held to the issue's training tolerance.
STEP_TOLERANCE = 1e-5


# ---- the groups ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tp,cp,dp,pp,ep",
    [(1, 1, 2, 1, 2), (1, 1, 4, 1, 2), (1, 1, 4, 1, 4), (2, 1, 4, 2, 2), (2, 2, 2, 1, 2), (2, 2, 2, 2, 4)],
)
def test_expert_groups_are_megatron_cores(tp, cp, dp, pp, ep):
    # Fails (not skips) where megatron-core is missing: its rank generator is the reference.
    from megatron.core.parallel_state import RankGenerator

    experts = RankGrid.megatron(tp=tp, cp=cp, dp=dp, pp=pp).experts(ep)
    # megatron-core's initialize_model_parallel: the expert generator has cp = 1 and dp = world / (tp ep pp)
    megatron = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert experts.groups("ep") == megatron.get_ranks("ep")
    assert experts.groups("expert_dp") == megatron.get_ranks("dp")
    assert experts.groups("tp") == megatron.get_ranks("tp") and experts.groups("pp") == megatron.get_ranks("pp")


def test_ep_is_consecutive_within_dp_x_cp():
    grid = RankGrid.megatron(tp=2, cp=2, dp=2, pp=2)
    experts = grid.experts(2)
    assert grid.group(0, "cp", "dp") == [0, 2, 4, 6]
    assert experts.group(0, "ep") == [0, 2] and experts.group(0, "expert_dp") == [0, 4]
    assert experts.group(13, "ep") == [13, 15] and experts.group(13, "expert_dp") == [9, 13]


def layout(world_size: int, *overrides: str):
    return layout_from_config(load_config(None, list(overrides)), world_size)


MOE = ("model.num_experts=8", "model.moe_router_topk=2")
INVALID = [
    (4, ("parallel.ep_size=3", *MOE), "dp x cp (world / (tp * pp))=4 is not divisible by parallel.ep_size=3"),
    (8, ("parallel.ep_size=8", "parallel.tp_size=2", *MOE), "=4 is not divisible by parallel.ep_size=8"),
    (4, ("parallel.ep_size=4", "model.num_experts=6"), "model.num_experts=6 is not divisible by parallel.ep_size=4"),
    (2, ("parallel.ep_size=2",), "parallel.ep_size=2 needs an MoE model: model.num_experts=None"),
    (1, ("parallel.ep_size=0",), "parallel.ep_size=0 must be >= 1"),
    (
        4,
        ("parallel.ep_size=2", "parallel.fsdp=true", "parallel.fsdp_replicate=2", *MOE),
        "parallel.ep_size=2 with parallel.fsdp_replicate=2 (HSDP) is not supported",
    ),
]


@pytest.mark.parametrize(
    "world_size,overrides,message", INVALID, ids=["dp", "tp", "experts", "dense", "positive", "hsdp"]
)
def test_bad_ep_is_refused_with_one_line(world_size, overrides, message):
    with pytest.raises((LayoutError, ValueError)) as refused:
        layout(world_size, *overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.tier("full")  # two processes that import the trainer
def test_trainer_and_model_stats_refuse_ep_without_experts(tmp_path):
    overrides = ["parallel.ep_size=2"]
    with pytest.raises(LayoutError) as refused:  # the trainer's default config is dense
        layout_from_config(load_config(os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"), overrides), 2)
    assert_entry_points_refuse(overrides, 2, str(refused.value), f"{tmp_path}/run")


def test_ep_layout():
    lay = layout(8, "parallel.ep_size=4", "parallel.tp_size=2", "train.global_batch_size=16", *MOE)
    assert (lay.dp_size, lay.ep_size, lay.expert_dp_size) == (4, 4, 1)
    assert "ep 4 x expert-dp 1" in lay.describe()


def _groups_ranks(rank, world_size):
    state = ParallelState.create(tp_size=2, pp_size=1, ep_size=2)  # 8 ranks: tp 2 x dp 4, ep 2 x expert-dp 2
    experts = RankGrid.megatron(tp=2, dp=4).experts(2)
    assert state.ep_ranks == experts.group(rank, "ep")
    assert state.expert_dp_ranks == experts.group(rank, "expert_dp")
    assert state.ep_rank == state.dp_rank % 2 and state.expert_dp_rank == state.dp_rank // 2
    assert state.expert_dp_size == 2 and state.expert_dp_group is state.ep_dp_group
    names = {name: group for name, group in state.comm.groups().items()}
    assert names["ep"] is state.ep_group and names["expert_dp"] is state.ep_dp_group
    plain = ParallelState.create(tp_size=2, pp_size=1)  # ep = 1: no new group, the experts' replicas are dp
    assert plain.ep_group is None and plain.expert_dp_group is plain.dp_cp_group and plain.ep_rank == 0


def test_state_builds_ep_and_expert_dp_groups():
    run_ranks(8, _groups_ranks)


def test_expert_params_lie_at_their_first_expert():
    cfg = ModelConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_experts=EXPERTS, moe_ffn_hidden_size=FFN
    )
    cfg.validate()

    class Exchange:  # the third of four ep ranks, without a group: only the layout of its weights is read
        ep_size, ep_rank = 4, 2

        def all_to_all(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]):
            raise AssertionError("no forward here")

    layer = MoELayer(cfg, expert_exchange=Exchange())
    bias = layer.experts.fc1_bias  # [E / ep, f]: a 2-D expert weight, as checkpoints piece them
    assert bias is not None and param_info(bias).experts == (4, 6) and param_info(bias).full_shape == (EXPERTS, FFN)
    full = torch.arange(EXPERTS * FFN, dtype=torch.float32).view(EXPERTS, FFN)
    assert torch.equal(param_info(bias).local_shard(full), full[4:6])
    pieces = pieces_of(bias.detach().reshape(-1), 0, tuple(bias.shape), tp_blocks(bias))
    assert [(offsets, tuple(view.shape)) for offsets, view in pieces] == [((4, 0), (2, FFN))]
    weight = layer.experts.fc2_weight  # [E / ep, h, f]: as a matrix [E / ep x h, f], expert 4's rows from 4 x h
    assert param_info(weight).spans(2 * HIDDEN) == [Span(0, 2 * HIDDEN, 4 * HIDDEN)]
    assert all(param_info(p).experts is None for p in layer.router.parameters())


def test_each_ep_rank_writes_its_experts_once():
    """checkpoint/state.param_records: an expert weight is replicated over expert-dp only, so one rank of each
    expert-dp group writes it (each ep rank its own experts), while a dense weight has one writer in dp x cp."""
    from checkpoint.state import param_records

    def writers(rank: int) -> list[bool]:  # 4 ranks: dp 4, ep 2 x expert-dp 2 (ranks 0, 2 and 1, 3 replicas)
        state = ParallelState(world_size=4, rank=rank, tp_size=1, pp_size=1, dp_size=4, ep_size=2)
        module = torch.nn.Module()
        module.dense = torch.nn.Parameter(torch.zeros(3, 2))
        module.experts = torch.nn.Parameter(torch.zeros(2, 3))  # 2 of 4 experts, [E_local, f]
        start = 2 * state.ep_rank
        set_param_info(module.experts, experts=(start, start + 2), full_shape=(4, 3))
        return [record.writes for record in param_records([module], state)]

    written = [writers(rank) for rank in range(4)]
    assert [w[0] for w in written] == [True, False, False, False]  # dense: record 0 -> dp x cp rank 0
    assert [w[1] for w in written] == [False, False, True, True]  # experts: record 1 -> expert-dp rank 1 of each


# ---- the all-to-all --------------------------------------------------------------------------------
def _all_to_all_ranks(rank, world_size):
    state = ParallelState.create(tp_size=1, pp_size=1, ep_size=world_size)
    issued: list[tuple[str, str]] = []

    def note(kind: str, group: str, async_op: bool) -> bool:  # the door's hook before each call: issue it
        issued.append((kind, group))
        return True

    state.comm.before_issue = note
    exchange = EPExchange.of(state)
    # rank r sends r + j + 1 rows to rank j; row values name (sender, receiver, row)
    input_splits = [rank + j + 1 for j in range(world_size)]
    output_splits = [i + rank + 1 for i in range(world_size)]
    rows = [[100 * rank + 10 * j + n for n in range(count)] for j, count in enumerate(input_splits)]
    tensor = torch.tensor([v for row in rows for v in row], dtype=torch.float64).unsqueeze(1).repeat(1, 3)
    tensor.requires_grad_(True)
    received = exchange.all_to_all(tensor, output_splits, input_splits)
    expected = [100 * i + 10 * rank + n for i in range(world_size) for n in range(output_splits[i])]
    assert received[:, 0].tolist() == expected
    weights = torch.arange(received.numel(), dtype=torch.float64).view_as(received)
    (received * weights).sum().backward()
    # each row's gradient is the weight its receiver gave it: the receiver's position of that row
    assert tensor.grad is not None
    back = exchange.all_to_all(weights, input_splits, output_splits)
    assert torch.equal(tensor.grad, back)
    assert issued == [("all_to_all", "ep")] * 3


def test_all_to_all_is_differentiable_through_the_door():
    run_ranks(2, _all_to_all_ranks)


# ---- the MoE layer ---------------------------------------------------------------------------------
def moe_config(capacity: float | None) -> ModelConfig:
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        activation="swiglu",
        add_bias_linear=False,
        num_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=FFN,
        moe_shared_expert_ffn_hidden_size=FFN,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_expert_capacity_factor=capacity,
    )
    cfg.validate()
    return cfg


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [s, b x world, h], the loss's weights of the output, same shape), the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    shape = (SEQ, LOCAL_BATCH * world_size, HIDDEN)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert error <= tolerance, f"{what}: max difference {error:.3g}"


def build(layer: MoELayer, state: ParallelState, distributed: bool, overlap: bool = False):
    ddp = DataParallel([layer], state, bucket_size_mb=0.002, distributed_optimizer=distributed)
    optimizer = build_optimizer(
        [layer],
        ddp,
        state,
        OptimConfig(lr=1e-2, weight_decay=0.1, adam_eps=1e-6),
        TrainConfig(clip_grad=1.0),
        overlap_param_gather=overlap,
    )
    return ddp, optimizer


def _layer_ranks(rank, world_size, ep_size, distributed, capacity, overlap=False, tp_size=1):
    # tp > 1: the tp ranks of one dp rank hold the same tokens and replicas of the experts (no tp inside them)
    state = ParallelState.create(tp_size=tp_size, pp_size=1, ep_size=ep_size)
    cfg = moe_config(capacity)
    reference = MoELayer(cfg, use_grouped_mm=False)
    initialize_parameters(reference, cfg, SEED)
    with torch.device("meta"):
        layer = MoELayer(cfg, use_grouped_mm=False, expert_exchange=EPExchange.of(state))
    initialize_parameters(layer, cfg, SEED)
    pairs = list(zip(layer.named_parameters(), reference.parameters(), strict=True))
    assert layer.dispatcher is not None
    lo_expert, hi_expert = layer.dispatcher.expert_range
    assert (lo_expert, hi_expert) == (state.ep_rank * EXPERTS // ep_size, (state.ep_rank + 1) * EXPERTS // ep_size)
    for (name, param), full in pairs:  # the layout-free init cuts the full draw
        assert torch.equal(param.detach(), param_info(param).local_shard(full.detach())), name
    assert layer.experts.fc1_weight.shape[0] == EXPERTS // ep_size
    ddp, optimizer = build(layer, state, distributed, overlap)
    reference_ddp, reference_optimizer = build(reference, ParallelState.single(), distributed=False)
    # the reference runs the dp ranks' micro-batches one after the other, each loss a 1/dp share as dp's average
    reference.aux_loss_backward_scale = 1.0 / state.dp_size
    columns = [slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH) for r in range(state.dp_size)]
    mine = columns[state.dp_rank]
    for step in range(2):
        tokens, weights = global_batch(step, state.dp_size)
        ddp.zero_grad()
        reference_ddp.zero_grad()
        out, _ = layer(tokens[:, mine])
        ddp.enable_grad_sync()  # one micro-batch: buckets are reduced as backward completes them
        (out * weights[:, mine]).sum().backward()
        ddp.finish_grad_sync()
        for r in range(state.dp_size):
            reference_out, _ = reference(tokens[:, columns[r]])
            ((reference_out * weights[:, columns[r]]).sum() / state.dp_size).backward()
            if r == state.dp_rank:
                close(out, reference_out.detach(), f"step {step} output")
        reference_ddp.finish_grad_sync()
        if capacity is None and step == 0:  # dropless: one forward over every rank's tokens gives the same
            with torch.no_grad():
                close(out, reference(tokens)[0][:, mine], "output against the whole batch")
        for (name, param), full in pairs:
            lo, hi = ddp.owned_param_slice(param)
            full_grad = full.main_grad  # type: ignore[attr-defined]
            expected = param_info(param).local_shard(full_grad).reshape(-1)[lo:hi]
            close(ddp.owned_main_grad(param), expected, f"step {step} gradient of {name}")
        stats, reference_stats = optimizer.step(), reference_optimizer.step()
        assert math.isclose(stats.grad_norm, reference_stats.grad_norm, rel_tol=TOLERANCE), (stats, reference_stats)
        optimizer.finish_param_gather()  # overlapped: the gathers the next forward would wait for
        for (name, param), full in pairs:
            after = f"step {step} {name} after the step"
            close(param.detach(), param_info(param).local_shard(full.detach()), after, STEP_TOLERANCE)


@pytest.mark.parametrize(
    "world_size,ep_size,distributed,capacity",
    [(2, 2, False, None), (2, 2, False, 1.0), (4, 2, True, None), (4, 4, False, 1.0), (4, 2, False, 1.0)],
    ids=["ep2", "ep2-dropping", "ep2-expert-dp2-distopt", "ep4-dropping", "ep2-expert-dp2-dropping"],
)
def test_moe_layer_with_ep_equals_one_process(world_size, ep_size, distributed, capacity):
    run_ranks(world_size, _layer_ranks, ep_size, distributed, capacity)


def test_overlapped_param_gather_of_expert_buckets():
    run_ranks(4, _layer_ranks, 2, True, None, True)


def test_tp2_ranks_hold_expert_replicas():  # tp 2 x dp 2, ep 2: each tp rank's ep group exchanges its copy
    run_ranks(4, _layer_ranks, 2, False, 1.0, False, 2)


class _Chunk(torch.nn.Module):
    """A model chunk of one MoE layer, as FSDP's wrapper reads chunks (transformer_layers)."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def transformer_layers(self) -> list[tuple[int, MoELayer]]:
        return [(0, self.layer)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def _fsdp_ranks(rank, world_size, ep_size):
    from optim.sharded_optimizer import build_sharded_optimizer
    from parallel.fsdp import ShardedDataParallel, local_shard

    state = ParallelState.create(tp_size=1, pp_size=1, ep_size=ep_size)
    cfg = moe_config(None)
    reference = MoELayer(cfg, use_grouped_mm=False)
    initialize_parameters(reference, cfg, SEED)
    with torch.device("meta"):
        layer = MoELayer(cfg, use_grouped_mm=False, expert_exchange=EPExchange.of(state))
    initialize_parameters(layer, cfg, SEED)
    chunk = _Chunk(layer)
    optim, train = OptimConfig(lr=1e-2, weight_decay=0.1, adam_eps=1e-6), TrainConfig(clip_grad=1.0)
    fsdp = ShardedDataParallel([chunk], state, torch.float32)
    optimizer = build_sharded_optimizer([chunk], fsdp, state, optim, train)
    assert layer.experts.fc1_weight.device_mesh.size() == state.expert_dp_size  # type: ignore[attr-defined]
    reference_ddp, reference_optimizer = build(reference, ParallelState.single(), distributed=False)
    reference.aux_loss_backward_scale = 1.0 / state.dp_size
    pairs = list(zip(layer.named_parameters(), reference.parameters(), strict=True))
    columns = [slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH) for r in range(world_size)]

    def shard_of(param: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's flat shard of `param`, the same elements of the reference's `full`)."""
        flat, start = local_shard(param)
        return flat, param_info(param).local_shard(full).reshape(-1)[start : start + flat.numel()]

    for step in range(2):
        tokens, weights = global_batch(step, world_size)
        fsdp.zero_grad()
        reference_ddp.zero_grad()
        out = chunk(tokens[:, columns[rank]])
        (out * weights[:, columns[rank]]).sum().backward()
        fsdp.finish_grad_sync()
        for r in range(world_size):
            reference_out, _ = reference(tokens[:, columns[r]])
            ((reference_out * weights[:, columns[r]]).sum() / state.dp_size).backward()
            if r == rank:
                close(out, reference_out.detach(), f"step {step} output")
        reference_ddp.finish_grad_sync()
        for (name, param), full in pairs:
            _, expected = shard_of(param, full.main_grad)  # type: ignore[attr-defined]
            got = fsdp.owned_main_grad(param)
            close(got, expected, f"step {step} gradient of {name}")
        stats, reference_stats = optimizer.step(), reference_optimizer.step()
        assert math.isclose(stats.grad_norm, reference_stats.grad_norm, rel_tol=TOLERANCE), (stats, reference_stats)
        for (name, param), full in pairs:
            close(*shard_of(param, full.detach()), f"step {step} {name} after the step", STEP_TOLERANCE)


@pytest.mark.parametrize("world_size", [2, 4], ids=["fsdp-ep2", "fsdp-ep2-expert-dp2"])
def test_fsdp_shards_experts_over_expert_dp(world_size):
    run_ranks(world_size, _fsdp_ranks, 2)
