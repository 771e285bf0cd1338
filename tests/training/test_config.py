"""Config loading: strict keys with suggestions, types, values, cross-section layout checks."""

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from config.schema import Config, ConfigError, load_config
from model.config import check_declared, key_spec
from parallel.layout import LayoutError, layout_from_config
from parallel.pipeline.plan import build_plan
from parallel.pipeline.schedules import build_schedule
from tests.conftest import REPO_ROOT, assert_entry_points_refuse

pytestmark = pytest.mark.tier("fast")


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_and_overrides(tmp_path):
    config = load_config(
        write(tmp_path, "model:\n  num_layers: 4\n"),
        [
            "train.train_iters=7",
            "optim.lr_warmup_iters=2",
            "optim.lr=1e-4",
            "optim.min_lr=1e-5",
            "parallel.sequence_parallel=true",
            "data.data_path=[0.3, a, 0.7, b]",
            "data.vocab_file=v.json",
            "data.merge_file=m.txt",
        ],
    )
    assert config.train.train_iters == 7 and config.optim.lr == 1e-4
    assert config.parallel.sequence_parallel is True
    assert config.data.data_path == [0.3, "a", 0.7, "b"]
    assert isinstance(config.optim.min_lr, float)


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"unknown config key train\.micro_batchsize; did you mean "
        r"train\.micro_batch_size\?",
    ):
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
    cases = {
        "train.precision=fp8": r"train\.precision='fp8' is not one of fp32, bf16, fp16",
        "model.hidden_dropout=1.5": r"model\.hidden_dropout=1\.5",
        "train.micro_batch_size=0": r"train\.micro_batch_size=0 must be >= 1",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    with pytest.raises(
        LayoutError,
        match=r"model\.num_layers=4 is not divisible by parallel\.pp_size \* "
        r"parallel\.vp_size = 3 \* 1",
    ):
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
    with pytest.raises(
        LayoutError,
        match=r"parallel\.vp_size=2 needs parallel\.schedule=interleaved .*got "
        r"parallel\.schedule=gpipe",
    ):
        layout(2, "parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=gpipe")
    with pytest.raises(LayoutError, match=r"parallel\.vp_size=2 needs parallel\.pp_size > 1"):
        layout(1, "parallel.vp_size=2")


def test_layout_checks_name_both_numbers():
    with pytest.raises(
        LayoutError,
        match=r"world size 6 is not divisible by parallel\.tp_size \* "
        r"parallel\.pp_size = 2 \* 2",
    ):
        layout(6, "parallel.tp_size=2", "parallel.pp_size=2")
    assert layout(8, "parallel.tp_size=2", "parallel.pp_size=2").dp_size == 2
    with pytest.raises(LayoutError, match=r"model\.num_attention_heads=4 is not divisible by parallel\.tp_size=3"):
        layout(3, "parallel.tp_size=3", "model.num_attention_heads=4")
    with pytest.raises(
        LayoutError,
        match=r"train\.global_batch_size=10 is not divisible by "
        r"train\.micro_batch_size \* dp = 4 \* 1",
    ):
        layout(1, "train.global_batch_size=10", "train.micro_batch_size=4")
    with pytest.raises(
        LayoutError,
        match=r"multiple of parallel\.pp_size=2: e\.g\. train\.global_batch_size = "
        r"8, 16, 24",
    ):
        layout(2, "parallel.pp_size=2", "parallel.vp_size=2", "train.global_batch_size=12", "train.micro_batch_size=4")
    with pytest.raises(
        LayoutError,
        match=r"model\.num_layers=4 is not divisible by parallel\.pp_size \* "
        r"parallel\.vp_size = 3 \* 2",
    ):
        layout(3, "parallel.pp_size=3", "parallel.vp_size=2")
    with pytest.raises(LayoutError, match=r"parallel\.tp_size=0 must be >= 1"):
        layout(1, "parallel.tp_size=0")


@pytest.mark.parametrize(
    "overrides, world_size",
    [
        (["parallel.pp_size=4", "parallel.vp_size=2", "parallel.schedule=gpipe"], 4),
        # the other refusals through every entry point (a python start each, ~4 CPU s): the full tier
        pytest.param(
            ["parallel.pp_size=4", "parallel.vp_size=2", "train.global_batch_size=24", "train.micro_batch_size=4"],
            4,
            marks=pytest.mark.tier("full"),
        ),
        pytest.param(["parallel.pp_size=1", "parallel.vp_size=2"], 1, marks=pytest.mark.tier("full")),
        pytest.param(["parallel.schedule=zigzag", "parallel.pp_size=2"], 2, marks=pytest.mark.tier("full")),
    ],
)
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
    assert_entry_points_refuse(overrides, world_size, str(expected.value), f"{tmp_path}/run")


def test_entry_point_rejects_bad_config_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "train.micro_batchsize=3", f"run.dir={tmp_path}/run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "did you mean train.micro_batch_size" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_every_shipped_config_loads():
    """Run configs load as configs; configs/clusters/ holds the planner's cluster specs, loaded by it."""
    import glob

    from planner.cluster import load_cluster

    clusters = os.path.join(REPO_ROOT, "configs", "clusters")
    paths = glob.glob(os.path.join(REPO_ROOT, "configs", "**", "*.yaml"), recursive=True)
    runs = [path for path in paths if not path.startswith(clusters + os.sep)]
    assert len(runs) >= 16 and len(paths) - len(runs) >= 3
    for path in runs:
        load_config(path)
    for path in sorted(set(paths) - set(runs)):
        load_cluster(path)


def test_checkpoint_load_keys():
    assert load_config(None, ["checkpoint.load=true"]).checkpoint.load is True
    assert load_config(None, ["checkpoint.load=/runs/a/checkpoints"]).checkpoint.load == "/runs/a/checkpoints"
    finetune = load_config(None, ["checkpoint.finetune=/runs/a/checkpoints"]).checkpoint  # one override
    # the override names the source, and the loaded config keeps what was given (nothing is rewritten)
    assert (finetune.load, finetune.finetune, finetune.source()) == (
        False,
        "/runs/a/checkpoints",
        "/runs/a/checkpoints",
    )
    for overrides, message in (
        (["checkpoint.finetune=true"], "checkpoint.finetune=true needs checkpoint.load"),
        (["checkpoint.load_optimizer=false"], "checkpoint.load_optimizer=false needs"),
        (["checkpoint.finetune=/a", "checkpoint.load=/b"], "name different checkpoints"),
        (["checkpoint.keep_last=-1"], "checkpoint.keep_last=-1 must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


# ---- hostile config files (issue 12) ------------------------------------------------------------------
def test_empty_config_file_is_an_error(tmp_path):
    for text in ("", "# only a comment\n"):
        with pytest.raises(ConfigError, match=r"config file .*c\.yaml is empty"):
            load_config(write(tmp_path, text))


def test_file_errors_name_the_file_and_the_key(tmp_path):
    path = write(tmp_path, "train: 5\n")
    with pytest.raises(ConfigError, match=rf"^config file {path}: config section 'train' must be a mapping"):
        load_config(path, ["train.train_iters=3"])
    path = write(tmp_path, "optim:\n  adam_eps: -1\n")
    with pytest.raises(ConfigError, match=rf"^config file {path}: optim\.adam_eps=-1\.0 must be > 0"):
        load_config(path)
    path = write(tmp_path, "optim:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=rf"^config file {path}: optim\.lr=inf must be a finite number"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^optim\.lr=-1\.0 and optim\.min_lr"):  # the override's fault
        load_config(write(tmp_path, "optim:\n  lr: 0.1\n"), ["optim.lr=-1"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lr=.inf", r"optim\.lr=inf must be a finite number"),
        ("optim.lr=.nan", r"optim\.lr=nan must be a finite number"),
        ("optim.min_lr=-1", r"0 <= min_lr <= lr"),
        ("optim.adam_eps=-1", r"optim\.adam_eps=-1\.0 must be > 0"),
        ("optim.adam_eps=0", r"optim\.adam_eps=0\.0 must be > 0"),
        ("optim.adam_beta1=1.5", r"optim\.adam_beta1=1\.5 must be in \[0, 1\)"),
        ("optim.adam_beta2=.nan", r"optim\.adam_beta2=nan must be a finite number"),
        ("optim.weight_decay=-0.1", r"optim\.weight_decay=-0\.1 must be >= 0"),
        ("train.clip_grad=-1", r"train\.clip_grad=-1\.0 must be >= 0"),
        ("train.clip_grad=.inf", r"train\.clip_grad=inf must be a finite number"),
        ("optim.min_loss_scale=0", r"optim\.min_loss_scale=0\.0 must be > 0"),
        ("train.max_nonfinite_iters=0", r"train\.max_nonfinite_iters=0 must be >= 1"),
        ("train.device=tpu", r"train\.device='tpu' is not one of auto, cuda, cpu"),
        ("parallel.train_timeout_s=0", r"parallel\.train_timeout_s=0\.0 must be in \(0, 604800\] \(at most a week\)"),
        ("parallel.init_timeout_s=1e9", r"parallel\.init_timeout_s=1000000000\.0 must be in \[1, 604800\]"),
        (
            "parallel.init_timeout_s=0.01",
            r"parallel\.init_timeout_s=0\.01 must be in \[1, 604800\] \(every rank joins the process groups",
        ),
        ("parallel.init_timeout_s=0", r"parallel\.init_timeout_s=0\.0 must be in \[1, 604800\]"),
        ("logging.straggler_interval=-1", r"logging\.straggler_interval=-1 must be >= 0 \(0: no report\)"),
        ("logging.straggler_threshold=0", r"logging\.straggler_threshold=0\.0 must be > 0"),
        (
            "eval.wikitext_file=wiki.test.tokens",
            r"^eval\.wikitext_file=wiki\.test\.tokens is read only .* eval\.interval",
        ),
        ("eval.lambada_file=lambada.jsonl", r"^eval\.lambada_file=lambada\.jsonl is read only .* eval\.interval"),
    ],
)
def test_values_that_make_no_sense_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("train:\n  train_iters: 300\n")
    config = load_config(
        "~/c.yaml",
        [
            "run.dir=~/runs/x",
            "data.data_path=[0.5, ~/a, 0.5, ~/b]",
            "data.vocab_file=~/v.json",
            "data.merge_file=~/m.txt",
        ],
    )
    assert config.run.dir == str(tmp_path / "runs" / "x")
    assert config.data.data_path == [0.5, str(tmp_path / "a"), 0.5, str(tmp_path / "b")]
    assert config.data.vocab_file == str(tmp_path / "v.json") and config.train.train_iters == 300


def test_relative_tokenizer_files_fall_back_to_the_config_files_folder(tmp_path, monkeypatch):
    """A relative data.vocab_file is taken from the working directory when it exists there, else from the
    YAML file's folder (absolute then); a path found in neither stays as given."""
    (tmp_path / "run" / "tokenizer").mkdir(parents=True)
    (tmp_path / "run" / "tokenizer" / "vocab.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text(
        "data:\n  vocab_file: tokenizer/vocab.json\n  merge_file: tokenizer/merges.txt\n"
    )
    (tmp_path / "cwd" / "tokenizer").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    data = load_config(str(tmp_path / "run" / "config.yaml")).data
    assert data.vocab_file == str(tmp_path / "run" / "tokenizer" / "vocab.json")
    assert data.merge_file == "tokenizer/merges.txt"  # nowhere: left for the tokenizer's own error
    (tmp_path / "cwd" / "tokenizer" / "vocab.json").write_text("{}")
    assert load_config(str(tmp_path / "run" / "config.yaml")).data.vocab_file == "tokenizer/vocab.json"


def test_null_tokenizer_with_data_needs_the_vocabulary_size(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  data_path: [corpus_text_document]\n  tokenizer_type: NullTokenizer\n")
    with pytest.raises(ConfigError, match=r"NullTokenizer needs model.vocab_size"):
        load_config(str(config))
    assert load_config(str(config), ["model.vocab_size=301"]).data.tokenizer_type == "NullTokenizer"


# ---- checks declared beside each key (issue 41) ----------------------------------------------------------
def declared_keys():
    """(section, field, its type) of every key of the schema, each section's dataclass read from Config."""
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(sections[section.name])
        for declaration in dataclasses.fields(sections[section.name]):
            yield section.name, declaration, hints[declaration.name]


def outside_values(declaration, hint):
    """(value, how its refusal starts) just outside what a key declares: a name not among its choices, and the
    value one past each bound (the bound itself where it is exclusive), a float where the key takes one."""
    meta = declaration.metadata
    if meta["choices"]:
        yield "not_a_choice", f"'not_a_choice' is not one of {', '.join(meta['choices'])}"
    number = float if float in (hint, *typing.get_args(hint)) else int
    for name, past in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
        if meta[name] is not None:
            value = number(meta[name] + past)
            yield value, f"{value} must be "


def test_every_declared_check_refuses_a_value_outside_it_with_one_line_naming_the_key():
    """The one checker runs over every section on load_config's path: each key's declared choices and bounds
    refuse a value just outside them, in one line that names the key and the value."""
    refused = 0
    for section, declaration, hint in declared_keys():
        for value, start in outside_values(declaration, hint):
            with pytest.raises(ConfigError) as caught:
                load_config(None, [f"{section}.{declaration.name}={value}"])
            message = str(caught.value)
            assert message.startswith(f"{section}.{declaration.name}={start}"), message
            assert "\n" not in message
            refused += 1
    assert refused >= 40  # every section's ranges and choices, not a handful


@dataclasses.dataclass
class Declared:
    """A section declaring each kind of check."""

    workers: int = dataclasses.field(default=1, metadata=key_spec("Workers.", ge=0))
    share: float = dataclasses.field(default=0.5, metadata=key_spec("A share.", gt=0, le=1, note="a fraction"))
    style: str = dataclasses.field(default="a", metadata=key_spec("A style.", choices=("a", "b")))
    window: int | None = dataclasses.field(default=None, metadata=key_spec("A window; None: derived.", ge=1))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workers": -1}, "sec.workers=-1 must be >= 0"),
        ({"share": 0.0}, "sec.share=0.0 must be in (0, 1] (a fraction)"),
        ({"share": 1.5}, "sec.share=1.5 must be in (0, 1] (a fraction)"),
        ({"share": float("nan")}, "sec.share=nan must be in (0, 1] (a fraction)"),
        ({"style": "c"}, "sec.style='c' is not one of a, b"),
        ({"window": 0}, "sec.window=0 must be >= 1 (or leave it out for the default)"),
    ],
)
def test_the_generic_checker_refuses_out_of_range_and_out_of_choices_values(values, message):
    with pytest.raises(ValueError) as caught:
        check_declared(Declared(**values), "sec")
    assert str(caught.value) == message


def test_the_generic_checker_passes_values_inside_and_none():
    check_declared(Declared(), "sec")  # no error: the defaults, a None window
    check_declared(Declared(workers=0, share=1.0, style="b", window=1), "sec")  # each value on its bound
    with pytest.raises(TypeError, match="one lower bound"):
        key_spec("Two lower bounds.", ge=0, gt=0)
