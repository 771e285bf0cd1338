"""`RankSpec`: one rank's description of its model, fixed before GPTModel is built.

GPTModel and its submodules build the right modules from it and nothing changes them afterwards: the split
layers and the tp hooks (`TensorParallelHooks`), the context-parallel attention (`ContextParallelHooks`), the
random stream each dropout draws from (`DropoutStreams`), activation recomputation (`Recompute`), the fused
kernels (`KernelSelection`, chosen and registered once), the ranks sharing a micro-batch's tokens for the MoE
router (`TokenGroup`) and, under expert parallelism, the ep group's token exchange (`ExpertExchange`).
`RankSpec.one_process(cfg)` is the default; the trainer's comes from parallel/model_builder.rank_spec (model/
imports no torch.distributed: everything here is a plain value or callable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from model.config import ModelConfig
from model.kernels import KernelSelection
from model.moe.dispatch import ExpertExchange
from model.tp_hooks import ContextParallelHooks, TensorFn, TensorParallelHooks, identity

# opens a random stream for the block it guards (parallel/random.RNGTracker.fork)
RNGFork = Callable[[], AbstractContextManager[None]]


class CheckpointFn(Protocol):
    """`checkpoint_fn(fn, *args)`: fn(*args) under activation checkpointing (parallel/random.make_checkpoint_fn);
    `fn` is a layer or the attention core, `args` its tensors (and None for an absent mask)."""

    def __call__(self, fn: Callable[..., torch.Tensor], /, *args: object) -> torch.Tensor: ...


@dataclass(frozen=True)
class DropoutStreams:
    """Which random stream each dropout draws from; None: the default generator (the same on every tp rank).

    attention  the attention core: its dropout acts on this rank's heads, so each tp rank needs its own stream
    hidden     the hidden and embedding dropouts: they act on replicated activations (default generator)
               unless sequence parallelism shards those along s (then each rank's own stream)
    """

    attention: RNGFork | None = None
    hidden: RNGFork | None = None


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation: `full` checkpoints whole layers (`uniform`: every layer; `block`: the first
    `num_layers` layers of each chunk), `selective` only the attention core; `none` keeps every activation."""

    mode: str = "none"
    method: str = "uniform"
    num_layers: int = 1
    checkpoint_fn: CheckpointFn | None = None

    def layer_ids(self, chunk_layer_ids: Sequence[int]) -> tuple[int, ...]:
        """The layers of a chunk (its global layer ids, in order) that full recomputation checkpoints."""
        if self.mode != "full":
            return ()
        return tuple(chunk_layer_ids if self.method == "uniform" else chunk_layer_ids[: self.num_layers])


@dataclass(frozen=True)
class TokenGroup:
    """The ranks whose tokens together make one micro-batch, as the MoE router's load-balancing losses must
    see them (megatron-core's tp x cp group): the tp group under sequence parallelism (each rank holds s/tp
    positions) times the cp group (each rank its chunks of the sequence); one process, or tp without sequence
    parallelism (every tp rank holds all the tokens): this rank alone.

    size        ranks in the group; each holds an equal share of the micro-batch's tokens
    sum_counts  a count tensor (no gradient) summed over the group, in place; identity for one rank
    """

    size: int = 1
    sum_counts: TensorFn = identity


@dataclass(frozen=True)
class RankSpec:
    """Everything that makes this rank's GPTModel differ from one process's (see the module docstring)."""

    kernels: KernelSelection
    tp: TensorParallelHooks = field(default_factory=TensorParallelHooks)
    cp: ContextParallelHooks = field(default_factory=ContextParallelHooks)
    dropout: DropoutStreams = field(default_factory=DropoutStreams)
    recompute: Recompute = field(default_factory=Recompute)
    moe_tokens: TokenGroup = field(default_factory=TokenGroup)
    # expert parallelism (parallel/expert_parallel.EPExchange): each MoE layer holds its ep rank's experts and
    # exchanges tokens over the ep group; None: every expert on this rank
    expert_exchange: ExpertExchange | None = None

    @classmethod
    def one_process(cls, cfg: ModelConfig, recompute: Recompute | None = None) -> RankSpec:
        """One process: plain torch layers, the default generator, the config's kernels."""
        return cls(kernels=cfg.kernel_selection().registered(), recompute=recompute or Recompute())
