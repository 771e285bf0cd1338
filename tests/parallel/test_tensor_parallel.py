"""Tensor-parallel layers against their serial versions on gloo ranks; size checks; the RNG tracker."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from config.schema import ParallelConfig
from evaluation.scoring import target_scores
from model.config import ModelConfig
from model.gpt import GPTModel, StreamDropout
from model.init import initialize_parameters
from model.param_info import Sharding, full_shape, param_info
from model.rank_spec import Recompute
from model.tp_hooks import identity
from parallel.data_parallel import DataParallel
from parallel.grad_utils import finalize_model_grads
from parallel.layout import LayoutError, check_tensor_parallel
from parallel.model_builder import rank_spec
from parallel.random import RNGTracker, make_checkpoint_fn
from parallel.state import ParallelState
from parallel.tensor_parallel import tp_comm
from parallel.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from parallel.tp_mappings import CommCounter
from tests.conftest import run_ranks
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.tier("fast")

S, B, H, OUT = 8, 2, 12, 16  # sequence, batch, in features, out features (all divisible by 2 and 4)


def _same_random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _world_tp_state(rank, world_size):
    """tp over the whole world: group None is the default group, so no new_group calls are needed."""
    return ParallelState(world_size=world_size, rank=rank, tp_size=world_size, pp_size=1, dp_size=1)


def _serial_linear(in_features, out_features, bias):
    torch.manual_seed(1)  # same weights on every rank
    return nn.Linear(in_features, out_features, bias=bias)


def _holding_shard_of(layer, serial):
    """`layer` with each parameter set to its shard of `serial`'s (the cut model/init.py makes of a full tensor)."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(param_info(param).local_shard(getattr(serial, name)))
    return layer


def _run_serial(linear, x, grad_out):
    x = x.clone().requires_grad_()
    y = linear(x)
    y.backward(grad_out)
    return y.detach(), x.grad, linear.weight.grad, None if linear.bias is None else linear.bias.grad


def _column_case(rank, world_size, sequence_parallel, num_stacked, bias):
    state = _world_tp_state(rank, world_size)
    comm = tp_comm(state)
    serial = _serial_linear(H, OUT, bias)
    x, grad_out = _same_random(S, B, H, seed=2), _same_random(S, B, OUT, seed=3)
    y, x_grad, w_grad, b_grad = _run_serial(serial, x, grad_out)
    layer = ColumnParallelLinear(H, OUT, comm, bias=bias, sequence_parallel=sequence_parallel, num_stacked=num_stacked)
    _holding_shard_of(layer, serial)
    shard_out = param_info(layer.weight).local_shard  # [.., OUT] -> [.., OUT/tp] along dim 0
    x_local = x.chunk(world_size, 0)[rank] if sequence_parallel else x
    x_local = x_local.clone().requires_grad_()
    y_local = layer(x_local)
    y_local.backward(shard_out(grad_out.movedim(-1, 0)).movedim(0, -1))
    _close(y_local, shard_out(y.movedim(-1, 0)).movedim(0, -1), "column output")
    _close(x_local.grad, x_grad.chunk(world_size, 0)[rank] if sequence_parallel else x_grad, "column dx")
    _close(layer.weight.grad, shard_out(w_grad), "column dW")
    if bias:
        _close(layer.bias.grad, param_info(layer.bias).local_shard(b_grad), "column db")
    assert param_info(layer.weight).tensor_parallel and param_info(layer.weight).sharding.dim == 0
    assert full_shape(layer.weight) == (OUT, H)


def _row_case(rank, world_size, sequence_parallel, bias):
    state = _world_tp_state(rank, world_size)
    comm = tp_comm(state)
    serial = _serial_linear(OUT, H, bias)
    x, grad_out = _same_random(S, B, OUT, seed=4), _same_random(S, B, H, seed=5)
    y, x_grad, w_grad, b_grad = _run_serial(serial, x, grad_out)
    layer = _holding_shard_of(RowParallelLinear(OUT, H, comm, bias=bias, sequence_parallel=sequence_parallel), serial)
    x_local = x.chunk(world_size, -1)[rank].clone().requires_grad_()
    # the trainer's gradient path: main_grad, then finalize_model_grads
    ddp = DataParallel([layer], state, ParallelConfig().grad_bucket_size_mb, distributed_optimizer=False)
    ddp.zero_grad()
    y_local = layer(x_local)
    seq_shard = (lambda t: t.chunk(world_size, 0)[rank]) if sequence_parallel else (lambda t: t)
    y_local.backward(seq_shard(grad_out))
    ddp.finish_grad_sync()
    finalize_model_grads([layer], state, ddp)  # sums the partial bias gradient over tp under SP
    _close(y_local, seq_shard(y), "row output")
    _close(x_local.grad, x_grad.chunk(world_size, -1)[rank], "row dx")
    _close(layer.weight.main_grad, param_info(layer.weight).local_shard(w_grad), "row dW")
    if bias:
        _close(layer.bias.main_grad, b_grad, "row db")
        info = param_info(layer.bias)
        assert not info.tensor_parallel and info.sequence_parallel == sequence_parallel


