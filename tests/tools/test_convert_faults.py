"""Faults a user or a damaged copy hands the converters (issue 31's campaign, each case reproduced first, then
neighbouring cases of the same class): each is ONE line naming the file, flag or value, exit status 2, and no
output or staging folder left behind; legal but suspicious input is one warning line.

- from-hf: config and weights that disagree (vocab_size above the embedding's rows, another hidden size), a
  config.json of another architecture, null, malformed sizes; tokenizer files that do not belong together (a
  truncated vocab.json, malformed merges.txt, ids that do not number the entries, a bad tokenizer_config.json);
  weights of the wrong dtype, damaged safetensors and shard indexes;
- layout flags: below 1 named as the flag, the rest refused by the trainer's own rules and messages;
- SIGTERM while a converter writes removes its staging folder (a real signal to real processes), and a rerun
  removes the staging folder of a process killed harder (kill -9).
Megatron and our own checkpoints: test_convert_faults_megatron.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from convert.staging import staged_folder
from tests.conftest import REPO_ROOT
from tests.tools.converter_inputs import (
    copy,
    cut,
    edit_json,
    refused,
    staging_paths,
)
from tools.convert_checkpoint import main

pytestmark = pytest.mark.tier("fast")


# ---- from-hf: config.json against the weights ------------------------------------------------------
def test_a_vocab_size_above_the_embedding_rows_is_refused(converter_sources, tmp_path, capsys):
    hf = copy(converter_sources["hf"], tmp_path)
    edit_json(os.path.join(hf, "config.json"), lambda c: {**c, "vocab_size": 1000})
    message = refused(capsys, "from-hf", hf, str(tmp_path / "out"))
    assert message == (
        f"{hf}/config.json says vocab_size=1000 but the embedding transformer.wte.weight has 300 rows: the config "
        "and the weights disagree; use the config.json saved with these weights (vocab_size=300)"
    )


BAD_CONFIGS = {
    "hidden-size": (
        lambda c: {**c, "n_embd": 96},
        "and the weights disagree: tensor transformer.wte.weight is [300, 64] in the",
    ),
    "fewer-layers": (
        lambda c: {**c, "n_layer": 5},
        "transformer.h.4.ln_1.weight is missing: the weights hold less than the config's 5 layers describe",
    ),
    "null": (lambda c: None, "config.json holds null, not a JSON object"),
    "list": (lambda c: [c], "config.json holds list, not a JSON object"),
    "bert": (
        lambda c: {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64},
        "model_type='bert'",
    ),
    "llama-keys-missing": (
        lambda c: {**c, "model_type": "llama"},
        "config.json: hidden_size is missing; a llama config needs it",
    ),
    "no-n_layer": (lambda c: {k: v for k, v in c.items() if k != "n_layer"}, "config.json: n_layer is missing"),
    "string-size": (lambda c: {**c, "n_layer": "4"}, "config.json: n_layer is '4', not a whole number >= 1"),
    "zero-heads": (lambda c: {**c, "n_head": 0}, "config.json: n_head is 0, not a whole number >= 1"),
    "heads-not-dividing": (
        lambda c: {**c, "n_head": 5},
        "model.hidden_size=64 is not divisible by model.num_attention_heads=5",
    ),
    "string-epsilon": (
        lambda c: {**c, "layer_norm_epsilon": "small"},
        "config.json: layer_norm_epsilon is 'small', not a number",
    ),
    "string-flag": (
        lambda c: {**c, "tie_word_embeddings": "yes"},
        "config.json: tie_word_embeddings is 'yes', not true or false",
    ),
}


@pytest.mark.parametrize("change,expected", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_a_bad_config_json_is_one_line(converter_sources, tmp_path, capsys, change, expected):
    hf = copy(converter_sources["hf"], tmp_path)
    edit_json(os.path.join(hf, "config.json"), change)
    assert expected in refused(capsys, "from-hf", hf, str(tmp_path / "out"))


# ---- from-hf: tokenizer files ----------------------------------------------------------------------
def _keep_first_entries(path: str, count: int) -> None:
    edit_json(path, lambda vocab: dict(list(vocab.items())[:count]))


def _cut_merges(hf: str, lines: int, mid_line: bool = False) -> None:
    """Keep the first `lines` lines of merges.txt (the #version header is line 1), and half the next one."""
    path = os.path.join(hf, "merges.txt")
    with open(path, encoding="utf-8") as handle:
        kept = handle.readlines()
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(kept[:lines] + ([kept[lines].split(" ")[0]] if mid_line else []))


UNMATCHED_TOKENIZERS = {  # run by test_bad_tokenizer_and_weight_files_are_one_line below
    "vocab-cut-mid-json": (
        lambda hf: cut(os.path.join(hf, "vocab.json")),
        "{hf}/vocab.json: cannot read GPT-2 vocabulary: ",
    ),
    "vocab-missing-entries": (
        lambda hf: _keep_first_entries(os.path.join(hf, "vocab.json"), 280),
        "which {hf}/vocab.json does not hold",
    ),
    "vocab-null": (
        lambda hf: edit_json(os.path.join(hf, "vocab.json"), lambda v: None),
        "vocab.json is not a GPT-2 vocabulary",
    ),
    "vocab-id-outside": (
        lambda hf: edit_json(os.path.join(hf, "vocab.json"), lambda v: {**v, "<|endoftext|>": 5000}),
        "vocab.json: the ids must number its 300 entries 0..299; '<|endoftext|>' has id 5000",
    ),
    "merges-cut-mid-line": (lambda hf: _cut_merges(hf, 10, mid_line=True), "{hf}/merges.txt:11: expected 'a b', got"),
    "more-entries-than-rows": (
        lambda hf: edit_json(os.path.join(hf, "vocab.json"), lambda v: {**v, "extra": len(v)}),
        "tokenizer {hf}/vocab.json has 301 entries but the model's vocabulary is model.vocab_size=300",
    ),
}


def test_a_merges_txt_cut_at_a_line_end_warns(converter_sources, tmp_path, capsys):
    """Every line whole but most merges gone: a tokenizer that works and encodes differently; legal, but one
    warning line says so."""
    hf = copy(converter_sources["hf"], tmp_path)
    _cut_merges(hf, 5)  # 4 of its 43 merges kept: 39 of its tokens are made by no merge
    assert main(["from-hf", hf, str(tmp_path / "out")]) == 0
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: 39 of the 300 tokens of {hf}/vocab.json are made")


def test_a_tokenizer_json_with_a_bad_tokenizer_config_is_refused(converter_sources, tmp_path, capsys):
    """tokenizer.json's tokenizer_config.json (its end of document): malformed or null is one line."""
    from tests.data.test_hf_tokenizer import make_tokenizer_json

    hf = copy(converter_sources["hf"], tmp_path)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        os.remove(os.path.join(hf, name))
    make_tokenizer_json(tmp_path / "in", ["<|endoftext|>"])
    config = os.path.join(hf, "tokenizer_config.json")
    for text, expected in (("{bad", "cannot be read as JSON: Expecting"), ("null", "holds null, not a JSON object")):
        with open(config, "w", encoding="utf-8") as handle:
            handle.write(text)
        assert refused(capsys, "from-hf", hf, str(tmp_path / "out")).startswith(f"{config} {expected}")
    cut(os.path.join(hf, "tokenizer.json"))
    os.remove(config)
    assert "cannot load a HuggingFace tokenizer.json" in refused(capsys, "from-hf", hf, str(tmp_path / "out"))


# ---- from-hf: weight files -------------------------------------------------------------------------
def _retype(hf: str, name: str, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf, "model.safetensors")
    weights = load_file(path)
    weights[name] = weights[name].to(dtype) if name in weights else torch.rand(300, 64)  # an untied head
    save_file(weights, path, metadata={"format": "pt"})


def _shard(hf: str, index) -> None:
    """Split model.safetensors into two shards and write `index(names)` as model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(hf, "model.safetensors"))
    os.remove(os.path.join(hf, "model.safetensors"))
    names = sorted(weights)
    save_file({k: weights[k] for k in names[:5]}, os.path.join(hf, "a.safetensors"))
    save_file({k: weights[k] for k in names[5:]}, os.path.join(hf, "b.safetensors"))
    with open(os.path.join(hf, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
        handle.write(index(names))


def _untie_without_a_head(hf: str) -> None:
    """config.json says tie_word_embeddings=false; the weights keep no lm_head.weight."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf, "config.json")
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({**config, "tie_word_embeddings": False}, handle)
    weights = load_file(os.path.join(hf, "model.safetensors"))
    weights.pop("lm_head.weight", None)
    save_file(weights, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})


