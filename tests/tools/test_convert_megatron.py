"""from-megatron / to-megatron against megatron-core's own GPTModel on CPU (gloo, 4 ranks):

- legacy torch checkpoints as Megatron-LM's training loop writes them (optimizer, scheduler, numpy RNG state,
  Transformer Engine `_extra_state` as io.BytesIO), GPT-2 style (tied, biases, LayerNorm, GeLU) and Llama
  style (SwiGLU, RMSNorm, RoPE base 5000, 2 query groups per tp rank, untied), at tp2 x pp2 and tp2 x pp2 x vp2;
- torch_dist checkpoints written by megatron-core's dist_checkpointing at tp2 (x dp2) and tp2 x pp2;
- to-megatron at tp2 x pp2 (x vp2) loaded strictly by megatron-core's GPTModel;
our forward on each converted checkpoint gives megatron-core's logits; Megatron's vocabulary padding (300 -> 512
at tp2). megatron-core is in requirements-dev.txt: without it this module fails to import (never skips)."""

import os
import subprocess
import sys

import pytest
import torch

from config.schema import config_from_dict
from convert.megatron import load_megatron_checkpoint
from convert.model_weights import build_model_from_state, load_global_state
from parallel.tensor_parallel import param_shardings
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT, run_ranks
from tests.payloads import PAYLOAD_GLOBAL, CreatesFile, arm_dcp_metadata, assert_refused
from tests.tools.megatron_runs import SEQ, TOKENS, VOCAB, megatron_ranks

pytestmark = pytest.mark.tier("fast")

LEGACY = {  # name: (style, tp, pp, vp)
    "llama_pp2": ("llama", 2, 2, 1),
    "llama_vp2": ("llama", 2, 2, 2),
    "gpt_pp2": ("gpt", 2, 2, 1),
    "gpt_vp2": ("gpt", 2, 2, 2),
}
TORCH_DIST = {"llama_dist_pp2": ("llama", 2, 2, 1), "gpt_dist_tp2": ("gpt", 2, 1, 1)}


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megatron"))
    jobs = []
    for name, (style, tp, pp, vp) in {**LEGACY, **TORCH_DIST}.items():
        kind = "torch_dist" if name in TORCH_DIST else "legacy"
        jobs.append(
            dict(style=style, tp=tp, pp=pp, vp=vp, logits=os.path.join(out, f"{name}.pt"), **{kind: f"{out}/{name}"})
        )
    run_ranks(4, megatron_ranks, jobs)
    return out


def convert(*args: str) -> subprocess.CompletedProcess:
    return run_cli([sys.executable, "tools/convert_checkpoint.py", *args], cwd=REPO_ROOT)


def our_logits(cfg, tensors) -> torch.Tensor:
    with torch.no_grad():
        return build_model_from_state(cfg, tensors)(TOKENS, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]


def assert_logits_close(ours, theirs):
    assert (ours - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())


@pytest.mark.parametrize("name", [*LEGACY, *TORCH_DIST])
def test_megatron_checkpoints_give_megatron_logits(megatron_dir, name):
    style = {**LEGACY, **TORCH_DIST}[name][0]
    cfg, tensors, data = load_megatron_checkpoint(os.path.join(megatron_dir, name))
    assert (cfg.num_layers, cfg.vocab_size, cfg.tie_embeddings) == (4, VOCAB, style == "gpt")
    assert cfg.query_groups == (4 if style == "llama" else 8)
    assert data == {"tokenizer_type": "NullTokenizer", "vocab_file": None, "merge_file": None, "tokenizer_model": None}
    assert cfg.rotary_base == (5000.0 if style == "llama" else 10000.0)
    assert_logits_close(our_logits(cfg, tensors), torch.load(os.path.join(megatron_dir, f"{name}.pt")))


def test_torch_dist_equals_legacy(megatron_dir):
    """The same megatron-core model saved in both formats converts to the same tensors, bitwise."""
    _, dist_tensors, _ = load_megatron_checkpoint(os.path.join(megatron_dir, "llama_dist_pp2"))
    _, legacy_tensors, _ = load_megatron_checkpoint(os.path.join(megatron_dir, "llama_pp2"))
    assert dist_tensors.keys() == legacy_tensors.keys()
    assert all(torch.equal(dist_tensors[k], legacy_tensors[k]) for k in dist_tensors)