def _all_layer_cases(rank, world_size):
    """One launch per tp size for every layer case (forking ranks is the slow part on a busy machine)."""
    for sequence_parallel in (False, True):
        _column_case(rank, world_size, sequence_parallel, 1, True)
        _row_case(rank, world_size, sequence_parallel, True)
    _column_case(rank, world_size, False, 2, False)  # SwiGLU fc1: (gate_local, up_local) halves, no bias
    _embedding_case(rank, world_size)
    cfg = ModelConfig(vocab_size=10, make_vocab_size_divisible_by=1)  # 10 not divisible by 4: padded
    _cross_entropy_case(rank, world_size, 10, cfg.padded_vocab_size(world_size))


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_layers_match_serial(world_size):
    """Column (+SP, +SwiGLU halves), Row (+SP), VocabParallelEmbedding and the vocab-parallel cross
    entropy: outputs and input/weight/bias gradients equal the serial layer's."""
    run_ranks(world_size, _all_layer_cases)


def test_swiglu_shard_keeps_gate_up_pairs():
    full = torch.arange(8.0).view(8, 1)  # gate rows 0..3, up rows 4..7
    local = Sharding(dim=0, parts=2).shard(full, rank=1, size=2)
    assert local.flatten().tolist() == [2.0, 3.0, 6.0, 7.0]


def _embedding_case(rank, world_size):
    state = _world_tp_state(rank, world_size)
    torch.manual_seed(1)
    serial = nn.Embedding(20, H)
    ids = torch.randint(0, 20, (B, S), generator=torch.Generator().manual_seed(6))
    grad_out = _same_random(B, S, H, seed=7)
    serial(ids).backward(grad_out)
    layer = _holding_shard_of(VocabParallelEmbedding(20, H, tp_comm(state)), serial)
    y = layer(ids)
    y.backward(grad_out)
    _close(y, serial(ids).detach(), "embedding output")
    _close(layer.weight.grad, param_info(layer.weight).local_shard(serial.weight.grad), "embedding dW")


def _cross_entropy_case(rank, world_size, vocab, padded):
    state = _world_tp_state(rank, world_size)
    logits = _same_random(S, B, padded, seed=8) * 3
    labels = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(9))
    grad_out = _same_random(S, B, seed=10)
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.view(-1, padded), labels.view(-1), reduction="none").view(S, B)
    expected.backward(grad_out)
    local = logits.chunk(world_size, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, tp_comm(state))
    loss.backward(grad_out)
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    _close(loss, expected.detach(), "loss")
    _close(local.grad, full.grad.chunk(world_size, -1)[rank], "dlogits")
    # Evaluation reads the same log-softmax: minus the loss bit for bit, and the argmax over the whole
    # vocabulary (the lowest id among equal maxima: a tie planted across the first and last shard).
    tied = logits.clone()
    tied[0, 0, 0] = tied[0, 0, -1] = tied[0, 0].max() + 1.0
    scores = target_scores(tied.chunk(world_size, -1)[rank], labels, state)
    tied_loss = vocab_parallel_cross_entropy(tied.chunk(world_size, -1)[rank], labels, tp_comm(state))
    assert torch.equal(scores[..., 0], -tied_loss.double())
    assert torch.equal(scores[..., 2], tied.argmax(dim=-1).double()) and scores[0, 0, 2] == 0
    assert torch.equal(scores[..., 1], (tied.argmax(dim=-1) == labels).double())


