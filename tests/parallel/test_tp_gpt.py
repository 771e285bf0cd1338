"""The whole GPT under tensor (and sequence) parallelism trains exactly like one process.

Every case runs a small training loop — meta build from the rank's description (parallel/model_builder.rank_spec)
-> initialize_parameters; fixed token batches; masked mean loss; backward; sequence-parallel grad all-reduce; Adam —
and compares the per-iteration losses of tp = 2 and 4 (with and without sequence parallelism) to tp = 1.
"""

import json

import pytest
import torch
import torch.distributed as dist

from config.schema import OptimConfig, ParallelConfig, TrainConfig
from model.config import ModelConfig
from model.gpt import GPTModel
from model.init import initialize_parameters
from model.rank_spec import Recompute
from optim.optimizer import build_optimizer
from parallel.data_parallel import DataParallel
from parallel.grad_utils import finalize_model_grads
from parallel.model_builder import rank_spec
from parallel.random import RNGTracker, make_checkpoint_fn
from parallel.state import ParallelState
from parallel.tp_mappings import CommCounter
from tests.conftest import run_ranks
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.tier("fast")

ITERS, BATCH, SEED = 10, 2, 1234
NUM_LAYERS = 2


@pytest.fixture(scope="module", autouse=True)
def _warm_meta_device():
    """Building on the meta device first imports torch's reference decompositions (~3 s); do it once in the
    parent so every forked rank inherits them instead of paying again."""
    with torch.device("meta"):
        GPTModel(_model_config("gpt"), 64)


def _model_config(style: str, num_query_groups: int = 2, dropout: float = 0.0) -> ModelConfig:
    llama = {} if style == "gpt" else dict(num_query_groups=num_query_groups, ffn_hidden_size=64)
    return tiny_config(
        style,
        num_layers=NUM_LAYERS,
        num_attention_heads=8,
        seq_length=16,
        make_vocab_size_divisible_by=8,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **llama,
    )


def _build(cfg: ModelConfig, state: ParallelState, sequence_parallel: bool, counter=None, tracker=None, recompute=None):
    # Each tp pads the vocabulary as Megatron does (56 rows at tp 1, 64 at tp 2 and 4); the padding rows are
    # masked out of the logits, so every layout still holds the same model.
    spec = rank_spec(cfg, state, sequence_parallel, tracker, counter, recompute)
    with torch.device("meta"):
        model = GPTModel(cfg, cfg.padded_vocab_size(state.tp_size), spec=spec)
    initialize_parameters(model, cfg, SEED)
    return model


def _batch(cfg: ModelConfig, iteration: int):
    """The same tokens, positions and loss mask on every rank and layout."""
    gen = torch.Generator().manual_seed(iteration)
    # A learnable stream (next = current + 7 mod V) so that the loss visibly falls within ten iterations.
    starts = torch.randint(0, cfg.vocab_size, (BATCH, 1), generator=gen)
    tokens = (starts + 7 * torch.arange(cfg.seq_length + 1)) % cfg.vocab_size
    mask = (torch.rand(BATCH, cfg.seq_length, generator=gen) > 0.2).float()
    positions = torch.arange(cfg.seq_length).expand(BATCH, -1)
    return tokens[:, :-1], positions, tokens[:, 1:], mask


def _backward_as_trainer(model: GPTModel, state: ParallelState, ddp: DataParallel, loss: torch.Tensor) -> None:
    """The trainer's gradient path: main_grad buffers, dp sync, then finalize_model_grads (which sums the
    sequence-parallel norm and bias gradients over tp)."""
    ddp.zero_grad()
    loss.backward()
    ddp.finish_grad_sync()
    finalize_model_grads([model], state, ddp)


def _train(
    model: GPTModel, cfg: ModelConfig, state: ParallelState, counter=None, sequence_parallel: bool = False
) -> list[float]:
    ddp = DataParallel([model], state, ParallelConfig().grad_bucket_size_mb, distributed_optimizer=False)
    optim, train = OptimConfig(lr=3e-3, weight_decay=0.0), TrainConfig(clip_grad=0.0)
    optimizer = build_optimizer([model], ddp, state, optim, train, overlap_param_gather=False)
    losses = []
    for iteration in range(ITERS):
        ids, positions, labels, mask = _batch(cfg, iteration)
        per_token = model(ids, positions, labels=labels)  # [b, s]
        loss = (per_token * mask).sum() / mask.sum()
        _backward_as_trainer(model, state, ddp, loss)
        optimizer.step(3e-3)
        losses.append(loss.item())
        if counter is not None and iteration == 0:
            _check_counts(counter, state.tp_size, sequence_parallel)
    return losses