def test_to_megatron_loads_strictly_in_megatron_core(megatron_dir, tmp_path):
    """from-megatron -> ours (tp1) -> to-megatron at Megatron's layout -> megatron-core GPTModel strict load:
    its logits equal ours; from-megatron of that export is bitwise our checkpoint."""
    jobs = []
    for name, vp in (("llama_pp2", 1), ("gpt_vp2", 2)):
        ours, exported = tmp_path / f"{name}_ours", tmp_path / f"{name}_megatron"
        assert convert("from-megatron", os.path.join(megatron_dir, name), str(ours)).returncode == 0
        result = convert("to-megatron", str(ours), str(exported), "--tp", "2", "--pp", "2", "--vp", str(vp))
        assert result.returncode == 0, result.stderr
        assert "loaded iteration 0 of" in result.stdout
        style = LEGACY[name][0]
        jobs.append(dict(style=style, tp=2, pp=2, vp=vp, load=str(exported), logits=str(tmp_path / f"{name}.pt")))
    run_ranks(4, megatron_ranks, jobs)
    for name, _ in (("llama_pp2", 1), ("gpt_vp2", 2)):
        config, tensors = load_global_state(str(tmp_path / f"{name}_ours"))
        cfg = config_from_dict(config).model
        assert_logits_close(our_logits(cfg, tensors), torch.load(tmp_path / f"{name}.pt"))
        back_cfg, back, _ = load_megatron_checkpoint(str(tmp_path / f"{name}_megatron"))
        stored = {k: s.stored for k, s in param_shardings(cfg).items()}  # padding rows are never saved
        assert back.keys() == tensors.keys() and all(
            torch.equal(stored[k](back[k]), stored[k](tensors[k])) for k in back
        )
        assert back_cfg.activation == cfg.activation and back_cfg.vocab_size == cfg.vocab_size


def test_legacy_names_and_the_cli(megatron_dir, tmp_path):
    """Megatron-LM's legacy `language_model` names (same tensor layouts) through the command line."""
    source = os.path.join(megatron_dir, "llama_pp2")
    legacy_root = tmp_path / "legacy"
    for folder in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        payload = torch.load(os.path.join(source, "iter_0000007", folder, "model_optim_rng.pt"), weights_only=False)
        payload["model"] = _as_legacy(payload["model"])
        os.makedirs(legacy_root / "iter_0000007" / folder)
        torch.save(payload, legacy_root / "iter_0000007" / folder / "model_optim_rng.pt")
    (legacy_root / "latest_checkpointed_iteration.txt").write_text("7\n")
    out = tmp_path / "ours"
    result = convert("from-megatron", str(legacy_root), str(out), "--tp", "2", "--pp", "2")
    assert result.returncode == 0, result.stderr
    config, tensors = load_global_state(str(out))
    assert config["parallel"]["tp_size"] == 2 and config["model"]["num_query_groups"] == 4
    assert_logits_close(
        our_logits(config_from_dict(config).model, tensors), torch.load(os.path.join(megatron_dir, "llama_pp2.pt"))
    )


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
        for old, new in renames.items():
            name = name.replace(old, new)
        top, rest = name.split(".", 1)
        legacy[top][rest] = tensor
    return {"language_model": legacy}


def _assert_refused(root, tmp_path, bad_file, marker):
    result = convert("from-megatron", str(root), str(tmp_path / "out"))
    assert_refused(result.returncode, result.stderr, bad_file, marker)
    assert not (tmp_path / "out").exists()
    assert result.stderr.strip() == (
        f"error: {bad_file} pickles {PAYLOAD_GLOBAL}, which is not on the allow-list "
        + (
            "(argparse.Namespace, numpy arrays and dtypes, io.BytesIO, megatron.* as inert placeholders)"
            if bad_file.endswith(".pt")
            else "(torch.distributed.checkpoint metadata classes, torch.Size, dtypes)"
        )
    )


