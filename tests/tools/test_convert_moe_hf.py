"""transformers' MoE families both ways (convert/hf_moe.py): a tiny random MixtralForCausalLM,
Qwen2MoeForCausalLM and OlmoeForCausalLM built here (no download), saved with a byte-level tokenizer.json; from-hf gives our model
transformers' logits (fp32, within 1e-5), to-hf gives back a folder transformers loads with the same logits,
and tools/generate.py's greedy text from the transformers folder equals transformers' greedy generate for 100
tokens. What the families cannot express is refused in one line naming the key."""

import argparse
import json
import shutil
from typing import Any

import pytest
import torch

from convert.hf_mapping import UnsupportedModelError, model_config_from_hf
from convert.model_weights import build_model_from_state, load_global_state
from model.generation import generate_tokens
from operations.startup import DistEnv
from tests.data.test_hf_tokenizer import make_tokenizer_json
from tests.tools.test_generate import PROMPT, greedy_tokens
from tools.convert_checkpoint import from_hf, model_config_of, to_hf
from tools.generate import make_logits_fn, prepare

pytestmark = pytest.mark.tier("fast")

VOCAB = 300
EOS = 1  # <|end_of_text|> of the tokenizer.json below

# Two layers of width 64 (8 heads of 8 in 2 key/value groups), 4 experts of width 32 with top-2 routing
ATTENTION: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=160,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=EOS,
    pad_token_id=None,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    # norm_topk_prob false: the top-k of the softmax as it is; layer 1 dense (mlp_only_layers); q, k, v biases
    "qwen2_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        qkv_bias=True,
    ),
    # norm_topk_prob true: renormalised, every layer sparse, no biases
    "qwen2_moe_normalised": dict(
        intermediate_size=48,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        qkv_bias=False,
    ),
    # the top-k of the softmax, not renormalised; RMSNorm over the whole q and k projections
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
}
CLASSES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "qwen2_moe_normalised": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig"),
}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A 300-entry byte-level BPE tokenizer.json with a tokenizer_config.json naming its end of text."""
    folder = tmp_path_factory.mktemp("moe_tokenizer")
    make_tokenizer_json(folder, ["<|begin_of_text|>", "<|end_of_text|>"])
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>"})
    )
    return folder


def random_moe_model(family: str):
    """A transformers MoE model of `family` with random weights (norms too, so that no layout error hides)."""
    import transformers

    torch.manual_seed(0)
    model_class, config_class = (getattr(transformers, name) for name in CLASSES[family])
    model = model_class(config_class(**ATTENTION, **FAMILIES[family]))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(-0.5, 1.5)
    return model.eval()


def save_with_tokenizer(model, folder, tokenizer_folder) -> None:
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
POSITIONS = torch.arange(24).expand(2, 24)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_family_converts_both_ways_with_transformers_logits(family, tokenizer_folder, tmp_path):
    import transformers
    from safetensors.torch import load_file

    hf_model = random_moe_model(family)
    save_with_tokenizer(hf_model, tmp_path / "hf", tokenizer_folder)
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    config, tensors = load_global_state(str(tmp_path / "ours"))
    cfg = model_config_of(config)  # what from-hf wrote into the checkpoint's config.yaml
    assert cfg.num_experts == FAMILIES[family]["num_experts" if family != "mixtral" else "num_local_experts"]
    assert cfg.moe_router_topk == 2 and cfg.qk_layernorm == (family == "olmoe")
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
        ours = build_model_from_state(cfg, tensors)(TOKENS, POSITIONS)[..., :VOCAB]
    assert (ours - theirs).abs().max().item() <= 1e-5

    to_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    written, original = json.loads((tmp_path / "back" / "config.json").read_text()), hf_model.config.to_dict()
    for key in set(FAMILIES[family]) - {"router_aux_loss_coef"}:  # the router settings written back
        assert written[key] == original[key], key
    if family == "mixtral":
        assert written["router_aux_loss_coef"] == 0.02
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(back) is type(hf_model)
    with torch.no_grad():
        assert (back(TOKENS).logits - theirs).abs().max().item() <= 1e-5
    saved, exported = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(exported) == set(saved) and all(torch.equal(exported[name], saved[name]) for name in saved)


def greedy_without_stop(folder: str, max_new_tokens: int) -> list[int]:
    """tools/generate.py's greedy tokens from a transformers folder, not stopping at the end of text."""
    args = argparse.Namespace(
        checkpoint=folder,
        greedy=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        max_new_tokens=max_new_tokens,
        dtype="fp32",
    )
    env = DistEnv(1, 0, 0, 1, torch.device("cpu"))
    model, cfg, state, tokenizer, sampling = prepare(args, env)
    logits_fn = make_logits_fn(model, cfg, state)
    ids = tokenizer.encode(PROMPT)
    return list(
        generate_tokens(logits_fn, ids, max_new_tokens, sampling, None, env.device, max_length=cfg.max_positions)
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_greedy_text_from_the_transformers_folder_equals_transformers(family, tokenizer_folder, tmp_path):
    """100 greedy tokens with the end of text an ordinary token on both sides, and the tool's stop at it."""
    import transformers

    save_with_tokenizer(random_moe_model(family), tmp_path / "hf", tokenizer_folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        stopping = hf_model.generate(prompt, do_sample=False, max_new_tokens=100)[0, prompt.shape[1] :].tolist()
        hf_model.generation_config.eos_token_id = None
        theirs = hf_model.generate(prompt, do_sample=False, max_new_tokens=100)[0, prompt.shape[1] :].tolist()
    assert len(theirs) == 100 and greedy_without_stop(str(tmp_path / "hf"), 100) == theirs
    # generate_tokens stops at the end of text without yielding it; transformers keeps it
    expected = stopping[:-1] if stopping[-1] == EOS else stopping
    assert greedy_tokens(str(tmp_path / "hf"), DistEnv(1, 0, 0, 1, torch.device("cpu")), 100) == expected


def _config_json(family: str, **changes: object) -> dict:
    return {**random_moe_model(family).config.to_dict(), **changes}


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("qwen2_moe", dict(use_sliding_window=True), "config.json: use_sliding_window=true"),
        ("mixtral", dict(sliding_window=16), "config.json: sliding_window=16 below max_position_embeddings=160"),
        ("mixtral", dict(router_jitter_noise=0.1), "config.json: router_jitter_noise=0.1"),
        ("mixtral", dict(num_experts_per_tok=None), "config.json: num_experts_per_tok is None, not a whole number"),
        ("olmoe", dict(clip_qkv=8.0), "config.json: clip_qkv=8.0 (clamping q, k, v) is not supported"),
    ],
)
def test_what_the_trainer_cannot_compute_is_refused_naming_the_field(family, changes, message):
    with pytest.raises(UnsupportedModelError) as error:
        model_config_from_hf(_config_json(family, **changes))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_to_hf_refuses_an_moe_model_no_family_computes():
    from convert.hf_mapping import hf_config
    from tests.tiny_models import tiny_config

    moe = dict(num_experts=4, moe_router_topk=2)
    cases = [
        (tiny_config("gpt", **moe), "model.num_experts=4 with position_embedding_type=learned"),
        (tiny_config("llama", **moe, moe_router_pre_softmax=True), "model.moe_router_pre_softmax=true without"),
        (tiny_config("llama", qk_layernorm=True), "model.qk_layernorm=true: GPT-2 and Llama have no q/k norm"),
        (
            tiny_config("llama", **moe, qk_layernorm=True, moe_layer_freq=2),
            "model.moe_layer_freq=2: OLMoE has an MoE layer in every layer",
        ),
        (tiny_config("llama", **moe, moe_expert_capacity_factor=1.0), "model.moe_expert_capacity_factor=1.0"),
        (tiny_config("llama", **moe, add_qkv_bias=True), "model.add_qkv_bias=true: Mixtral has no attention"),
        (tiny_config("llama", add_qkv_bias=True), "model.add_qkv_bias=true with model.add_bias_linear=false: GPT-2"),
        (tiny_config("llama", **moe, moe_layer_freq=2), "model.moe_layer_freq=2: Mixtral has an MoE layer in every"),
        (
            tiny_config("llama", **moe, moe_shared_expert_ffn_hidden_size=32),
            "model.moe_shared_expert_ffn_hidden_size=32 with model.moe_shared_expert_gate=false",
        ),
    ]
    for cfg, message in cases:
        with pytest.raises(UnsupportedModelError) as error:
            hf_config(cfg, 0, 0)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_qk_layernorm_is_refused_under_tensor_parallelism():
    """OLMoE's q/k norm spans every head; a tp rank holds only its own, so tp > 1 is refused naming the key."""
    from model.gpt import GPTModel
    from model.kernels import KernelSelection
    from model.rank_spec import RankSpec
    from model.tp_hooks import TensorParallelHooks
    from tests.tiny_models import tiny_config

    cfg = tiny_config("llama", qk_layernorm=True)
    with pytest.raises(ValueError, match=r"^model.qk_layernorm=true needs parallel.tp_size=1, got 2$"):
        GPTModel(
            cfg, cfg.padded_vocab_size(2), spec=RankSpec(kernels=KernelSelection(), tp=TensorParallelHooks(tp_size=2))
        )
    with pytest.raises(ValueError, match=r"^model.qk_layernorm=true needs model.normalization=rmsnorm"):
        tiny_config("gpt", qk_layernorm=True).validate()


