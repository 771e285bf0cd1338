"""One Sharding record per parameter drives everything that splits, places or trims it: the converters' view
(param_shardings, no live model) equals what the tp layers declare, and from it follow the sharded init, the
checkpoint blocks (padding rows left out) and the vocabulary trimming and padding of the converters."""

from __future__ import annotations

import pytest
import torch

from checkpoint.pieces import global_shape, tp_blocks
from convert.model_weights import resize_vocab_rows
from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.param_info import Sharding, param_info
from parallel.model_builder import rank_spec
from parallel.state import ParallelState
from parallel.tensor_parallel import param_shardings

pytestmark = pytest.mark.tier("fast")

VOCAB, SEED = 50, 5  # padded to 56 rows at tp 1 and 64 at tp 2 and 4 (multiple 8 * tp)
STYLES = {
    "gpt": {},  # learned positions, LayerNorm, GeLU, tied, biases
    "llama": dict(
        num_query_groups=4,
        position_embedding_type="rope",
        normalization="rmsnorm",
        activation="swiglu",
        tie_embeddings=False,
        add_bias_linear=False,
    ),
}
# (style, global name, the record the tp layers must declare)
CASES = [
    ("gpt", "layers.0.attention.qkv.weight", Sharding(dim=0)),
    ("gpt", "layers.0.attention.qkv.bias", Sharding(dim=0)),
    ("gpt", "layers.1.attention.proj.weight", Sharding(dim=1)),
    ("gpt", "layers.1.attention.proj.bias", Sharding()),  # added after the reduction: replicated
    ("gpt", "layers.0.mlp.fc1.weight", Sharding(dim=0)),
    ("gpt", "layers.0.mlp.fc2.weight", Sharding(dim=1)),
    ("gpt", "layers.0.input_norm.weight", Sharding()),
    ("gpt", "embedding.position_embeddings.weight", Sharding()),
    ("gpt", "embedding.word_embeddings.weight", Sharding(dim=0, valid_rows=VOCAB)),
    ("gpt", "output_layer.weight", Sharding(dim=0, valid_rows=VOCAB)),  # tied: the embedding itself
    ("llama", "layers.0.attention.qkv.weight", Sharding(dim=0)),  # per query group: no stacked parts
    ("llama", "layers.1.mlp.fc1.weight", Sharding(dim=0, parts=2)),  # SwiGLU [gate; up]
    ("llama", "layers.1.mlp.fc2.weight", Sharding(dim=1)),
    ("llama", "final_norm.weight", Sharding()),
    ("llama", "embedding.word_embeddings.weight", Sharding(dim=0, valid_rows=VOCAB)),
    ("llama", "output_layer.weight", Sharding(dim=0, valid_rows=VOCAB)),
]


def _config(style: str) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        ffn_hidden_size=64,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=8,
        **STYLES[style],
    )


def _full(cfg: ModelConfig, tp_size: int) -> dict[str, torch.Tensor]:
    """The one-process init at tp's vocabulary padding."""
    model = GPTModel(cfg, cfg.padded_vocab_size(tp_size))
    initialize_parameters(model, cfg, SEED)
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def _shards(cfg: ModelConfig, tp_size: int) -> list[dict[str, torch.nn.Parameter]]:
    """Every tp rank's parameters, built as the trainer builds them (no collective runs)."""
    ranks = []
    for rank in range(tp_size):
        state = ParallelState(world_size=tp_size, rank=rank, tp_size=tp_size, pp_size=1, dp_size=1)
        with torch.device("meta"):
            model = GPTModel(cfg, cfg.padded_vocab_size(tp_size), spec=rank_spec(cfg, state))
        initialize_parameters(model, cfg, SEED)
        ranks.append(dict(model.named_parameters(remove_duplicate=False)))
    return ranks


def _assemble(params: list[torch.nn.Parameter], shape: tuple[int, ...]) -> torch.Tensor:
    """The stored global tensor from every rank's checkpoint blocks (rank 0's copy of a replicated one)."""
    out = torch.full(shape, float("nan")).view(shape[0], -1)
    for param in params[: 1 if not param_info(params[0]).tensor_parallel else None]:
        local = param.detach().view(param.shape[0], -1)
        for b in tp_blocks(param):
            out[b.r0 + b.row_off : b.r1 + b.row_off, b.c0 + b.col_off : b.c1 + b.col_off] = local[
                b.r0 : b.r1, b.c0 : b.c1
            ]
    return out.view(shape)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("style", list(STYLES))
def test_one_record_drives_init_checkpoint_and_vocab_trimming(style, tp_size):
    cfg = _config(style)
    declared = param_shardings(cfg)  # the converters' view: no live sharded model, valid at tp 1
    full, ranks = _full(cfg, tp_size), _shards(cfg, tp_size)
    assert set(declared) == set(full) == set(ranks[0])
    for case_style, name, sharding in CASES:
        if case_style != style:
            continue
        assert declared[name] == sharding, name
        params = [shards[name] for shards in ranks]
        for rank, param in enumerate(params):  # init: each rank's shard is the slice of the full init
            assert param_info(param).sharding == sharding, name
            assert torch.equal(param.detach(), sharding.shard(full[name], rank, tp_size)), (name, rank)
        stored = sharding.stored(full[name])  # checkpoint: the global tensor without padding rows
        assert global_shape(params[0]) == tuple(stored.shape) == sharding.stored_shape(tuple(full[name].shape))
        assert torch.equal(_assemble(params, tuple(stored.shape)), stored), name
        assert torch.equal(sharding.merge([p.detach() for p in params]), full[name]), name  # Megatron's merge
    # vocabulary trimming: tp's padded tables -> the tp 1 padding, the real rows kept, zeros below
    resized = resize_vocab_rows(full, cfg, cfg.padded_vocab_size(1))
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert resized[name].shape[0] == cfg.padded_vocab_size(1) < full[name].shape[0]
        assert torch.equal(resized[name][:VOCAB], full[name][:VOCAB])
        assert not resized[name][VOCAB:].any()
    assert torch.equal(resized["final_norm.weight"], full["final_norm.weight"])
