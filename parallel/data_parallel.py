"""Data parallelism: flat fp32 gradient buffers, buckets, and the dp reduction overlapped with backward.

Every parameter of a model chunk gets `param.main_grad`, a view into one contiguous fp32 buffer per chunk.
A post-accumulate-grad hook adds `param.grad` into `main_grad` and drops `param.grad`, so 16-bit params
accumulate over micro-batches in fp32 and fp32 params take the same path.

The buffer is cut into buckets of about `bucket_size_mb`, in reverse registration order (roughly the order
backward produces gradients). Reduction over the dp group is launched bucket by bucket while the LAST
micro-batch's backward is running: the executor calls `enable_grad_sync(chunk)` just before it, and a bucket
is launched as soon as all of its params have fired their hook. Earlier micro-batches only accumulate.
Buckets are launched strictly in bucket order so that every dp rank issues the same collectives in the same
order (a requirement of NCCL and gloo), whatever order autograd happens to finish them in.

Plain: async all_reduce of each bucket pre-divided by dp. Distributed optimizer (ZeRO-1): every bucket is
padded to a multiple of dp and split into dp equal shards; dp rank d owns shard d of every bucket and gets
it by an async reduce_scatter. The tied embedding (`shared_embedding=True`) always has a bucket of its own
so the first and last pipeline stages shard it identically (see parallel/grad_utils.finalize_model_grads).

Expert parallelism: the weights of an ep rank's experts (ParamInfo.experts set) are replicated over the
expert-dp group only (dp x cp / ep ranks), so they sit in buckets of their own, reduced (and, with the
distributed optimizer, sharded) over `state.expert_dp_group`. Their division is by dp as for every other
bucket (megatron-core's expert gradient scaling factor is 1 / dp x cp too): each rank's loss is its own dp
share, and the all-to-all's backward already brought every ep rank's contribution to the expert's owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from model.param_info import is_expert_param, param_info
from parallel.comm import RecordedWork

if TYPE_CHECKING:
    from parallel.state import ParallelState


@dataclass
class Bucket:
    """A contiguous range [start, end) of one chunk's grad buffer (end - start divisible by dp when the
    distributed optimizer is on) and the params laid out in it."""

    chunk_index: int
    index: int  # position in the chunk's launch order
    start: int
    end: int
    params: list[nn.Parameter]
    pending: set[int] = field(default_factory=set)  # ids of params whose hook has not fired since sync on
    work: RecordedWork | None = None
    launched: bool = False
    expert: bool = False  # holds expert-parallel weights: reduced and sharded over the expert-dp group

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """Buffer range [start, end) of dp rank `dp_rank`'s shard of this bucket."""
        return shard_range(self.start, self.end, dp_rank, dp_size)


