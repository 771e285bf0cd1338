"""Issue 31's fault campaign, the small tools' cases: preprocess_data.py's --workers past the cores (it forked
about 5,400 processes) and --vocab-size named as the trainer's key, compare_runs.py's negative tolerance,
generate.py's NaN temperature, prompt length and binary stdin, plan.py's `--tokens -1e9` and a GPU count no
layout divides, a tokenizer_config.json naming an eos token the tokenizer.json lacks; and neighbours of the
same classes (pipeline_timeline.py's unbounded drawings and NaN costs, train_tokenizer.py's 10**11 vocabulary,
deep or binary JSON lines). Each is one line naming the option or file and what to do, exit 2, nothing
written."""

from __future__ import annotations

import io
import json
import math
import os
import types

import pytest

from data import preprocess
from data.tokenizers import HuggingFaceTokenizer
from model.generation import SamplingConfig, generate_tokens
from tests.conftest import REPO_ROOT, run_ranks
from tests.data.test_hf_tokenizer import make_tokenizer_json
from tests.tools.test_compare_runs import write_run
from tools import (
    compare_runs,
    generate,
    merge_datasets,
    pipeline_timeline,
    plan,
    prepare_sample_data,
    preprocess_data,
    train_tokenizer,
)

pytestmark = pytest.mark.tier("fast")

A100 = os.path.join(REPO_ROOT, "configs", "clusters", "dgx_a100_80gb.yaml")
GPT_1T = os.path.join(REPO_ROOT, "configs", "paper", "gpt_1t.yaml")


