"""What a rank contributes to (and takes from) a checkpoint: its parameters and optimizer state as
`GlobalPieces` under global keys (written and read by the planners of checkpoint/dcp_planners.py).

Keys: the model weight under its global name (`layers.5.mlp.fc1.weight`), the optimizer state under
`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>` and, when the weights are not fp32, `optim.master.<name>`
(with fp32 weights the master is the weight and is stored once). Writers: each tensor element once per
checkpoint: replicated-over-tp params by tp rank 0; dp replicas by one dp rank (params dealt round-robin over
dp, so every dp rank writes a share); with the distributed optimizer each dp rank writes its own shard of the
state. The last pipeline stage's copy of a tied embedding is never written (the first stage writes it) but
is loaded from the same key (under zb-v on the rank that holds the embedding: two pieces at the same offsets,
each filled, dcp_planners.GlobalPieces.piece_at).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from checkpoint import dcp_modules
from checkpoint.files import CheckpointError
from checkpoint.pieces import Block, global_shape, pieces_of, tp_blocks
from model.param_info import param_info
from optim.optimizer import Optimizer
from parallel.fsdp import LocalShard, local_shard, shard_replicas
from parallel.state import ParallelState

if TYPE_CHECKING:  # torch.distributed.checkpoint costs ~1.3 CPU s to import: only a save or a load needs it
    from torch.distributed.checkpoint.metadata import Metadata

    from checkpoint.dcp_planners import GlobalPieces

OPTIM_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class ParamRecord:
    """One parameter of this rank with its checkpoint identity."""

    name: str  # global name = checkpoint key of the weight
    param: nn.Parameter
    shape: tuple[int, ...]  # global (stored) shape
    blocks: list[Block]  # where the local tp shard lies in the global tensor
    writes: bool  # this rank writes the weight (and with the plain optimizer its state)
    replica_writer: bool  # among tp replicas and tied copies, this rank is the one that may write
    local: LocalShard  # the elements this rank holds: the whole tp shard, or its FSDP shard of it


def param_records(chunks: Sequence[nn.Module], state: ParallelState) -> list[ParamRecord]:
    """This rank's parameters in chunk order, each once (a tied output layer is the embedding)."""
    records: list[ParamRecord] = []
    for chunk in chunks:
        for module_name, param in chunk.named_parameters():
            info = param_info(param)
            name = info.init_name or module_name
            copy = info.embedding_copy
            replicated = not info.tensor_parallel or state.tp_size == 1
            replica_writer = not copy and (not replicated or state.tp_rank == 0)
            # replicas dealt round-robin: the dp x cp ranks (an ep rank's experts: its expert-dp group, the
            # other ep ranks write other experts), or for an FSDP shard HSDP's replicas of it
            dp_replicas = (
                (state.expert_dp_size, state.expert_dp_rank)
                if info.experts is not None
                else (state.dp_cp_size, state.dp_cp_rank)
            )
            replicas, replica_rank = shard_replicas(param) or dp_replicas
            writes = replica_writer and len(records) % replicas == replica_rank
            records.append(
                ParamRecord(
                    name,
                    param,
                    global_shape(param),
                    tp_blocks(param),
                    writes,
                    replica_writer,
                    local_shard(param),
                )
            )
    return records