BAD_WEIGHTS = {
    "untied-config-without-a-head": (  # before: "... hold less than the config's 4 layers describe"
        _untie_without_a_head,
        "{hf}: transformers tensor lm_head.weight is missing: config.json says tie_word_embeddings=false (an output "
        "layer of its own) but the weights hold none",
    ),
    "int64": (
        lambda hf: _retype(hf, "transformer.h.0.mlp.c_fc.weight", torch.int64),
        "{hf}: tensor transformer.h.0.mlp.c_fc.weight holds int64 values, not weights in fp32, bf16, fp16 or fp64",
    ),
    "fp8": (lambda hf: _retype(hf, "transformer.ln_f.weight", torch.float8_e4m3fn), "holds float8_e4m3fn values"),
    "truncated": (
        lambda hf: cut(os.path.join(hf, "model.safetensors")),
        "{hf}/model.safetensors cannot be read: Error while",
    ),
    "index-null": (
        lambda hf: _shard(hf, lambda names: "null"),
        "model.safetensors.index.json holds null, not a JSON object",
    ),
    "index-no-map": (lambda hf: _shard(hf, lambda names: "{}"), "model.safetensors.index.json has no weight_map"),
    "index-escapes": (
        lambda hf: _shard(hf, lambda names: json.dumps({"weight_map": {n: "../../x.safetensors" for n in names}})),
        "names shard '../../x.safetensors', which is not a file name inside {hf}",
    ),
    "untied-head-of-a-tied-config": (
        lambda hf: _retype(hf, "lm_head.weight", torch.float32),
        "tie_word_embeddings is true but the weights hold a lm_head.weight of their own (not the embedding)",
    ),
    "index-missing-shard": (
        lambda hf: _shard(hf, lambda names: json.dumps({"weight_map": {n: "c.safetensors" for n in names}})),
        "names shard c.safetensors, which {hf} lacks",
    ),
}


