"""Helpers of the fault-class tests (test_fault_*.py): run the trainer, expect exactly one error line."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Sequence

import numpy as np

import pretrain_gpt
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.conftest import free_port, tiny_train_args

QUICK = ("train.train_iters=2", "train.eval_iters=0", "optim.lr_warmup_iters=0")


def run_main(corpus: dict, run_dir: str, *extra: str, config: str | None = None) -> int:
    """pretrain_gpt.main on the tiny corpus (`config` replaces the default YAML file)."""
    return pretrain_gpt.main(
        ["--config", config or pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)]
    )


def _trainer_rank(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os._exit(pretrain_gpt.main(argv))  # its code, without gloo's teardown


def run_trainer_ranks(corpus: dict, run_dir: str, world_size: int, ranks: Sequence[int], *extra: str) -> list:
    """`run_main` as ranks `ranks` of a `world_size`-rank job on this node, each forked from this process (no
    launcher: a rank left out never starts, as on a node that failed to). Returns their exit codes, in order."""
    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)]
    port, context = free_port(), multiprocessing.get_context("fork")
    processes = [context.Process(target=_trainer_rank, args=(rank, world_size, port, argv)) for rank in ranks]
    for process in processes:
        process.start()
    for process in processes:
        process.join(240)
        if process.exitcode is None:
            process.kill()
    return [process.exitcode for process in processes]


def one_error_line(capsys) -> str:
    """The one `error:` line on stderr (no traceback anywhere)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def copy_corpus(corpus: dict, root: str, token_map=None) -> str:
    """A copy of the tiny corpus (tokens passed through `token_map`), as int32 so negative ids fit."""
    source = IndexedDataset(corpus["data_prefix"])
    prefix = os.path.join(root, "copy_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for i in range(len(source)):
        tokens = np.array(source[i], dtype=np.int32)
        builder.add_document(token_map(tokens) if token_map else tokens)
    builder.finalize(prefix + ".idx")
    return prefix


def copy_tree(source: str, target: str) -> str:
    shutil.copytree(source, target)
    return target
