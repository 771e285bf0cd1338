"""Tokenizers through the converters: files copied into OUT/tokenizer/ and named relative to OUT (moving the
folder keeps to-hf, generate and training working), tokenizer.json (HuggingFaceTokenizer) and Megatron's
NullTokenizer in every direction."""

import json
import os
import shutil
import sys

import pytest
import torch
import yaml

from config.schema import load_config
from convert.megatron import load_megatron_checkpoint
from convert.model_weights import load_global_state
from data.tokenizers import HuggingFaceTokenizer, build_tokenizer
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT
from tests.data.test_hf_tokenizer import make_tokenizer_json
from tests.tools.test_convert_checkpoint import (
    GPT,
    LLAMA,
    run_config,
    run_tool,
    save_single,
    tokenizer_files,  # noqa: F401  (the fixture)
)
from tools.convert_checkpoint import from_hf, to_hf, to_megatron

pytestmark = pytest.mark.tier("fast")


def test_a_moved_conversion_keeps_its_tokenizer(tokenizer_files, tmp_path, monkeypatch):  # noqa: F811
    """from-hf copies the tokenizer into OUT/tokenizer/ and names it relative to OUT: after moving OUT,
    to-hf, generate and a training config (load_config of OUT/config.yaml) still find it."""
    save_single(run_config(GPT, tokenizer_files), str(tmp_path / "ckpt"))
    to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    from_hf(str(tmp_path / "hf"), str(tmp_path / "out"), tp=2)
    written = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["data"]
    assert (written["vocab_file"], written["merge_file"]) == ("tokenizer/vocab.json", "tokenizer/merges.txt")
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(tmp_path / "out"), str(moved))
    monkeypatch.chdir(tmp_path)  # neither the old nor the new folder
    saved, _ = load_global_state(str(moved))
    assert saved["data"]["vocab_file"] == str(moved / "tokenizer" / "vocab.json")
    to_hf(str(moved), str(tmp_path / "hf2"))
    assert (tmp_path / "hf2" / "vocab.json").read_bytes() == (tmp_path / "hf" / "vocab.json").read_bytes()
    result = run_cli(
        [sys.executable, os.path.join(REPO_ROOT, "tools/generate.py"), "--checkpoint", str(moved)]
        + ["--prompt", "import os", "--max-new-tokens", "3", "--greedy"],
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    assert result.returncode == 0 and result.stdout.startswith("import os"), result.stderr
    data = load_config(str(moved / "config.yaml")).data  # what a training run from that file builds
    assert data.vocab_file == str(moved / "tokenizer" / "vocab.json")
    assert build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file).vocab_size == 300
    # the working directory comes first: a relative path that exists there is kept as given
    (tmp_path / "tokenizer").mkdir()
    shutil.copy(moved / "tokenizer" / "vocab.json", tmp_path / "tokenizer" / "vocab.json")
    data = load_config(str(moved / "config.yaml")).data
    assert data.vocab_file == "tokenizer/vocab.json" and data.merge_file == str(moved / "tokenizer" / "merges.txt")


def test_huggingface_tokenizer_json_round_trips(tmp_path):
    """A folder with tokenizer.json only (Llama-3 style): from-hf carries it, to-hf writes it back for
    AutoTokenizer with bos/eos = its end of document, to-megatron names its folder in Megatron's args."""
    import transformers

    source = tmp_path / "tok"
    source.mkdir()
    make_tokenizer_json(source, ["<|begin_of_text|>", "<|end_of_text|>"])
    (source / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>"})
    )
    tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(source)}
    save_single(run_config(LLAMA, tokenizer), str(tmp_path / "ckpt"))
    assert run_tool("to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")).returncode == 0
    assert json.load(open(tmp_path / "hf" / "config.json"))["eos_token_id"] == 1
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert sorted(os.listdir(tmp_path / "ours" / "tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]
    to_hf(str(tmp_path / "ours"), str(tmp_path / "hf2"))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf2"))
    text = "def walk(top, topdown=True):\n    héllo"
    ours = HuggingFaceTokenizer(str(source))
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf_tokenizer.eos_token_id == ours.eod == 1
    to_megatron(str(tmp_path / "ours"), str(tmp_path / "megatron"))
    args = torch.load(tmp_path / "megatron" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)[
        "args"
    ]
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == str(
        tmp_path / "ours" / "tokenizer"
    )
    cfg, _, data = load_megatron_checkpoint(str(tmp_path / "megatron"))
    assert data["tokenizer_type"] == "HuggingFaceTokenizer" and cfg.vocab_size == 300


def test_null_tokenizer_exports_weights_and_converts_back(tmp_path):
    """NullTokenizer (no files): to-hf writes weights and config.json with a warning; to-megatron stores
    Megatron's vocab_size (ours - 1) and from-megatron carries NullTokenizer with our size back."""
    config = run_config(GPT, {"tokenizer_type": "NullTokenizer"})
    save_single(config, str(tmp_path / "ckpt"))
    result = run_tool("to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert result.returncode == 0 and "NullTokenizer (text = ids, no files)" in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors"]
    to_megatron(str(tmp_path / "ckpt"), str(tmp_path / "megatron"))
    args = torch.load(tmp_path / "megatron" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)[
        "args"
    ]
    assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 299)
    result = run_tool("from-megatron", str(tmp_path / "megatron"), str(tmp_path / "back"))
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    saved = yaml.safe_load((tmp_path / "back" / "config.yaml").read_text())
    assert saved["data"]["tokenizer_type"] == "NullTokenizer" and saved["model"]["vocab_size"] == 300
    assert not os.path.exists(tmp_path / "back" / "tokenizer")