@pytest.mark.parametrize(
    "damage,expected",
    [*UNMATCHED_TOKENIZERS.values(), *BAD_WEIGHTS.values()],
    ids=[*UNMATCHED_TOKENIZERS, *BAD_WEIGHTS],
)
def test_bad_tokenizer_and_weight_files_are_one_line(converter_sources, tmp_path, capsys, damage, expected):
    """Tokenizer files that do not belong together (or to the model), weights of the wrong dtype, damaged
    safetensors files and shard indexes."""
    hf = copy(converter_sources["hf"], tmp_path)
    damage(hf)
    assert expected.format(hf=hf) in refused(capsys, "from-hf", hf, str(tmp_path / "out"))


# ---- layout flags ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command,flags,expected",
    [
        ("to-megatron", ["--vp", "2", "--pp", "1"], "parallel.vp_size=2 needs parallel.pp_size > 1"),
        ("to-megatron", ["--tp", "0"], "--tp 0: a parallel size must be >= 1"),
        ("to-megatron", ["--pp", "-1"], "--pp -1: a parallel size must be >= 1"),
        ("to-megatron", ["--tp", "3"], "model.num_attention_heads=4 is not divisible by parallel.tp_size=3"),
        ("to-megatron", ["--pp", "3"], "model.num_layers=4 is not divisible by parallel.pp_size * parallel.vp_size"),
        ("from-hf", ["--vp", "0"], "--vp 0: a parallel size must be >= 1"),
        ("from-hf", ["--vp", "2", "--pp", "1"], "parallel.vp_size=2 needs parallel.pp_size > 1"),
        ("from-megatron", ["--tp", "0"], "--tp 0: a parallel size must be >= 1"),
    ],
)
def test_layout_flags_are_checked_by_the_trainers_rules(converter_sources, tmp_path, capsys, command, flags, expected):
    source = {"to-megatron": "ours", "from-hf": "hf", "from-megatron": "megatron"}[command]
    assert refused(capsys, command, converter_sources[source], str(tmp_path / "out"), *flags).startswith(expected)


