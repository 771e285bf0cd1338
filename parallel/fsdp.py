"""Sharded data parallelism (ZeRO-3) with torch's FSDP2: the third data-parallel flavour, beside DataParallel
(replicated parameters, bucketed gradient all-reduce) and DataParallel + DistributedOptimizer (ZeRO-1).

`ShardedDataParallel` shards each model chunk over the data-parallel ranks with `fully_shard` (public API of
torch.distributed.fsdp, the same in torch 2.11 and 2.13): one FSDP unit per transformer layer plus the chunk itself
(the embedding, the final norm and the output layer), on a DeviceMesh made from the ParallelState's own groups:
1-D over the dp x cp ranks (context-parallel ranks hold replicas too), or 2-D for HSDP (`parallel.fsdp_replicate`
replicas of consecutive dp x cp ranks: all-reduce over "dp_replicate", shard over "dp_shard"). Tensor
parallelism stays the project's own (plain local tensors, not DTensor TP): FSDP shards each rank's tp shard
along dim 0, as torchtitan's dp_shard x cp over a tp mesh.

What FSDP does per micro-batch: all-gather a layer's parameters before its forward (the next layer prefetched),
free them after it (`parallel.fsdp_reshard_after_forward`, ZeRO-3; false keeps them until backward, ZeRO-2
like), gather again before its backward (the previous layer prefetched), reduce-scatter its gradients right
after it (the shards accumulate over micro-batches in fp32). A forward-only pass (evaluation, no_grad) has no
backward to reshard in: every unit is resharded when the chunk's forward ends. Mixed precision with the
trainer's semantics: the sharded parameters stay fp32 (they are the optimizer's master weights), compute runs
in bf16/fp16 (`MixedPrecisionPolicy(param_dtype)`: the all-gather carries 16-bit values) and gradients are
reduced in fp32 (`reduce_dtype`), summed and divided by dp (not dp x cp: cp ranks' losses are parts of one sum,
as DataParallel). FSDP's all-gathers and reduce-scatters go through `state.comm` (custom collectives: the
recorder sees them like every other collective), HSDP's all-reduce is noted there after FSDP issues it.

Expert parallelism (plain FSDP only): a module whose own parameters are an ep rank's experts (ParamInfo.experts:
model/moe/experts.GroupedExperts) is a unit of its own, sharded over the expert-dp group (its replicas, dp x cp
/ ep ranks) instead of dp x cp, inside its layer's unit, as torchtitan shards MoE experts over its
dp_shard_mod_ep mesh. Its gradients are divided by dp as every other one; the grad norm's sum over dp x cp
(= ep x expert-dp) counts each expert element once.

The interface is DataParallel's (`zero_grad`, `enable_grad_sync`, `finish_grad_sync`, `owned_main_grad`,
`grad_buffer_bytes`), so the step and the loop do not know which flavour they hold; the optimizer
(optim/sharded_optimizer.py) steps each rank's fp32 shards with the same AdamW arithmetic, and checkpoints
store the shards as pieces of global tensors (`local_shard`), so they stay layout-free.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeGuard

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from model.param_info import ParamInfo, is_expert_param, param_info, set_param_info
from model.shape import fsdp_shard_rows
from parallel.comm import Collectives, RecordedWork
from parallel.lazy_torch import dtensor, fsdp

if TYPE_CHECKING:  # torch.distributed.fsdp imports torch.distributed.tensor (~1.3 CPU s): only FSDP runs need it
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from parallel.state import ParallelState


class LocalShard(NamedTuple):
    """This rank's part of a parameter (or of a param-shaped tensor): `flat` holds the parameter's flat elements
    [start, start + flat.numel()) (a view: writing it writes the parameter)."""

    flat: torch.Tensor
    start: int


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor (an FSDP parameter or shard). A DTensor exists only once
    torch.distributed.tensor is imported (torch.distributed.fsdp and DCP import it), so a process that has not imported it
    holds none: looking it up in sys.modules keeps `import pretrain_gpt` from importing it (its operator
    strategies and sympy, ~1.3 CPU s of every process's start-up)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP shard's local part, or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_shard(tensor: torch.Tensor) -> LocalShard:
    """Where this rank's elements of `tensor` lie in its flat elements: an FSDP parameter (Shard(0) over its
    mesh's last dimension, torch.chunk's split: ceil(rows / n) rows per rank, the last ranks fewer or none) or
    a plain tensor (all of it)."""
    if not is_dtensor(tensor):
        return LocalShard(tensor.detach().view(-1), 0)
    local = tensor.to_local().detach()
    rows = tensor.shape[0]
    per_row = tensor.numel() // rows if rows else 0
    placement = tensor.placements[-1]
    if not isinstance(placement, dtensor().Shard) or placement.dim != 0:
        raise ValueError(f"expected an FSDP parameter sharded along dim 0, got placements {tensor.placements}")
    mesh = tensor.device_mesh
    index, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    first_row, _ = fsdp_shard_rows(rows, size, index)
    return LocalShard(local.view(-1), first_row * per_row)


def shard_replicas(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(replicas, this rank's replica) of an FSDP shard: HSDP's replicas of it, or (1, 0) without HSDP; None for
    a plain tensor (its replicas are the dp x cp ranks)."""
    if not is_dtensor(tensor):
        return None
    mesh = tensor.device_mesh
    return (mesh.size(0), mesh.get_local_rank(0)) if mesh.ndim == 2 else (1, 0)


