"""Megatron-LM flags and misspelt keys: one line naming the key to write; the docs table is the code's table."""

import os
import subprocess
import sys

import pytest

import pretrain_gpt
from config.data_config import DataConfig
from config.megatron_flags import markdown_table
from config.schema import ConfigError, load_config
from data.tokenizers import TOKENIZER_TYPES
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("fast")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--train-iters", "50"], "--train-iters is a Megatron-LM flag: write the override train.train_iters=50"),
        (["--bf16", "train.seed=3"], "--bf16 is a Megatron-LM flag: write the override train.precision=bf16"),
        (
            ["--tensor-model-parallel-size=2"],
            "--tensor-model-parallel-size is a Megatron-LM flag: write the override parallel.tp_size=2",
        ),
        (["--data-cache-path", "/c"], "--data-cache-path is a Megatron-LM flag: write the override data.cache_dir=/c"),
    ],
)
def test_megatron_flags_name_the_override(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {line} (docs/megatron_flags.md maps every flag to its key)"]


def test_unknown_option_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--frobnicate", "3"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown option --frobnicate: the trainer takes --config FILE and section.key=value overrides"
    ]


def test_docs_table_is_generated_from_the_code():
    with open(os.path.join(REPO_ROOT, "docs", "megatron_flags.md"), encoding="utf-8") as handle:
        assert handle.read() == markdown_table(), "regenerate: python -m config.megatron_flags > docs/megatron_flags.md"


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.iters=5", "train.train_iters"),
        ("train.train-iters=5", "train.train_iters"),
        ("parallel.tp=2", "parallel.tp_size"),
        ("model.layers=2", "model.num_layers"),
        ("optim.warmup=3", "optim.lr_warmup_iters"),
        ("data.data_cache_path=x", "data.cache_dir"),  # Megatron's name
        ("data.index_cache_dir=x", "data.cache_dir"),
        ("train.tensor_model_parallel_size=2", "parallel.tp_size"),  # another section
        ("train.micro_batchsize=3", "train.micro_batch_size"),
    ],
)
def test_closest_key(override, suggestion):
    with pytest.raises(ConfigError, match=rf"; did you mean {suggestion}\?$"):
        load_config(None, [override])


def test_nothing_close_lists_the_keys():
    with pytest.raises(ConfigError, match=r"unknown config key train\.foo; known keys: micro_batch_size, "):
        load_config(None, ["train.foo=1"])


def test_split_paths_and_data_path_exclude_each_other():
    with pytest.raises(ConfigError, match="data.data_path and data.train_data_path are both set"):
        load_config(None, ["data.data_path=[a]", "data.train_data_path=[b]", "data.vocab_file=v", "data.merge_file=m"])
    with pytest.raises(ConfigError, match="without data.train_data_path"):
        load_config(None, ["data.valid_data_path=[b]", "data.vocab_file=v", "data.merge_file=m"])
    with pytest.raises(ConfigError, match="so HuggingFaceTokenizer needs data.tokenizer_model"):
        load_config(None, ["data.train_data_path=[b]", "data.tokenizer_type=HuggingFaceTokenizer"])
    assert DataConfig.TOKENIZER_TYPES == TOKENIZER_TYPES  # config/ does not import data/'s tokenizers
