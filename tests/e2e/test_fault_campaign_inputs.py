"""Issue 31's fault campaign, the config and start-up cases: YAML alias bombs and deep nesting (in a config
file, in an override, in a cluster spec), thread and worker counts past the machine, a NUL in a path, seeds
numpy refuses, run.dir a broken symbolic link, wandb installed but not importable, data.split beside the
per-split paths, the training prefix given for validation, --config given twice. Each is refused before any
work with one line naming the key, file or value (exit 2), and no run folder is left behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from config.schema import ConfigError, load_config
from config.yaml_reader import MAX_ALIAS_EXPANSION, MAX_DEPTH, load_yaml_text
from operations.guards import EXIT_INPUT_ERROR
from operations.threads import check_cpu_requests
from planner.cluster import ClusterError, load_cluster
from tests.conftest import REPO_ROOT
from tests.e2e.faults import QUICK, one_error_line, run_main

pytestmark = pytest.mark.tier("fast")


def alias_bomb(levels: int = 9, width: int = 10, indent: str = "    ") -> str:
    """YAML list items whose last one expands to width**levels strings (a "billion laughs")."""
    lines = [f"{indent}- &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"{indent}- &a{k} [{', '.join([f'*a{k - 1}'] * width)}]" for k in range(1, levels)]
    return "\n".join(lines)


BOMBS = {  # the campaign's keys: a list key, an int key given a list, a per-split list key
    "data.data_path": f"data:\n  data_path:\n{alias_bomb()}\n",
    "model.num_layers": f"model:\n  num_layers:\n{alias_bomb()}\n",
    "data.train_data_path": f"data:\n  train_data_path:\n{alias_bomb()}\n",
    "merge-keys": "\n".join(
        ["a0: &a0 {k: 1, j: 2}"]
        + [f"a{i}: &a{i} {{<<: [*a{i - 1}, *a{i - 1}, *a{i - 1}], z{i}: 1}}" for i in range(1, 30)]
    ),
}


@pytest.mark.parametrize("key", list(BOMBS))
def test_an_alias_bomb_in_a_config_file_is_refused_at_once(tmp_path, key):
    """Before: pretrain_gpt.py grew to 1.6 GB in 42 s expanding data.data_path (str() of the nested lists)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMBS[key])
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    message = str(error.value)
    assert message.startswith(f"config file {path}: aliases (*name) expand to more than") and "\n" not in message


def test_an_alias_bomb_in_an_override_and_a_cluster_spec(tmp_path):
    levels = ", ".join(
        ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 9)]
    )
    with pytest.raises(ConfigError, match=r"^override model\.num_layers=\.\.\.: aliases \(\*name\) expand"):
        load_config(None, [f"model.num_layers=[{levels}]"])
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"name: bomb\ngpus:\n{alias_bomb(indent='  ')}\n")
    with pytest.raises(ClusterError, match=rf"^cluster file {cluster}: aliases"):
        load_cluster(str(cluster))


def test_the_trainer_refuses_a_bomb_within_seconds(tmp_path):
    """The acceptance check, as a user runs it (the refusal itself takes milliseconds; the rest is imports)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMBS["data.data_path"])
    done = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--config", str(path), f"run.dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_INPUT_ERROR and done.stderr.count("\n") == 1, done.stderr
    assert "aliases (*name) expand to more than" in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("a: " + "[" * 5000 + "]" * 5000, f"nested deeper than {MAX_DEPTH} levels (line 1)"),
        ("a:\n" + "".join("  " * k + f"k{k}:\n" for k in range(1, 200)) + "  " * 200 + "v", "nested deeper than"),
        ("\n".join(["a0: &a0 [x]"] + [f"a{k}: &a{k} [*a{k - 1}]" for k in range(1, 100)]), "through aliases"),
        ("a: &a [1, *a]", "an alias (*name) names a value that holds it"),
        ("a: " + "9" * 5000, "a value cannot be read (Exceeds the limit (4300 digits)"),
        ("a: 2024-02-30", "a value cannot be read (day is out of range for month)"),
    ],
    ids=["flow-5000-deep", "block-200-deep", "alias-chain-100-deep", "alias-cycle", "int-5000-digits", "bad-date"],
)
def test_nesting_cycles_and_unreadable_values_are_one_line(tmp_path, text, expected):
    """Before: RecursionError from PyYAML's recursive composer (or later, from whatever walked the result)."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    assert expected in str(error.value) and str(error.value).startswith(f"config file {path}: "), error.value


