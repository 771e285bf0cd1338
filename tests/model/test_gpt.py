"""The plain GPT: both styles run, init is layout-independent, Megatron's init and vocabulary padding."""

import math

import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.param_info import param_info
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.tier("fast")


def build(cfg, **kwargs):
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size(), **kwargs)
    initialize_parameters(model, cfg, seed=7)
    return model


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_forward_backward_shapes(style):
    cfg = tiny_config(style, hidden_size=64, seq_length=16, vocab_size=300)
    model = build(cfg)
    tokens = torch.randint(0, 300, (3, 16))
    positions = torch.arange(16).expand(3, 16)
    loss = model(tokens, positions, labels=tokens)
    assert loss.shape == (3, 16) and loss.dtype == torch.float32
    assert abs(loss.mean().item() - math.log(384)) < 1.0  # near-uniform at init
    loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    logits = model(tokens, positions)
    assert logits.shape == (3, 16, 384)


def test_padded_vocab_follows_megatron():
    cfg = ModelConfig(vocab_size=50257)
    assert cfg.padded_vocab_size(1) == 50304
    assert cfg.padded_vocab_size(8) == 51200


def test_init_is_independent_of_the_cut_and_follows_megatron():
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=300)
    whole = build(cfg)
    second_half = build(cfg, layer_ids=[2, 3], pre_process=False)
    for name, param in second_half.named_parameters():
        reference = dict(whole.named_parameters())[
            name if name != "output_layer.weight" else "embedding.word_embeddings.weight"
        ]
        assert torch.equal(param, reference), name
    assert param_info(second_half.output_layer.weight).embedding_copy
    fc2 = whole.layers["0"].mlp.fc2.weight
    fc1 = whole.layers["0"].mlp.fc1.weight
    assert abs(fc1.std().item() - 0.02) < 0.002
    assert abs(fc2.std().item() - 0.02 / math.sqrt(8)) < 0.001
    assert torch.all(whole.layers["0"].mlp.fc1.bias == 0)
    assert torch.all(whole.layers["0"].input_norm.weight == 1)


def test_tied_output_layer_shares_the_embedding():
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=100)
    model = build(cfg)
    assert model.output_layer.weight is model.embedding.word_embeddings.weight
    untied = build(
        ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=100, tie_embeddings=False)
    )
    assert untied.output_layer.weight is not untied.embedding.word_embeddings.weight


def test_largest_paper_model_builds_on_meta_without_memory():
    cfg = ModelConfig(num_layers=128, hidden_size=25600, num_attention_heads=160, seq_length=2048, vocab_size=51200)
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size())
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 1008.0


def test_reset_attention_mask_path_matches_causal_when_one_document():
    cfg = tiny_config(num_layers=1, num_attention_heads=2)
    model = build(cfg)
    tokens = torch.randint(0, 50, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8)
    assert torch.allclose(model(tokens, positions, attention_mask=causal), model(tokens, positions), atol=1e-6)


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_reset_masks_make_documents_independent(style):
    """With reset_attention_mask and reset_position_ids, the second document of a sequence gets exactly the
    logits it gets alone: no attention across the EOD, positions restarted (learned and rotary)."""
    from data.loader import get_batch_masks

    cfg = tiny_config(style, seq_length=12)
    model = build(cfg)
    eod = 0
    first, second = torch.randint(1, 50, (1, 4)), torch.randint(1, 50, (1, 7))
    tokens = torch.cat((first, torch.full((1, 1), eod), second), dim=1)  # [1, 12]: doc A + EOD, doc B
    _, positions, mask = get_batch_masks(tokens, eod, False, True, True)
    assert positions[0].tolist() == list(range(5)) + list(range(7))
    together = model(tokens, positions, attention_mask=mask)[:, 5:]
    alone = model(second, torch.arange(7).unsqueeze(0))
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    unmasked = model(tokens, torch.arange(12).unsqueeze(0))[:, 5:]
    assert not torch.allclose(unmasked, alone, atol=1e-3)  # the masks are what makes them equal
