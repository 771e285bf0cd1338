"""Our global state dict -> Megatron-LM's legacy "torch" checkpoint at a chosen tp / pp / vp, with
megatron-core's key names (local layer spec: `decoder.layers.N.self_attention.linear_qkv.weight`, ...)
and the `args` Megatron-LM reads the model from (`--use-checkpoint-args`) and checks on load.

    OUT/latest_checkpointed_iteration.txt
    OUT/iter_{it:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
        {"args", "checkpoint_version": 3.0, "iteration", "model" (or "model0".."model{vp-1}"),
         "num_floating_point_operations_so_far": 0}

Weights only: Megatron-LM continues from it with `--finetune` (or `--no-load-optim --no-load-rng`). The
vocabulary is padded by Megatron's rule (a multiple of make_vocab_size_divisible_by x tp); a tied
embedding is stored on the first stage and, as Megatron keeps it, copied to the last stage's
output_layer.weight. Every linear of the local spec carries an `_extra_state` of None (strict loading
expects the key).
"""

from __future__ import annotations

import argparse
import os

import torch

from checkpoint import MAIN_FILE, iter_name, mp_rank_name
from convert.megatron_args import model_args, tokenizer_args
from convert.megatron_names import GLOBAL_TO_MCORE, LAYER_EXTRA_STATES, LAYER_TO_MCORE, OUTPUT_EXTRA_STATE
from convert.model_weights import check_layout, resize_vocab_rows
from model.config import ModelConfig
from parallel.pipeline.stages import StageMap
from parallel.tensor_parallel import param_shardings

Tensors = dict[str, torch.Tensor | None]


def megatron_args(cfg: ModelConfig, layout: tuple[int, int, int], iteration: int, data: dict) -> argparse.Namespace:
    """The model, layout and tokenizer fields of Megatron-LM's args (what load_args_from_checkpoint and
    check_checkpoint_args read), for layout (tp, pp, vp)."""
    tp, pp, vp = layout
    return argparse.Namespace(
        **model_args(cfg),
        padded_vocab_size=cfg.padded_vocab_size(tp),
        **tokenizer_args(cfg, data),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        num_layers_per_virtual_pipeline_stage=StageMap(pp, vp).layers_per_chunk(cfg.num_layers) if vp > 1 else None,
        transformer_impl="local",
        params_dtype=torch.float32,
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )


def chunk_state(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: tuple[int, int, int], layout: tuple[int, int, int]
) -> Tensors:
    """One model chunk's state dict under megatron-core names. rank = (tp_rank, pp_rank, chunk), layout =
    (tp, pp, vp); chunk c of stage p holds layers [(c * pp + p) * per, ...) (Megatron's interleaving).
    `tensors` is our global state dict padded to Megatron's vocabulary rows at this tp."""
    (tp_rank, pp_rank, chunk), (tp, pp, vp) = rank, layout
    shardings = param_shardings(cfg)
    state: Tensors = {}

    def put(megatron_name: str, ours: str) -> None:
        if ours in tensors:
            state[megatron_name] = shardings[ours].shard(tensors[ours], tp_rank, tp).clone()

    def put_global(ours: str, source: str | None = None) -> None:  # under its megatron-core name
        put(GLOBAL_TO_MCORE[ours], source or ours)

    placement = StageMap(pp, vp).placement(cfg.num_layers, pp_rank, chunk)  # Megatron's interleaving
    first, last = placement.pre_process, placement.post_process
    if first:
        put_global("embedding.word_embeddings.weight")
        put_global("embedding.position_embeddings.weight")
    for local, layer in enumerate(placement.layer_ids):
        for ours, theirs in LAYER_TO_MCORE.items():
            for kind in ("weight", "bias"):
                put(f"decoder.layers.{local}.{theirs}.{kind}", f"layers.{layer}.{ours}.{kind}")
        state.update({f"decoder.layers.{local}.{linear}._extra_state": None for linear in LAYER_EXTRA_STATES})
    if last:
        put_global("final_norm.weight")
        put_global("final_norm.bias")
        if not (cfg.tie_embeddings and first):  # tied on one stage: the embedding is the output layer
            put_global("output_layer.weight", "embedding.word_embeddings.weight" if cfg.tie_embeddings else None)
        state[OUTPUT_EXTRA_STATE] = None
    return state


def megatron_files(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: tuple[int, int, int], iteration: int, data: dict
) -> dict[str, dict]:
    """{relative path of each model_optim_rng.pt: its payload} for the layout (tp, pp, vp)."""
    tp, pp, vp = layout
    check_layout(cfg, tp, pp, vp)  # the trainer's layout rules and messages (heads, groups, ffn, layers, vp)
    padded = resize_vocab_rows(tensors, cfg, cfg.padded_vocab_size(tp))
    args = megatron_args(cfg, layout, iteration, data)
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            chunks = [chunk_state(padded, cfg, (tp_rank, pp_rank, c), layout) for c in range(vp)]
            models = {"model": chunks[0]} if vp == 1 else {f"model{c}": chunk for c, chunk in enumerate(chunks)}
            folder = mp_rank_name(tp_rank, pp_rank, name_pp_rank=pp > 1)
            files[os.path.join(iter_name(iteration), folder, MAIN_FILE)] = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
                **models,
                "num_floating_point_operations_so_far": 0,
            }
    return files
