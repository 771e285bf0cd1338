"""Overlapped parameter all-gather of the distributed optimizer (Megatron's `overlap_param_gather`).

After the step, each dp rank holds the updated fp32 masters of its shard of every bucket; the full params
come back by an all-gather over dp. With `parallel.overlap_param_gather` the gathers are launched
asynchronously at the end of the step, one per bucket, in forward order (the last bucket holds the first
layers: buckets follow backward order), and each is waited on just before the first forward that uses one of
its params, by a forward pre-hook on every module that owns params. So the gather of layer 5's bucket runs
while layers 1-4 compute. Anything else that reads the params (a checkpoint save, the finiteness check, a
checkpoint load that overwrites them) calls `finish()` first. The values copied are the same as without
overlap, so losses are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from parallel.comm import RecordedWork
from parallel.data_parallel import Bucket, DataParallel


@dataclass
class PendingGather:
    """One bucket's all-gather in flight: `full` [bucket numel] in the params' dtype fills as `work` ends."""

    bucket: Bucket
    full: torch.Tensor
    work: RecordedWork | None  # None: nothing to gather (one replica) or left out (Collectives.before_issue)


def copy_bucket_to_params(ddp: DataParallel, bucket: Bucket, full: torch.Tensor) -> None:
    """Write the gathered bucket `full` [bucket numel] into its params."""
    for param in bucket.params:
        where = ddp.param_ranges[param]
        param.data.copy_(full[where.start - bucket.start : where.end - bucket.start].view(param.shape))


class ParamGather:
    """The gathers in flight and the forward pre-hooks that finish them (see the module docstring)."""

    def __init__(self, ddp: DataParallel):
        self.ddp = ddp
        self.pending: dict[int, PendingGather] = {}  # id(bucket) -> gather in flight
        self.handles = [handle for chunk in ddp.chunks for handle in self._hook_modules(chunk)]

    def _hook_modules(self, chunk: nn.Module) -> list[RemovableHandle]:
        """A forward pre-hook on every module that owns params (directly) in the grad buffers."""
        handles = []
        for module in chunk.modules():
            buckets = {
                id(where.bucket): where.bucket
                for param in module.parameters(recurse=False)
                if (where := self.ddp.param_ranges.get(param)) is not None
            }
            if buckets:
                handles.append(module.register_forward_pre_hook(self._make_hook(list(buckets.values()))))
        return handles

    def _make_hook(self, buckets: list[Bucket]) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            if self.pending:
                for bucket in buckets:
                    self.wait(bucket)

        # inside a compiled layer (train.compile) the wait runs eagerly: a collective's handle is not traceable
        return torch.compiler.disable(hook)

    def launch(self, bucket: Bucket, full: torch.Tensor, local: torch.Tensor) -> None:
        """Start gathering `bucket` over the ranks it is sharded over (dp x cp, or the expert-dp group for an
        expert bucket; its shard `local` already written into `full`)."""
        group, _, size = self.ddp.replica_group(bucket)
        work = self.ddp.state.comm.all_gather_into(full, local, group, async_op=True) if size > 1 else None
        self.pending[id(bucket)] = PendingGather(bucket, full, work)

    def wait(self, bucket: Bucket) -> None:
        """Finish `bucket`'s gather, if one is in flight, and copy it into the params."""
        gather = self.pending.pop(id(bucket), None)
        if gather is None:
            return
        if gather.work is not None:
            gather.work.wait()
        copy_bucket_to_params(self.ddp, gather.bucket, gather.full)

    def finish(self) -> None:
        """Finish every gather in flight (before anything reads or overwrites the params outside forward)."""
        for gather in list(self.pending.values()):
            self.wait(gather.bucket)

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