def test_generate_checks_a_transformers_folder_as_from_hf_does(converter_sources, tmp_path, capsys):
    from tools import generate

    hf = copy(converter_sources["hf"], tmp_path)
    edit_json(os.path.join(hf, "config.json"), lambda c: {**c, "vocab_size": 1000})
    assert generate.main(["--checkpoint", hf, "--prompt", "x", "--max-new-tokens", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: {hf}/config.json says vocab_size=1000 but the embedding transformer.wte.weight has 300 "
        "rows: the config and the weights disagree; use the config.json saved with these weights (vocab_size=300)"
    ]


def test_bad_output_paths_and_sizes_are_one_line(converter_sources, tmp_path, capsys):
    ours = converter_sources["ours"]
    assert refused(capsys, "to-hf", ours, str(tmp_path / "out"), "--max-shard-size", "0") == (
        "--max-shard-size='0' must be above 0 (e.g. 5GB)"
    )
    missing = str(tmp_path / "no-such-folder" / "model.pt")
    assert main(["consolidate", ours, missing]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: output {missing}: its folder {tmp_path / 'no-such-folder'} does not exist; create it first"
    ]


# ---- staging folders: SIGTERM, and what kill -9 leaves ---------------------------------------------
# Runs the converter with its last step (the rename into place) replaced by a wait, so that a signal is sure to
# arrive while the output is staged: real processes, real signals.
STAGED_THEN_WAIT = """
import faulthandler, signal, sys, time
import convert.staging, data.atomic_files

faulthandler.register(signal.SIGUSR1)  # a process that outlives its signal shows where it is

def wait(*args, **kwargs):
    print("staged", flush=True)
    time.sleep(300)

convert.staging.publish_folder = wait
data.atomic_files.publish = wait
from tools.convert_checkpoint import main
sys.exit(main(sys.argv[1:]))
"""


def start_staged(*argv: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", STAGED_THEN_WAIT, *argv],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal for it alone (and none of the terminal's reaches it)
    )
    return process


def finish(process: subprocess.Popen, timeout: float = 300.0) -> str:
    """Its stderr once it has exited (both pipes drained meanwhile); where it hangs, if it does not."""
    try:
        return process.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to stderr
        time.sleep(2)
        process.kill()
        raise AssertionError(f"still running {timeout} s after its signal: {process.communicate()[1]}") from None


def wait_until_staged(process: subprocess.Popen) -> None:
    for line in process.stdout:
        if line.strip() == "staged":
            return
    raise AssertionError(f"the converter ended before staging its output: {process.wait()} {process.stderr.read()}")


@pytest.mark.tier("full")  # signals to a real converter process: the launch path
def test_sigterm_removes_the_staging_folder_and_a_rerun_removes_a_killed_ones(converter_sources, tmp_path, capsys):
    runs = {
        "to-hf": converter_sources["ours"],
        "to-megatron": converter_sources["ours"],
        "from-hf": converter_sources["hf"],
        "from-megatron": converter_sources["megatron"],
        "consolidate": converter_sources["ours"],
    }
    outs = {command: str(tmp_path / f"{command}.out") for command in runs}
    processes = {command: start_staged(command, source, outs[command]) for command, source in runs.items()}
    killed_out = str(tmp_path / "killed.out")
    killed = start_staged("to-hf", converter_sources["ours"], killed_out)
    try:
        for command, process in processes.items():
            wait_until_staged(process)
            assert staging_paths(outs[command]), command  # staged: the signal arrives mid-write
            process.send_signal(signal.SIGTERM)
        wait_until_staged(killed)
        killed.kill()  # kill -9: no handler runs, the staging folder stays
        for command, process in processes.items():
            stderr = finish(process)
            assert process.returncode == 128 + signal.SIGTERM, (command, stderr)
            assert stderr.strip().splitlines()[-1] == (
                f"stopped by SIGTERM: {outs[command]} was not written (nothing half-written left)"
            )
            assert not os.path.exists(outs[command]) and not staging_paths(outs[command]), command
        finish(killed)
        assert killed.returncode == -signal.SIGKILL
    finally:
        for process in [*processes.values(), killed]:
            if process.poll() is None:
                process.kill()
                process.communicate()
    (stale,) = staging_paths(killed_out)
    assert stale == f"{killed_out}.tmp-{socket.gethostname()}-{killed.pid}" and os.path.isdir(stale)
    assert main(["to-hf", converter_sources["ours"], killed_out]) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"removed {stale}, left by an interrupted conversion (its process is gone)"
    ]
    assert os.path.isfile(os.path.join(killed_out, "model.safetensors")) and not staging_paths(killed_out)


def test_a_live_process_staging_is_kept_and_the_sigterm_handler_restored(tmp_path):
    """A staging folder whose process lives (here: this one's, as another converter on this host would have)
    is left alone; the handler found before staging comes back after (whatever it was on entry)."""
    out = str(tmp_path / "out")
    before = signal.getsignal(signal.SIGTERM)
    other = f"{out}.tmp-{socket.gethostname()}-{os.getppid()}"  # the parent: alive
    os.makedirs(other)
    with staged_folder(out) as tmp:
        assert signal.getsignal(signal.SIGTERM) is not before
        assert os.path.isdir(other) and tmp == f"{out}.tmp-{socket.gethostname()}-{os.getpid()}"
    assert signal.getsignal(signal.SIGTERM) is before
    assert os.path.isdir(out) and os.path.isdir(other)