def test_code_in_a_legacy_file_is_refused(megatron_dir, tmp_path, marker):
    root = tmp_path / "evil"
    os.makedirs(root / "iter_0000007" / "mp_rank_00")
    payload = torch.load(
        os.path.join(megatron_dir, "gpt_pp2", "iter_0000007", "mp_rank_00_000", "model_optim_rng.pt"),
        weights_only=False,
    )
    payload["rng_state"].append(CreatesFile(marker))
    torch.save(payload, root / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    _assert_refused(root, tmp_path, f"{root}/iter_0000007/mp_rank_00/model_optim_rng.pt", marker)


@pytest.mark.parametrize("target", ["common.pt", ".metadata"])
def test_code_in_a_torch_dist_checkpoint_is_refused(megatron_dir, tmp_path, marker, target):
    import shutil

    root = tmp_path / "evil"
    shutil.copytree(os.path.join(megatron_dir, "gpt_dist_tp2"), root)
    iter_dir = str(root / "iter_0000007")
    if target == "common.pt":
        common = torch.load(os.path.join(iter_dir, target), weights_only=False)
        torch.save({**common, "hook": CreatesFile(marker)}, os.path.join(iter_dir, target))
        bad_file = os.path.join(iter_dir, target)
    else:
        bad_file = arm_dcp_metadata(iter_dir, marker)
    _assert_refused(root, tmp_path, bad_file, marker)


def test_tokenizer_named_in_args(tmp_path):
    """Megatron's tokenizer args -> our data section: NullTokenizer (vocab_size + 1, no files), a local
    HuggingFaceTokenizer folder or tokenizer.json, GPT-2 BPE; a hub name or missing files carry nothing."""
    from argparse import Namespace

    from convert.megatron_args import tokenizer_from_args
    from tests.data.test_hf_tokenizer import make_tokenizer_json

    nothing = dict(vocab_file=None, merge_file=None, tokenizer_model=None)
    data, size = tokenizer_from_args(Namespace(tokenizer_type="NullTokenizer", vocab_size=299, **nothing))
    assert data == {"tokenizer_type": "NullTokenizer", **nothing} and size == 300
    path = make_tokenizer_json(tmp_path, ["<|end_of_text|>"])
    for model in (str(tmp_path), path):
        data, size = tokenizer_from_args(
            Namespace(tokenizer_type="HuggingFaceTokenizer", **{**nothing, "tokenizer_model": model})
        )
        assert data == {"tokenizer_type": "HuggingFaceTokenizer", **nothing, "tokenizer_model": path} and size == 300
    hub = Namespace(tokenizer_type="HuggingFaceTokenizer", **{**nothing, "tokenizer_model": "meta-llama/Llama-3-8B"})
    assert tokenizer_from_args(hub) == (None, None)
    missing = Namespace(tokenizer_type="GPT2BPETokenizer", **{**nothing, "vocab_file": str(tmp_path / "no.json")})
    assert tokenizer_from_args(missing) == (None, None)


def test_qkv_bias_alone_round_trips_through_megatron_args_and_qk_layernorm_is_refused():
    """model.add_qkv_bias (biases on q, k, v alone, Qwen2's) is Megatron's add_qkv_bias=true with
    add_bias_linear=false, both ways; biases everywhere but q, k, v has no counterpart and is refused in one line,
    as is model.qk_layernorm on export (OLMoE's norm spans every head; megatron-core's is per head)."""
    import argparse

    from convert.hf_mapping import UnsupportedModelError
    from convert.megatron_args import model_args, model_config_from_args
    from tests.tiny_models import tiny_config

    args = model_args(tiny_config("llama", add_qkv_bias=True))
    assert args["add_qkv_bias"] is True and args["add_bias_linear"] is False
    assert model_config_from_args(argparse.Namespace(**args), 50).add_qkv_bias
    assert not model_config_from_args(argparse.Namespace(**model_args(tiny_config("gpt"))), 50).add_qkv_bias
    with pytest.raises(UnsupportedModelError, match=r"^Megatron option add_qkv_bias=False with add_bias_linear=True"):
        model_config_from_args(argparse.Namespace(**{**model_args(tiny_config("gpt")), "add_qkv_bias": False}), 50)
    with pytest.raises(UnsupportedModelError, match=r"^model.qk_layernorm=true has no Megatron-LM counterpart"):
        model_args(tiny_config("llama", qk_layernorm=True))