def test_vocab_parallel_cross_entropy_bf16_single_rank():
    """Without a group (tp = 1) the same function works, and the bf16 gradient comes back in bf16."""
    comm = tp_comm(ParallelState.single())
    logits = _same_random(S, B, 12, seed=11).bfloat16().requires_grad_()
    labels = torch.randint(0, 12, (S, B))
    loss = vocab_parallel_cross_entropy(logits, labels, comm)
    expected = F.cross_entropy(logits.float().view(-1, 12), labels.view(-1), reduction="none").view(S, B)
    _close(loss, expected.detach(), "bf16 loss")
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


# ---- size checks ------------------------------------------------------------------------------------
def _fake_state(tp_size, rank=0):
    """A state for building only (no collective runs while sharding a model)."""
    return ParallelState(world_size=tp_size, rank=rank, tp_size=tp_size, pp_size=1, dp_size=1)


@pytest.mark.parametrize(
    "key, kwargs",
    [
        ("num_attention_heads", dict(num_attention_heads=6, hidden_size=48)),
        ("num_query_groups", dict(num_attention_heads=8, num_query_groups=2, hidden_size=64)),
        ("ffn_hidden_size", dict(ffn_hidden_size=102)),
    ],
)
def test_tp_not_dividing_model_fails_clearly(key, kwargs):
    cfg = ModelConfig(vocab_size=64, **kwargs)
    with pytest.raises(LayoutError, match=rf"model\.{key}=\d+ is not divisible by parallel\.tp_size=4"):
        check_tensor_parallel(cfg, 4, sequence_parallel=False)
    with pytest.raises(ValueError, match=rf"model.{key}"):
        rank_spec(cfg, _fake_state(4))  # refused before any module is built


def test_tp_one_builds_plain_torch_layers():
    cfg = ModelConfig(vocab_size=64, num_layers=1, hidden_size=32)
    with torch.device("meta"):
        model = GPTModel(cfg, 64, spec=rank_spec(cfg, ParallelState.single()))
    assert isinstance(model.layers["0"].mlp.fc1, nn.Linear) and isinstance(model.output_layer, nn.Linear)


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_sharded_init_equals_slice_of_full_init(style):
    extra = (
        {}
        if style == "gpt"
        else dict(
            num_query_groups=2,
            activation="swiglu",
            normalization="rmsnorm",
            position_embedding_type="rope",
            tie_embeddings=False,
        )
    )
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, **extra)
    full_model = GPTModel(cfg, 64)
    initialize_parameters(full_model, cfg, seed=3)
    full = dict(full_model.named_parameters())
    for rank in range(2):
        state = _fake_state(2, rank)
        with torch.device("meta"):
            model = GPTModel(cfg, 64, spec=rank_spec(cfg, state, sequence_parallel=True))
        initialize_parameters(model, cfg, seed=3)
        for name, param in model.named_parameters():
            info = param_info(param)
            expected = info.local_shard(full[name])
            assert torch.equal(param, expected), name
            partial_grad = "norm." in name or name.endswith(("proj.bias", "fc2.bias"))
            assert info.sequence_parallel == partial_grad, name
        if cfg.tie_embeddings:
            assert model.output_layer.weight is model.embedding.word_embeddings.weight


