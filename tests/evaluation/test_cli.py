"""The command lines: tools/evaluate.py's table, its bad input (one line, exit 2), the same figures under
torchrun at tp2 x pp2, and `python -m evaluation.harness` (lm_eval's command line with "ptdp")."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tools.evaluate as evaluate_tool
from data.indexed_dataset import IndexedDatasetBuilder
from data.tokenizer_training import train_gpt2_bpe
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("full")  # the lm-evaluation-harness comparisons, under torchrun


def bad_input_cases(eval_model, eval_files, tmp_path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, the start of the one error line)."""
    checkpoint = ["--checkpoint", eval_model["checkpoint"]]
    (tmp_path / "empty.tokens").write_text("", encoding="utf-8")
    (tmp_path / "fake.bin").write_bytes(b"not tokens")
    (tmp_path / "fake.idx").write_bytes(b"not an index")
    builder = IndexedDatasetBuilder(str(tmp_path / "ids.bin"), np.uint16)
    for document in range(4):
        builder.add_document([(7 * k + document) % 500 if k != 50 else 600 for k in range(100)])
    builder.finalize(str(tmp_path / "ids.idx"))
    other = train_gpt2_bpe(["a small text to train another tokenizer on, " * 20], 300, str(tmp_path / "other"))
    return {
        "missing file": (["wikitext", "--data", str(tmp_path / "nope.tokens"), *checkpoint], "error: "),
        "empty file": (["wikitext", "--data", str(tmp_path / "empty.tokens"), *checkpoint], "error: "),
        "endless file": (["wikitext", "--data", "/dev/zero", *checkpoint], "error: /dev/zero holds NUL bytes"),
        "wikitext as lambada": (["lambada", "--data", eval_files["wikitext"], *checkpoint], "error: "),
        "lambada as wikitext": (["wikitext", "--data", eval_files["lambada"], *checkpoint], "error: "),
        "not a dataset": (["loss", "--data", str(tmp_path / "fake"), *checkpoint], "error: "),
        "token outside the vocabulary": (["loss", "--data", str(tmp_path / "ids"), *checkpoint], "error: token id 600"),
        "missing checkpoint": (["lambada", "--data", eval_files["lambada"], "--checkpoint", str(tmp_path)], "error: "),
        "transformers folder as checkpoint": (
            ["lambada", "--data", eval_files["lambada"], "--checkpoint", eval_model["hf"]],
            f"error: {eval_model['hf']} is a transformers folder (config.json), not a checkpoint of this trainer: "
            f"give it as --hf DIR",
        ),
        "vocabulary mismatch": (
            [
                "lambada",
                "--data",
                eval_files["lambada"],
                *checkpoint,
                f"data.vocab_file={other[0]}",
                f"data.merge_file={other[1]}",
            ],
            "error: tokenizer ",
        ),
        "window past the positions": (
            ["lambada", "--data", eval_files["lambada"], *checkpoint, "eval.seq_length=65"],
            "error: eval.seq_length=65",
        ),
        "bad layout": (["lambada", "--data", eval_files["lambada"], *checkpoint, "parallel.tp_size=3"], "error: "),
    }


def test_bad_input_is_one_line_and_exit_2(eval_model, eval_files, tmp_path, capsys):
    for name, (argv, start) in bad_input_cases(eval_model, eval_files, tmp_path).items():
        assert evaluate_tool.main(argv) == 2, name
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert captured.out == "" and len(lines) == 1 and lines[0].startswith(start), (name, captured.err)
        assert "Traceback" not in captured.err, name


def run_eval_cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """A command line from the repository root (forked where it is one of ours: tests/cli_runner.py)."""
    return run_cli(args, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_torchrun_tp2_pp2_gives_the_table_of_one_process(eval_model, eval_files, tmp_path, capsys):
    argv = ["tools/evaluate.py", "lambada", "--data", eval_files["lambada"], "--checkpoint", eval_model["checkpoint"]]
    assert evaluate_tool.main(argv[1:]) == 0  # the table, in this process
    single = capsys.readouterr()
    assert single.out.startswith("lambada of ") and "target_perplexity" in single.out
    assert "convention: LAMBADA: the target is the last word" in single.out
    parallel = run_eval_cli(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            *argv,
            "--json",
            "parallel.tp_size=2",
            "parallel.pp_size=2",
        ]
    )
    assert parallel.returncode == 0, parallel.stderr
    record = json.loads(parallel.stdout)  # one record: only rank 0 prints
    assert "tp 2 x dp 1 x pp 2" in record["layout"]
    table = dict(line.split(None, 1) for line in single.out.splitlines()[1:] if line.startswith("  "))
    for key in ("correct", "loose_correct", "total"):
        assert str(record[key]) == table[key]
    assert abs(record["target_perplexity"] - float(table["target_perplexity"])) <= 1e-5 * record["target_perplexity"]
    bad = run_eval_cli([sys.executable, *argv[:-1], str(tmp_path / "none")])
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and bad.stdout == ""


