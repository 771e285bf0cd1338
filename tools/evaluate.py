"""Zero-shot evaluation of a checkpoint (any layout) or a transformers folder: WikiText and LAMBADA as Megatron-LM
and lm-evaluation-harness score them, and the loss over a .bin/.idx dataset split as validation computes it.

    python tools/evaluate.py wikitext --data wiki.test.tokens --checkpoint runs/gpt2/checkpoints
    python tools/evaluate.py lambada --data lambada_test.jsonl --hf hf/gpt2 --json
    python tools/evaluate.py loss --data data/corpus_text_document --checkpoint runs/x/checkpoints --split valid
    torchrun --nproc-per-node 4 tools/evaluate.py lambada --data lambada_test.jsonl --checkpoint CKPT \\
        parallel.tp_size=2 parallel.pp_size=2

Overrides are `section.key=value` on the run config (the checkpoint's saved one): parallel.* choose the
layout (any tp, pp, vp, cp; dp = the rest of the world), train.micro_batch_size the windows per micro-batch,
eval.seq_length the window (default: the model's positions), eval.overlapping_eval Megatron's WikiText
overlap (32). Files are never downloaded: docs/evaluation.md says where wiki.test.tokens and
lambada_test.jsonl are published and what every figure means. With --json one record goes to stdout;
otherwise a table, and a progress bar on stderr when it is a terminal. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from operations.openmp_wait import passive_wait_default

# Before torch is imported: libgomp reads its wait policy once, when torch loads it (operations/openmp_wait.py).
os.environ.update(passive_wait_default(os.environ, sys.modules))

import torch.distributed as dist

from data.indexed_dataset import IndexedDataset
from evaluation.dataset_loss import SPLITS, ReportedError, dataset_split, loss_task
from evaluation.documents import EvalInputError, read_lambada, read_wikitext
from evaluation.model_source import (
    DTYPES,
    INPUT_ERRORS,
    ModelSource,
    load_model,
    run_config,
    run_tokenizer,
    window_length,
)
from evaluation.scoring import WindowScorer
from evaluation.tasks import Task, lambada_task, wikitext_task
from model.precision import precision_dtype
from operations.guards import EXIT_HUNG
from operations.startup import DistEnv, check_devices, init_distributed
from parallel.group_setup import GroupCreationTimeout
from parallel.layout import layout_from_config
from training.logging import json_safe

if TYPE_CHECKING:
    from config.schema import Config
    from evaluation.model_source import TextTokenizer
    from evaluation.tasks import Figures

TASKS = ("wikitext", "lambada", "loss")
SKIPPED_IN_TABLE = ("task", "convention")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--data", required=True, help="wiki.test.tokens, lambada_test.jsonl, or a .bin/.idx prefix")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", help="checkpoints folder or iter_XXXXXXX folder of this trainer")
    model.add_argument("--hf", help="transformers model folder (GPT-2 or Llama, with its tokenizer)")
    parser.add_argument("--json", action="store_true", help="one JSON record on stdout")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--split", choices=SPLITS, default="all", help="loss: which split of the dataset")
    parser.add_argument("--batches", type=int, default=None, help="loss: global batches (default: one epoch)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.tp_size=2")
    return parser.parse_intermixed_args(argv)


def dataset_prefix(path: str) -> str:
    """The prefix of a .bin/.idx pair (given as the prefix or either file), opened once to check it."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise EvalInputError(f"{prefix + suffix}: no such file (the loss task reads a .bin/.idx dataset)")
    IndexedDataset(prefix)  # a malformed pair is refused here, before any rank waits on another
    return prefix


def prepare_task(args: argparse.Namespace, config: Config, tokenizer: TextTokenizer) -> Task | None:
    """The wikitext / lambada task of --data, tokenized and windowed (None for loss)."""
    if args.task == "loss":
        return None
    window = window_length(config)
    if args.task == "wikitext":
        text = read_wikitext(args.data)
        return wikitext_task(text, tokenizer.encode, tokenizer.eod, window, config.eval.overlapping_eval)
    return lambada_task(read_lambada(args.data), tokenizer.encode, tokenizer.eod, window)


class ProgressBar:
    """Windows scored so far, on stderr (a terminal only, rank 0)."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled = label, enabled

    def __call__(self, done: int, total: int) -> None:
        if self.enabled:
            filled = 30 * done // max(total, 1)
            end = "\n" if done >= total else ""
            print(
                f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} windows", end=end, file=sys.stderr
            )


def evaluate(args: argparse.Namespace, env_holder: list[DistEnv]) -> Figures:
    """Every check of the input, then the model, then the task's figures (with where they come from)."""
    data_prefix = dataset_prefix(args.data) if args.task == "loss" else None
    config, source = run_config(args.checkpoint, args.hf, args.overrides)
    layout = layout_from_config(config, int(os.environ.get("WORLD_SIZE", "1")))
    tokenizer = run_tokenizer(config)
    task = prepare_task(args, config, tokenizer)
    env = init_distributed(check_devices(config.train, os.environ), config.train.num_threads, announce_threads=False)
    env_holder.append(env)
    ctx = load_model(config, source, layout, env, precision_dtype(args.dtype))
    if task is None:
        assert data_prefix is not None
        dataset = dataset_split(config, data_prefix, args.split, env)
        figures = loss_task(ctx, config, dataset, args.batches, tokenizer.eod, env)
    else:
        progress = ProgressBar(args.task, env.rank == 0 and sys.stderr.isatty())
        figures = task.run(WindowScorer(ctx, tokenizer.eod, progress))
    return {**figures, **describe_source(source, args, layout.describe())}


def describe_source(source: ModelSource, args: argparse.Namespace, layout: str) -> Figures:
    return {
        "iteration": source.iteration,
        "model": source.describe(),
        "data": os.path.abspath(args.data),
        "dtype": args.dtype,
        "layout": layout,
    }


def print_table(record: Figures) -> None:
    print(f"{record['task']} of {record['data']}: {record['model']} ({record['dtype']}, {record['layout']})")
    for key, value in record.items():
        if key in SKIPPED_IN_TABLE or key in ("data", "model", "dtype", "layout"):
            continue
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        print(f"  {key:<22} {shown}")
    print(f"convention: {record['convention']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env_holder: list[DistEnv] = []
    try:
        record = evaluate(args, env_holder)
    except GroupCreationTimeout as err:  # a rank that never joined: one line per rank, as the trainer says it
        print(f"error: {err}", file=sys.stderr)
        return EXIT_HUNG
    except ReportedError as err:  # found on one rank: that rank names it
        if env_holder and env_holder[0].rank == err.reporting_rank:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except INPUT_ERRORS as err:
        rank = env_holder[0].rank if env_holder else int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if env_holder[0].rank == 0:
        if args.json:
            print(json.dumps(json_safe(record)))  # an overflowing perplexity: null, named under "nonfinite"
        else:
            print_table(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