def test_last_stage_tied_copy_keeps_its_attributes():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    state = _fake_state(2, 1)
    with torch.device("meta"):
        model = GPTModel(cfg, 64, layer_ids=[1], pre_process=False, post_process=True, spec=rank_spec(cfg, state))
    weight = model.output_layer.weight
    info = param_info(weight)
    assert info.init_name == "embedding.word_embeddings.weight" and info.shared_embedding and info.embedding_copy
    assert info.tensor_parallel and info.sharding == Sharding(dim=0, valid_rows=64) and tuple(weight.shape) == (32, 32)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_split_layers_and_tp_hooks_agree_by_construction(sequence_parallel):
    """Every split layer, every parameter's record and the loss and sequence-parallel hooks come from the one
    tp group of the rank's description: no layer is plain, none was made for another group or size."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
    state = _fake_state(2, 1)
    spec = rank_spec(cfg, state, sequence_parallel)
    with torch.device("meta"):
        model = GPTModel(cfg, 64, spec=spec)
    hooks = model.tp_hooks
    assert hooks is spec.tp and hooks.tp_size == 2 and hooks.sequence_parallel == sequence_parallel
    assert hooks.loss_fn.keywords["comm"].size == 2 and hooks.loss_fn.keywords["comm"].rank == 1
    assert (hooks.scatter_to_sequence_parallel is not identity) == sequence_parallel
    split = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    layers = [m for m in model.modules() if isinstance(m, split)]
    assert len(layers) == 2 * 4 + 2  # qkv, proj, fc1, fc2 per layer; the embedding and the output layer
    assert all(m.comm.size == 2 and m.comm.rank == 1 for m in layers)
    assert all(getattr(m, "sequence_parallel", sequence_parallel) == sequence_parallel for m in layers)
    plain = [name for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert plain == ["embedding.position_embeddings"]  # replicated: learned positions are not split
    for name, param in model.named_parameters():
        info = param_info(param)
        made_by_split_layer = info.full_shape is not None
        assert (info.tp_rank, info.tp_size) == ((1, 2) if made_by_split_layer else (0, 1)), name
        partial_grad = "norm." in name or name.endswith(("proj.bias", "fc2.bias"))
        assert info.sequence_parallel == (sequence_parallel and partial_grad), name


# ---- RNG tracker ------------------------------------------------------------------------------------
def test_rng_tracker_seeds_and_round_trip():
    tracker = RNGTracker.seeded(1234, tp_rank=1, pp_rank=2, device="cpu")
    default_draw = torch.rand(4)
    assert torch.equal(default_draw, torch.rand(4, generator=torch.Generator().manual_seed(1234 + 200)))
    with tracker.fork():
        forked = torch.rand(4)
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(1234 + 200 + 2718 + 1)))
    saved = tracker.state_dict()
    with tracker.fork():
        expect_forked = torch.rand(3)
    expect_default = torch.rand(3)
    other = RNGTracker("cpu")
    other.load_state_dict(saved)
    with other.fork():
        assert torch.equal(torch.rand(3), expect_forked)
    assert torch.equal(torch.rand(3), expect_default)


def test_rng_tracker_tp_ranks_differ_default_shared():
    draws = []
    for tp_rank in (0, 1):
        tracker = RNGTracker.seeded(7, tp_rank=tp_rank, device="cpu")
        with tracker.fork():
            forked = torch.rand(5)
        draws.append((forked, torch.rand(5)))
    assert not torch.equal(draws[0][0], draws[1][0])
    assert torch.equal(draws[0][1], draws[1][1])


def _dropout_block(tracker):
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(16, 16),
        StreamDropout(0.5, tracker.fork),
        nn.Linear(16, 16),
        nn.Dropout(0.5),
        StreamDropout(0.3, tracker.fork),
    )


def test_recompute_replays_tracker_and_default_masks():
    grads = []
    for recompute in (False, True):
        tracker = RNGTracker.seeded(5, device="cpu")
        block = _dropout_block(tracker)
        x = torch.randn(4, 16, requires_grad=True)
        fn = make_checkpoint_fn(tracker)
        # advance the tracker between forward and backward: recompute must still use the forward's state
        y = fn(block, x) if recompute else block(x)
        with tracker.fork():
            torch.rand(100)
        torch.rand(100)
        y.square().sum().backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    for no_recompute, with_recompute in zip(*grads):
        assert torch.equal(no_recompute, with_recompute)


def test_gpt_recompute_with_dropout_bitwise_equal():
    """Whole GPT, tp = 1 with the attention dropout on the tracker's stream: full and selective recompute give
    the same gradients bit for bit as no recompute."""
    cfg = tiny_config(vocab_size=64, hidden_dropout=0.2, attention_dropout=0.3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    results = []
    for mode in ("none", "full", "selective"):
        tracker = RNGTracker.seeded(11, device="cpu")
        recompute = Recompute(mode, "uniform", 0, make_checkpoint_fn(tracker))
        model = GPTModel(cfg, 64, spec=rank_spec(cfg, ParallelState.single(), rng_tracker=tracker, recompute=recompute))
        model(ids, pos, labels=ids).sum().backward()
        results.append([p.grad for p in model.parameters()])
    for grads in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], grads))


def test_comm_counter_summary_and_reset():
    counter = CommCounter()
    counter.record("layer", "all_reduce", "forward", torch.zeros(4))
    assert counter.count("all_reduce", "forward") == 1
    assert "all_reduce" in counter.summary(num_layers=1)
    counter.reset()
    assert counter.count("all_reduce", "forward") == 0
