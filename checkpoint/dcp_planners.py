"""This rank's pieces of global tensors, and the two torch.distributed.checkpoint planners that write and read
them, through DCP's public planner interface only.

A checkpoint stores every tensor under its global name with its global shape; a rank holds pieces of those
tensors (its tp shard, with the distributed optimizer a flat range of it), each a view into the rank's own
storage. `GlobalPieces` lists such pieces as (global offsets, local view) pairs. `PiecesSavePlanner` emits one
WriteItem per piece and hands DCP the piece's view to write; `PiecesLoadPlanner` asks DCP's resharding helper
(`create_read_items_for_chunk_list`) which stored chunks overlap each piece and hands DCP the matching
sub-view of the piece to read into, so a load writes straight into the model and optimizer. The items and
chunk metadata are the ones DCP builds for DTensor shards: the files are those earlier versions wrote.

Every DCP name used here is listed, with its torch 2.11 signature, in docs/architecture.md.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, LoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass
class GlobalPieces:
    """This rank's pieces of one global tensor of shape `shape`: (global offsets, local view) pairs with
    view.ndim == len(shape). The views alias the rank's storage, so a load writes straight into it."""

    shape: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def chunks(self) -> list[ChunkStorageMetadata]:
        """Where each piece lies in the global tensor, in DCP's terms."""
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape) for offsets, view in self.pieces]

    def write_items(self, fqn: str) -> list[WriteItem]:
        """One SHARD WriteItem per piece, as DCP writes a DTensor's local shards."""
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(view),
                    size=torch.Size(self.shape),
                ),
            )
            for chunk, (_, view) in zip(self.chunks(), self.pieces)
        ]

    def piece_at(self, fqn: str, offsets: torch.Size | None, index: int | None = None) -> torch.Tensor:
        """The view of the piece at global `offsets` (those of a WriteItem's or ReadItem's index). `index`,
        the position in `chunks()` DCP records in a ReadItem's dest_index, picks among pieces at the same
        offsets: one rank may hold two copies of a tensor (zb-v's rank 0 holds the tied embedding and the
        head's copy of it), and each must be filled."""
        if index is not None and index < len(self.pieces) and torch.Size(self.pieces[index][0]) == offsets:
            return self.pieces[index][1]
        found = [view for piece_offsets, view in self.pieces if torch.Size(piece_offsets) == offsets]
        if len(found) != 1:  # none, or copies DCP gave no index for: never fill only one of them silently
            raise ValueError(f"{len(found)} pieces of {fqn} at offsets {offsets} on this rank (expected one)")
        return found[0]


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (its global plan: deduplication, metadata, validation) over a state dict
    of `GlobalPieces`: the local plan is every piece's WriteItem, and the data of an item its piece's view."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)
        self.pieces: dict[str, GlobalPieces] = {}

    def set_up_planner(
        self, state_dict: dict, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.pieces = dict(state_dict)

    def create_local_plan(self) -> SavePlan:
        return SavePlan([item for fqn, pieces in self.pieces.items() for item in pieces.write_items(fqn)])

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        index = write_item.index
        return exact_storage(self.pieces[index.fqn].piece_at(index.fqn, index.offset))


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """`view` as a tensor whose storage is exactly its own bytes, sharing its memory (no copy). DCP's writer
    clones a tensor whose storage is larger than itself (torch.save writes a whole storage): a piece is a view
    into a flat optimizer segment or the rank's parameters, so without this every byte of a save is copied once
    more before it is written (~5 GB for GPT-2 355M with Adam). torch.save writes the same bytes and the same
    record (offset 0, contiguous strides) for this alias as for the clone. A non-contiguous, empty or non-CPU
    view is returned as it is (DCP copies those itself)."""
    if (
        not view.is_cpu
        or not view.is_contiguous()
        or view.numel() == 0
        or view.untyped_storage().nbytes() == view.nbytes
    ):
        return view
    as_bytes = view.detach().reshape(-1).view(torch.uint8).numpy()  # a buffer over the view's bytes only
    return torch.frombuffer(as_bytes, dtype=view.dtype).view(view.shape)


def narrow_view(view: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The sub-view [offsets, offsets + lengths) of `view` (no copy)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        view = view.narrow(dim, start, length)
    return view


class PiecesLoadPlanner(LoadPlanner):
    """Reads a checkpoint into a state dict of `GlobalPieces`, resharding from whatever chunks were stored.
    Every key must be in the checkpoint (callers check keys and shapes first, for a one-line error)."""

    def __init__(self) -> None:
        self.pieces: dict[str, GlobalPieces] = {}
        self.checkpoint: Metadata | None = None

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.pieces, self.checkpoint = dict(state_dict), metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.checkpoint is not None, "DCP sets the checkpoint's metadata up before planning"
        items: list[ReadItem] = []
        for fqn, pieces in self.pieces.items():
            stored = self.checkpoint.state_dict_metadata[fqn]
            if not isinstance(stored, TensorStorageMetadata):
                raise ValueError(f"checkpoint entry {fqn!r} is not a tensor")
            items += create_read_items_for_chunk_list(fqn, stored, pieces.chunks())
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan  # each rank reads only what it holds: nothing to coordinate

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} holds bytes; only tensors are read")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The part of the destination piece this read fills: DCP copies the stored data into it."""
        index = read_item.dest_index
        view = self.pieces[index.fqn].piece_at(index.fqn, index.offset, index.index)
        return narrow_view(view, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing left to do: `tensor` is the view resolve_tensor returned, already filled in place."""