def test_an_endless_config_file_is_not_read_to_its_end():
    """Before: --config /dev/zero read until memory ran out."""
    with pytest.raises(ConfigError, match=r"^config file /dev/zero is larger than 16 MiB: give the path of a"):
        load_config("/dev/zero")


def test_aliases_within_the_bound_still_load():
    small = load_yaml_text("base: &b {lr: 0.1, wd: 0.0}\nrun: {<<: *b, wd: 0.1}\nlist: &l [1, 2]\nagain: [*l, *l]")
    assert small == {
        "base": {"lr": 0.1, "wd": 0.0},
        "run": {"lr": 0.1, "wd": 0.1},
        "list": [1, 2],
        "again": [[1, 2], [1, 2]],
    }
    wide = load_yaml_text(
        "a: &a [" + ", ".join(["x"] * 100) + "]\nb: [" + ", ".join(["*a"] * (MAX_ALIAS_EXPANSION // 101)) + "]"
    )
    assert len(wide["b"]) == MAX_ALIAS_EXPANSION // 101
    long_blend = load_yaml_text("data_path: [" + ", ".join(f"1, p{k}" for k in range(20000)) + "]")  # no alias
    assert len(long_blend["data_path"]) == 40000


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (("train.num_threads=100000",), "train.num_threads=100000 is more threads than the"),
        (("data.num_workers=100000",), "data.num_workers=100000 is more loader processes than the"),
        (("train.seed=-1",), "train.seed=-1 must be in [0, 4294967295]"),
        (("train.seed=4294967296",), "train.seed=4294967296 must be in [0, 4294967295]"),
        (('run.dir="/tmp/a\\0b"',), "run.dir='/tmp/a\\x00b' holds a NUL character"),
        (('data.data_path=["/tmp/a\\0b"]',), "data.data_path=['/tmp/a\\x00b'] holds a NUL character"),
        (("model.num_query_groups=-2",), "model.num_query_groups=-2 must be >= 1 (or leave it out"),
        (("model.init_std=-1",), "model.init_std=-1.0 must be >= 0"),
        (("model.rotary_base=0",), "model.rotary_base=0.0 must be > 0"),
        (("optim.lr=1e300",), "optim.lr=1e+300 is past float32's range"),
        (("optim.lr=1" + "0" * 400,), "is past float32's range"),
        (('data.data_path=[""]',), "data.data_path=['']: entry 0 is empty: give a data prefix"),
        (('data.cache_dir=""',), "data.cache_dir is an empty string: give a path, or leave the key out"),
        (("data.data_path=[]", "data.train_data_path=[{p}]", "data.split=99,1,0"), "data.split='99,1,0' is not used"),
        (("data.data_path=[]", "data.train_data_path=[{p}]", "data.valid_data_path=[{p}]"), "data.valid_data_path and"),
        (("data.data_path=[]", "data.train_data_path=[{p}]", "data.test_data_path=[2,{p}]"), "data.test_data_path and"),
    ],
    ids=[
        "threads",
        "loader-workers",
        "seed-negative",
        "seed-2^32",
        "nul-run-dir",
        "nul-data-path",
        "query-groups-negative",
        "init-std-negative",
        "rotary-base-0",
        "lr-1e300",
        "lr-401-digits",
        "empty-prefix",
        "empty-cache-dir",
        "split-ignored",
        "valid-is-train",
        "test-is-train",
    ],
)
def test_start_up_refusals_are_one_line(tiny_corpus, tmp_path, capsys, overrides, expected):
    """Before: SIGSEGV (threads), thousands of processes (workers), numpy's "Seed must be between 0 and 2**32 - 1"
    after start-up, an "embedded null byte" traceback, tracebacks from torch (negative sizes and std, an lr
    past float32), ".idx: cannot open" (an empty prefix), the index cache silently kept in memory
    (cache_dir ""), and the last three trained silently."""
    run_dir = str(tmp_path / "run")
    given = [item.format(p=tiny_corpus["data_prefix"]) for item in overrides]
    assert run_main(tiny_corpus, run_dir, *QUICK, *given) == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert expected in line, line
    assert not os.path.exists(run_dir)


NO_TOKENIZER_FILES = ("data.data_path=[]", "data.tokenizer_type=NullTokenizer", "model.vocab_size=300")