def _check_counts(counter: CommCounter, tp_size: int, sequence_parallel: bool) -> None:
    """Per transformer layer and micro-batch: 2 all-reduces forward and 2 backward; with sequence
    parallelism 2 all-gathers + 2 reduce-scatters each way and no all-reduce."""
    layer_counts = {
        (kind, phase): counter.count(kind, phase) / NUM_LAYERS
        for kind in ("all_reduce", "all_gather", "reduce_scatter")
        for phase in ("forward", "backward")
    }
    if sequence_parallel:
        expected = {
            ("all_reduce", "forward"): 0,
            ("all_reduce", "backward"): 0,
            ("all_gather", "forward"): 2,
            ("all_gather", "backward"): 2,
            ("reduce_scatter", "forward"): 2,
            ("reduce_scatter", "backward"): 2,
        }
    else:
        expected = {
            ("all_reduce", "forward"): 2,
            ("all_reduce", "backward"): 2,
            ("all_gather", "forward"): 0,
            ("all_gather", "backward"): 0,
            ("reduce_scatter", "forward"): 0,
            ("reduce_scatter", "backward"): 0,
        }
    assert layer_counts == expected, f"tp={tp_size}: {counter.summary(NUM_LAYERS)}"
    assert counter.count("all_reduce", "forward", scope="loss") == 3  # max, target logit, sum of exp
    counter.reset()


def _parity_rank(rank, world_size, style, num_query_groups, out_path):
    """tp = world_size; without and then with sequence parallelism (tp = 1: once)."""
    cfg = _model_config(style, num_query_groups)
    state = ParallelState.create(world_size, 1)
    results = {}
    for sequence_parallel in (False, True) if world_size > 1 else (False,):
        counter = CommCounter() if world_size > 1 else None
        model = _build(cfg, state, sequence_parallel, counter)
        results[str(sequence_parallel)] = _train(model, cfg, state, counter, sequence_parallel)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize(
    "style, tp, num_query_groups",
    [
        ("gpt", 2, None),
        ("gpt", 4, None),
        ("llama", 2, 2),
        ("llama", 4, 4),  # GQA: 8 heads in tp query groups (groups must divide by tp)
    ],
)
def test_tp_gpt_matches_single_process(tmp_path, style, tp, num_query_groups):
    run_ranks(1, _parity_rank, style, num_query_groups, str(tmp_path / "tp1.json"))
    run_ranks(tp, _parity_rank, style, num_query_groups, str(tmp_path / "tp.json"))
    reference = json.loads((tmp_path / "tp1.json").read_text())["False"]
    results = json.loads((tmp_path / "tp.json").read_text())
    assert reference[-1] < reference[0]  # it trains
    for sequence_parallel, losses in results.items():
        for iteration, (expected, actual) in enumerate(zip(reference, losses)):
            assert abs(actual - expected) <= 1e-5 * abs(expected), (
                f"{style} tp={tp} sequence_parallel={sequence_parallel} iteration {iteration}: "
                f"{actual} vs {expected}\n{reference}\n{losses}"
            )


def _dropout_rank(rank, world_size):
    """Dropout > 0 at tp = 2 with sequence parallelism: full recompute replays the tracker-forked masks
    bit for bit, and the loss is identical across tp ranks (dropout on replicated activations agrees)."""
    cfg = _model_config("gpt", dropout=0.2)
    state = ParallelState.create(world_size, 1)
    ids, positions, labels, mask = _batch(cfg, 0)
    for sequence_parallel in (False, True):
        runs = []
        for recompute in (False, True):
            tracker = RNGTracker.seeded(SEED, state.tp_rank, state.pp_rank, device="cpu")
            full = Recompute("full", "uniform", 0, make_checkpoint_fn(tracker)) if recompute else None
            model = _build(cfg, state, sequence_parallel, tracker=tracker, recompute=full)
            loss = (model(ids, positions, labels=labels) * mask).sum() / mask.sum()
            ddp = DataParallel([model], state, ParallelConfig().grad_bucket_size_mb, distributed_optimizer=False)
            _backward_as_trainer(model, state, ddp, loss)
            runs.append((loss.detach(), [p.main_grad.clone() for p in model.parameters()]))
        assert torch.equal(runs[0][0], runs[1][0])
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), f"sp={sequence_parallel}"
        losses = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(losses, runs[0][0])
        assert all(torch.equal(losses[0], other) for other in losses), f"sp={sequence_parallel}: {losses}"


def test_tp_dropout_recompute_and_replicated_masks():
    run_ranks(2, _dropout_rank)
