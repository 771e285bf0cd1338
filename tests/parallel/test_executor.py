"""The pipeline executor on gloo ranks: parity with one process for every schedule, memory bounds,
scatter/gather, forward-only evaluation, loss scaling and the output-deallocation trick."""

import pytest
import torch

from parallel.layout import LayoutError
from parallel.pipeline.executor import deallocate_output, execute_schedule, run_backward
from parallel.pipeline.plan import build_plan
from parallel.pipeline.stages import virtual_stage
from parallel.state import ParallelState
from tests.conftest import run_ranks

pytestmark = pytest.mark.tier("fast")

HIDDEN, BATCH, LAYERS = 8, 4, 8
SHAPE = (BATCH, HIDDEN)  # activation [b, h]


# ---- the toy model --------------------------------------------------------------------------------
def full_blocks(seed: int = 0) -> list[torch.nn.Module]:
    """L blocks of Linear + tanh, initialised deterministically from `seed`."""
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()) for _ in range(LAYERS)]


def make_microbatches(m: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(SHAPE, generator=gen), "y": torch.randn(SHAPE, generator=gen)} for _ in range(m)]


def rank_chunks(blocks, pp_size: int, pp_rank: int, vp_size: int) -> list[torch.nn.Module]:
    """Virtual stage k holds blocks [k*L/(p*v), (k+1)*L/(p*v))."""
    per = LAYERS // (pp_size * vp_size)
    chunks = []
    for c in range(vp_size):
        k = virtual_stage(pp_rank, c, pp_size)
        chunks.append(torch.nn.Sequential(*blocks[k * per : (k + 1) * per]))
    return chunks


def make_forward_fn(num_microbatches: int, outputs=None):
    """Runs a chunk; the last virtual stage returns the loss; sent outputs are recorded in `outputs`."""

    def forward_fn(chunk_index, chunk, input_tensor, microbatch):
        # The loss chunk (last virtual stage) is marked by the test with `is_last`.
        x = microbatch["x"] if input_tensor is None else input_tensor
        out = chunk(x)
        if getattr(chunk, "is_last", False):
            return ((out - microbatch["y"]) ** 2).mean() / num_microbatches
        if outputs is not None:
            outputs.append(out)
        return out

    return forward_fn


def serial_reference(m: int):
    """Losses and per-block gradients of one process running the whole model."""
    blocks = full_blocks()
    model = torch.nn.Sequential(*blocks)
    losses = []
    for mb in make_microbatches(m):
        loss = ((model(mb["x"]) - mb["y"]) ** 2).mean() / m
        loss.backward()
        losses.append(loss.detach())
    return losses, blocks


def run_pipeline(state, schedule: str, m: int, vp: int, forward_only: bool = False, **kwargs):
    """This rank's chunks of the toy model through `schedule`; `kwargs` for execute_schedule (default: no
    scatter-gather, no overlapped messages)."""
    kwargs = {"scatter_gather": False, "overlap_p2p_comm": False, **kwargs}
    blocks = full_blocks()
    chunks = rank_chunks(blocks, state.pp_size, state.pp_rank, vp)
    if state.is_last_stage:
        chunks[-1].is_last = True
    outputs = []
    plan = build_plan(schedule, state.pp_size, state.pp_rank, m, vp, forward_only=forward_only)
    result = execute_schedule(
        plan, chunks, make_microbatches(m), make_forward_fn(m, outputs), state, SHAPE, torch.float32, **kwargs
    )
    return result, chunks, outputs


def check_parity(state, schedule, m, vp, result, chunks, grad_scale=1.0):
    ref_losses, ref_blocks = serial_reference(m)
    per = LAYERS // (state.pp_size * vp)
    for c, chunk in enumerate(chunks):
        k = virtual_stage(state.pp_rank, c, state.pp_size)
        for mine, ref in zip(
            chunk.parameters(), torch.nn.Sequential(*ref_blocks[k * per : (k + 1) * per]).parameters()
        ):
            torch.testing.assert_close(
                mine.grad, ref.grad * grad_scale, rtol=1e-5, atol=1e-7, msg=f"{schedule} v{vp} stage {k}"
            )
    if state.is_last_stage:
        torch.testing.assert_close(torch.stack(result.losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-7)
    else:
        assert result.losses == []


# ---- rank bodies --------------------------------------------------------------------------------
def _schedules_body(rank, world_size, m):
    state = ParallelState.create(1, world_size)
    p, r = state.pp_size, state.pp_rank
    for schedule, vp in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        result, chunks, outputs = run_pipeline(state, schedule, m, vp)
        check_parity(state, schedule, m, vp, result, chunks)
        # Memory: in-flight micro-batches bounded as each schedule promises.
        if schedule == "gpipe":
            assert result.max_in_flight == m
        elif schedule == "1f1b":
            assert result.max_in_flight == min(p - r, m) <= p - r
        else:
            assert result.max_in_flight == min(2 * (p - r - 1) + (vp - 1) * p + 1, m * vp)
        # Sent outputs were deallocated (only their graph was kept for backward).
        assert outputs or (vp == 1 and state.is_last_stage)
        assert all(o.numel() == 1 for o in outputs)
        # Overlapped communication changes when batches are waited on, never the numbers.
        overlapped, overlapped_chunks, _ = run_pipeline(state, schedule, m, vp, overlap_p2p_comm=True)
        assert_bitwise_equal(result, chunks, overlapped, overlapped_chunks)


def assert_bitwise_equal(result, chunks, other, other_chunks):
    assert len(result.losses) == len(other.losses)
    assert all(torch.equal(a, b) for a, b in zip(result.losses, other.losses))
    for chunk, other_chunk in zip(chunks, other_chunks):
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(chunk.parameters(), other_chunk.parameters()))