@pytest.mark.parametrize("linked", ["folder", "files"])
def test_a_linked_training_prefix_is_still_the_training_data(tiny_corpus, tmp_path, linked):
    prefix = tiny_corpus["data_prefix"]
    if linked == "folder":  # a link to the corpus folder
        os.symlink(os.path.dirname(prefix), tmp_path / "linked")
        alias = str(tmp_path / "linked" / os.path.basename(prefix))
    else:  # links to the .bin and .idx under another name
        alias = str(tmp_path / "alias")
        for ext in (".bin", ".idx"):
            os.symlink(prefix + ext, alias + ext)
    splits = [*NO_TOKENIZER_FILES, f"data.train_data_path=[{prefix}]"]
    with pytest.raises(ConfigError, match=f"data.valid_data_path and data.train_data_path both hold {alias}:"):
        load_config(None, [*splits, f"data.valid_data_path=[{alias}]"])


def test_validation_and_test_may_share_a_prefix(tiny_corpus, tmp_path):
    prefix = tiny_corpus["data_prefix"]
    splits = [f"data.train_data_path=[{tmp_path / 'train'}]", f"data.valid_data_path=[{prefix}]"]
    config = load_config(None, [*NO_TOKENIZER_FILES, *splits, f"data.test_data_path=[{prefix}]"])
    assert config.data.valid_data_path == config.data.test_data_path == [prefix]  # not training data: allowed


def test_cpu_requests_are_bounded_by_the_cores():
    check_cpu_requests(2, 2, {}, cores=2)  # at the bound: fine
    check_cpu_requests(0, 0, {"OMP_NUM_THREADS": "64"}, cores=64)
    with pytest.raises(
        ValueError, match=r"^OMP_NUM_THREADS=100000 is more threads than the 8 cores .*export at most 8"
    ):
        check_cpu_requests(0, 1, {"OMP_NUM_THREADS": "100000"}, cores=8)
    with pytest.raises(ValueError, match=r"^train.num_threads=9 is more threads than the 8 cores"):
        check_cpu_requests(9, 1, {"OMP_NUM_THREADS": "1"}, cores=8)


@pytest.mark.parametrize("link", ["loop", "dangling", "file"])
def test_run_dir_a_broken_symbolic_link_or_a_file_is_named_as_one(tiny_corpus, tmp_path, capsys, link):
    """Before: "cannot hold the run: File exists"."""
    run_dir = tmp_path / "run"
    if link == "file":
        run_dir.write_text("x")
    else:
        os.symlink(run_dir if link == "loop" else tmp_path / "gone" / "x", run_dir)
    assert run_main(tiny_corpus, str(run_dir), *QUICK) == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    expected = {
        "loop": "is a symbolic link that loops back on itself",
        "dangling": f"is a symbolic link that points to {tmp_path / 'gone' / 'x'}, which does not exist",
        "file": "is a file, not a folder: give run.dir a folder",
    }[link]
    assert line.startswith(f"error: run.dir={run_dir} cannot hold the run: {run_dir} {expected}"), line
    assert not (tmp_path / "gone").exists() and (run_dir.is_file() or run_dir.is_symlink())


def test_wandb_installed_but_not_importable_is_refused_at_start_up(tiny_corpus, tmp_path, capsys, monkeypatch):
    """Before: the config check passed (find_spec sees the package) and the import failed after start-up."""
    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError(\"No module named 'wandb_core_dependency'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    run_dir = str(tmp_path / "run")
    assert run_main(tiny_corpus, run_dir, *QUICK, "logging.wandb_project=demo") == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert "logging.wandb_project=demo needs wandb, which cannot be imported (ImportError: No module named" in line
    assert not os.path.exists(run_dir)


def test_config_given_twice_is_refused_naming_both(tiny_corpus, tmp_path, capsys):
    """Before: the first file was dropped without a word. Refused rather than merged: overrides are the one
    way to change a file's settings."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train:\n  seed: 1\n")
    second.write_text("train:\n  seed: 2\n")
    run_dir = str(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        run_main(tiny_corpus, run_dir, "--config", str(second), config=str(first))
    assert exit_info.value.code == EXIT_INPUT_ERROR
    line = one_error_line(capsys)
    assert line == (
        f"error: --config is given 2 times ({first}, {second}): give one file, and the changes to it as "
        f"section.key=value overrides"
    )
    assert not os.path.exists(run_dir)
