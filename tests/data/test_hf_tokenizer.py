"""HuggingFaceTokenizer (a tokenizer.json) against transformers' fast tokenizer on the same file."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.indexed_dataset import IndexedDataset
from data.tokenizers import HuggingFaceTokenizer, build_tokenizer
from tests.data.helpers import VARIED_TEXTS, load_tool, write_jsonl

pytestmark = pytest.mark.tier("fast")


def make_tokenizer_json(folder, special: list[str]) -> str:
    """A 300-entry byte-level BPE trained on VARIED_TEXTS, saved as folder/tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(VARIED_TEXTS * 3, trainer)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory):
    """A folder with tokenizer.json (<|begin_of_text|>, <|end_of_text|>) and a tokenizer_config.json naming eos."""
    folder = tmp_path_factory.mktemp("hf_tok")
    make_tokenizer_json(folder, ["<|begin_of_text|>", "<|end_of_text|>"])
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    return folder


def test_ids_equal_transformers(llama3_style):
    from transformers import PreTrainedTokenizerFast

    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(llama3_style))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(llama3_style / "tokenizer.json"))
    assert ours.vocab_size == len(reference) == 300
    for text in VARIED_TEXTS + ["a <|end_of_text|> b"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.eod == reference.convert_tokens_to_ids("<|end_of_text|>") == 1


def test_end_of_document_without_a_config(tmp_path):
    path = make_tokenizer_json(tmp_path, ["<unk>", "</s>"])
    assert HuggingFaceTokenizer(path).eod == 1  # </s>, found among the usual names


def test_bad_files_are_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot load a HuggingFace tokenizer\.json") as error:
        HuggingFaceTokenizer(str(tmp_path))
    assert "\n" not in str(error.value)
    make_tokenizer_json(tmp_path, ["<pad>"])
    with pytest.raises(ValueError, match=r"no end-of-document token \(tried <\|endoftext\|>, "):
        HuggingFaceTokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="HuggingFaceTokenizer needs tokenizer_model"):
        build_tokenizer("HuggingFaceTokenizer")


def test_preprocess_writes_the_same_ids(llama3_style, tmp_path):
    from transformers import PreTrainedTokenizerFast

    texts = VARIED_TEXTS[:6]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    load_tool("preprocess_data").main(
        [
            "--input",
            corpus,
            "--output-prefix",
            str(tmp_path / "hf"),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(llama3_style / "tokenizer.json"),
            "--append-eod",
        ]
    )
    reference = PreTrainedTokenizerFast(tokenizer_file=str(llama3_style / "tokenizer.json"))
    dataset = IndexedDataset(str(tmp_path / "hf_text_document"))
    documents = [text for text in texts if reference.encode(text, add_special_tokens=False)]
    assert len(dataset) == len(documents)
    for k, text in enumerate(documents):
        expected = reference.encode(text, add_special_tokens=False) + [1]
        np.testing.assert_array_equal(dataset[k], expected)