def test_the_lm_eval_command_line_runs_ptdp(eval_model, harness_files, harness_results, tmp_path):
    out = tmp_path / "results"
    result = run_eval_cli(
        [
            sys.executable,
            "-m",
            "evaluation.harness",
            "--model",
            "ptdp",
            "--model_args",
            f"checkpoint={eval_model['checkpoint']},dtype=fp32",
            "--tasks",
            "local_lambada,local_wikitext",
            "--include_path",
            harness_files["tasks"],
            "--batch_size",
            "4",
            "--output_path",
            str(out),
        ],
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    files = [os.path.join(d, f) for d, _, names in os.walk(out) for f in names if f.startswith("results")]
    with open(files[0], encoding="utf-8") as handle:
        cli = json.load(handle)["results"]
    hf = harness_results["hf"]["results"]
    for task, metric in (
        ("local_lambada", "acc,none"),
        ("local_lambada", "perplexity,none"),
        ("local_wikitext", "word_perplexity,none"),
        ("local_wikitext", "bits_per_byte,none"),
    ):
        assert abs(cli[task][metric] - hf[task][metric]) <= 1e-4 * max(abs(hf[task][metric]), 1e-3), (task, metric)


def test_the_lm_eval_command_line_refuses_a_bad_model_in_one_line(tmp_path, capsys, monkeypatch):
    """A bad checkpoint ends evaluation.harness's command line with one line and exit 2. lm_eval's own command
    line is replaced by the step that fails (its registry building the model from --model_args): the real
    one first indexes every task lm_eval ships, which takes half a minute here."""
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from evaluation.harness import main

    def cli_evaluate():
        get_model("ptdp").create_from_arg_string(f"checkpoint={tmp_path}", {"batch_size": 4, "device": "cpu"})

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
    assert main([]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {tmp_path} holds no complete checkpoint (no tracker, no verifying iter_* folder)"]


def test_the_trainer_refuses_an_endless_eval_file_in_one_line(tmp_path, capsys):
    """eval.wikitext_file=/dev/zero: one line and exit 2 before any work, not a MemoryError."""
    import pretrain_gpt

    argv = ["--config", pretrain_gpt.DEFAULT_CONFIG, f"run.dir={tmp_path / 'run'}", "eval.interval=2"]
    for key in ("wikitext_file", "lambada_file"):
        assert pretrain_gpt.main([*argv, f"eval.{key}=/dev/zero"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: /dev/zero holds NUL bytes"), lines


def test_the_lm_eval_command_line_refuses_no_task_or_an_unknown_one_in_one_line(tmp_path, capsys, monkeypatch):
    """lm_eval's real command line, without a task and with an unknown one: one line naming --tasks, exit 2.
    Its task index is cut to the tasks given by --include_path (none here): the index of every task lm_eval
    ships takes half a minute; its logging set-up (INFO lines on stderr, a handler kept for the test process)
    is left out."""
    import functools

    import lm_eval.__main__
    import lm_eval.tasks

    from evaluation.harness import main

    monkeypatch.setattr(
        lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
    )
    monkeypatch.setattr(lm_eval.__main__, "setup_logging", lambda: None)
    model = ["--model", "ptdp", "--model_args", f"checkpoint={tmp_path}"]
    for tasks, message in (
        ([], "error: No tasks specified, or no tasks found. Please verify the task names. (--tasks NAME"),
        (["--tasks", "no_such_task"], "error: Tasks not found: no_such_task (--tasks NAME"),
    ):
        assert main([*model, *tasks]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), lines


def test_the_harness_model_args_are_named_as_given(eval_model, capsys, monkeypatch):
    """model_args max_length out of range: the one error line names max_length (the harness's argument), not
    the eval.seq_length it becomes; a transformers folder given as checkpoint= points to hf=."""
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from evaluation.harness import main

    for value, message in (
        ("-1", "ptdp model_args max_length=-1 must be >= 1"),
        ("0", "ptdp model_args max_length=0 must be >= 1"),
        ("1.5", "ptdp model_args max_length=1.5 is not a whole number of tokens"),
        ("inf", "ptdp model_args max_length=inf is not a whole number of tokens"),
        ("65", "ptdp model_args max_length=65 is longer than the model's 64 positions"),
        (
            None,
            f"{eval_model['hf']} is a transformers folder (config.json), not a checkpoint of this trainer: give "
            f"it as hf=DIR",
        ),
    ):
        model_args = (
            f"checkpoint={eval_model['hf']}"
            if value is None
            else f"checkpoint={eval_model['checkpoint']},max_length={value}"
        )

        def cli_evaluate(model_args=model_args):
            get_model("ptdp").create_from_arg_string(model_args, {"batch_size": 4, "device": "cpu"})

        monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
        assert main([]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