def test_schedules_pp2_match_serial():
    run_ranks(2, _schedules_body, 4)


def test_schedules_pp4_match_serial():
    run_ranks(4, _schedules_body, 8)


def _extras_body(rank, world_size, m):
    state = ParallelState.create(1, world_size)
    # Forward-only evaluation: the training losses, no gradients touched.
    train, _, _ = run_pipeline(state, "interleaved", m, 2)
    evaluation, chunks, _ = run_pipeline(state, "interleaved", m, 2, forward_only=True)
    if state.is_last_stage:
        assert len(evaluation.losses) == m
        assert torch.equal(torch.stack(evaluation.losses), torch.stack(train.losses))
    else:
        assert evaluation.losses == [] and train.losses == []
    assert all(p.grad is None for chunk in chunks for p in chunk.parameters())
    # Loss scaling scales the gradients, not the reported losses.
    calls = []
    scaled, chunks, _ = run_pipeline(state, "1f1b", m, 1, loss_scale=4.0, on_last_backward=calls.append)
    check_parity(state, "1f1b", m, 1, scaled, chunks, grad_scale=4.0)
    assert calls == [0]


def test_forward_only_loss_scale_and_hook_pp2():
    run_ranks(2, _extras_body, 4)


def _scatter_gather_body(rank, world_size, m):
    state = ParallelState.create(2, 2)
    results = {}
    for scatter in (False, True):
        for schedule, vp in [("1f1b", 1), ("interleaved", 2)]:
            result, chunks, _ = run_pipeline(state, schedule, m, vp, scatter_gather=scatter)
            check_parity(state, schedule, m, vp, result, chunks)
            # Overlap with scatter/gather: the tp all-gather of a received slice waits for its batch.
            overlapped, overlapped_chunks, _ = run_pipeline(
                state, schedule, m, vp, scatter_gather=scatter, overlap_p2p_comm=True
            )
            assert_bitwise_equal(result, chunks, overlapped, overlapped_chunks)
            results[(scatter, schedule)] = ([p.grad for c in chunks for p in c.parameters()], result.losses)
    for schedule in ("1f1b", "interleaved"):
        (grads_off, losses_off), (grads_on, losses_on) = results[(False, schedule)], results[(True, schedule)]
        assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
        assert all(torch.equal(a, b) for a, b in zip(losses_off, losses_on))


def test_scatter_gather_tp2_pp2_identical():
    run_ranks(4, _scatter_gather_body, 4)


# ---- single process ---------------------------------------------------------------------------------
def test_single_stage_runs_without_communication():
    state = ParallelState.single()
    for schedule in ("gpipe", "1f1b"):
        result, chunks, _ = run_pipeline(state, schedule, 3, 1)
        check_parity(state, schedule, 3, 1, result, chunks)
        assert result.max_in_flight == 1
    # Virtual stages need a pipeline (layout.py's rule, the same from the config and the executor).
    with pytest.raises(LayoutError, match=r"parallel\.vp_size=2 needs parallel\.pp_size > 1"):
        build_plan("interleaved", 1, 0, 3, 2)


def test_deallocated_output_backward_matches():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    grad = torch.randn(3, 4)
    torch.autograd.backward(torch.tanh(layer(x)) * 2, grad)
    expected = layer.weight.grad.clone()
    layer.weight.grad = None
    out = torch.tanh(layer(x)) * 2
    assert deallocate_output(out) and out.numel() == 1
    run_backward(out, grad)
    torch.testing.assert_close(layer.weight.grad, expected)