def shard_range(start: int, end: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Buffer range [start, end) of dp rank `dp_rank`'s shard of the bucket [start, end) (padded to dp)."""
    size = (end - start) // dp_size
    return start + dp_rank * size, start + (dp_rank + 1) * size


def owned_slice(shard: tuple[int, int], start: int, end: int) -> tuple[int, int]:
    """[lo, hi) in the param's own elements of the param at buffer range [start, end) inside `shard`
    (maybe empty: (0, 0))."""
    lo, hi = max(shard[0], start), min(shard[1], end)
    return (lo - start, hi - start) if lo < hi else (0, 0)


@dataclass
class ParamRange:
    """Where one param lives: chunk `chunk_index`'s buffer, elements [start, end), inside `bucket`."""

    chunk_index: int
    start: int
    end: int
    bucket: Bucket


def plan_buckets(sizes: Sequence[tuple[int, bool]], bucket_numel: int, pad_to: int) -> list[tuple[int, int, list[int]]]:
    """(start, end, param indices) of each bucket of one chunk's grad buffer, in launch order. `sizes` are
    (numel, is the shared embedding) of the params in launch order (reversed registration); a bucket closes
    once it holds `bucket_numel` elements, the shared embedding weight always gets one of its own, and each
    bucket is padded to a multiple of `pad_to` (dp x cp with the distributed optimizer, else 1). The planner
    cuts its listed reductions with this same function (planner/collectives.py)."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, (numel, shared) in enumerate(sizes):
        if shared:
            if current:
                groups.append(current)
            groups.append([index])
            current, size = [], 0
            continue
        current.append(index)
        size += numel
        if size >= bucket_numel:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    layout, offset = [], 0
    for group in groups:
        padded = -(-sum(sizes[i][0] for i in group) // pad_to) * pad_to
        layout.append((offset, offset + padded, group))
        offset += padded
    return layout


class DataParallel:
    """Gradient buffers and bucketed dp reduction for this rank's model chunks.

    Args:
        chunks: this rank's model chunks (one without virtual pipeline stages).
        state: the ParallelState (uses dp_cp_group, dp_cp_size, dp_cp_rank: context-parallel ranks hold
            replicas too, so gradients are reduced over dp x cp; divided by dp_size only, because the cp
            ranks' losses are parts of one sum, not replicas of a mean).
        bucket_size_mb: target bucket size in MiB of gradient (parallel.grad_bucket_size_mb).
        distributed_optimizer: reduce_scatter into dp shards instead of all_reduce (parallel.distributed_optimizer).
        grad_dtype: dtype of the main gradient buffers (fp32).
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        state: ParallelState,
        bucket_size_mb: float,
        distributed_optimizer: bool,
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.chunks, self.state = chunks, state
        self.distributed_optimizer = distributed_optimizer
        self.grad_dtype = grad_dtype
        element_size = torch.empty((), dtype=grad_dtype).element_size()
        self.bucket_numel = max(1, int(bucket_size_mb * 2**20) // element_size)
        self.buffers: list[torch.Tensor] = []  # one flat [numel] grad buffer per chunk
        self.buckets: list[list[Bucket]] = []  # per chunk, in launch order
        self.param_ranges: dict[nn.Parameter, ParamRange] = {}
        self._sync_enabled = [False] * len(chunks)
        self._next_launch = [0] * len(chunks)
        self._hook_handles: list[RemovableHandle] = []
        for chunk_index, chunk in enumerate(chunks):
            self._build_chunk(chunk_index, chunk)

    # ---- construction -----------------------------------------------------------------------
    def _plan_chunk(self, ordered: list[nn.Parameter]) -> list[tuple[int, int, list[int], bool]]:
        """`plan_buckets` over each run of consecutive expert or non-expert params of `ordered`, laid out one
        after another: (start, end, param indices, expert) per bucket, in launch order. Without expert
        parallelism that is plan_buckets over all of them."""
        runs: list[list[int]] = []
        for index, param in enumerate(ordered):
            if runs and is_expert_param(param) == is_expert_param(ordered[runs[-1][0]]):
                runs[-1].append(index)
            else:
                runs.append([index])
        layout, offset = [], 0
        for run in runs:
            expert = is_expert_param(ordered[run[0]])
            replicas = self.state.expert_dp_size if expert else self.state.dp_cp_size
            pad_to = replicas if self.distributed_optimizer else 1
            sizes = [(ordered[i].numel(), param_info(ordered[i]).shared_embedding) for i in run]
            for start, end, indices in plan_buckets(sizes, self.bucket_numel, pad_to):
                layout.append((offset + start, offset + end, [run[i] for i in indices], expert))
            offset = layout[-1][1]
        return layout

    def _build_chunk(self, chunk_index: int, chunk: nn.Module) -> None:
        params = [p for p in chunk.parameters() if p.requires_grad]  # parameters() skips tied duplicates
        ordered = list(reversed(params))  # roughly the order backward produces gradients
        layout = self._plan_chunk(ordered)
        device = params[0].device if params else torch.device("cpu")
        buffer = torch.zeros(layout[-1][1] if layout else 0, dtype=self.grad_dtype, device=device)
        buckets = []
        for index, (start, end, indices, expert) in enumerate(layout):
            group = [ordered[i] for i in indices]
            bucket = Bucket(chunk_index, index, start, end, group, expert=expert)
            position = start
            for param in group:
                self.param_ranges[param] = ParamRange(chunk_index, position, position + param.numel(), bucket)
                param.main_grad = buffer[position : position + param.numel()].view(param.shape)  # type: ignore[attr-defined]
                position += param.numel()
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._make_hook(bucket)))
            buckets.append(bucket)
        self.buffers.append(buffer)
        self.buckets.append(buckets)

    def _make_hook(self, bucket: Bucket):
        def hook(param: torch.Tensor) -> None:
            if bucket.launched and self._sync_enabled[bucket.chunk_index]:
                # Adding now would race with (or miss) the reduction already in flight.
                raise RuntimeError(
                    f"a gradient of chunk {bucket.chunk_index} bucket {bucket.index} arrived "
                    f"after the bucket's dp reduction was launched"
                )
            if param.grad is not None:
                param.main_grad.add_(param.grad)  # type: ignore[attr-defined]  # fp32 accumulation, also 16-bit params
                param.grad = None
            if self._sync_enabled[bucket.chunk_index]:
                # A set, not a counter: robust to a hook firing twice and to params that get no grad.
                bucket.pending.discard(id(param))
                if not bucket.pending:
                    self._launch_ready(bucket.chunk_index)

        return hook

    # ---- per iteration ----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the main grad buffers (and any stray .grad) and turn grad sync off for the next iteration."""
        for buffer in self.buffers:
            buffer.zero_()
        for param in self.param_ranges:
            param.grad = None
        self._reset_sync_state()

    def _reset_sync_state(self) -> None:
        self._sync_enabled = [False] * len(self.chunks)
        self._next_launch = [0] * len(self.chunks)
        for bucket in self._all_buckets():
            bucket.pending, bucket.work, bucket.launched = set(), None, False

    def enable_grad_sync(self, chunk_index: int = 0) -> None:
        """Called just before the last micro-batch's backward of chunk `chunk_index`: from now on a bucket
        whose params all fired their hook is reduced right away."""
        self._sync_enabled[chunk_index] = True
        for bucket in self.buckets[chunk_index]:
            if not bucket.launched:
                bucket.pending = {id(p) for p in bucket.params}

    def finish_grad_sync(self) -> None:
        """Launch the buckets not yet launched (sync never enabled, params without grad) and wait for all.
        Afterwards main_grad holds the dp average (distributed optimizer: in this rank's shards only)."""
        for chunk_index, buckets in enumerate(self.buckets):
            for bucket in buckets[self._next_launch[chunk_index] :]:
                self._launch(bucket)
            self._next_launch[chunk_index] = len(buckets)
        for bucket in self._all_buckets():
            if bucket.work is not None:
                bucket.work.wait()
        self._reset_sync_state()  # the next iteration starts accumulating again, even without zero_grad

    def _launch_ready(self, chunk_index: int) -> None:
        """Launch, in bucket order, every bucket from the next unlaunched one that is complete."""
        buckets = self.buckets[chunk_index]
        while self._next_launch[chunk_index] < len(buckets):
            bucket = buckets[self._next_launch[chunk_index]]
            if bucket.pending:
                return
            self._launch(bucket)
            self._next_launch[chunk_index] += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched, bucket.pending = True, set()
        if self.state.dp_cp_size == 1:
            return
        flat = self.buffers[bucket.chunk_index][bucket.start : bucket.end]
        if self.state.dp_size > 1:
            flat.div_(self.state.dp_size)  # average: sum of grads / dp (gloo has no AVG op)
        group, rank, size = self.replica_group(bucket)
        if size == 1:  # experts with ep = dp x cp: no other rank holds them
            return
        if self.distributed_optimizer:
            start, end = bucket.shard_range(rank, size)
            shard = self.buffers[bucket.chunk_index][start:end]
            bucket.work = self.state.comm.reduce_scatter_into(shard, flat, group, async_op=True)
        else:
            bucket.work = self.state.comm.all_reduce(flat, group, async_op=True)

    def replica_group(self, bucket: Bucket) -> tuple[ProcessGroup | None, int, int]:
        """(group, this rank's index in it, its size) of the ranks holding replicas of `bucket`'s params: the
        expert-dp group for an expert bucket, dp x cp for every other one (the distributed optimizer shards
        the bucket over it)."""
        if bucket.expert:
            return self.state.expert_dp_group, self.state.expert_dp_rank, self.state.expert_dp_size
        return self.state.dp_cp_group, self.state.dp_cp_rank, self.state.dp_cp_size

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """Buffer range [start, end) of `bucket` this rank holds reduced: the whole bucket, or with the
        distributed optimizer its shard over the bucket's replica group."""
        if not self.distributed_optimizer:
            return bucket.start, bucket.end
        _, rank, size = self.replica_group(bucket)
        return bucket.shard_range(rank, size)

    # ---- layout queries ---------------------------------------------------------------------
    def _all_buckets(self):
        return (bucket for buckets in self.buckets for bucket in buckets)

    def owned_param_slice(self, param: nn.Parameter) -> tuple[int, int]:
        """[start, end) in param.view(-1) elements of the part of `param` this rank owns (maybe empty)."""
        where = self.param_ranges[param]
        if not self.distributed_optimizer:
            return 0, param.numel()
        return owned_slice(self.owned_range(where.bucket), where.start, where.end)

    def owned_main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The flat part of `param.main_grad` that holds reduced gradients after finish_grad_sync: all of
        it, or with the distributed optimizer the part inside this rank's dp shard (maybe empty)."""
        lo, hi = self.owned_param_slice(param)
        return param.main_grad.view(-1)[lo:hi]  # type: ignore[attr-defined]

    def grad_buffer_bytes(self) -> int:
        """Bytes of the main grad buffers on this rank."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def remove_hooks(self) -> None:
        """Detach the grad hooks (tests, or before building a new DataParallel on the same chunks)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
