"""AdamW on flat fp32 tensors: the shared step (`Optimizer`), the plain optimizer over whole gradient buffers
(`BufferOptimizer`) and the distributed (ZeRO-1) one; FSDP's is optim/sharded_optimizer.py.

The buffer optimizers work on the flat fp32 grad buffers of `parallel.data_parallel.DataParallel`, one segment
per bucket: the whole bucket (plain) or this dp rank's shard of it (distributed). For each segment it keeps fp32
master params, exp_avg and exp_avg_sq. Weight decay and "counts in the grad norm" are per element but stored
as runs of (start, end) over contiguous params, not as per-element masks: that costs nothing per element.

Param groups as Megatron: no weight decay on 1-D params (biases, norm weights), decay on everything else.
One step: unscale (fp16) -> inf/nan check over the world (fp16: skip the step) -> global grad norm (not finite:
skip the step, any precision) -> clip -> AdamW -> write the masters back into the model params (distributed:
all-gather the shards over dp).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from config.schema import PRECISIONS, OptimConfig, TrainConfig
from optim.loss_scaler import loss_scaler_for
from parallel.data_parallel import Bucket, DataParallel
from parallel.grad_utils import any_non_finite, clip_coefficient, counts_in_grad_norm, reduce_norm, sum_of_squares
from parallel.param_gather import ParamGather, copy_bucket_to_params

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from parallel.state import ParallelState


class SegmentState(TypedDict):
    """One segment of `OptimizerState`: where it lies in its chunk's grad buffer, and its fp32 tensors."""

    chunk: int
    start: int
    end: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class OptimizerState(TypedDict):
    """`Optimizer.state_dict()`: this rank's state (its shards when distributed) and the layout it belongs to."""

    step: int
    loss_scaler: dict[str, float]
    distributed: bool
    dp_size: int  # the replicas the state is sharded over (dp x cp)
    dp_rank: int
    segments: list[SegmentState]


@dataclass
class StepStats:
    """What one optimizer step reports. `grad_norm` is nan for a skipped step; `loss_scale` is the scale
    the step's gradients were computed with (1.0 unless fp16)."""

    grad_norm: float
    skipped: bool
    loss_scale: float


def decays(param: nn.Parameter) -> bool:
    """The weight-decay param group: matrices decay; biases and norm weights (1-D) do not."""
    return param.ndim > 1


@dataclass
class Segment:
    """One owned range [start, end) of chunk `bucket.chunk_index`'s grad buffer and its optimizer state.
    `pieces` are (param, segment offset, param-flat offset, length) of the params overlapping it."""

    bucket: Bucket | None  # None: a sharded parameter's segment (optim/sharded_optimizer.py)
    start: int
    end: int
    grad: torch.Tensor  # [end - start] view into the grad buffer
    master: torch.Tensor  # fp32 [end - start]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    pieces: list[tuple[nn.Parameter, int, int, int]] = field(default_factory=list)
    decay_runs: list[tuple[int, int]] = field(default_factory=list)
    norm_runs: list[tuple[int, int]] = field(default_factory=list)


def _runs(pieces: list[tuple[nn.Parameter, int, int, int]], keep) -> list[tuple[int, int]]:
    """Merge the pieces whose param satisfies `keep` into maximal contiguous (start, end) runs."""
    runs: list[tuple[int, int]] = []
    for param, offset, _, length in pieces:
        if not keep(param):
            continue
        if runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + length)
        else:
            runs.append((offset, offset + length))
    return runs


def _pieces(ddp: DataParallel, bucket: Bucket, start: int, end: int):
    pieces = []
    for param in bucket.params:
        where = ddp.param_ranges[param]
        lo, hi = max(start, where.start), min(end, where.end)
        if lo < hi:
            pieces.append((param, lo - start, lo - where.start, hi - lo))
    return pieces


