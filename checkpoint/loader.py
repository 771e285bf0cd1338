"""Reading a checkpoint at any layout: verify this rank's share of the small files and every file's size,
check keys and global shapes, then let torch.distributed.checkpoint read (and reshard) every piece straight into
the model and optimizer, each data file read once and verified against checksums.json from the same bytes
(checkpoint/dcp_reader.py). DCP's `.metadata` is read only through checkpoint/safe_reader.py (a pickle: nothing
in it may run).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from checkpoint import dcp_modules, files
from checkpoint.files import CheckpointError
from checkpoint.legacy import load_legacy_weights
from checkpoint.safe_reader import load_weights_file
from checkpoint.state import (
    buffer_pieces,
    check_against_metadata,
    optimizer_pieces,
    param_records,
    weight_pieces,
)
from checkpoint.train_state import OptimizerScalars, rng_path
from checkpoint.write_errors import reraise_interrupt
from optim.optimizer import Optimizer
from parallel.comm import Collectives
from parallel.lazy_torch import dcp
from parallel.model_builder import build_chunk_modules, rank_spec
from parallel.state import ParallelState

if TYPE_CHECKING:  # torch.distributed.checkpoint costs ~1.3 CPU s to import: the functions reading one get it lazily
    from torch.distributed.checkpoint.metadata import Metadata

    from checkpoint.dcp_planners import GlobalPieces
    from model.config import ModelConfig


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def verify_share(
    iter_dir: str, comm: Collectives, group: dist.ProcessGroup | None = None, data_crc: bool = True
) -> None:
    """Every file's size and CRC-32, the files dealt over the ranks; CheckpointError on every rank, naming
    the first bad file, if any rank found one (the verdicts gathered through `comm`, the caller's door).
    data_crc=False: the data files' sizes only, for a caller that loads next (`load_pieces` with checksums
    takes their CRC-32 from the bytes it reads)."""
    names = sorted(files.read_checksums(iter_dir))
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    error = None
    try:
        files.verify_files(iter_dir, names[rank::world], data_crc=data_crc)
    except CheckpointError as err:
        error = str(err)
    if world > 1:
        gathered: list[str | None] = [None] * world
        comm.all_gather_object(gathered, error, group)
        error = next((e for e in gathered if e), None)
    if error:
        raise CheckpointError(error)


def load_pieces(
    iter_dir: str,
    wanted: dict[str, GlobalPieces],
    metadata: Metadata,
    group: dist.ProcessGroup | None = None,
    checksums: dict[str, dict] | None = None,
) -> None:
    """Read every piece of `wanted` from the checkpoint (collective when distributed). With `checksums`
    (checksums.json's), every data file is verified from the bytes the load reads, each by one rank, and a bad
    one fails the load on every rank (CheckpointError naming it) before this returns; the pieces may then hold
    part of what was read, and the caller must not use them."""
    check_against_metadata(wanted, metadata, iter_dir)
    files.check_storage_extents(iter_dir, metadata)  # else an extent past the file is DCP's "[Errno 22]"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp().load(
                wanted,
                storage_reader=dcp_modules.reader().SafeFileSystemReader(iter_dir, metadata, checksums),
                planner=dcp_modules.planners().PiecesLoadPlanner(),
                process_group=group,
                no_dist=not _distributed(),
            )
    except BaseException as err:  # CheckpointException is a BaseException
        reraise_interrupt(err)  # also one DCP wrapped: a second Ctrl-C exits 130
        ours = reported_error(err)
        if ours is not None:
            raise CheckpointError(str(ours)) from None
        lines = [line for line in str(err).splitlines() if line.strip()]
        raise CheckpointError(
            f"checkpoint {iter_dir} cannot be read: {lines[-1] if lines else type(err).__name__}"
        ) from None


def reported_error(err: BaseException) -> CheckpointError | None:
    """The CheckpointError a rank's reader raised inside DCP's CheckpointException (which gathers every rank's
    failure): a checksum verdict first, else the lowest rank's; None when no reader raised one."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        return None
    found = [
        failure[0]
        for _, failure in sorted(failures.items())
        if isinstance(failure, tuple) and failure and isinstance(failure[0], CheckpointError)
    ]
    return next((error for error in found if isinstance(error, files.ChecksumError)), found[0] if found else None)


def _weight_key(metadata: Metadata) -> Callable[[str], str]:
    """Weights come from the fp32 master when the checkpoint has one (16-bit runs), else the weight."""
    stored = metadata.state_dict_metadata
    return lambda name: f"optim.master.{name}" if f"optim.master.{name}" in stored else name


def load_model_weights(
    iter_dir: str,
    chunks: Sequence[nn.Module],
    state: ParallelState,
    group: dist.ProcessGroup | None = None,
    verify: bool = True,
) -> None:
    """Load only the model weights of the checkpoint in iter_dir into this rank's chunks, at any layout
    (collective when distributed). CheckpointError (one line) for a bad file or a model that does not fit.
    The data files are verified as they are read; verify=False: the caller has verified the other files and
    every size (`verify_share(..., data_crc=False)`, as plan_resume does)."""
    if files.is_legacy(iter_dir):
        load_legacy_weights(iter_dir, chunks, state)
        return
    if verify:
        verify_share(iter_dir, state.comm, group, data_crc=False)
    metadata = dcp_modules.reader().read_dcp_metadata(iter_dir)
    records = param_records(chunks, state)
    wanted = weight_pieces(records, for_save=False, key_of=_weight_key(metadata))
    wanted |= buffer_pieces(chunks, state, for_save=False)
    with torch.no_grad():
        load_pieces(iter_dir, wanted, metadata, group, files.read_checksums(iter_dir))


def check_model_entries(iter_dir: str, metadata: Metadata, cfg: ModelConfig) -> None:
    """The check every weight load makes before reading (check_against_metadata), made without reading: each
    weight of a `cfg` model is stored as a tensor of its global shape. CheckpointError naming the first that
    is missing, bytes or of another shape (tools/checkpoint_info.py --verify refuses what the loaders refuse)."""
    state = ParallelState.single()
    chunks = build_chunk_modules(cfg, state, rank_spec(cfg, state))  # meta device: shapes, no memory
    wanted = weight_pieces(param_records(chunks, state), for_save=False, key_of=_weight_key(metadata))
    check_against_metadata(wanted | buffer_pieces(chunks, state, for_save=False), metadata, iter_dir)


def load_optimizer_state(
    iter_dir: str,
    chunks: Sequence[nn.Module],
    optimizer: Optimizer,
    state: ParallelState,
    metadata: Metadata,
    scalars: OptimizerScalars,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Masters and Adam moments of this rank's share (any layout, plain or distributed optimizer), the step
    and loss-scaler state, and the persistent buffers (the MoE expert biases); then the masters are written
    into the params (collective over dp). The data files are verified as they are read (the other files and
    every size: `verify_share(..., data_crc=False)` first)."""
    records = param_records(chunks, state)
    wanted = optimizer_pieces(records, optimizer, for_save=False, master_key=_weight_key(metadata))
    wanted |= buffer_pieces(chunks, state, for_save=False)
    with torch.no_grad():
        load_pieces(iter_dir, wanted, metadata, group, files.read_checksums(iter_dir))
    optimizer.step_count = scalars.step
    optimizer.scaler.load_state_dict(scalars.loss_scaler)
    optimizer.copy_to_params()


def load_rng(iter_dir: str, rank: int) -> dict | None:
    """This rank's saved RNG states (TrainState.rng), None when the checkpoint has none for it."""
    path = rng_path(iter_dir, rank)
    if not os.path.exists(path):
        return None
    return load_weights_file(path)


def read_global_tensors(iter_dir: str, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole global tensors (all keys, or `keys`) of a checkpoint, read in this process alone (tools, tests)."""
    reader, planners = dcp_modules.reader(), dcp_modules.planners()
    metadata = reader.read_dcp_metadata(iter_dir)
    stored = metadata.state_dict_metadata
    out, wanted = {}, {}
    for key in sorted(stored) if keys is None else keys:
        if key not in stored:
            raise CheckpointError(f"checkpoint {iter_dir} has no tensor {key!r}")
        entry = stored[key]
        if not isinstance(entry, dcp().metadata.TensorStorageMetadata):
            continue  # bytes entries (none are written today)
        tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        out[key] = tensor
        wanted[key] = planners.GlobalPieces(tuple(entry.size), [((0,) * tensor.ndim, tensor)])
    files.check_storage_extents(iter_dir, metadata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            storage_reader = reader.SafeFileSystemReader(iter_dir, metadata)
            dcp().load(wanted, storage_reader=storage_reader, planner=planners.PiecesLoadPlanner(), no_dist=True)
        except BaseException as err:
            reraise_interrupt(err)
            ours = reported_error(err)
            reason = str(ours) if ours is not None else f"checkpoint {iter_dir} cannot be read: {type(err).__name__}"
            raise CheckpointError(reason) from None
    return out
