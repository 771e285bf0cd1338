"""What stops a run early, and the exit codes it stops with.

Exit codes of pretrain_gpt.py (every rank):
    0    finished: train.train_iters reached, or train.exit_interval / train.exit_duration_mins (checkpoint saved)
    1    a write that failed (a checkpoint save, metrics.jsonl; a full disk is named), or an unexpected error
    2    bad input: config, data files, a token id outside the vocabulary, checkpoint, run.dir in use, sizes
         that cannot fit in this machine's memory (training/size_check.py)
    3    stopped by SIGTERM / SIGUSR1 / SIGINT after saving a checkpoint of the last finished iteration
    4    training diverged: train.max_nonfinite_iters iterations in a row with a non-finite loss or gradient
         norm, or an fp16 loss scale stuck at its minimum (no checkpoint is written from such a state)
    5    a hang: a collective timed out or failed (parallel.init_timeout_s / train_timeout_s; creating a process
         group included, parallel/group_setup.py), or the rank made no progress and its watchdog stopped it
         (operations/watchdog.py); each rank that could wrote its dump under
         run.dir/diagnostics/ (read them with tools/diagnose_hang.py); the last complete checkpoint stays the
         latest. A failure to SLURM: scripts/slurm/pretrain_gpt.sbatch requeues only after its USR1 warning.
    130  a second SIGINT: stopped at once, no checkpoint

Per iteration the ranks agree on three things with one all-reduce (`agree`): a stop signal received by any
rank, the exit_duration_mins clock, and a batch holding token ids outside the vocabulary on any rank.
The non-finite checks need no collective of their own: the loss and the gradient norm are already reduced
to the same value on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from data.blended_dataset import BlendedDataset
from data.gpt_dataset import GPTDataset
from data.loader import sample_index
from data.microbatch import Microbatch
from parallel.fsdp import local_tensor

if TYPE_CHECKING:
    from parallel.state import ParallelState

EXIT_OK, EXIT_ERROR, EXIT_INPUT_ERROR, EXIT_PREEMPTED, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_HUNG = 5


class TrainingStopped(Exception):
    """Ends the run with `exit_code` and the one-line `message` (printed by rank `reporting_rank`)."""

    def __init__(self, message: str, exit_code: int, reporting_rank: int = 0):
        super().__init__(message)
        self.exit_code, self.reporting_rank = exit_code, reporting_rank


@dataclass
class Agreement:
    """What every rank decided together at an iteration boundary."""

    signal_number: int  # the largest signal number any rank received, 0 = none
    time_up: bool
    bad_token_rank: int  # the lowest rank holding a bad batch, -1 = none


def agree(state: ParallelState, device: torch.device, signal_number: int, time_up: bool, bad_batch: bool) -> Agreement:
    """One MAX all-reduce over the world of [signal, time up, world - rank if this rank's batch is bad]."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if state.is_distributed else (1, 0)
    flags = torch.tensor(
        [signal_number, int(time_up), world - rank if bad_batch else 0], dtype=torch.int64, device=device
    )
    if state.is_distributed:
        state.comm.all_reduce(flags, op=dist.ReduceOp.MAX)
    signal_number, time_up_flag, bad = (int(x) for x in flags.tolist())
    return Agreement(signal_number, bool(time_up_flag), world - bad if bad else -1)


# ---- token ids ---------------------------------------------------------------------------------------
def find_bad_token(microbatches: list[Microbatch], vocab_size: int) -> tuple[int, int, int, int] | None:
    """(micro-batch, row, position in the sample, id) of the first id outside [0, vocab_size), else None.

    One min/max per tensor on the CPU batch before it moves to the device; the exact position is searched
    only for a bad micro-batch. A sample is tokens + the last label ([b, s + 1], as read from the data)."""
    for k, mb in enumerate(microbatches):
        lows, highs = zip(*(torch.aminmax(ids) for ids in (mb.tokens, mb.labels)))
        if min(int(x) for x in lows) >= 0 and max(int(x) for x in highs) < vocab_size:
            continue
        text = torch.cat([mb.tokens, mb.labels[:, -1:]], dim=1)
        row, position = ((text < 0) | (text >= vocab_size)).nonzero()[0].tolist()
        return k, row, position, int(text[row, position])
    return None


def bad_token_message(
    found: tuple[int, int, int, int],
    dataset: GPTDataset | BlendedDataset,
    first_sample: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    vocab_size: int,
    split: str,
) -> str:
    """The one line for a bad id found by find_bad_token on dp rank `dp_rank` in the micro-batches of a step
    that starts at `first_sample` (the samples consumed before it); the sampler says which sample that is."""
    microbatch, row, position, token = found
    sample = sample_index(first_sample, microbatch, row, micro_batch_size, dp_rank, dp_size)
    source = dataset.locate_token(sample, position)
    return (
        f"token id {token} in document {source.document} of {source.path_prefix} (token {source.offset} of the "
        f"document, {split} "
        f"sample {sample}) is outside the model's vocabulary of {vocab_size} ids (model.vocab_size): the data "
        f"was tokenized with another tokenizer, or model.vocab_size is too small"
    )


# ---- non-finite values -------------------------------------------------------------------------------
class StepResult(Protocol):
    """What NonFiniteGuard reads of an iteration's outcome (training.train_step.StepResult has these and more;
    operations/ does not import training/)."""

    @property
    def loss(self) -> float: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def skipped(self) -> bool: ...
    @property
    def loss_scale(self) -> float: ...


class NonFiniteGuard:
    """Counts consecutive iterations with a non-finite loss or gradient norm (the optimizer skipped their
    update) and, with fp16, skipped steps whose loss scale was already the minimum. Ordinary fp16 overflow
    skips while the scale is still coming down do not count."""

    def __init__(self, max_consecutive: int, min_loss_scale: float, dynamic_scale: bool):
        self.max_consecutive, self.min_loss_scale, self.dynamic_scale = max_consecutive, min_loss_scale, dynamic_scale
        self.count = 0

    def is_bad(self, result: StepResult) -> bool:
        if not math.isfinite(result.loss):
            return True
        if not result.skipped:
            return False
        return not self.dynamic_scale or result.loss_scale <= self.min_loss_scale

    def check(self, result: StepResult, iteration: int) -> None:
        """Account for one iteration's StepResult; raise TrainingStopped once too many were bad in a row."""
        self.count = self.count + 1 if self.is_bad(result) else 0
        if self.count < self.max_consecutive:
            return
        first = iteration - self.count + 1
        if self.dynamic_scale and math.isfinite(result.loss):
            what = (
                f"the fp16 loss scale is stuck at its minimum optim.min_loss_scale={self.min_loss_scale:g} "
                f"and every step overflows"
            )
        else:
            what = f"non-finite loss or gradient norm (last: loss {result.loss}, grad norm {result.grad_norm})"
        raise TrainingStopped(
            f"training diverged: iterations {first}-{iteration} in a row ({self.count}, train.max_nonfinite_iters="
            f"{self.max_consecutive}): {what}; their updates were skipped and no checkpoint was written from "
            f"them: lower optim.lr or resume from the last checkpoint",
            EXIT_DIVERGED,
        )


def weights_are_finite(chunks: Sequence[torch.nn.Module], state: ParallelState, device: torch.device) -> bool:
    """Whether every parameter on every rank is finite (one sync and one all-reduce; run before a save)."""
    params = [local_tensor(p).detach() for chunk in chunks for p in chunk.parameters()]  # FSDP: this rank's shard
    ok = torch.stack([torch.isfinite(p).all() for p in params]).all() if params else torch.tensor(True)
    flag = ok.to(device=device, dtype=torch.int32).reshape(1)
    if state.is_distributed:
        state.comm.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