def fsdp_mesh(state: ParallelState, device_type: str) -> DeviceMesh:
    """The mesh FSDP shards over, from the state's groups: 1-D over dp x cp, or (replicate, shard) for HSDP."""
    if state.fsdp_replicate == 1:
        assert state.dp_cp_group is not None, "FSDP shards over dp x cp > 1 ranks: the state has their group"
        return DeviceMesh.from_group(state.dp_cp_group, device_type, mesh_dim_names=("dp_shard",))
    shard = state.dp_cp_size // state.fsdp_replicate
    dp_cp_ranks = state.grid.group(state.rank, "cp", "dp")  # ascending: dp_cp_rank order, as the HSDP groups
    layout = torch.tensor(dp_cp_ranks, dtype=torch.int).view(state.fsdp_replicate, shard)
    assert state.hsdp_replicate_group is not None and state.hsdp_shard_group is not None, "HSDP groups not created"
    return DeviceMesh.from_group(
        [state.hsdp_replicate_group, state.hsdp_shard_group],
        device_type,
        mesh=layout,
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )


def expert_fsdp_mesh(state: ParallelState, device_type: str) -> DeviceMesh:
    """The mesh an ep rank's experts are sharded over: its expert-dp group (dp x cp / ep ranks, maybe one)."""
    assert state.ep_dp_group is not None, "expert parallelism: the state has its expert-dp group"
    return DeviceMesh.from_group(state.ep_dp_group, device_type, mesh_dim_names=("expert_dp_shard",))


def holds_experts(module: nn.Module) -> bool:
    """Whether `module`'s own parameters are all expert-parallel weights (and it has some)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(is_expert_param(p) for p in own)


class RecordedAllGather:
    """FSDP's parameter all-gather (the `set_custom_all_gather` interface: allocate, then call) issued through
    the project's Collectives, so the rank's recorder sees it."""

    def __init__(self, comm: Collectives):
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup, async_op: bool = False
    ) -> RecordedWork | None:
        return self.comm.all_gather_into(output_tensor, input_tensor, group, async_op=async_op)


class RecordedReduceScatter:
    """FSDP's gradient reduce-scatter (`set_custom_reduce_scatter`), a sum (FSDP divides afterwards: see
    `ShardedDataParallel`), through the project's Collectives."""

    def __init__(self, comm: Collectives):
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: torch.distributed.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> RecordedWork | None:
        if op != torch.distributed.ReduceOp.SUM:  # force_sum_reduction_for_comms is set on every unit
            raise ValueError(f"FSDP asked for a {op} reduce-scatter; the trainer sums and divides afterwards")
        return self.comm.reduce_scatter_into(output_tensor, input_tensor, group, async_op=async_op)


