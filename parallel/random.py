"""The model-parallel RNG tracker (Megatron's `CudaRNGStatesTracker`), as one object per process.

Dropout must draw the same mask on every tp rank where activations are replicated (hidden dropout without
sequence parallelism: otherwise the replicas diverge) and different masks where each rank holds a different
part (attention heads; anything along a sequence shard: otherwise the masks are correlated). So:

    default generator of the device   seed + 100 * pp_rank            same on all tp (and dp) ranks
    tracker's "model-parallel" state  seed + 100 * pp_rank + 2718 + tp_rank

`RNGTracker.fork()` swaps the tracker's state into the device's default generator for the duration of a
block. `dropout_streams` says which of the model's dropouts run inside `fork()` (model/rank_spec.DropoutStreams,
given to GPTModel at construction). `make_checkpoint_fn` builds the activation-checkpoint function that replays
the same tracker-forked masks on recomputation.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint

from model.rank_spec import CheckpointFn, DropoutStreams

MODEL_PARALLEL = "model-parallel"
TP_SEED_OFFSET = 2718


class RNGTracker:
    """Named generator states that `fork()` swaps into the default generator of `device`'s type.

    Args:
        device: "cpu" or "cuda" (default: cuda when available). Dropout on CUDA tensors draws from the
            CUDA generator, on CPU tensors from the CPU one: the tracker swaps the one the model uses.
    """

    def __init__(self, device: str | torch.device | None = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device_type = torch.device(device).type
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def seeded(
        cls, seed: int, tp_rank: int = 0, pp_rank: int = 0, device: str | torch.device | None = None
    ) -> RNGTracker:
        """Seed the process as Megatron does and return its tracker (call once per process)."""
        tracker = cls(device)
        offset = seed + 100 * pp_rank
        random.seed(offset)
        torch.manual_seed(offset)  # CPU and every CUDA device
        tracker.add(MODEL_PARALLEL, offset + TP_SEED_OFFSET + tp_rank)
        return tracker

    # ---- the device's default generator ---------------------------------------------------------
    def _get_device_state(self) -> torch.Tensor:
        if self.device_type == "cuda":
            return torch.cuda.get_rng_state()
        return torch.get_rng_state()

    def _set_device_state(self, state: torch.Tensor) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    # ---- tracked states --------------------------------------------------------------------------
    def add(self, name: str, seed: int) -> None:
        """Register a generator state seeded with `seed`, leaving the default generator untouched."""
        if name in self.states:
            raise ValueError(f"RNG tracker state {name!r} already exists")
        original = self._get_device_state()
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        self.states[name] = self._get_device_state()
        self._set_device_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Run the block on the tracked state `name`; the default generator is restored afterwards and the
        tracked state keeps its advance, so consecutive forks draw fresh numbers."""
        original = self._get_device_state()
        self._set_device_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get_device_state()
            self._set_device_state(original)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the random streams: python, CPU, CUDA (if any), tracker states."""
        return {
            "python": random.getstate(),
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": self.get_states(),
            "device_type": self.device_type,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["cpu"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        self.set_states(state["tracker"])


def dropout_streams(rng_tracker: RNGTracker | None, sequence_parallel: bool) -> DropoutStreams:
    """Which dropout draws from the tracker's tp-specific stream: the attention core always (it acts on this
    rank's heads); the hidden and embedding dropouts under sequence parallelism (at tp > 1: each rank holds a
    different slice of s), else the default generator (replicated activations need the same mask on every tp
    rank). Without a tracker every dropout draws from the default generator (fine for dropout 0 and tests)."""
    if rng_tracker is None:
        return DropoutStreams()
    return DropoutStreams(attention=rng_tracker.fork, hidden=rng_tracker.fork if sequence_parallel else None)


class _RecomputeContext:
    """Swaps the forward's tracker states in for a recomputation and back afterwards. Re-enterable: a
    zero-bubble schedule recomputes a checkpointed region again for its weight gradients (one engine run
    per parameter group, parallel/pipeline/weight_grad.py), with the same context object."""

    def __init__(self, rng_tracker: RNGTracker, snapshot: dict[str, torch.Tensor]):
        self.rng_tracker, self.snapshot = rng_tracker, snapshot
        self.saved: list[dict[str, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved.append(self.rng_tracker.get_states())
        self.rng_tracker.set_states(self.snapshot)

    def __exit__(self, *exc: object) -> None:
        self.rng_tracker.set_states(self.saved.pop())


def make_checkpoint_fn(rng_tracker: RNGTracker) -> CheckpointFn:
    """`checkpoint_fn(fn, *args)`: non-reentrant activation checkpointing whose recomputation sees the same
    random numbers as the original forward, for the default generator (preserve_rng_state) and for the
    tracker's states (snapshot at forward, swapped in during recomputation, then restored)."""

    def context_fn() -> tuple[AbstractContextManager[None], _RecomputeContext]:
        snapshot: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def forward_context() -> Iterator[None]:
            snapshot.update(rng_tracker.get_states())
            yield

        return forward_context(), _RecomputeContext(rng_tracker, snapshot)

    def checkpoint_fn(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
        )

    return checkpoint_fn
