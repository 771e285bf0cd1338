"""megatron-core's GPTModel on CPU (gloo) for the conversion tests: build it at (tp, pp, vp), optionally load a
legacy checkpoint strictly, run TOKENS through it, save the logits and the checkpoint as Megatron-LM's training
loop writes it (legacy torch with the full default payload, or torch_dist through dist_checkpointing).

megatron-core (requirements-dev.txt) runs on CPU once a few CUDA-only calls are redirected: the current device
of its global memory buffer, the RNG tracker's fork (no CUDA RNG state on CPU), and for dist_checkpointing
torch.cuda.synchronize and Tensor.cuda."""

import argparse
import contextlib
import io
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, VOCAB, LAYERS, HIDDEN = 16, 300, 4, 64
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
STYLES = {  # name: (TransformerConfig kwargs, GPTModel kwargs, Megatron-LM args)
    "llama": (  # 8 heads, 4 query groups: 2 groups per tp rank at tp2
        dict(
            num_query_groups=4,
            ffn_hidden_size=96,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
        ),
        dict(position_embedding_type="rope", share_embeddings_and_output_weights=False, rotary_base=5000),
        dict(
            group_query_attention=True,
            num_query_groups=4,
            ffn_hidden_size=96,
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=False,
            position_embedding_type="rope",
            rotary_base=5000,
            untie_embeddings_and_output_weights=True,
        ),
    ),
    "gpt": (
        dict(ffn_hidden_size=256, normalization="LayerNorm", add_bias_linear=True),
        dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True),
        dict(
            group_query_attention=False,
            ffn_hidden_size=256,
            normalization="LayerNorm",
            swiglu=False,
            add_bias_linear=True,
            position_embedding_type="learned_absolute",
            untie_embeddings_and_output_weights=False,
        ),
    ),
}


def padded_vocab(tp: int) -> int:
    """Megatron's rule: a multiple of make_vocab_size_divisible_by (128) x tp (300 -> 512 at tp2)."""
    return 128 * tp * -(-VOCAB // (128 * tp))


def megatron_args(style: str, tp: int, pp: int, vp: int) -> argparse.Namespace:
    """Fields of Megatron-LM's args as its training loop pickles them (model_type is Megatron's enum);
    NullTokenizer's vocabulary is vocab_size + 1 (the end-of-document id)."""
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=8,
        seq_length=SEQ,
        max_position_embeddings=64,
        padded_vocab_size=padded_vocab(tp),
        vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=128,
        norm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        tokenizer_type="NullTokenizer",
        model_type=ModelType.encoder_or_decoder,
        params_dtype=torch.float32,
        ckpt_format="torch",
        **STYLES[style][2],
    )


def full_payload(args: argparse.Namespace, models: dict, chunks: list) -> dict:
    """What Megatron-LM's save_checkpoint writes with its defaults: optimizer, scheduler, numpy RNG state."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 7,
        **models,
        "optimizer": {"optimizer": optimizer.state_dict(), "grad_scaler": None, "fp32_from_fp16_params": [params]},
        "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 1e-5, "num_steps": 7, "decay_style": "cosine"},
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                "rng_tracker_states": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)},
            }
        ],
        "num_floating_point_operations_so_far": 1.5e9,
    }


def _config(style: str, tp: int, pp: int, vp: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=8,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        **STYLES[style][0],
    )


def _build(style: str, tp: int, pp: int, vp: int) -> list:
    """This rank's model chunks (one per virtual stage)."""
    config, pp_rank = _config(style, tp, pp, vp), mpu.get_pipeline_model_parallel_rank()
    chunks = []
    for chunk in range(vp):
        chunks.append(
            MegatronGPT(
                config,
                get_gpt_layer_local_spec(normalization=config.normalization),
                vocab_size=padded_vocab(tp),
                max_sequence_length=64,
                pre_process=pp_rank == 0 and chunk == 0,
                post_process=pp_rank == pp - 1 and chunk == vp - 1,
                vp_stage=chunk if vp > 1 else None,
                **STYLES[style][1],
            ).eval()
        )
    return chunks