def persistent_buffers(chunk: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(global name, tensor) of the buffers `chunk`'s state_dict holds: the MoE routers' expert biases (the
    selection counts beside them are not persistent)."""
    # the state_dict is what holds exactly the persistent buffers (beside the parameters), through public API
    params = {name for name, _ in chunk.named_parameters(remove_duplicate=False)}
    state = chunk.state_dict(keep_vars=True)
    return [(name, value) for name, value in state.items() if name not in params and isinstance(value, torch.Tensor)]


def buffer_pieces(chunks: Sequence[nn.Module], state: ParallelState, for_save: bool) -> dict[str, GlobalPieces]:
    """The persistent buffers as whole tensors under their global names: every rank holds the same value (they
    are replicated over tp, dp and cp, and each pipeline stage holds its own layers'), so tp rank 0 of dp x cp
    rank 0 writes them and every rank loads them."""
    out: dict[str, GlobalPieces] = {}
    if for_save and (state.tp_rank != 0 or state.dp_cp_rank != 0):
        return out
    for chunk in chunks:
        for name, buffer in persistent_buffers(chunk):
            _add(out, name, tuple(buffer.shape), [((0,) * buffer.ndim, buffer)])
    return out


def _add(out: dict[str, GlobalPieces], key: str, shape: tuple[int, ...], pieces: list) -> None:
    if pieces:  # a save or a load: DCP is needed now
        out.setdefault(key, dcp_modules.planners().GlobalPieces(shape, [])).pieces.extend(pieces)


def weight_pieces(records: list[ParamRecord], for_save: bool, key_of=lambda name: name) -> dict[str, GlobalPieces]:
    """Model weights: the ones this rank writes (for_save) or all it holds (load, keyed by key_of(name))."""
    out: dict[str, GlobalPieces] = {}
    for rec in records:
        if for_save and not rec.writes:
            continue
        flat, start = rec.local
        _add(out, key_of(rec.name), rec.shape, pieces_of(flat, start, tuple(rec.param.shape), rec.blocks))
    return out


def optimizer_pieces(
    records: list[ParamRecord],
    optimizer: Optimizer,
    for_save: bool,
    master_key: Callable[[str], str] = lambda name: f"optim.master.{name}",
) -> dict[str, GlobalPieces]:
    """Adam moments and fp32 masters of this rank's optimizer segments as global pieces. Saving skips the
    master of fp32 weights (it equals the weight) and what another rank writes."""
    by_param = {id(rec.param): rec for rec in records}
    out: dict[str, GlobalPieces] = {}
    for seg in optimizer.segments:
        for param, seg_offset, param_offset, length in seg.pieces:
            rec = by_param[id(param)]
            writer = rec.replica_writer if optimizer.distributed else rec.writes
            if for_save and not writer:
                continue
            for kind in OPTIM_KINDS:
                if kind == "master" and for_save and param.dtype == torch.float32:
                    continue
                key = master_key(rec.name) if kind == "master" else f"optim.{kind}.{rec.name}"
                flat = getattr(seg, kind)[seg_offset : seg_offset + length]
                _add(out, key, rec.shape, pieces_of(flat, param_offset, tuple(param.shape), rec.blocks))
    return out


def staged_copy(
    state_dict: dict[str, GlobalPieces], buffers: dict[str, GlobalPieces] | None = None
) -> dict[str, GlobalPieces]:
    """The same pieces copied into CPU memory that training does not touch (async save). `buffers`, the
    result of an earlier call with pieces of the same shapes, is reused: no new allocation (page faults cost
    more than the copy), and pinned when the tensors live on a GPU."""
    new_pieces = dcp_modules.planners().GlobalPieces  # a save: DCP is needed now

    def same_layout(a: GlobalPieces, b: GlobalPieces) -> bool:
        return [(o, t.shape, t.dtype) for o, t in a.pieces] == [(o, t.shape, t.dtype) for o, t in b.pieces]

    if (
        buffers is None
        or buffers.keys() != state_dict.keys()
        or not all(same_layout(state_dict[k], buffers[k]) for k in state_dict)
    ):
        buffers = {
            key: new_pieces(
                tuple(value.shape),
                [
                    (offsets, torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda))
                    for offsets, tensor in value.pieces
                ],
            )
            for key, value in state_dict.items()
        }
    for key, value in state_dict.items():
        for (_, source), (_, target) in zip(value.pieces, buffers[key].pieces):
            target.copy_(source.detach(), non_blocking=source.is_cuda)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return buffers


def check_against_metadata(wanted: dict[str, GlobalPieces], metadata: Metadata, iter_dir: str) -> None:
    """Every key present with the expected global shape; else CheckpointError naming the first tensor."""
    stored = metadata.state_dict_metadata
    for key in sorted(wanted):
        if key not in stored:
            raise CheckpointError(f"checkpoint {iter_dir} has no tensor {key!r} (saved from a different model?)")
        saved_shape = getattr(stored[key], "size", None)
        if saved_shape is None:  # a BytesStorageMetadata: a blob where the model has a tensor
            raise CheckpointError(f"checkpoint {iter_dir}: {key!r} holds bytes, not a tensor (damaged or crafted)")
        if tuple(saved_shape) != tuple(wanted[key].shape):
            raise CheckpointError(
                f"checkpoint {iter_dir}: tensor {key!r} has shape {list(saved_shape)} in the "
                f"checkpoint but {list(wanted[key].shape)} in this model"
            )
