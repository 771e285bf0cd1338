"""Setup that is bounded: no silent training of a big config on the sample corpus, stop signals during
index building stop at once leaving no temporary file, a finished run says so, separate split paths train."""

import os
import signal
import subprocess
import sys

import pytest

import pretrain_gpt
from data import atomic_files, gpt_dataset
from operations.guards import EXIT_INPUT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from tests.conftest import REPO_ROOT, read_metrics, tiny_train_args
from tests.e2e.faults import copy_corpus

pytestmark = pytest.mark.tier("fast")


def run_main(corpus, run_dir, *extra):
    return pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *tiny_train_args(corpus, run_dir, *extra)])


def test_a_big_config_without_data_is_refused_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--config", "configs/gpt2_124m.yaml", f"run.dir={tmp_path}/run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == EXIT_INPUT_ERROR
    assert result.stderr.strip().splitlines() == [
        "error: data.data_path is empty, so the run would train on the bundled sample corpus (257 byte-level "
        "tokens, for the tiny configs), but model.vocab_size=50257 expects a tokenizer of its own: set "
        "data.data_path (and the tokenizer keys) to your preprocessed corpus, or data.use_sample_corpus=true to "
        "measure speed on the sample corpus"
    ]
    assert not (tmp_path / "run").exists()


def signal_during(monkeypatch, module, name: str, sig: signal.Signals) -> None:
    """Deliver `sig` to this process (a real kill(2)) when module.name is first called."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize(
    "module, name, sig",
    [
        (gpt_dataset, "build_sample_index", signal.SIGTERM),  # while the arrays are built in memory
        (atomic_files, "publish", signal.SIGINT),  # a temporary file complete, not yet renamed
        (atomic_files, "publish", signal.SIGUSR1),
    ],
    ids=["build-SIGTERM", "write-SIGINT", "write-SIGUSR1"],
)
def test_a_signal_while_building_indices_stops_at_once(tiny_corpus, tmp_path, monkeypatch, capsys, module, name, sig):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    found = signal.getsignal(sig)  # SIG_IGN for SIGINT when the suite was started in the background
    signal_during(monkeypatch, module, name, sig)
    assert run_main(tiny_corpus, str(run_dir), f"data.cache_dir={cache}") == EXIT_INTERRUPTED
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"error: received {sig.name} while building the data indices: stopped before the first iteration "
        "(nothing to save yet); temporary files removed"
    )
    left = os.listdir(cache) if cache.exists() else []
    assert not [name for name in left if ".tmp" in name], left
    assert not (run_dir / "checkpoints").exists()
    monkeypatch.undo()
    assert signal.getsignal(sig) == found  # the handler this test found is restored
    assert run_main(tiny_corpus, str(run_dir), f"data.cache_dir={cache}", "train.train_iters=2") == EXIT_OK


def test_resuming_a_finished_run_says_so(tiny_corpus, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert run_main(tiny_corpus, run_dir, "train.train_iters=2") == EXIT_OK
    capsys.readouterr()
    assert run_main(tiny_corpus, run_dir, "train.train_iters=2", "checkpoint.load=true") == EXIT_OK
    out = capsys.readouterr().out
    assert (
        "nothing to train: the checkpoint is at iteration 2 and train.train_iters=2; raise train.train_iters "
        "to train on" in out
    )


def test_separate_split_paths_train(tiny_corpus, tmp_path, capsys):
    prefix, run_dir = tiny_corpus["data_prefix"], str(tmp_path / "run")
    args = tiny_train_args(tiny_corpus, run_dir, "train.train_iters=2", "train.eval_interval=2")
    args = [a for a in args if not a.startswith("data.data_path=")]
    code = pretrain_gpt.main(
        ["--config", pretrain_gpt.DEFAULT_CONFIG, *args, f"data.train_data_path=[{prefix}]", "data.valid_data_path=[]"]
    )
    assert code == EXIT_INPUT_ERROR  # the run evaluates: a valid path is needed
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: data.valid_data_path is not set but the run reads 16 valid samples: set it, or train.eval_iters=0"
    )
    code = pretrain_gpt.main(
        [
            "--config",
            pretrain_gpt.DEFAULT_CONFIG,
            *args,
            f"data.train_data_path=[{prefix}]",
            f"data.valid_data_path=[{copy_corpus(tiny_corpus, str(tmp_path))}]",  # the train prefix is refused
        ]
    )
    assert code == EXIT_OK
    assert [r["iteration"] for r in read_metrics(run_dir) if "lm_loss" in r][-1] == 2


def test_the_sample_corpus_on_a_big_config_when_asked():
    from config.schema import load_config
    from operations.startup import check_sample_corpus_fits

    path = os.path.join(REPO_ROOT, "configs", "gpt2_124m.yaml")
    check_sample_corpus_fits(load_config(path, ["data.use_sample_corpus=true"]))  # scripts/gpu_check.sh's runs
    with pytest.raises(ValueError, match="model.vocab_size=50257 expects a tokenizer of its own"):
        check_sample_corpus_fits(load_config(path))
    check_sample_corpus_fits(load_config(None, ["model.vocab_size=257"]))  # the sample corpus's own size
