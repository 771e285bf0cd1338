"""The folder and file names of Megatron-LM's checkpoints, which this project's checkpoints share: one place
for checkpoint/ (ours) and convert/ (reading and writing Megatron-LM's).

    CHECKPOINTS/latest_checkpointed_iteration.txt    the tracker: the newest complete iteration (Megatron: or
                                                     "release")
    CHECKPOINTS/iter_0000100/                        one iteration (Megatron also names one release/)
    iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt  Megatron's per-rank file: tp rank TT, pipeline rank PPP
                                                     when there is a pipeline (our format 1 always names it)
"""

from __future__ import annotations

import re

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # Megatron-LM's name of a checkpoint without an iteration
ITER_RE = re.compile(r"^iter_(\d{7})$")
MP_RANK_PREFIX = "mp_rank_"  # every per-rank folder (expert-parallel ones too)
MP_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")  # tensor and pipeline parallel ones
MAIN_FILE = "model_optim_rng.pt"


def iter_name(iteration: int) -> str:
    """iter_0000100 for iteration 100."""
    return f"iter_{iteration:07d}"


def mp_rank_name(tp_rank: int, pp_rank: int, name_pp_rank: bool) -> str:
    """mp_rank_TT, or mp_rank_TT_PPP when the pipeline rank is named (Megatron-LM: pp > 1)."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if name_pp_rank else "")


def parse_mp_rank(name: str) -> tuple[int, int] | None:
    """(tp rank, pp rank) of an mp_rank_TT[_PPP] folder name (pp rank 0 when not named), else None."""
    match = MP_RANK_RE.match(name)
    return None if match is None else (int(match.group(1)), int(match.group(2) or 0))