def one_line(capsys) -> str:
    """The whole of stderr, which must be one `error:` line."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def preprocess_ids(tmp_path, capsys, *extra: str, text: str = '{"text": "1 2 3"}\n') -> tuple[int, str]:
    """preprocess_data.main on a one-line NullTokenizer corpus: (exit code, the error line)."""
    (tmp_path / "in.jsonl").write_text(text)
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out" / "x")]
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main([*argv, "--tokenizer-type", "NullTokenizer", *extra])
    return exit_info.value.code, one_line(capsys)


@pytest.mark.parametrize(
    "extra,expected",
    [
        (("--vocab-size", "10", "--workers", "100000"), "--workers 100000 is more than the"),
        (("--vocab-size", "10", "--workers", "0"), "--workers 0 must be >= 1"),
        (
            (
                "--vocab-size",
                "0",
            ),
            "--vocab-size 0 must be >= 1 (NullTokenizer's ids are 0 .. V-1)",
        ),
        (
            (
                "--vocab-size",
                "-5",
            ),
            "--vocab-size -5 must be >= 1",
        ),
        ((), "--tokenizer-type NullTokenizer needs --vocab-size V"),
    ],
    ids=["workers-100000", "workers-0", "vocab-size-0", "vocab-size-negative", "vocab-size-missing"],
)
def test_preprocess_options_are_refused_before_any_work(tmp_path, capsys, monkeypatch, extra, expected):
    """Before: 100000 workers forked until memory ran out; --vocab-size 0 was "NullTokenizer needs model.vocab_size"
    (the trainer's key), and errors exited 1."""
    monkeypatch.setattr(preprocess.multiprocessing, "get_context", lambda *a: pytest.fail("a worker pool was made"))
    code, line = preprocess_ids(tmp_path, capsys, *extra)
    assert code == 2 and expected in line, line
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_preprocess_names_a_json_line_nested_too_deeply(tmp_path, capsys):
    """Before: a RecursionError traceback from json.loads."""
    code, line = preprocess_ids(tmp_path, capsys, "--vocab-size", "10", text="[" * 100000 + "]" * 100000 + "\n")
    assert code == 2 and "in.jsonl:1: JSON nested too deeply to be a document" in line, line
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.parametrize(
    "option,expected",
    [
        (("--rtol", "-1"), "--rtol -1.0 must be a finite number >= 0"),
        (("--rtol", "-1e-5"), "--rtol -1e-05 must be a finite number >= 0"),  # argparse took -1e-5 for an option
        (("--rtol", "nan"), "--rtol nan must be a finite number >= 0"),
        (("--drift-rtol", "inf"), "--drift-rtol inf must be a finite number >= 0"),
        (("--strict-iters", "-2"), "--strict-iters -2 must be >= -1"),
    ],
)
def test_compare_runs_refuses_tolerances_that_decide_nothing(tmp_path, capsys, option, expected):
    """Before: --rtol -1 failed every comparison (and NaN passed every one)."""
    run_a, run_b = write_run(tmp_path / "a", [1.0, 2.0]), write_run(tmp_path / "b", [1.0, 2.0])
    assert compare_runs.main([run_a, run_b, *option], out=io.StringIO()) == 2
    assert expected in one_line(capsys)


@pytest.mark.parametrize("content", [b"\xff\xfe{}\n", b"[" * 100000 + b"]" * 100000 + b"\n"], ids=["binary", "deep"])
def test_compare_runs_names_an_unreadable_metrics_line(tmp_path, capsys, content):
    run_a = write_run(tmp_path / "a", [1.0])
    os.makedirs(tmp_path / "b")
    (tmp_path / "b" / "metrics.jsonl").write_bytes(content)
    assert compare_runs.main([run_a, str(tmp_path / "b")], out=io.StringIO()) == 2
    assert f"{tmp_path / 'b' / 'metrics.jsonl'}:1: " in one_line(capsys)


@pytest.mark.parametrize(
    "option,expected",
    [
        (("--temperature", "nan"), "--temperature=nan must be a number > 0"),
        (("--temperature", "inf"), "--temperature=inf must be a number > 0"),
        (("--temperature", "-1e-3"), "--temperature=-0.001 must be a number > 0"),
        (("--repetition-penalty", "nan"), "--repetition-penalty=nan must be a number > 0"),
        (("--seed", "-1"), "--seed=-1 must be in [0, 2**64 - 1]"),
        (("--seed", str(2**70)), f"--seed={2**70} must be in [0, 2**64 - 1]"),
    ],
)
def test_generate_refuses_sampling_options_in_one_line(tmp_path, capsys, option, expected):
    """Before: --temperature nan passed the check and failed inside sampling with a traceback."""
    assert generate.main(["--checkpoint", str(tmp_path / "none"), *option]) == 2
    assert expected in one_line(capsys)


def test_generate_says_how_long_a_prompt_may_be():
    """Before: "the prompt has 128 tokens; the model takes at most 128" (so 128 looked allowed)."""
    with pytest.raises(ValueError) as error:
        next(generate_tokens(lambda *a: None, [1] * 128, 5, SamplingConfig(greedy=True), 0, "cpu", max_length=128))
    assert str(error.value) == (
        "the prompt has 128 tokens and the model reads at most 128 positions: shorten it to at most 127 tokens, "
        "so that a new token fits"
    )
    SamplingConfig(temperature=1e-3, repetition_penalty=1.2).validate()
    assert not math.isnan(SamplingConfig().temperature)


def test_generate_names_binary_stdin(monkeypatch):
    """Before: "'utf-8' codec can't decode byte 0xff in position 0" (no word of stdin)."""
    stdin = types.SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO(b"ok \xff\xfe"))
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(ValueError) as error:
        generate.read_prompt(types.SimpleNamespace(prompt=None), rank=0)
    assert str(error.value) == "the prompt piped to stdin is not UTF-8 text (byte 3 of 5): pipe text, or give --prompt"
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO("é".encode())))
    assert generate.read_prompt(types.SimpleNamespace(prompt=None), rank=0) == "é"