def _forward(chunks: list, pp: int) -> torch.Tensor | None:
    """Run TOKENS through stage 0 chunk 0, stage 1 chunk 0, ..., stage pp-1 chunk vp-1; the last chunk's
    local logits [b, s, vocab/tp] (None on other ranks)."""
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]  # True = masked (Megatron's convention)
    positions = torch.arange(SEQ).expand(2, SEQ)
    group, rank = mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_rank()
    output = None
    with torch.no_grad():
        for index, chunk in enumerate(chunks):
            if not chunk.pre_process:  # receive [s, b, h] from the previous stage
                hidden = torch.empty(SEQ, 2, HIDDEN)
                dist.recv(hidden, group=group, group_src=(rank - 1) % pp)
                chunk.set_input_tensor(hidden)
            output = chunk(TOKENS, positions, attention_mask=mask)
            if not chunk.post_process:
                dist.send(output.contiguous(), group=group, group_dst=(rank + 1) % pp)
            elif index == len(chunks) - 1:
                return output
    return None


def _save_logits(output: torch.Tensor | None, tp: int, path: str) -> None:
    if output is not None and mpu.get_data_parallel_rank() == 0:
        shards = [torch.empty_like(output) for _ in range(tp)]
        dist.all_gather(shards, output.contiguous(), group=mpu.get_tensor_model_parallel_group())
        if mpu.get_tensor_model_parallel_rank() == 0:
            torch.save(torch.cat(shards, dim=-1)[..., :VOCAB], path)


def _save_legacy(chunks: list, args: argparse.Namespace, root: str) -> None:
    tp_rank, pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    if mpu.get_data_parallel_rank() == 0:
        states = [chunk.state_dict() for chunk in chunks]
        for state in states:  # older Transformer Engine layers: _extra_state as a byte buffer
            state.update({k: io.BytesIO(b"\x00te") for k in state if k.endswith("_extra_state")})
        models = {"model": states[0]} if len(states) == 1 else {f"model{i}": s for i, s in enumerate(states)}
        pp = args.pipeline_model_parallel_size
        folder = os.path.join(root, "iter_0000007", f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else ""))
        os.makedirs(folder, exist_ok=True)
        torch.save(full_payload(args, models, chunks), os.path.join(folder, "model_optim_rng.pt"))


def _save_torch_dist(chunks: list, args: argparse.Namespace, root: str) -> None:
    """What the training loop hands dist_checkpointing.save with --ckpt-format torch_dist."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    tp_rank, pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    models = [chunk.sharded_state_dict() for chunk in chunks]
    rng = {"np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 7,
        "num_floating_point_operations_so_far": 1.5e9,
        "rng_state": ShardedObject("rng_state", [rng], (pp, tp), (pp_rank, tp_rank), mpu.get_data_parallel_rank()),
        **({"model": models[0]} if len(models) == 1 else {f"model{i}": m for i, m in enumerate(models)}),
    }
    folder = os.path.join(root, "iter_0000007")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, folder)


def megatron_run(job: dict) -> None:
    """One job: {style, tp, pp, vp, logits: path, optional load: legacy root, legacy / torch_dist: roots}."""
    style, tp, pp, vp = job["style"], job["tp"], job["pp"], job.get("vp", 1)
    mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    torch.manual_seed(0)  # the full master weights are drawn on every rank, then sliced
    chunks = _build(style, tp, pp, vp)
    if "load" in job:
        tp_rank, pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
        folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
        with open(os.path.join(job["load"], "latest_checkpointed_iteration.txt")) as handle:
            iteration = int(handle.read())
        path = os.path.join(job["load"], f"iter_{iteration:07d}", folder, "model_optim_rng.pt")
        payload = torch.load(path, weights_only=False)
        for index, chunk in enumerate(chunks):
            chunk.load_state_dict(payload["model"] if vp == 1 else payload[f"model{index}"], strict=True)
    _save_logits(_forward(chunks, pp), tp, job["logits"])
    args = megatron_args(style, tp, pp, vp)
    if "legacy" in job:
        _save_legacy(chunks, args, job["legacy"])
    if "torch_dist" in job:
        _save_torch_dist(chunks, args, job["torch_dist"])
    for root in (job.get("legacy"), job.get("torch_dist")):
        if root and dist.get_rank() == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
                handle.write("7")
    dist.barrier()
    mpu.destroy_model_parallel()


def megatron_ranks(rank: int, world_size: int, jobs: list[dict]) -> None:
    """run_ranks entry: redirect the CUDA-only calls, then run each job on every rank."""
    torch.cuda.current_device = lambda: "cpu"  # megatron's global memory buffer asks for it
    torch.cuda.synchronize = lambda *args, **kwargs: None  # dist_checkpointing's save
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # dist_checkpointing's validation
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for job in jobs:
            megatron_run(job)
