"""from-megatron on checkpoints written by megatron-core's own GPTModel on CPU (gloo): tp2 x pp2 (Llama style,
GQA, untied) and tp2 (GPT style, biases, tied), megatron-core key names, plus the same tensors under the legacy
`language_model` names; our forward on the converted checkpoint gives megatron-core's logits.

megatron-core (requirements-dev.txt) runs forward on CPU once two CUDA-only calls are redirected: the
current device of its global memory buffer and the RNG tracker's fork (no CUDA RNG state on CPU)."""

import argparse
import contextlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from convert.megatron import load_megatron_checkpoint
from convert.model_weights import build_model_from_state, load_global_state
from tests.conftest import REPO_ROOT, run_ranks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as mpu
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, VOCAB, PADDED = 16, 300, 384
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
STYLES = {  # name: (TransformerConfig kwargs, GPTModel kwargs, Megatron-LM args)
    "llama": (
        dict(
            num_query_groups=2,
            ffn_hidden_size=96,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
        ),
        dict(position_embedding_type="rope", share_embeddings_and_output_weights=False, rotary_base=5000),
        dict(
            group_query_attention=True,
            num_query_groups=2,
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


def megatron_args(style: str, tp: int, pp: int) -> argparse.Namespace:
    """The fields Megatron-LM's save_checkpoint pickles that matter here (model_type is Megatron's enum)."""
    return argparse.Namespace(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        seq_length=SEQ,
        max_position_embeddings=64,
        padded_vocab_size=PADDED,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=128,
        norm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        tokenizer_type="NullTokenizer",
        model_type=ModelType.encoder_or_decoder,
        params_dtype=torch.float32,
        **STYLES[style][2],
    )


def _megatron_forward(style: str, tp: int, pp: int, out_dir: str) -> None:
    """Build megatron-core's GPTModel at (tp, pp), run TOKENS through it, save logits and the checkpoint."""
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)  # the full master weights are drawn on every rank, then sliced
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
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
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    model = MegatronGPT(
        config,
        get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=PADDED,
        max_sequence_length=64,
        pre_process=first,
        post_process=last,
        **STYLES[style][1],
    ).eval()
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]  # True = masked (Megatron's convention)
    positions = torch.arange(SEQ).expand(2, SEQ)
    pp_group, pp_rank = mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        if not first:  # receive [s, b, h] from the previous stage
            hidden = torch.empty(SEQ, 2, 64)
            dist.recv(hidden, group=pp_group, group_src=pp_rank - 1)
            model.set_input_tensor(hidden)
        output = model(TOKENS, positions, attention_mask=mask)
        if not last:
            dist.send(output.contiguous(), group=pp_group, group_dst=pp_rank + 1)
    tp_rank, dp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank()
    if last and dp_rank == 0:
        shards = [torch.empty_like(output) for _ in range(tp)]
        dist.all_gather(shards, output.contiguous(), group=mpu.get_tensor_model_parallel_group())
        if tp_rank == 0:
            torch.save(torch.cat(shards, dim=-1)[..., :VOCAB], os.path.join(out_dir, f"{style}_logits.pt"))
    if dp_rank == 0:
        folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
        path = os.path.join(out_dir, style, "iter_0000007", folder)
        os.makedirs(path, exist_ok=True)
        torch.save(
            {
                "args": megatron_args(style, tp, pp),
                "checkpoint_version": 3.0,
                "iteration": 7,
                "model": model.state_dict(),
            },
            os.path.join(path, "model_optim_rng.pt"),
        )
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, style, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write("7")
    dist.barrier()
    mpu.destroy_model_parallel()


def _megatron_ranks(rank, world_size, out_dir):
    torch.cuda.current_device = lambda: "cpu"  # megatron's global memory buffer asks for it
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _megatron_forward("llama", tp=2, pp=2, out_dir=out_dir)
        _megatron_forward("gpt", tp=2, pp=1, out_dir=out_dir)  # dp = 2 here


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("megatron"))
    run_ranks(4, _megatron_ranks, out_dir)
    return out_dir


def our_logits(cfg, tensors) -> torch.Tensor:
    with torch.no_grad():
        return build_model_from_state(cfg, tensors)(TOKENS, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]


def assert_logits_close(ours, theirs):
    assert (ours - theirs).abs().max().item() <= 1e-4 * (theirs.max() - theirs.min()).item()


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_megatron_core_checkpoint_gives_megatron_logits(megatron_dir, style):
    cfg, tensors, _ = load_megatron_checkpoint(os.path.join(megatron_dir, style))
    assert (cfg.num_layers, cfg.vocab_size, cfg.tie_embeddings) == (4, VOCAB, style == "gpt")
    assert cfg.query_groups == (2 if style == "llama" else 8)
    assert_logits_close(our_logits(cfg, tensors), torch.load(os.path.join(megatron_dir, f"{style}_logits.pt")))


def _as_legacy(state: dict) -> dict:
    """megatron-core names -> Megatron-LM's legacy nested `language_model` dict (same tensor layouts)."""
    renames = {
        "decoder.": "encoder.",
        "self_attention.linear_qkv": "self_attention.query_key_value",
        "self_attention.linear_proj": "self_attention.dense",
        "pre_mlp_layernorm": "post_attention_layernorm",
        "mlp.linear_fc1": "mlp.dense_h_to_4h",
        "mlp.linear_fc2": "mlp.dense_4h_to_h",
    }
    legacy: dict = {"embedding": {}, "encoder": {}, "output_layer": {}}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        top, rest = name.split(".", 1)
        legacy[top][rest] = tensor
    return {"language_model": legacy}


def test_legacy_names_and_the_cli(megatron_dir, tmp_path):
    source = os.path.join(megatron_dir, "llama")
    legacy_root = tmp_path / "legacy"
    for folder in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        payload = torch.load(os.path.join(source, "iter_0000007", folder, "model_optim_rng.pt"), weights_only=False)
        payload["model"] = _as_legacy(payload["model"])
        os.makedirs(legacy_root / "iter_0000007" / folder)
        torch.save(payload, legacy_root / "iter_0000007" / folder / "model_optim_rng.pt")
    (legacy_root / "latest_checkpointed_iteration.txt").write_text("7\n")
    out = tmp_path / "ours"
    result = subprocess.run(
        [
            sys.executable,
            "tools/convert_checkpoint.py",
            "from-megatron",
            str(legacy_root),
            str(out),
            "--tp",
            "2",
            "--pp",
            "2",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    config, tensors = load_global_state(str(out))
    assert config["parallel"]["tp_size"] == 2 and config["model"]["num_query_groups"] == 2
    from config.schema import config_from_dict

    assert_logits_close(
        our_logits(config_from_dict(config).model, tensors), torch.load(os.path.join(megatron_dir, "llama_logits.pt"))
    )


def test_unknown_globals_are_refused_by_name(tmp_path):
    root = tmp_path / "evil"
    os.makedirs(root / "iter_0000001" / "mp_rank_00")
    torch.save(
        {"args": argparse.Namespace(num_layers=1), "model": {}, "hook": contextlib.nullcontext()},
        root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt",
    )
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "from-megatron", str(root), str(tmp_path / "out")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip().splitlines() == [
        f"error: {root}/iter_0000001/mp_rank_00/model_optim_rng.pt pickles contextlib.nullcontext, which is not on "
        "the allow-list (argparse.Namespace, megatron.* as inert placeholders)"
    ]