@pytest.mark.parametrize(
    "args,expected",
    [
        (("--gpus", "3072", "--tokens", "-1e9"), "error: --tokens -1e+09 must be a positive number of training tokens"),
        (("--gpus", "3072", "--tokens", "nan"), "error: --tokens nan must be a positive number of training tokens"),
        (("--gpus", "-8"), "error: --gpus -8 must be in [1, 1,048,576]"),
        (("--gpus", str(10**12), "--search"), f"error: --gpus {10**12} must be in [1, 1,048,576]"),
        (("--gpus", "8", "--search", "--top", "-1"), "error: --top -1 must be >= 1"),
        (
            ("--gpus", "7", "--search"),
            "error: no layout divides --gpus 7: tp must divide model.num_attention_heads=160, pp "
            "model.num_layers=128, and dp train.global_batch_size=3072 (with the micro-batch); give a GPU count "
            "these divide",
        ),
        (("--gpus", "8", "--config", GPT_1T), f"error: --config is given 2 times ({GPT_1T}, {GPT_1T}): give one file"),
    ],
    ids=["tokens-negative", "tokens-nan", "gpus-negative", "gpus-10^12", "top-negative", "7-gpus", "config-twice"],
)
def test_plan_names_the_option(capsys, args, expected):
    """Before: `--tokens -1e9` was argparse's "expected one argument", 7 GPUs printed an empty ranking
    "why: no layout fits in memory" with exit 0, and --search on 10**12 GPUs ran for minutes."""
    assert plan.main(["--cluster", A100, "--config", GPT_1T, *args]) == 2
    assert one_line(capsys).startswith(expected)


@pytest.mark.parametrize(
    "args,expected",
    [
        (("--compare", "--search"), "error: --compare does not use --search: run --compare and --search separately"),
        (("--compare", "--top", "3"), "error: --compare does not use --top: run --compare and --top separately"),
        (
            ("--compare", "--tokens", "1e12", "--search"),
            "error: --compare does not use --search, --tokens: run --compare and --search separately",
        ),
        (("--search", "--tokens", "1e12"), "error: --search does not use --tokens"),
        (("--top", "3"), "error: --top 3 only trims --search's ranking: add --search or drop --top"),
    ],
    ids=["compare-search", "compare-top", "compare-tokens-search", "search-tokens", "top-alone"],
)
def test_plan_refuses_an_option_its_mode_ignores(capsys, args, expected):
    """Before: --compare printed its three schemes and dropped --search, --top and --tokens without a word;
    --search dropped --tokens, and --top without --search did nothing."""
    assert plan.main(["--cluster", A100, "--config", GPT_1T, "--gpus", "3072", *args]) == 2
    assert one_line(capsys).startswith(expected)


def test_a_configured_eos_token_the_tokenizer_lacks_is_refused(tmp_path):
    """Before: the tokenizer fell back to <|endoftext|> (the first usual name it held) without a word."""
    path = make_tokenizer_json(tmp_path, ["<|endoftext|>", "<pad>"])
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": {"content": "</s>", "special": True}}))
    with pytest.raises(ValueError) as error:
        HuggingFaceTokenizer(str(tmp_path))
    assert str(error.value) == (
        f"{config} names eos_token '</s>', which {path} does not hold: add the token to the tokenizer.json, "
        f"or correct eos_token"
    )
    config.write_text(json.dumps({"eos_token": None}))  # transformers writes null when there is none
    assert HuggingFaceTokenizer(str(tmp_path)).eod == 0
    config.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{config}: cannot read it as JSON \(.*\): fix or remove the file$"):
        HuggingFaceTokenizer(str(tmp_path))
    config.write_text(json.dumps({"eos_token": 2}))
    with pytest.raises(ValueError, match=r"eos_token 2 is not a token string"):
        HuggingFaceTokenizer(str(tmp_path))


