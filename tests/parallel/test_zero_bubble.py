"""Zero-bubble schedules (zb-h1, zb-v) on the pipeline executor: parity with one process, the B/W split of
parallel/pipeline/weight_grad.py on every kind of parameter, and the in-flight (activation memory) bound."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from parallel.pipeline.executor import execute_schedule
from parallel.pipeline.plan import build_plan
from parallel.pipeline.stages import StageMap
from parallel.pipeline.weight_grad import backward_input
from parallel.state import ParallelState
from tests.conftest import run_ranks
from tests.parallel.test_executor import (
    LAYERS,
    SHAPE,
    full_blocks,
    make_forward_fn,
    make_microbatches,
    serial_reference,
)

pytestmark = pytest.mark.tier("fast")


def _run(state, schedule: str, m: int, vp: int, v_shape: bool, forward_only: bool = False):
    blocks = full_blocks()
    per = LAYERS // (state.pp_size * vp)
    chunks, stages = [], []
    for placement in StageMap(state.pp_size, vp, v_shape).placements(LAYERS, state.pp_rank):
        k = placement.virtual_stage
        chunk = torch.nn.Sequential(*blocks[k * per : (k + 1) * per])
        chunk.is_last = placement.post_process
        chunks.append(chunk)
        stages.append(k)
    plan = build_plan(schedule, state.pp_size, state.pp_rank, m, vp, forward_only=forward_only)
    result = execute_schedule(
        plan,
        chunks,
        make_microbatches(m),
        make_forward_fn(m),
        state,
        SHAPE,
        torch.float32,
        scatter_gather=False,
        overlap_p2p_comm=False,
    )
    return result, chunks, stages, per


def _peak(result, vp: int) -> int:
    """The most micro-batches (whole stages' worth of activations) held by any rank."""
    peak = torch.tensor([result.max_in_flight / vp])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _zero_bubble_body(rank, world_size, m):
    state = ParallelState.create(1, world_size)
    ref_losses, ref_blocks = serial_reference(m)
    one_f_one_b, _, _, _ = _run(state, "1f1b", m, 1, False)
    for schedule, vp, v_shape in [("zb-h1", 1, False), ("zb-v", 2, True)]:
        result, chunks, stages, per = _run(state, schedule, m, vp, v_shape)
        for chunk, k in zip(chunks, stages):
            ref = torch.nn.Sequential(*ref_blocks[k * per : (k + 1) * per])
            for mine, expected in zip(chunk.parameters(), ref.parameters()):
                torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=f"{schedule} {k}")
        if any(chunk.is_last for chunk in chunks):
            torch.testing.assert_close(torch.stack(result.losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-7)
        else:
            assert result.losses == []
        # Activation memory: a micro-batch is held until its WEIGHT; the peak equals 1F1B's.
        assert _peak(result, vp) == _peak(one_f_one_b, 1) == state.pp_size
        # Evaluation walks the same placement forward only.
        evaluation, _, _, _ = _run(state, schedule, m, vp, v_shape, forward_only=True)
        assert [float(x) for x in evaluation.losses] == [float(x) for x in result.losses]


def test_zero_bubble_pp2_match_serial():
    run_ranks(2, _zero_bubble_body, 4)


def test_zero_bubble_pp4_match_serial():
    run_ranks(4, _zero_bubble_body, 8)


class _Mixed(torch.nn.Module):
    """Every kind of parameter: linear weight and bias, a norm, an embedding added to the input, a weight
    used twice, and a recomputed (checkpointed) linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6, bias=False)
        self.norm = torch.nn.LayerNorm(6)
        self.position = torch.nn.Embedding(4, 6)
        self.inner = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [4, 6]
        h = self.norm(x + self.position(torch.arange(4)))
        h = torch.tanh(self.fc1(h))
        h = checkpoint(lambda t: torch.relu(self.inner(t)), h, use_reentrant=False)
        h = self.inner(h) + h  # `inner` used twice
        return self.fc2(h) * self.scale + self.scale


def test_split_backward_matches_full_backward():
    torch.manual_seed(0)
    model, x, grad = _Mixed(), torch.randn(4, 6), torch.randn(4, 6)
    reference = x.clone().requires_grad_()
    torch.autograd.backward(model(reference), grad)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fired = []
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    inp = x.clone().requires_grad_()
    input_grad, deferred = backward_input(model(inp), grad, inp, list(model.parameters()))
    torch.testing.assert_close(input_grad, reference.grad)
    assert fired == [] and all(p.grad is None for p in model.parameters())  # no weight gradient yet
    deferred.run()
    assert set(fired) == set(expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)


def test_first_stage_defers_its_whole_backward():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    out = model(torch.randn(2, 4))
    input_grad, deferred = backward_input(out, torch.ones(2, 4), None, list(model.parameters()))
    assert input_grad is None and model.weight.grad is None
    deferred.run()
    assert model.weight.grad is not None and model.bias.grad is not None