class Optimizer(ABC):
    """AdamW over segments of flat fp32 tensors; the subclasses say where the segments lie: `BufferOptimizer`
    (the whole grad buffers of DataParallel), `DistributedOptimizer` (this dp rank's shards of them) and
    optim/sharded_optimizer.ShardedOptimizer (FSDP's parameter shards). See the module docstring.

    The settings are the config's: lr, weight_decay, adam_beta1/2 and adam_eps of the optim section (and its
    loss-scaler settings under fp16); train.clip_grad; train.precision (fp32: each param becomes a view of its
    master where the subclass can alias). `step(lr)` is collective over the world (the inf/nan check) and the
    model-parallel group (the norm).
    """

    distributed = False

    def __init__(self, state: ParallelState, optim: OptimConfig, train: TrainConfig):
        self.state = state
        self.lr, self.weight_decay = optim.lr, optim.weight_decay
        self.betas, self.eps = (optim.adam_beta1, optim.adam_beta2), optim.adam_eps
        self.clip_grad = train.clip_grad
        self.scaler = loss_scaler_for(train.precision, optim)
        self.step_count = 0
        self.segments = self._build_segments()
        self.aliased = self._alias_params(train.precision)

    @abstractmethod
    def _build_segments(self) -> list[Segment]:
        """This rank's segments: where its gradients, masters and moments lie."""

    @abstractmethod
    def _alias_params(self, precision: str) -> bool:
        """Make the model params views of their masters where that is possible; True if they are."""

    # ---- the step ---------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale

    def _norm_groups(self) -> list[ProcessGroup | None]:
        return [self.state.model_parallel_group] if self.state.is_distributed else []

    def _expert_norm_groups(self) -> list[ProcessGroup | None]:
        """Where the experts' squares are summed before `_norm_groups`: over ep, whose ranks hold different
        experts (the distributed optimizer's dp x cp group already spans ep x expert-dp)."""
        return [self.state.ep_group]

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) main grads, each element counted once over tp, pp and dp (and
        each expert once over ep)."""
        device = self.segments[0].grad.device if self.segments else "cpu"

        def squares(expert: bool) -> torch.Tensor:
            return sum_of_squares(
                [
                    seg.grad[lo:hi]
                    for seg in self.segments
                    if (seg.bucket is not None and seg.bucket.expert) == expert
                    for lo, hi in seg.norm_runs
                ],
                device,
            )

        total = squares(expert=False)
        if self.state.ep_size > 1:  # every rank of the ep group takes part, experts here or not
            expert_squares = squares(expert=True)
            for group in self._expert_norm_groups():
                self.state.comm.all_reduce(expert_squares, group)
            total = total + expert_squares
        return reduce_norm(total, self.state.comm, self._norm_groups())

    @torch.no_grad()
    def step(self, lr: float | None = None) -> StepStats:
        """Unscale, check, clip and apply one AdamW step at `lr` (default: the constructor's lr)."""
        lr = self.lr if lr is None else lr
        scale = self.scaler.scale
        grads = [seg.grad for seg in self.segments]
        if scale != 1.0 and grads:
            for grad in grads:  # per tensor, public API only (the same elementwise product)
                grad.mul_(1.0 / scale)
        if self.scaler.dynamic:
            world = [dist.group.WORLD] if self.state.is_distributed else []
            device = grads[0].device if grads else "cpu"
            found_inf = any_non_finite(grads, self.state.comm, world, device)
            self.scaler.update(found_inf)
            if found_inf:
                return StepStats(grad_norm=float("nan"), skipped=True, loss_scale=scale)
        norm = self.grad_norm()
        if not math.isfinite(norm):
            # An inf/nan gradient would make every weight nan: skip the update (as fp16 does on overflow);
            # the trainer counts such steps and stops after train.max_nonfinite_iters in a row.
            return StepStats(grad_norm=norm, skipped=True, loss_scale=scale)
        coefficient = clip_coefficient(norm, self.clip_grad)
        if coefficient < 1.0 and grads:
            for grad in grads:
                grad.mul_(coefficient)
        self.step_count += 1
        for seg in self.segments:
            self._adamw(seg, lr)
        self.copy_to_params()
        return StepStats(grad_norm=norm, skipped=False, loss_scale=scale)

    def _adamw(self, seg: Segment, lr: float) -> None:
        """torch.optim.AdamW's update (decoupled weight decay, bias correction) on one segment."""
        beta1, beta2 = self.betas
        if self.weight_decay:
            for lo, hi in seg.decay_runs:
                seg.master[lo:hi].mul_(1.0 - lr * self.weight_decay)
        seg.exp_avg.lerp_(seg.grad, 1.0 - beta1)
        seg.exp_avg_sq.mul_(beta2).addcmul_(seg.grad, seg.grad, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**self.step_count
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**self.step_count)
        denom = (seg.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        seg.master.addcdiv_(seg.exp_avg, denom, value=-lr / bias_correction1)

    def finish_param_gather(self) -> None:
        """Finish parameter gathers still in flight (distributed optimizer with overlap_param_gather): call
        before anything but the forward reads or overwrites the model params."""
        return  # none by default: only DistributedOptimizer gathers in the background

    def copy_to_params(self) -> None:
        """Write the fp32 masters into the (16-bit) model parameters (after a step or a checkpoint load)."""
        if self.aliased:
            return
        for seg in self.segments:
            for param, offset, _, length in seg.pieces:
                param.data.copy_(seg.master[offset : offset + length].view(param.shape))

    # ---- state ------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 masters (unless they are the params) + moments.
        The grad buffers are `ddp.grad_buffer_bytes()`."""
        per_segment = 2 if self.aliased else 3
        return sum(per_segment * seg.master.numel() * seg.master.element_size() for seg in self.segments)

    def state_dict(self) -> OptimizerState:
        """This rank's state (its shards when distributed); tensors, numbers, strings, lists and dicts only."""
        return {
            "step": self.step_count,
            "loss_scaler": self.scaler.state_dict(),
            "distributed": self.distributed,
            "dp_size": self.state.dp_cp_size,  # the replicas the state is sharded over (dp x cp)
            "dp_rank": self.state.dp_cp_rank,
            "segments": [
                {
                    "chunk": seg.bucket.chunk_index if seg.bucket is not None else 0,
                    "start": seg.start,
                    "end": seg.end,
                    "master": seg.master,
                    "exp_avg": seg.exp_avg,
                    "exp_avg_sq": seg.exp_avg_sq,
                }
                for seg in self.segments
            ],
        }

    @torch.no_grad()
    def reset_from_params(self) -> None:
        """Fresh state for the current params (after loading weights only): masters copied from the params,
        moments zero, step 0, loss scaler as new."""
        self.finish_param_gather()
        for seg in self.segments:
            for param, offset, param_offset, length in seg.pieces:
                seg.master[offset : offset + length].copy_(
                    param.detach().reshape(-1)[param_offset : param_offset + length]
                )
            seg.exp_avg.zero_()
            seg.exp_avg_sq.zero_()
        self.step_count = 0

    @torch.no_grad()
    def load_state_dict(self, state: OptimizerState) -> None:
        """Restore `state_dict()` output of the same layout and write the masters into the model params
        (collective over dp when distributed). Resharding to another dp size is not supported."""
        mine = self.state_dict()
        # The plain optimizer's state is the same on every dp rank (dp rank 0 saves it for all of them).
        layout_keys: tuple[Literal["distributed", "dp_size", "dp_rank"], ...] = ("distributed", "dp_size", "dp_rank")
        for key in layout_keys if self.distributed else layout_keys[:2]:
            if state[key] != mine[key]:
                raise ValueError(f"optimizer checkpoint has {key}={state[key]}, this run has {mine[key]}")
        ranges = [(s["chunk"], s["start"], s["end"]) for s in state["segments"]]
        if ranges != [(s["chunk"], s["start"], s["end"]) for s in mine["segments"]]:
            raise ValueError(
                "optimizer checkpoint's buffer layout differs from this model's "
                "(model shape, bucket size or parameter order changed)"
            )
        tensor_keys: tuple[Literal["master", "exp_avg", "exp_avg_sq"], ...] = ("master", "exp_avg", "exp_avg_sq")
        for seg, saved in zip(self.segments, state["segments"]):
            for tensor_key in tensor_keys:
                getattr(seg, tensor_key).copy_(saved[tensor_key])
        self.step_count = int(state["step"])
        self.scaler.load_state_dict(state["loss_scaler"])
        self.copy_to_params()


class BufferOptimizer(Optimizer):
    """AdamW over the whole grad buffers of `ddp` (plain, dp-replicated state): one segment per gradient bucket."""

    def __init__(self, ddp: DataParallel, state: ParallelState, optim: OptimConfig, train: TrainConfig):
        self.ddp = ddp  # read by _build_segments, which the base constructor calls
        super().__init__(state, optim, train)

    def _build_segments(self) -> list[Segment]:
        """One segment per bucket: the whole bucket, or (distributed) this rank's shard of it."""
        return [self._build_segment(b, *self._owned(b)) for b in self.ddp._all_buckets() if b.numel]

    def _owned(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.start, bucket.end

    def _build_segment(self, bucket: Bucket, start: int, end: int) -> Segment:
        grad = self.ddp.buffers[bucket.chunk_index][start:end]
        master = torch.zeros(end - start, dtype=torch.float32, device=grad.device)
        pieces = _pieces(self.ddp, bucket, start, end)
        for param, offset, param_offset, length in pieces:
            master[offset : offset + length].copy_(param.detach().reshape(-1)[param_offset : param_offset + length])
        tp_rank = self.state.tp_rank
        return Segment(
            bucket,
            start,
            end,
            grad,
            master,
            torch.zeros_like(master),
            torch.zeros_like(master),
            pieces,
            decay_runs=_runs(pieces, decays),
            norm_runs=_runs(pieces, lambda p: counts_in_grad_norm(p, tp_rank)),
        )

    def _alias_params(self, precision: str) -> bool:
        """fp32 plain: make each param a view of its master, so no copy-back and no second fp32 copy."""
        if precision != "fp32":
            return False
        params = [piece[0] for seg in self.segments for piece in seg.pieces]
        if self.distributed or any(p.dtype != torch.float32 for p in params):
            return False
        for seg in self.segments:
            for param, offset, _, length in seg.pieces:
                param.data = seg.master[offset : offset + length].view(param.shape)
        return True


class DistributedOptimizer(BufferOptimizer):
    """ZeRO-1: this dp rank keeps masters and moments of its shard of every bucket only; the norm also sums
    over dp; updated shards are all-gathered over dp into the model params, bucket by bucket. With
    `overlap_param_gather` the gathers run in the background until the forward that needs them
    (parallel/param_gather.py)."""

    distributed = True

    def __init__(
        self,
        ddp: DataParallel,
        state: ParallelState,
        optim: OptimConfig,
        train: TrainConfig,
        overlap_param_gather: bool,
    ):
        super().__init__(ddp, state, optim, train)
        overlap = overlap_param_gather and state.dp_cp_size > 1  # the shards span dp x cp
        self.param_gather = ParamGather(ddp) if overlap else None

    def _owned(self, bucket: Bucket) -> tuple[int, int]:
        return self.ddp.owned_range(bucket)

    def _norm_groups(self) -> list[ProcessGroup | None]:
        return [self.state.model_parallel_group, self.state.dp_cp_group] if self.state.is_distributed else []

    def _expert_norm_groups(self) -> list[ProcessGroup | None]:
        return []

    def finish_param_gather(self) -> None:
        if self.param_gather is not None:
            self.param_gather.finish()

    def copy_to_params(self) -> None:
        # overlapped: launch in forward order (the last bucket holds the first layers), so the first forward
        # waits only for the first gather
        segments = self.segments[::-1] if self.param_gather is not None else self.segments
        for seg in segments:
            bucket = seg.bucket
            assert bucket is not None  # the distributed optimizer's segments are bucket shards
            group, dp_rank, dp_size = self.ddp.replica_group(bucket)  # dp x cp, or expert-dp for experts
            dtypes = {p.dtype for p in bucket.params}
            dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
            full = torch.empty(bucket.numel, dtype=dtype, device=seg.master.device)  # [bucket] in param dtype
            shard = bucket.numel // dp_size
            local = full[dp_rank * shard : (dp_rank + 1) * shard]
            local.copy_(seg.master)
            if self.param_gather is not None:
                self.param_gather.wait(bucket)  # a gather still in flight (two steps, no forward between)
                self.param_gather.launch(bucket, full, local)
                continue
            if dp_size > 1:
                self.state.comm.all_gather_into(full, local, group)
            copy_bucket_to_params(self.ddp, bucket, full)


def check_optimizer_inputs(
    chunks: list[nn.Module], ddp_chunks: list[nn.Module], train: TrainConfig, builder: str
) -> None:
    """What every optimizer builder checks: a known precision, and `chunks` the ones data parallelism wraps."""
    if train.precision not in PRECISIONS:
        raise ValueError(f"train.precision={train.precision!r} is not one of {', '.join(PRECISIONS)}")
    if [id(c) for c in chunks] != [id(c) for c in ddp_chunks]:
        raise ValueError(f"{builder}: chunks are not the ones data parallelism was built on")


def build_optimizer(
    chunks: list[nn.Module],
    ddp: DataParallel,
    state: ParallelState,
    optim: OptimConfig,
    train: TrainConfig,
    *,
    overlap_param_gather: bool,
) -> Optimizer:
    """The optimizer matching `ddp` (distributed iff ddp.distributed_optimizer) with the settings of the optim
    and train sections (Optimizer's docstring); FSDP's (a ShardedDataParallel) is
    optim/sharded_optimizer.build_sharded_optimizer. `chunks` must be the chunks `ddp` was built on.
    `overlap_param_gather` (parallel.overlap_param_gather; distributed only) gathers the updated params in the
    background until the next forward.
    """
    check_optimizer_inputs(chunks, ddp.chunks, train, "build_optimizer")
    if ddp.distributed_optimizer:
        return DistributedOptimizer(ddp, state, optim, train, overlap_param_gather)
    return BufferOptimizer(ddp, state, optim, train)
