"""Build this rank's model chunks for any (tp, cp, pp, vp) layout, with the same weights as one process."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.param_info import param_info
from parallel.context_parallel import context_parallel_hooks
from parallel.random import RNGTracker
from parallel.state import ParallelState
from parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_hooks, tp_comm
from parallel.tp_mappings import CommCounter


def build_model_chunks(
    cfg: ModelConfig,
    state: ParallelState,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    sequence_parallel: bool = False,
    rng_tracker: RNGTracker | None = None,
    comm_counter: CommCounter | None = None,
    checkpoint_fn: Callable | None = None,
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    compile_layers: bool = False,
    compile_backend: str = "inductor",
) -> list[GPTModel]:
    """The vp_size chunks of this pipeline rank: built on the meta device with the tp group's hooks
    (parallel/tensor_parallel.tensor_parallel_hooks), sharded over tp, then each
    parameter drawn in full from (seed, its global name) and cut to the local shard (model/init.py);
    `compile_layers` torch.compiles each transformer layer (regional compilation, on first use). Which layers
    each chunk holds is the state's stage map (`state.stages`: interleaved, or zb-v's V)."""
    chunks = []
    hooks = tensor_parallel_hooks(tp_comm(state, comm_counter), sequence_parallel)
    cp_hooks = context_parallel_hooks(state)
    for placement in state.stages.placements(cfg.num_layers, state.pp_rank):
        with torch.device("meta"):
            model = GPTModel(
                cfg,
                cfg.padded_vocab_size(state.tp_size),
                placement.layer_ids,
                placement.pre_process,
                placement.post_process,
                tp_hooks=hooks,
                cp_hooks=cp_hooks,
            )
        model = apply_tensor_parallel(
            model, state, sequence_parallel, comm_counter=comm_counter, rng_tracker=rng_tracker
        )
        initialize_parameters(model, cfg, seed, device=device, dtype=dtype)
        model.tie_weights()
        if recompute != "none":
            model.set_recompute(recompute, recompute_method, recompute_num_layers, checkpoint_fn)
        if compile_layers:
            model.compile_layers(compile_backend)
        chunks.append(model)
    return chunks


def count_parameters(chunks: list[GPTModel], state: ParallelState | None = None) -> int:
    """Parameters on this rank, each tensor-parallel-replicated one and the tied copy counted once."""
    total = 0
    for chunk in chunks:
        for param in chunk.parameters():
            info = param_info(param)
            if info.embedding_copy:
                continue
            if state is not None and not info.tensor_parallel and state.tp_rank != 0:
                continue
            total += param.numel()
    return total
