"""Helpers of the fault-class tests (test_fault_*.py): run the trainer, expect exactly one error line."""

from __future__ import annotations

import os
import shutil

import numpy as np

import pretrain_gpt
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.conftest import tiny_train_args

QUICK = ("train.train_iters=2", "train.eval_iters=0", "optim.lr_warmup_iters=0")


def run_main(corpus: dict, run_dir: str, *extra: str, config: str | None = None) -> int:
    """pretrain_gpt.main on the tiny corpus (`config` replaces the default YAML file)."""
    return pretrain_gpt.main(
        ["--config", config or pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)]
    )


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