def test_from_hf_at_tp2_pp2_holds_the_same_experts_and_olmoe_refuses_tp2(tokenizer_folder, tmp_path):
    """from-hf to tp2 x pp2 writes the layout-free pieces: read back at one process they equal the tp1
    conversion's, stacked experts included; OLMoE's q/k norm cannot run at tp2, so from-hf refuses it in one line
    and writes nothing."""
    save_with_tokenizer(random_moe_model("qwen2_moe"), tmp_path / "hf", tokenizer_folder)
    from_hf(str(tmp_path / "hf"), str(tmp_path / "tp1"))
    from_hf(str(tmp_path / "hf"), str(tmp_path / "tp2pp2"), tp=2, pp=2)
    (_, single), (config, split) = load_global_state(str(tmp_path / "tp1")), load_global_state(str(tmp_path / "tp2pp2"))
    assert config["parallel"]["tp_size"] == 2 and config["parallel"]["pp_size"] == 2
    assert "layers.0.mlp.experts.fc1_weight" in single and set(split) == set(single)
    assert all(torch.equal(split[name], single[name]) for name in single)
    save_with_tokenizer(random_moe_model("olmoe"), tmp_path / "olmoe", tokenizer_folder)
    with pytest.raises(ValueError, match=r"^model.qk_layernorm=true needs parallel.tp_size=1, got 2$"):
        from_hf(str(tmp_path / "olmoe"), str(tmp_path / "olmoe_tp2"), tp=2)
    assert not (tmp_path / "olmoe_tp2").exists()
