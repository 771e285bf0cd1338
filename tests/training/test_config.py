"""Config loading: strict keys with suggestions, types, values, cross-section layout checks."""
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from training.config import ConfigError, load_config, validate_layout


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_and_overrides(tmp_path):
    config = load_config(write(tmp_path, "model:\n  num_layers: 4\n"),
                         ["train.train_iters=7", "optim.lr_warmup_iters=2", "optim.lr=1e-4", "optim.min_lr=1e-5", "parallel.sequence_parallel=true",
                          "data.data_path=[0.3, a, 0.7, b]", "data.vocab_file=v.json", "data.merge_file=m.txt"])
    assert config.train.train_iters == 7 and config.optim.lr == 1e-4
    assert config.parallel.sequence_parallel is True
    assert config.data.data_path == [0.3, "a", 0.7, "b"]
    assert isinstance(config.optim.min_lr, float)


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key train\.micro_batchsize; did you mean "
                                          r"train\.micro_batch_size\?"):
        load_config(write(tmp_path, "train:\n  micro_batchsize: 4\n"))
    with pytest.raises(ConfigError, match=r"did you mean parallel\.tp_size"):
        load_config(None, ["parallel.tp_sise=2"])
    with pytest.raises(ConfigError, match=r"unknown config section 'trian'; did you mean train"):
        load_config(write(tmp_path, "trian:\n  seed: 1\n"))


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.num_layers='four' has the wrong type: expected int"):
        load_config(write(tmp_path, "model:\n  num_layers: four\n"))
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=2\.5 has the wrong type"):
        load_config(None, ["train.micro_batch_size=2.5"])
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel=1 has the wrong type"):
        load_config(None, ["parallel.sequence_parallel=1"])


def test_impossible_values(tmp_path):
    cases = {"train.precision=fp8": r"train\.precision='fp8' is not one of fp32, bf16, fp16",
             "parallel.schedule=zigzag": r"parallel\.schedule='zigzag'",
             "model.hidden_dropout=1.5": r"model\.hidden_dropout=1\.5",
             "train.micro_batch_size=0": r"train\.micro_batch_size=0 must be >= 1"}
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    with pytest.raises(ConfigError, match=r"model\.num_layers=4 is not divisible by parallel\.pp_size \* "
                                          r"parallel\.vp_size = 3 \* 1"):
        load_config(None, ["model.num_layers=4", "parallel.pp_size=3"])
    with pytest.raises(ConfigError, match=r"model\.hidden_size=100 is not divisible by model\.num_attention_heads=3"):
        load_config(None, ["model.hidden_size=100", "model.num_attention_heads=3"])


def test_data_path_needs_its_tokenizer_files():
    with pytest.raises(ConfigError, match=r"GPT2BPETokenizer needs data\.vocab_file and data\.merge_file"):
        load_config(None, ["data.data_path=[corpus_text_document]"])
    with pytest.raises(ConfigError, match=r"SentencePieceTokenizer needs data\.tokenizer_model"):
        load_config(None, ["data.data_path=[c]", "data.tokenizer_type=SentencePieceTokenizer"])


def test_virtual_stages_select_the_interleaved_schedule():
    config = load_config(None, ["parallel.pp_size=2", "parallel.vp_size=2"])
    assert config.parallel.schedule == "interleaved"
    with pytest.raises(ConfigError, match=r"parallel\.vp_size=2 needs parallel\.schedule=interleaved \(got gpipe\)"):
        load_config(None, ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=gpipe"])


def test_layout_checks_name_both_numbers():
    config = load_config(None, ["parallel.tp_size=2", "parallel.pp_size=2"])
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by parallel\.tp_size \* "
                                          r"parallel\.pp_size = 2 \* 2"):
        validate_layout(config, 6)
    assert validate_layout(config, 8) == 2
    config = load_config(None, ["parallel.tp_size=3", "model.num_attention_heads=4"])
    with pytest.raises(ConfigError, match=r"model\.num_attention_heads=4 is not divisible by parallel\.tp_size=3"):
        validate_layout(config, 3)
    config = load_config(None, ["train.global_batch_size=10", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"train\.global_batch_size=10 is not divisible by "
                                          r"train\.micro_batch_size \* dp = 4 \* 1"):
        validate_layout(config, 1)
    config = load_config(None, ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=interleaved",
                                "train.global_batch_size=12", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"multiple of parallel\.pp_size=2"):
        validate_layout(config, 2)


def test_entry_point_rejects_bad_config_before_any_work(tmp_path):
    result = subprocess.run([sys.executable, "pretrain_gpt.py", "train.micro_batchsize=3",
                             f"run.dir={tmp_path}/run"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "did you mean train.micro_batch_size" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_every_shipped_config_loads():
    import glob
    import os
    paths = glob.glob(os.path.join(REPO_ROOT, "configs", "**", "*.yaml"), recursive=True)
    assert len(paths) >= 16
    for path in paths:
        load_config(path)