def _carry_param_info(chunk: nn.Module, before: dict[str, ParamInfo]) -> None:
    """fully_shard replaces every parameter by a DTensor one: give each the ParamInfo its plain one had."""
    for name, param in chunk.named_parameters(remove_duplicate=False):
        info = before[name]
        set_param_info(param, **{f.name: getattr(info, f.name) for f in dataclasses.fields(info)})


class ShardedDataParallel:
    """FSDP2 over this rank's model chunks with DataParallel's interface (module docstring).

    Args:
        chunks: this rank's model chunks (one: FSDP runs with pp = 1), built in fp32 (the master weights).
        state: the ParallelState (dp_cp_group, or the HSDP groups with fsdp_replicate > 1).
        compute_dtype: the dtype forward and backward run in (bf16 / fp16: FSDP casts the gathered parameters).
        reshard_after_forward: free a layer's gathered parameters after its forward (ZeRO-3) or keep them.
    """

    distributed_optimizer = False  # the optimizer state is sharded by FSDP itself (optim/sharded_optimizer.py)

    def __init__(
        self,
        chunks: list[nn.Module],
        state: ParallelState,
        compute_dtype: torch.dtype,
        reshard_after_forward: bool = True,
    ):
        self.chunks, self.state = chunks, state
        # A chunk's output is a view ([b, s] loss, transposed); the executor never changes it in place, which
        # is what FSDP warns about on every forward.
        warnings.filterwarnings(
            "ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning
        )
        device = next(p for chunk in chunks for p in chunk.parameters()).device
        self.mesh = fsdp_mesh(state, device.type)
        self.expert_mesh = expert_fsdp_mesh(state, device.type) if state.ep_size > 1 else None
        self.undivided: list[nn.Parameter] = []  # experts on a one-rank mesh: finish_grad_sync divides by dp
        policy = fsdp().MixedPrecisionPolicy(
            param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
        )
        for chunk in chunks:
            self._shard_chunk(chunk, policy, reshard_after_forward)
        unique = {id(p): p for chunk in chunks for p in chunk.parameters() if p.requires_grad}  # tied: once
        self.params: list[nn.Parameter] = list(unique.values())

    @property
    def shard_group(self) -> ProcessGroup | None:
        """The group each parameter is sharded over (dp x cp, or one HSDP replica): the grad norm sums over it."""
        return self.state.dp_cp_group if self.state.fsdp_replicate == 1 else self.state.hsdp_shard_group

    def _shard_chunk(self, chunk: nn.Module, policy: MixedPrecisionPolicy, reshard_after_forward: bool) -> None:
        fully_shard = fsdp().fully_shard
        before = {name: param_info(p) for name, p in chunk.named_parameters(remove_duplicate=False)}
        layers = [layer for _, layer in chunk.transformer_layers()]  # type: ignore[operator]
        experts = [module for module in chunk.modules() if holds_experts(module)] if self.expert_mesh else []
        for module in experts:  # before their layers: a unit inside a unit shards its own parameters
            fully_shard(module, mesh=self.expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        # the chunk's own parameters (embedding, final norm, head) are needed again first thing in backward:
        # kept gathered from forward to backward (FSDP's own choice for a root unit when left unset)
        fully_shard(chunk, mesh=self.mesh, reshard_after_forward=False, mp_policy=policy)
        _carry_param_info(chunk, before)
        if self.state.expert_dp_size == 1:
            self.undivided += [param for module in experts for param in module.parameters()]
        units: list[FSDPModule] = [*experts, *layers, chunk]  # type: ignore[list-item]
        for current, following in zip(layers, layers[1:]):  # layer i gathers layer i+1 while it computes
            current.set_modules_to_forward_prefetch([following])
        for current, previous in zip(layers[1:], layers):  # and, in backward, layer i - 1
            current.set_modules_to_backward_prefetch([previous])
        for unit in units:
            self._configure(unit, one_rank=unit in experts and self.state.expert_dp_size == 1)
        # A forward under no_grad (evaluation) has no backward, and FSDP reshards a unit that keeps its
        # gathered parameters after forward (this chunk always; every layer without reshard_after_forward)
        # only in backward: the gathered parameters would stay registered in the modules in place of the
        # shards the optimizer and the checkpoint hold. This hook, registered after FSDP's own post-forward
        # hook, runs after it.
        chunk.register_forward_hook(lambda module, args, output: self._reshard_after_forward_only(units))

    @staticmethod
    def _reshard_after_forward_only(units: list[FSDPModule]) -> None:
        """After a chunk's forward under no_grad: put every unit's shards back in its modules."""
        if torch.is_grad_enabled():
            return  # training: FSDP reshards each unit after its backward
        for unit in units:
            unit.reshard()

    def _configure(self, unit: FSDPModule, one_rank: bool = False) -> None:
        """Collectives through the door, sums divided by dp once; `one_rank`: an experts' unit whose mesh is
        this rank alone (ep = dp x cp), whose gradients `finish_grad_sync` divides."""
        comm = self.state.comm
        dp_size = float(self.state.dp_size)  # dp, not dp x cp (see the module docstring)
        unit.set_custom_all_gather(RecordedAllGather(comm))  # type: ignore[arg-type]
        unit.set_custom_reduce_scatter(RecordedReduceScatter(comm))  # type: ignore[arg-type]
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; the division is FSDP's own, after
        # HSDP whose shard groups hold one rank: FSDP (torch 2.13) skips the reduce-scatter of a one-rank group
        # and divides its copy of the gradient by the factor, then divides again after the replicas' all-reduce
        # (dp^2 in all). There the trainer divides instead, once, after the all-reduce sums the replicas.
        one_rank_shards = self.state.fsdp_replicate == self.state.dp_cp_size
        # The same double division hits an experts' unit on a one-rank mesh (measured: dp^2): the trainer
        # divides its gradients once in finish_grad_sync.
        unit.set_gradient_divide_factor(1.0 if one_rank_shards or one_rank else dp_size)
        if self.state.fsdp_replicate > 1:
            group = self.state.hsdp_replicate_group

            def after_all_reduce(reduced: torch.Tensor) -> None:  # FSDP issued it (HSDP) just before this call
                comm.note("all_reduce", reduced.numel() * reduced.element_size(), group)
                if one_rank_shards:
                    reduced.div_(dp_size)

            unit.set_all_reduce_hook(after_all_reduce)

    # ---- DataParallel's interface ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drop the sharded gradients (FSDP allocates them again in the next backward)."""
        for param in self.params:
            param.grad = None

    def enable_grad_sync(self, chunk_index: int = 0) -> None:
        """Nothing to enable: FSDP reduce-scatters every micro-batch's gradients as its backward ends (the
        shards accumulate; no rank holds a whole gradient across micro-batches, as ZeRO-3)."""

    def finish_grad_sync(self) -> None:
        """FSDP waited for its reduce-scatters at the end of backward; a parameter that got no gradient gets a
        zero shard, so every rank steps the same elements; experts on a one-rank mesh are divided by dp here."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self.state.dp_size > 1:
            for param in self.undivided:
                assert param.grad is not None
                local_tensor(param.grad).div_(self.state.dp_size)

    def owned_main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The flat fp32 gradient of this rank's shard of `param` (after finish_grad_sync)."""
        if param.grad is None:
            raise RuntimeError("owned_main_grad before finish_grad_sync: FSDP has not reduced the gradients yet")
        return local_tensor(param.grad).view(-1)

    def grad_buffer_bytes(self) -> int:
        """Bytes of this rank's fp32 gradient shards (held from backward to the step)."""
        return sum(local_tensor(p).numel() * 4 for p in self.params)
