"""tools/preprocess_data.py and tools/merge_datasets.py: outputs, merge parity, bad lines, atomicity."""

import os
import sys

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset
from data.tokenizers import GPT2BPETokenizer
from tests.cli_runner import run_cli
from tests.data.helpers import REPO_ROOT, VARIED_TEXTS, load_tool, run_preprocess, write_jsonl

pytestmark = pytest.mark.tier("fast")


def _run(tok_files, inp, prefix, *extra):
    return run_preprocess(tok_files, inp, prefix, "--log-interval", "5", *extra)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_preprocess_tokens_and_eod(tmp_path, tok_files, workers):
    inp = write_jsonl(tmp_path / "in.jsonl", VARIED_TEXTS)
    out = _run(tok_files, inp, str(tmp_path / "out"), "--append-eod", "--workers", workers)
    tok = GPT2BPETokenizer(*tok_files)
    ds = IndexedDataset(out)
    expected = [tok.encode(t) + [tok.eod] for t in VARIED_TEXTS if t]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.dtype == np.uint16
    # Megatron: an empty document keeps its document boundary but has no sequence.
    assert ds.document_count == len(VARIED_TEXTS)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_merge_equals_preprocessing_the_concatenation(tmp_path, tok_files):
    halves = VARIED_TEXTS[:9], VARIED_TEXTS[9:]
    prefixes = [
        _run(tok_files, write_jsonl(tmp_path / f"p{k}.jsonl", h), str(tmp_path / f"p{k}"), "--append-eod")
        for k, h in enumerate(halves)
    ]
    whole = _run(tok_files, write_jsonl(tmp_path / "all.jsonl", VARIED_TEXTS), str(tmp_path / "all"), "--append-eod")
    load_tool("merge_datasets").main(["--input", *prefixes, "--output-prefix", str(tmp_path / "merged")])
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, prefix in enumerate(prefixes):
        for ext in (".bin", ".idx"):
            os.rename(prefix + ext, str(shards / f"part{k}{ext}"))
    load_tool("merge_datasets").main(["--input", str(shards), "--output-prefix", str(tmp_path / "fromdir")])
    for ext in (".bin", ".idx"):
        expected = open(whole + ext, "rb").read()
        assert open(str(tmp_path / "merged") + ext, "rb").read() == expected
        assert open(str(tmp_path / "fromdir") + ext, "rb").read() == expected


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "broken\n', 2, "not valid JSON"),
    (b'{"text": "ok"}\n{"other": "x"}\n', 2, "no key 'text'"),
    (b'{"text": "ok"}\n{"text": "ok"}\n{"text": "\xff\xfe"}\n', 3, "not valid UTF-8"),
    (b'{"text": 5}\n', 1, "not a string"),
    (b'{"text": "ok"}\n{"text": "lone \\ud800 surrogate"}\n', 2, "not encodable as UTF-8"),
]


@pytest.mark.parametrize("content,line,reason", BAD_LINES)
def test_bad_line_stops_with_line_number_and_leaves_nothing(tmp_path, tok_files, capsys, content, line, reason):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(content)
    with pytest.raises(SystemExit) as info:
        _run(tok_files, str(inp), str(tmp_path / "out"), "--workers", "2")
    message = capsys.readouterr().err.strip()
    assert info.value.code == 2 and message.startswith("error: ")
    assert f"in.jsonl:{line}:" in message and reason in message and "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_skip_bad_lines_counts_them(tmp_path, tok_files, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(c for c, _, _ in BAD_LINES))
    out = _run(tok_files, str(inp), str(tmp_path / "out"), "--skip-bad-lines")
    assert "skipped 5 bad lines" in capsys.readouterr().err
    assert len(IndexedDataset(out)) == 5  # the five good "ok" lines


def test_cli_reports_throughput_and_exits_nonzero_on_error(tmp_path, tok_files):
    inp = write_jsonl(tmp_path / "in.jsonl", VARIED_TEXTS)
    cmd = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        inp,
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        tok_files[0],
        "--merge-file",
        tok_files[1],
        "--workers",
        "2",
    ]
    done = run_cli(cmd, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "MB/s per worker" in done.stderr
    missing = run_cli(cmd[:3] + [str(tmp_path / "nope.jsonl")] + cmd[4:], cwd=REPO_ROOT)
    assert missing.returncode != 0 and "nope.jsonl" in missing.stderr


def test_interrupted_run_leaves_no_output(tmp_path, tok_files, monkeypatch):
    from data import preprocess

    inp = write_jsonl(tmp_path / "in.jsonl", VARIED_TEXTS * 50)
    monkeypatch.setattr(preprocess, "_BATCH_LINES", 8)
    real = preprocess._Encoder.encode_batch.__func__
    calls = []

    def interrupt_on_third(cls, batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(cls, batch)

    monkeypatch.setattr(preprocess._Encoder, "encode_batch", classmethod(interrupt_on_third))
    with pytest.raises(SystemExit, match="interrupted"):
        _run(tok_files, inp, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
