"""Layout-free checkpoints (torch.distributed.checkpoint), keyed by what a tensor is, not where it lived; this
module is the package's one public face: code outside checkpoint/ imports only the names below.

Every model tensor is stored once under its global parameter name with its global shape
(`layers.5.mlp.fc1.weight` [ffn, h]; the word embedding without the tp padding rows), the optimizer state per
parameter in the same global coordinates (`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`, and
`optim.master.<name>` for 16-bit weights), also when the distributed optimizer holds it as flat dp shards. Each
rank writes only what it owns, dp replicas once. A checkpoint therefore loads at any valid (tp, pp, vp, dp,
distributed optimizer, sequence parallel) layout of the same model. Folder layout: checkpoint/files.py (names
shared with Megatron-LM's folders: checkpoint/folder_names.py). Pieces: checkpoint/state.py; the DCP planners:
checkpoint/dcp_planners.py; everything else a checkpoint holds (counters, LR schedule, layout, config, RNG):
checkpoint/train_state.py. Saving (sync/async): checkpoint/saver.py; resuming: checkpoint/resume.py.

Public API (kept stable for the trainer, tools/, convert/, evaluation/ and scripts/):
    resolve_checkpoint(path) -> iteration folder
    read_saved_config(iter_dir) -> the run config saved with it (Config.to_dict() form)
    load_model_weights(iter_dir, chunks, state)       weights only, any layout (collective)
    save_model_weights(root, iteration, chunks, state, config_dict) -> iteration folder (weights only)
    save_checkpoint(...) / Checkpointer               the trainer's full save (optimizer, RNG, counters)
    plan_resume(...) / load_into_run(...)             the trainer's resume
and the folder names, readers and checks of the tools. The names that need torch.distributed.checkpoint
(`read_dcp_metadata`, `SafeFileSystemReader`, the planners) import it on first use (PEP 562 `__getattr__`):
`import checkpoint` must not cost every process DCP's import (~1.3 CPU s; tests/test_start_up_imports.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from torch import nn

from checkpoint import files
from checkpoint.files import (
    CHECKSUMS,
    DCP_METADATA,
    META,
    TMP_RE,
    CheckpointError,
    check_storage_extents,
    dir_size,
    is_legacy,
    list_iterations,
    read_checksums,
    read_meta,
    read_tracker,
    resolve_checkpoint,
    verify_files,
)
from checkpoint.folder_names import (
    ITER_RE,
    MAIN_FILE,
    MP_RANK_PREFIX,
    RELEASE,
    TRACKER,
    iter_name,
    mp_rank_name,
    parse_mp_rank,
)
from checkpoint.layout import CheckpointLayout
from checkpoint.legacy import dp_rank_file, rank_dir
from checkpoint.loader import check_model_entries, read_global_tensors
from checkpoint.loader import load_model_weights as _load_model_weights
from checkpoint.parts import CheckpointParts
from checkpoint.resume import ResumePlan, load_into_run, plan_resume
from checkpoint.safe_reader import load_weights_file, read_metadata_file
from checkpoint.saver import Checkpointer, SaveJob, write_checkpoint
from checkpoint.state import buffer_pieces, optimizer_pieces, param_records, weight_pieces
from checkpoint.train_state import (
    OptimizerScalars,
    TrainingProgress,
    TrainState,
    read_saved_config,
    read_train_state,
)
from checkpoint.write_errors import describe_write_error
from parallel.state import ParallelState

if TYPE_CHECKING:
    from checkpoint.dcp_planners import GlobalPieces, PiecesLoadPlanner, PiecesSavePlanner
    from checkpoint.dcp_reader import SafeFileSystemReader, read_dcp_metadata

# name -> the module that defines it, imported when the name is first asked for (it imports DCP at its top)
_DCP_NAMES = MappingProxyType(
    {
        "GlobalPieces": "checkpoint.dcp_planners",
        "PiecesLoadPlanner": "checkpoint.dcp_planners",
        "PiecesSavePlanner": "checkpoint.dcp_planners",
        "SafeFileSystemReader": "checkpoint.dcp_reader",
        "read_dcp_metadata": "checkpoint.dcp_reader",
    }
)

__all__ = [
    "CHECKSUMS",
    "DCP_METADATA",
    "ITER_RE",
    "MAIN_FILE",
    "META",
    "MP_RANK_PREFIX",
    "RELEASE",
    "TMP_RE",
    "TRACKER",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointParts",
    "Checkpointer",
    "GlobalPieces",
    "OptimizerScalars",
    "PiecesLoadPlanner",
    "PiecesSavePlanner",
    "ResumePlan",
    "SafeFileSystemReader",
    "SaveJob",
    "TrainState",
    "TrainingProgress",
    "build_save_job",
    "check_model_entries",
    "check_storage_extents",
    "describe_write_error",
    "dir_size",
    "dp_rank_file",
    "is_legacy",
    "iter_name",
    "list_iterations",
    "load_into_run",
    "load_model_weights",
    "load_weights_file",
    "mp_rank_name",
    "parse_mp_rank",
    "plan_resume",
    "rank_dir",
    "read_checksums",
    "read_dcp_metadata",
    "read_global_tensors",
    "read_meta",
    "read_metadata_file",
    "read_saved_config",
    "read_tracker",
    "read_train_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_model_weights",
    "verify_files",
    "write_checkpoint",
]


def __getattr__(name: str) -> object:
    """PEP 562: the DCP-heavy names, imported from their module on first use."""
    module = _DCP_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def load_model_weights(iter_dir: str, chunks: Sequence[nn.Module], state: ParallelState) -> None:
    """Load only the model weights of the checkpoint in `iter_dir` (see resolve_checkpoint) into this rank's
    `chunks` at any layout; collective when distributed. Every file this rank is dealt is checksum-verified.
    CheckpointError (one line) names a bad file, a missing tensor, or the first tensor whose global shape
    differs (with both shapes)."""
    _load_model_weights(iter_dir, chunks, state)


def save_model_weights(
    root: str, iteration: int, chunks: Sequence[nn.Module], state: ParallelState, config_dict: dict
) -> str:
    """Write a weights-only checkpoint (no optimizer state, no RNG) of `chunks` as root/iter_XXXXXXX and
    update root's trackers; returns the iteration folder. `checkpoint.load=ROOT checkpoint.finetune=true`
    (or `checkpoint.load_optimizer=false`) loads it at any layout. Collective when distributed."""
    os.makedirs(root, exist_ok=True)
    records = param_records(chunks, state)
    sequence_parallel = config_dict.get("parallel", {}).get("sequence_parallel", False)
    train_state = TrainState(
        progress=TrainingProgress(iteration),
        config=config_dict,
        layout=CheckpointLayout.of(state, sequence_parallel, distributed_optimizer=False, schedule=None),
    )
    tensors = weight_pieces(records, for_save=True) | buffer_pieces(chunks, state, for_save=True)
    job = SaveJob(root, iteration, tensors, train_state, keep_last=0)
    return write_checkpoint(job, comm=state.comm).path


def build_save_job(
    root: str,
    parts: CheckpointParts,
    progress: TrainingProgress,
    config: dict,
    *,
    keep_last: int,
    before_tracker: Callable[[], None] = lambda: None,
) -> SaveJob:
    """The trainer's full checkpoint: weights, optimizer state, counters, LR schedule, RNG, config, layout.
    `keep_last` is checkpoint.keep_last (0: keep every checkpoint)."""
    parts.optimizer.finish_param_gather()  # overlap_param_gather: the params are whole before they are read
    records = param_records(parts.chunks, parts.state)
    tensors = weight_pieces(records, for_save=True)
    tensors.update(buffer_pieces(parts.chunks, parts.state, for_save=True))
    tensors.update(optimizer_pieces(records, parts.optimizer, for_save=True))
    optimizer = parts.optimizer
    train_state = TrainState(
        progress=dataclasses.replace(progress),  # a copy: an async save must not see the next iteration's
        config=config,
        layout=parts.layout,
        lr_schedule=parts.lr_schedule.state_dict(),
        optimizer=OptimizerScalars(optimizer.step_count, optimizer.scaler.state_dict()),
        has_optimizer=True,
        rng=parts.rng_tracker.state_dict(),
    )
    return SaveJob(root, progress.iteration, tensors, train_state, keep_last=keep_last, before_tracker=before_tracker)


def save_checkpoint(
    root: str,
    parts: CheckpointParts,
    progress: TrainingProgress,
    config: dict,
    *,
    keep_last: int,
    checkpointer: Checkpointer | None = None,
    before_tracker: Callable[[], None] = lambda: None,
) -> str:
    """Save (through `checkpointer`: sync or async) the trainer's checkpoint of `progress.iteration`;
    returns the iteration folder it is (or will be, when async) renamed to. Collective."""
    os.makedirs(root, exist_ok=True)
    job = build_save_job(root, parts, progress, config, keep_last=keep_last, before_tracker=before_tracker)
    if checkpointer is None:
        write_checkpoint(job, comm=parts.state.comm)
    else:
        checkpointer.save(job)
    return os.path.join(root, files.iter_name(progress.iteration))
