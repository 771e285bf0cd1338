"""Config loading: strict keys with suggestions, types, values, cross-section layout checks."""
import os
import subprocess
import sys

import pytest

from parallel.layout import LayoutError, layout_from_config
from parallel.pipeline.plan import build_plan
from parallel.pipeline.schedules import build_schedule
from tests.conftest import REPO_ROOT
from training.config import ConfigError, load_config


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
             "model.hidden_dropout=1.5": r"model\.hidden_dropout=1\.5",
             "train.micro_batch_size=0": r"train\.micro_batch_size=0 must be >= 1"}
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    with pytest.raises(LayoutError, match=r"model\.num_layers=4 is not divisible by parallel\.pp_size \* "
                                          r"parallel\.vp_size = 3 \* 1"):
        layout(3, "model.num_layers=4", "parallel.pp_size=3")
    with pytest.raises(ConfigError, match=r"model\.hidden_size=100 is not divisible by model\.num_attention_heads=3"):
        load_config(None, ["model.hidden_size=100", "model.num_attention_heads=3"])


def test_data_path_needs_its_tokenizer_files():
    with pytest.raises(ConfigError, match=r"GPT2BPETokenizer needs data\.vocab_file and data\.merge_file"):
        load_config(None, ["data.data_path=[corpus_text_document]"])
    with pytest.raises(ConfigError, match=r"SentencePieceTokenizer needs data\.tokenizer_model"):
        load_config(None, ["data.data_path=[c]", "data.tokenizer_type=SentencePieceTokenizer"])


def layout(world_size, *overrides):
    return layout_from_config(load_config(None, list(overrides)), world_size)


def test_virtual_stages_select_the_interleaved_schedule():
    assert layout(2, "parallel.pp_size=2", "parallel.vp_size=2").schedule == "interleaved"
    assert layout(1, "parallel.schedule=gpipe").schedule == "1f1b"  # one stage: forward, backward per micro-batch
    with pytest.raises(LayoutError, match=r"parallel\.vp_size=2 needs parallel\.schedule=interleaved .*got "
                                          r"parallel\.schedule=gpipe"):
        layout(2, "parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=gpipe")
    with pytest.raises(LayoutError, match=r"parallel\.vp_size=2 needs parallel\.pp_size > 1"):
        layout(1, "parallel.vp_size=2")


def test_layout_checks_name_both_numbers():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by parallel\.tp_size \* "
                                          r"parallel\.pp_size = 2 \* 2"):
        layout(6, "parallel.tp_size=2", "parallel.pp_size=2")
    assert layout(8, "parallel.tp_size=2", "parallel.pp_size=2").dp_size == 2
    with pytest.raises(LayoutError, match=r"model\.num_attention_heads=4 is not divisible by parallel\.tp_size=3"):
        layout(3, "parallel.tp_size=3", "model.num_attention_heads=4")
    with pytest.raises(LayoutError, match=r"train\.global_batch_size=10 is not divisible by "
                                          r"train\.micro_batch_size \* dp = 4 \* 1"):
        layout(1, "train.global_batch_size=10", "train.micro_batch_size=4")
    with pytest.raises(LayoutError, match=r"multiple of parallel\.pp_size=2: e\.g\. train\.global_batch_size = "
                                          r"8, 16, 24"):
        layout(2, "parallel.pp_size=2", "parallel.vp_size=2", "train.global_batch_size=12",
               "train.micro_batch_size=4")
    with pytest.raises(LayoutError, match=r"model\.num_layers=4 is not divisible by parallel\.pp_size \* "
                                          r"parallel\.vp_size = 3 \* 2"):
        layout(3, "parallel.pp_size=3", "parallel.vp_size=2")
    with pytest.raises(LayoutError, match=r"parallel\.tp_size=0 must be >= 1"):
        layout(1, "parallel.tp_size=0")


@pytest.mark.parametrize("overrides, world_size", [
    (["parallel.pp_size=4", "parallel.vp_size=2", "parallel.schedule=gpipe"], 4),
    (["parallel.pp_size=4", "parallel.vp_size=2", "train.global_batch_size=24", "train.micro_batch_size=4"], 4),
    (["parallel.pp_size=1", "parallel.vp_size=2"], 1),
    (["parallel.schedule=zigzag", "parallel.pp_size=2"], 2),
])
def test_every_entry_point_gives_the_same_answer(overrides, world_size, tmp_path):
    """The trainer (before any work), tools/model_stats.py, the schedule builder and the pipeline plan all
    go through parallel/layout.py: the same input gives the same error line everywhere."""
    config = load_config(os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"), overrides)  # the trainer's default
    with pytest.raises(LayoutError) as expected:
        layout_from_config(config, world_size)
    par = config.parallel
    num_micro = config.train.global_batch_size // config.train.micro_batch_size
    with pytest.raises(LayoutError) as from_schedule:
        build_schedule(par.schedule, par.pp_size, 0, num_micro, par.vp_size)
    with pytest.raises(LayoutError) as from_plan:
        build_plan(par.schedule, par.pp_size, 0, num_micro, par.vp_size)
    # The same rule and numbers; only the trainer knows the batch sizes to suggest after the colon.
    assert str(expected.value).startswith(str(from_schedule.value).split(": ")[0])
    assert str(from_plan.value) == str(from_schedule.value)
    env = {**os.environ, "WORLD_SIZE": str(world_size)}
    trainer = subprocess.run([sys.executable, "pretrain_gpt.py", *overrides, f"run.dir={tmp_path}/run"],
                             cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    stats = subprocess.run([sys.executable, "tools/model_stats.py", "--config", "configs/gpt_tiny.yaml",
                            "model.vocab_size=257", *overrides], cwd=REPO_ROOT, capture_output=True, text=True)
    for result in (trainer, stats):
        assert result.returncode == 2 and result.stderr.strip() == f"error: {expected.value}", result.stderr
    assert not (tmp_path / "run").exists()


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
