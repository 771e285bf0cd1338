"""tools/preprocess_data.py: Megatron's list-of-strings values, the special-token policy, empty inputs."""

import json
import os
import re

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset
from data.tokenizers import GPT2BPETokenizer
from tests.data.helpers import run_preprocess, write_jsonl

pytestmark = pytest.mark.tier("fast")


def test_list_of_strings_is_one_document_of_sequences(tmp_path, tok_files):
    lines = [{"text": ["First sentence.", "", " Second one!"]}, {"text": "plain"}, {"text": []}, {"text": [""]}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    ds = IndexedDataset(run_preprocess(tok_files, str(inp), str(tmp_path / "out"), "--append-eod"))
    tok = GPT2BPETokenizer(*tok_files)
    # Megatron's encoder: one sequence per non-empty string, EOD appended to the document's last sequence.
    expected = [tok.encode("First sentence."), tok.encode(" Second one!") + [tok.eod], tok.encode("plain") + [tok.eod]]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.document_indices.tolist() == [0, 2, 3, 3, 3]


def test_list_with_a_non_string_names_the_line(tmp_path, tok_files, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "ok"}\n{"text": ["a", 3]}\n', encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        run_preprocess(tok_files, str(inp), str(tmp_path / "out"))
    assert exc.value.code == 2
    assert "in.jsonl:2: value of 'text' is not a string or a list of strings" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_special_token_text_is_plain_by_default_and_eod_with_the_flag(tmp_path, tok_files):
    text = "before<|endoftext|>after <|endoftext|>"
    inp = write_jsonl(tmp_path / "in.jsonl", [text])
    tok = GPT2BPETokenizer(*tok_files)
    plain = IndexedDataset(run_preprocess(tok_files, inp, str(tmp_path / "plain")))
    assert plain[0].tolist() == tok.encode(text) and tok.eod not in plain[0].tolist()
    parsed = IndexedDataset(run_preprocess(tok_files, inp, str(tmp_path / "parsed"), "--parse-special-tokens"))
    expected = tok.encode("before") + [tok.eod] + tok.encode("after ") + [tok.eod]
    assert parsed[0].tolist() == expected
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Tokenizer(vocab=tok_files[0], merges=tok_files[1])
    assert hf.encode(text) == expected  # what megatron-core's HF-based GPT2BPETokenizer produces


@pytest.mark.parametrize("content", ["", '{"text": "bad"\n'])
def test_no_documents_fails_unless_allowed(tmp_path, tok_files, capsys, content):
    inp = tmp_path / "in.jsonl"
    inp.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        run_preprocess(tok_files, str(inp), str(tmp_path / "out"), "--skip-bad-lines")
    assert re.search("no documents read .*nothing written", capsys.readouterr().err)
    assert exc.value.code == 2 and sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    prefix = run_preprocess(tok_files, str(inp), str(tmp_path / "out"), "--skip-bad-lines", "--allow-empty")
    assert "WARNING" in capsys.readouterr().err and len(IndexedDataset(prefix)) == 0
    assert IndexedDataset(prefix).sequence_lengths.dtype == np.int32
