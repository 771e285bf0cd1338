"""Fixtures shared by the data tests."""

import pytest

from tests.data.helpers import VARIED_TEXTS, load_tool, write_jsonl


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory) -> tuple[str, str]:
    """(vocab.json, merges.txt) of a 400-entry GPT-2 BPE trained by tools/train_tokenizer.py on VARIED_TEXTS."""
    tmp = tmp_path_factory.mktemp("tok")
    corpus = write_jsonl(tmp / "c.jsonl", VARIED_TEXTS * 2)
    load_tool("train_tokenizer").main(["--input", corpus, "--vocab-size", "400", "--output-dir", str(tmp)])
    return str(tmp / "vocab.json"), str(tmp / "merges.txt")
