"""Our state dict <-> transformers GPT2LMHeadModel / LlamaForCausalLM, checked against transformers itself:
same logits (fp32, max abs diff <= 1e-4 of the logit range) at tp1, tp2 and pp2, bitwise round trips."""

import os
import tempfile

import pytest
import torch

from convert.hf_mapping import (
    UnsupportedModelError,
    from_hf_state_dict,
    hf_config,
    model_config_from_hf,
    to_hf_state_dict,
)
from convert.model_weights import build_model_from_state
from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from parallel.state import ParallelState
from tests.conftest import run_ranks
from tests.tiny_models import tiny_config, tiny_hf_config

pytestmark = pytest.mark.tier("fast")

VOCAB = 300  # padded to 384 here (and to 512 at tp2 with the default multiple 128)


def random_hf_model(arch: str):
    """A transformers model with random weights (norms and biases too, so that no layout error hides)."""
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = tiny_hf_config(
            "gpt2", vocab_size=VOCAB, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = tiny_hf_config(
            "llama", vocab_size=VOCAB, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
        )
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(-0.5, 1.5)
    return model.eval()


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    spread = (theirs.max() - theirs.min()).item()
    assert (ours - theirs).abs().max().item() <= 1e-4 * spread


def imported(arch: str):
    hf_model = random_hf_model(arch)
    cfg = model_config_from_hf(hf_model.config.to_dict())
    return hf_model, cfg, from_hf_state_dict(cfg, hf_model.state_dict())


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
POSITIONS = torch.arange(24).expand(2, 24)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_gives_transformers_logits_and_round_trips_bitwise(arch):
    hf_model, cfg, ours = imported(arch)
    assert cfg.padded_vocab_size(1) == 384 and ours["embedding.word_embeddings.weight"].shape[0] == 384
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
        logits = build_model_from_state(cfg, ours)(TOKENS, POSITIONS)[..., :VOCAB]
    assert_logits_close(logits, theirs)
    back = to_hf_state_dict(cfg, ours)
    reference = hf_model.state_dict()
    assert set(back) == set(reference) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert all(torch.equal(back[name], reference[name]) for name in back)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_at_pp2_gives_transformers_logits(arch):
    hf_model, cfg, ours = imported(arch)
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
    first = GPTModel(cfg, 384, layer_ids=[0], post_process=False)
    second = GPTModel(cfg, 384, layer_ids=[1], pre_process=False)
    for stage in (first, second):
        stage.load_state_dict({k: v for k, v in ours.items() if k in stage.state_dict()})
        stage.eval()
    with torch.no_grad():
        hidden = first(TOKENS, POSITIONS)  # [s, b, h], what stage 0 sends to stage 1
        logits = second(position_ids=POSITIONS, hidden_states=hidden)[..., :VOCAB]
    assert_logits_close(logits, theirs)


def _tp2_logits(rank, world_size, arch, out_dir):
    _hf_model, cfg, ours = imported(arch)
    state = ParallelState.create(2, 1)
    model = build_model_from_state(cfg, ours, state)
    with torch.no_grad():
        local = model(TOKENS, POSITIONS)  # [b, s, V/2]
    torch.save(local, os.path.join(out_dir, f"logits_{rank}.pt"))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_at_tp2_gives_transformers_logits(arch):
    hf_model = random_hf_model(arch)
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(2, _tp2_logits, arch, out_dir)
        shards = [torch.load(os.path.join(out_dir, f"logits_{r}.pt")) for r in range(2)]
    assert shards[0].shape[-1] == 256  # 300 padded to a multiple of 128 * tp
    assert_logits_close(torch.cat(shards, dim=-1)[..., :VOCAB], theirs)


@pytest.mark.parametrize("style", ["gpt2", "gpt2_untied_no_bias", "llama_gqa_tied"])
def test_export_gives_transformers_the_same_logits(style):
    import transformers

    overrides = dict(hidden_size=64, seq_length=32, vocab_size=VOCAB, init_std=0.1)
    if style == "gpt2_untied_no_bias":
        overrides.update(tie_embeddings=False, add_bias_linear=False)
    if style.startswith("llama"):  # Llama with GPT-2's tied output layer and biases
        overrides.update(tie_embeddings=True, add_bias_linear=True, rotary_base=500.0)
    cfg = tiny_config("llama" if style.startswith("llama") else "gpt", **overrides)
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size())
    initialize_parameters(model, cfg, seed=11)
    model.eval()
    config = transformers.AutoConfig.for_model(**hf_config(cfg, 0, 0))
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = hf_model.load_state_dict(to_hf_state_dict(cfg, model.state_dict()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and cfg.tie_embeddings == bool(missing)
    hf_model.tie_weights()
    tokens = TOKENS[:, :20]
    with torch.no_grad():
        assert_logits_close(model(tokens, POSITIONS[:, :20])[..., :VOCAB], hf_model(tokens).logits)


def test_unsupported_options_are_refused_by_name():
    gpt2 = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 8, "vocab_size": 10}
    assert model_config_from_hf(gpt2).activation == "gelu_tanh"  # GPT-2's default gelu_new
    with pytest.raises(UnsupportedModelError, match="activation_function='relu'"):
        model_config_from_hf({**gpt2, "activation_function": "relu"})
    with pytest.raises(UnsupportedModelError, match="model_type='bert'"):
        model_config_from_hf({"model_type": "bert"})
    with pytest.raises(UnsupportedModelError, match="rope_type='linear'"):
        model_config_from_hf(
            {
                "model_type": "llama",
                "hidden_size": 8,
                "num_attention_heads": 2,
                "rope_parameters": {"rope_type": "linear", "factor": 2.0},
            }
        )
    with pytest.raises(UnsupportedModelError, match="position_embedding_type=rope, normalization=layernorm"):
        hf_config(ModelConfig(position_embedding_type="rope", vocab_size=10), 0, 0)
    hf_model, cfg, _ours = imported("llama")
    extra = {**hf_model.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}
    with pytest.raises(UnsupportedModelError, match="q_norm.weight has no counterpart"):
        from_hf_state_dict(cfg, extra)
