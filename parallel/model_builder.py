"""Build this rank's model chunks for any (tp, cp, pp, vp) layout, with the same weights as one process.

`rank_spec` describes everything this rank's model does differently from one process's (model/rank_spec.py),
once; `build_chunk_modules` builds each chunk whole from it on the meta device; `build_model_chunks` then
gives every parameter its value, drawn in full from (seed, its global name) and cut to the local shard
(model/init.py). Nothing replaces or wraps a module of a built chunk.
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.param_info import param_info
from model.rank_spec import RankSpec, Recompute, TokenGroup
from parallel.context_parallel import context_parallel_hooks
from parallel.expert_parallel import EPExchange
from parallel.layout import check_tensor_parallel
from parallel.random import RNGTracker, dropout_streams
from parallel.state import ParallelState
from parallel.tensor_parallel import tensor_parallel_hooks, tp_comm
from parallel.tp_mappings import CommCounter


def rank_spec(
    cfg: ModelConfig,
    state: ParallelState,
    sequence_parallel: bool = False,
    rng_tracker: RNGTracker | None = None,
    comm_counter: CommCounter | None = None,
    recompute: Recompute | None = None,
) -> RankSpec:
    """This rank's model description: the tp layers and hooks of its tp group (collectives counted in
    `comm_counter`), ring attention over its cp group, the dropouts' random streams (`rng_tracker`; None: the
    default generator), recomputation, and the config's fused kernels (registered here, once)."""
    check_tensor_parallel(cfg, state.tp_size, sequence_parallel)
    return RankSpec(
        kernels=cfg.kernel_selection().registered(),
        tp=tensor_parallel_hooks(tp_comm(state, comm_counter), sequence_parallel),
        cp=context_parallel_hooks(state),
        dropout=dropout_streams(rng_tracker, sequence_parallel and state.tp_size > 1),
        recompute=recompute or Recompute(),
        moe_tokens=moe_token_group(state, sequence_parallel),
        expert_exchange=EPExchange.of(state) if state.ep_size > 1 else None,
    )


def moe_token_group(state: ParallelState, sequence_parallel: bool) -> TokenGroup:
    """The ranks holding parts of this rank's micro-batches (model/rank_spec.TokenGroup): its tp group under
    sequence parallelism (each tp rank s/tp positions; without it every tp rank holds them all), times its cp
    group. Counts are summed over each in turn (megatron-core sums over one tp x cp group: the same sum)."""
    groups = [state.cp_group] if state.cp_size > 1 else []
    if sequence_parallel and state.tp_size > 1:
        groups.append(state.tp_group)
    if not groups:
        return TokenGroup()
    comm = state.comm

    def sum_counts(counts: torch.Tensor) -> torch.Tensor:
        for group in groups:
            comm.all_reduce(counts, group)
        return counts

    size = (state.cp_size if state.cp_size > 1 else 1) * (state.tp_size if sequence_parallel else 1)
    return TokenGroup(size=size, sum_counts=sum_counts)


def build_chunk_modules(cfg: ModelConfig, state: ParallelState, spec: RankSpec) -> list[GPTModel]:
    """The vp_size chunks of this pipeline rank, built whole from `spec` on the meta device (no weights yet).
    Which layers each chunk holds is the state's stage map (`state.stages`: interleaved, or zb-v's V)."""
    chunks = []
    for placement in state.stages.placements(cfg.num_layers, state.pp_rank):
        with torch.device("meta"):
            model = GPTModel(
                cfg,
                cfg.padded_vocab_size(state.tp_size),
                placement.layer_ids,
                placement.pre_process,
                placement.post_process,
                spec=spec,
            )
        chunks.append(model)
    return chunks


def build_model_chunks(
    cfg: ModelConfig,
    state: ParallelState,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    spec: RankSpec | None = None,
    compile_backend: str | None = None,
) -> list[GPTModel]:
    """This rank's chunks with their initial weights on `device` (`spec` default: `rank_spec(cfg, state)`);
    with a `compile_backend` (train.compile_backend under train.compile) each transformer layer is
    torch.compiled by it (regional compilation, on first use); None: eager."""
    chunks = build_chunk_modules(cfg, state, spec or rank_spec(cfg, state))
    for model in chunks:
        initialize_parameters(model, cfg, seed, device=device, dtype=dtype)
        if compile_backend is not None:
            model.compile_layers(compile_backend)
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
