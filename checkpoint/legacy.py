"""The per-rank checkpoint format of earlier versions (format 1), still loaded at the layout that wrote it:

    iter_XXXXXXX/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   model chunks, plain optimizer, LR schedule,
                                                               counters, config (written by dp rank 0)
    iter_XXXXXXX/mp_rank_{tp:02d}_{pp:03d}/dp_rank_{dp:03d}.pt   RNG states and distributed-optimizer shard

Resume such a checkpoint once at its own layout: the next save writes the layout-free format, which then
loads at any layout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch import nn

from checkpoint.files import CheckpointError
from checkpoint.folder_names import MAIN_FILE, mp_rank_name
from checkpoint.layout import CheckpointLayout
from checkpoint.safe_reader import load_weights_file
from optim.optimizer import Optimizer
from parallel.state import ParallelState


def rank_dir(iter_dir: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(iter_dir, mp_rank_name(tp_rank, pp_rank, name_pp_rank=True))  # format 1 always names it


def dp_rank_file(dp_rank: int) -> str:
    """The per-rank file of dp rank `dp_rank` (RNG states, distributed-optimizer shard) in a rank folder."""
    return f"dp_rank_{dp_rank:03d}.pt"


def _load_file(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    return load_weights_file(path)


def legacy_main_file(iter_dir: str, tp_rank: int = 0, pp_rank: int = 0) -> dict:
    return _load_file(os.path.join(rank_dir(iter_dir, tp_rank, pp_rank), MAIN_FILE))


def _check_layout(iter_dir: str, main: dict, state: ParallelState) -> None:
    try:
        saved = CheckpointLayout.from_dict(main.get("layout") or {})  # format 1 records tp, pp and vp
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {iter_dir}: its main file's layout is not one: {err}") from None
    if (saved.tp, saved.pp, saved.vp) != (state.tp_size, state.pp_size, state.vp_size):
        raise CheckpointError(
            f"checkpoint {iter_dir} is in the per-rank format of earlier versions, saved at {saved.describe()}; "
            f"this run is tp {state.tp_size} x pp {state.pp_size} x vp {state.vp_size}: resume it once at its own "
            f"layout (the next save writes the layout-free format, which loads at any layout)"
        )


def load_legacy_weights(iter_dir: str, chunks: Sequence[nn.Module], state: ParallelState) -> dict:
    """Model weights of this rank from a format-1 checkpoint at its own layout; returns the main file."""
    main = legacy_main_file(iter_dir, state.tp_rank, state.pp_rank)
    _check_layout(iter_dir, main, state)
    for chunk, chunk_state in zip(chunks, main["model"]):
        chunk.load_state_dict(chunk_state)
    return main


def load_legacy(
    iter_dir: str,
    state: ParallelState,
    chunks: Sequence[nn.Module],
    optimizer: Optimizer | None,
    distributed_optimizer: bool,
) -> tuple[dict, dict]:
    """Weights, optimizer (unless None) of this rank; returns (main file, per-rank file)."""
    main = load_legacy_weights(iter_dir, chunks, state)
    per_rank = _load_file(os.path.join(rank_dir(iter_dir, state.tp_rank, state.pp_rank), dp_rank_file(state.dp_rank)))
    if optimizer is not None:
        try:
            optimizer.load_state_dict(per_rank["optimizer"] if distributed_optimizer else main["optimizer"])
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"checkpoint {iter_dir}: optimizer state does not fit this run: {err}") from None
    return main, per_rank
