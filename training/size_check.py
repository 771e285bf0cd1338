"""Refuse a run whose sizes cannot fit in this machine's memory, before anything is allocated.

Without it a hidden size of 2^30, a sequence of 10^9 tokens, a micro-batch of 10^6 or 10^7 layers end in an
integer overflow, a 512 GB allocation or minutes of building before torch fails with a traceback. The
estimate is the planner's (planner/memory.py, the numbers `tools/plan.py` prints) taken as a lower bound:
fused attention (no [s, s] scores), no allowance for the CUDA context, at most 64 micro-batches per pipeline
stage in flight. A run it refuses cannot fit; a run it passes may still need more.

The machine's memory: the GPU's total memory with CUDA (one rank per GPU), else MemAvailable of
/proc/meminfo (os.sysconf where there is none) shared by the ranks of this node.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from data.index_budget import available_memory_bytes
from planner.activations import shape_from_config
from planner.memory import GIB, MemoryEstimate, config_memory

if TYPE_CHECKING:
    from config.schema import Config
    from parallel.layout import Layout

_MAX_MICROBATCHES_PER_STAGE = 64  # beyond it the estimate is bounded (a schedule of 10^6 actions is not built)
_VOCAB_UNKNOWN = 1  # before the tokenizer is read: the smallest vocabulary, so the estimate stays a lower bound


def available_memory(use_cuda: bool, local_rank: int, environ: Mapping[str, str]) -> tuple[float, str]:
    """(bytes one rank may use, where they come from): the GPU's memory, or this node's available memory
    divided by its ranks (LOCAL_WORLD_SIZE)."""
    if use_cuda:
        props = torch.cuda.get_device_properties(local_rank % max(1, torch.cuda.device_count()))
        return float(props.total_memory), f"the {props.name}'s {props.total_memory / GIB:.1f} GiB"
    local_ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1")) or 1))
    available = available_memory_bytes()  # MemAvailable; else the free physical pages
    total = float(available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    share = f" / {local_ranks} ranks on this node" if local_ranks > 1 else ""
    return total / local_ranks, f"{total / GIB:.1f} GiB of available memory{share}"


def lower_bound_estimate(config: Config, layout: Layout) -> MemoryEstimate:
    """The planner's per-rank estimate of `config` under `layout` (parallel.layout.Layout), as a lower bound
    (see the module docstring)."""
    model = config.model
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=_VOCAB_UNKNOWN)
    cap = _MAX_MICROBATCHES_PER_STAGE * layout.pp_size  # a multiple of pp, as interleaving needs
    bounded = dataclasses.replace(layout, num_microbatches=min(layout.num_microbatches, cap))
    estimated = dataclasses.replace(config, model=model)
    shape = shape_from_config(estimated, layout, attention="flash")
    return config_memory(estimated, bounded, shape, 0.0)


def check_fits(config: Config, layout: Layout, use_cuda: bool, environ: Mapping[str, str]) -> None:
    """ValueError (one line: the planner's estimate, the memory there is, what to change) when the run
    cannot fit on one rank of this machine."""
    estimate = lower_bound_estimate(config, layout)
    have, source = available_memory(use_cuda, int(environ.get("LOCAL_RANK", "0") or 0), environ)
    if estimate.total <= have:
        return
    parts = estimate.as_gib()
    model, train = config.model, config.train
    raise ValueError(
        f"this run cannot fit: the planner estimates at least {parts['total']:,.1f} GiB per rank "
        f"(weights {parts['weights']:,.1f}, grads {parts['grads']:,.1f}, optimizer {parts['optimizer']:,.1f}, "
        f"activations {parts['activations'] + parts['working_set']:,.1f} GiB; {estimate.params:,} parameters) "
        f"but one rank has {have / GIB:,.1f} GiB ({source}) with model.hidden_size={model.hidden_size}, "
        f"model.num_layers={model.num_layers}, model.seq_length={model.seq_length}, "
        f"train.micro_batch_size={train.micro_batch_size}: make them smaller, or spread the model over more "
        f"ranks (parallel.tp_size / pp_size; python tools/plan.py shows layouts that fit)"
    )