@pytest.mark.parametrize(
    "args,expected",
    [
        (("--pp", "100000", "--microbatches", "8"), "--pp 100000 x vp 1 x --microbatches 8 is more than the 2,048"),
        (("--pp", "4", "--microbatches", "100000000"), "is more than the 2,048 forward steps a timeline draws"),
        (("--pp", "4", "--microbatches", "8", "--forward-cost", "nan"), "--forward-cost (nan) must be a finite"),
        (("--pp", "4", "--microbatches", "8", "--comm-cost", "inf"), "--comm-cost (inf) must be a finite number"),
        (("--pp", "4", "--microbatches", "8", "--xmax", "-1"), "--xmax (-1.0) must be > 0"),
    ],
    ids=["pp-100000", "microbatches-10^8", "forward-nan", "comm-inf", "xmax-negative"],
)
def test_pipeline_timeline_bounds_what_it_draws(tmp_path, capsys, args, expected):
    """Before: the first two ran past 30 s (a box per step for matplotlib), NaN printed "bubble fraction: nan"
    and drew an empty picture, an infinite message cost was matplotlib's traceback."""
    assert pipeline_timeline.main([*args, "--output", str(tmp_path / "t.png")]) == 2
    assert expected in one_line(capsys)
    assert not (tmp_path / "t.png").exists()


def _binary_stdin_on_rank_0(rank, world_size, out_dir):
    import sys

    from operations.startup import DistEnv

    sys.stdin = types.SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO(b"\xff"))
    tokenizer = types.SimpleNamespace(encode=lambda text: [1], eod=0)
    env = DistEnv(world_size, rank, rank, world_size, "cpu")
    try:
        generate.shared_prompt(types.SimpleNamespace(prompt=None), env, tokenizer)
    except ValueError as err:
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as handle:
            handle.write(str(err))


def test_generate_under_torchrun_every_rank_learns_of_bad_stdin(tmp_path):
    """Rank 0 reads stdin; its failure reaches the other rank instead of leaving it in the broadcast."""
    run_ranks(2, _binary_stdin_on_rank_0, str(tmp_path), timeout=120)
    messages = {(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)}
    assert messages == {"the prompt piped to stdin is not UTF-8 text (byte 0 of 1): pipe text, or give --prompt"}


@pytest.mark.parametrize("kind", ["gpt2bpe", "sentencepiece"])
def test_train_tokenizer_refuses_a_vocabulary_it_cannot_allocate(tmp_path, capsys, kind):
    """Before: --vocab-size 100000000000 aborted the process inside the Rust BPE trainer (exit 134)."""
    (tmp_path / "in.jsonl").write_text('{"text": "hello world"}\n')
    argv = ["--input", str(tmp_path / "in.jsonl"), "--type", kind, "--vocab-size", str(10**11)]
    with pytest.raises(SystemExit) as exit_info:
        train_tokenizer.main([*argv, "--output-dir", str(tmp_path / "tok")])
    assert exit_info.value.code == 2
    assert one_line(capsys) == "error: vocab_size 100000000000 is larger than 4,194,304: give a real vocabulary size"
    assert not (tmp_path / "tok").exists()


def test_merge_datasets_and_prepare_sample_data_exit_2_on_bad_input(tmp_path, capsys):
    """Before: both exited 1 (SystemExit(message)) where every other tool exits 2 on bad input."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.idx").write_bytes(b"")
    out = str(tmp_path / "out" / "merged")
    assert merge_datasets.main(["--input-dir", str(tmp_path / "shards"), "--output-prefix", out]) == 2
    assert one_line(capsys) == f"error: {tmp_path / 'shards' / 'a.bin'} is missing"
    assert merge_datasets.main(["--input", str(tmp_path / "none"), "--output-prefix", out]) == 2
    assert str(tmp_path / "none") in one_line(capsys)
    assert not os.path.exists(tmp_path / "out")
    (tmp_path / "file").write_text("x")
    assert prepare_sample_data.main(["--output-dir", str(tmp_path / "file" / "sample")]) == 2
    assert str(tmp_path / "file") in one_line(capsys)
