"""The `loss` task: the mean loss over a split of a .bin/.idx dataset, computed as the trainer's validation
computes it (parallel.pipeline.forward.evaluate: the validation forward of the layout, loss = the mean over global
batches of the mean over micro-batches of each micro-batch's mean token loss, averaged over dp).

The split is built as the trainer builds its splits (data/builder.py, the run's seed, sequence length and
sample options): `all` takes every document of the prefix as one validation split; train / valid / test take
that split of data.split, so `--split valid` with the run's data and train.eval_iters batches gives the
validation loss the run logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from config.schema import Config
from data.builder import SPLIT_NAMES, build_train_valid_test_datasets
from data.microbatch import Microbatch
from evaluation.documents import EvalInputError
from evaluation.tasks import Figures, capped_perplexity
from operations.guards import agree, bad_token_message, find_bad_token
from operations.startup import DistEnv, build_options, data_iterator
from parallel.pipeline.forward import ForwardOnlyContext, evaluate

if TYPE_CHECKING:
    from data.blended_dataset import BlendedDataset
    from data.gpt_dataset import GPTDataset

SPLITS = ("all", *SPLIT_NAMES)


class ReportedError(EvalInputError):
    """An input error found on one rank of several: that rank reports it (the others stop quietly)."""

    def __init__(self, message: str, reporting_rank: int):
        super().__init__(message)
        self.reporting_rank = reporting_rank


def dataset_split(config: Config, prefix: str, split: str, env: DistEnv) -> GPTDataset | BlendedDataset:
    """One epoch of `split` of the dataset at `prefix` (rank 0 writes the index caches first)."""
    if split not in SPLITS:
        raise EvalInputError(f"--split={split} is not one of {', '.join(SPLITS)}")
    data = config.data
    options = build_options(data)
    ratios, index = ("0,1,0", 1) if split == "all" else (data.split, SPLIT_NAMES.index(split))
    # None builds one epoch of the split (data/builder.py); 0 builds nothing.
    counts = cast(tuple[int, int, int], tuple(None if k == index else 0 for k in range(3)))

    def build() -> GPTDataset | BlendedDataset | None:
        return build_train_valid_test_datasets(
            [prefix], ratios, config.model.seq_length, config.train.seed, counts, data.cache_dir, options
        )[index]

    dataset, problem = None, [""]
    if env.rank == 0:
        try:
            dataset = build()
        except (ValueError, OSError) as err:  # (an empty split, a split without tokens) named by rank 0 ...
            problem[0] = str(err)
    if env.world_size > 1:  # ... and known to every rank, none left waiting for the index caches
        env.comm.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ReportedError(problem[0], 0)
    if env.rank != 0:
        dataset = build()
    if dataset is None:
        raise EvalInputError(f"{prefix}: data.split={data.split!r} gives the {split} split no documents")
    return dataset


def loss_task(
    ctx: ForwardOnlyContext,
    config: Config,
    dataset: GPTDataset | BlendedDataset,
    batches: int | None,
    eod: int,
    env: DistEnv,
) -> Figures:
    """Mean validation loss over the first `batches` global batches of `dataset` (None: every whole global
    batch of its epoch); a token id outside the model's vocabulary stops every rank, one of them naming it."""
    train, state = config.train, ctx.state
    available = len(dataset) // train.global_batch_size
    batches = available if batches is None else batches
    if batches < 1 or batches > available:
        raise EvalInputError(
            f"the split holds {len(dataset)} samples of {config.model.seq_length} tokens: {available} global batches "
            f"of train.global_batch_size={train.global_batch_size}, {batches} asked"
        )
    vocab_size = config.model.vocab_size
    assert vocab_size is not None

    def check(microbatches: list[Microbatch], batch: int) -> None:
        found = find_bad_token(microbatches, vocab_size)
        verdict = agree(state, env.device, 0, False, found is not None)
        if verdict.bad_token_rank >= 0:
            first = batch * train.global_batch_size  # the samples the batches before this one consumed
            message = (
                ""
                if found is None
                else bad_token_message(
                    found, dataset, first, train.micro_batch_size, state.dp_rank, state.dp_size, vocab_size, "evaluated"
                )
            )
            raise ReportedError(message, verdict.bad_token_rank)

    data = data_iterator(config, dataset, 0, state.dp_rank, state.dp_size, eod, num_workers=0)
    loss = evaluate(ctx, data, batches, check)
    return {
        "task": "loss",
        "convention": (
            "the trainer's validation: mean over global batches of the mean over micro-batches of each "
            "micro-batch's mean token loss (loss mask applied), averaged over dp; perplexity = exp(min(20, loss))"
        ),
        "seq_length": config.model.seq_length,
        "loss": loss,
        "perplexity": capped_perplexity(loss),
        "batches": batches,
        "samples": batches * train.global_batch_size,
        "tokens": batches * train.global_batch_size * config.model.seq_length,
    }
