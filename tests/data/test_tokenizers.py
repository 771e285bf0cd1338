"""GPT-2 BPE ids equal transformers' GPT2Tokenizer on files made by tools/train_tokenizer.py.

Also: SentencePiece with Megatron's GPT semantics, build_tokenizer's errors.
"""

import os

import pytest

from data.bpe import bytes_to_unicode
from data.tokenizers import GPT2BPETokenizer, SentencePieceTokenizer, build_tokenizer
from tests.data.helpers import VARIED_TEXTS, load_tool, write_jsonl

pytestmark = pytest.mark.tier("fast")


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """vocab.json + merges.txt trained by the tool on the varied texts (repeated, so pairs recur)."""
    tmp = tmp_path_factory.mktemp("bpe")
    corpus = write_jsonl(tmp / "corpus.jsonl", VARIED_TEXTS * 3)
    load_tool("train_tokenizer").main(
        [
            "--input",
            corpus,
            "--type",
            "gpt2bpe",
            "--vocab-size",
            "700",
            "--min-frequency",
            "1",
            "--output-dir",
            str(tmp / "tok"),
        ]
    )
    return str(tmp / "tok" / "vocab.json"), str(tmp / "tok" / "merges.txt")


@pytest.fixture(scope="module")
def hf_tokenizer(bpe_files):
    from transformers import GPT2Tokenizer

    tok = GPT2Tokenizer(vocab=bpe_files[0], merges=bpe_files[1])
    assert len(tok) > 300  # guards against transformers 5's silently empty tokenizer
    return tok


def _cases():
    extra = [a + b for a, b in zip(VARIED_TEXTS, VARIED_TEXTS[1:])]
    return VARIED_TEXTS + extra + ["".join(VARIED_TEXTS), "x" * 300, " " * 17 + "y", "\n" * 9]


@pytest.mark.parametrize("use_tiktoken", [True, False])
def test_gpt2_ids_equal_transformers(bpe_files, hf_tokenizer, use_tiktoken):
    ours = GPT2BPETokenizer(*bpe_files, use_tiktoken=use_tiktoken)
    assert (ours.fast is not None) == use_tiktoken
    for text in _cases():
        expected = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, repr(text)
        assert ours.encode(text) == expected, repr(text)  # second call: served from the cache


def test_gpt2_decode_round_trip_and_eod(bpe_files):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0], merge_file=bpe_files[1])
    for text in _cases():
        assert tok.decode(tok.encode(text)) == text
    assert tok.eod == tok.vocab["<|endoftext|>"]
    assert tok.vocab_size == len(tok.vocab)


def test_bytes_to_unicode_matches_the_spec():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    for b in list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256)):
        assert table[b] == chr(b)
    others = [b for b in range(256) if table[b] != chr(b)]
    assert [table[b] for b in others] == [chr(256 + n) for n in range(68)]


def test_unknown_tokenizer_type_is_named():
    with pytest.raises(ValueError, match="NoSuchTokenizer"):
        build_tokenizer("NoSuchTokenizer")


def test_sentencepiece_tool_and_gpt_semantics(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", VARIED_TEXTS * 20)
    load_tool("train_tokenizer").main(
        ["--input", corpus, "--type", "sentencepiece", "--vocab-size", "600", "--output-dir", str(tmp_path / "sp")]
    )
    model = os.path.join(tmp_path, "sp", "tokenizer.model")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.eod == tok.sp.eos_id() == 2
    assert tok.vocab_size == tok.sp.get_piece_size()
    text = "Hello world! Café 日本語"
    assert tok.decode(tok.encode(text)) == text


def test_null_tokenizer_reads_ids_and_ends_documents_with_the_last_id():
    """Megatron's NullTokenizer: text is space-separated ids; the vocabulary is those ids plus eod (the last)."""
    from data.tokenizers import NullTokenizer, build_tokenizer

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=301)  # Megatron's --vocab-size 300
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 301 and tokenizer.eod == 300
    assert tokenizer.encode(" 12 7\n0  299 ") == [12, 7, 0, 299]
    assert tokenizer.decode([12, 7, 300]) == "12 7 300"
    with pytest.raises(ValueError, match="space-separated integer ids"):
        tokenizer.encode("12 seven")
    with pytest.raises(ValueError, match=r"id 301 is outside the vocabulary \[0, 301\)"):
        tokenizer.encode("1 301")
    with pytest.raises(ValueError, match="NullTokenizer needs model.vocab_size"):
        build_tokenizer("NullTokenizer")


def test_preprocess_data_takes_a_null_tokenizer_with_megatrons_vocab_size(tmp_path):
    """tools/preprocess_data.py --tokenizer-type NullTokenizer --vocab-size 300: ids kept, eod = 300."""
    from data.indexed_dataset import IndexedDataset

    corpus = write_jsonl(tmp_path / "ids.jsonl", ["5 6 7", "299 0"])
    prefix = str(tmp_path / "ids")
    argv = ["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
    load_tool("preprocess_data").main([*argv, "--append-eod"])
    dataset = IndexedDataset(prefix + "_text_document")
    assert [list(map(int, dataset[i])) for i in range(len(dataset))] == [[5, 6, 7, 300], [299, 0, 300]]


def test_a_truncated_vocab_is_refused_when_the_tokenizer_is_built(bpe_files, tmp_path):
    """A vocab.json cut short (entries a merge of merges.txt needs are gone) is one ValueError naming both files
    when the tokenizer is built, not a KeyError when some text is first encoded."""
    import json

    vocab_file, merge_file = bpe_files
    with open(vocab_file, encoding="utf-8") as handle:
        vocab = json.load(handle)
    kept = dict(sorted(vocab.items(), key=lambda item: item[1])[: len(vocab) - 50])
    truncated = tmp_path / "vocab.json"
    truncated.write_text(json.dumps(kept), encoding="utf-8")
    with pytest.raises(ValueError, match=r"merge \d+ .* needs .*which .*vocab.json does not hold"):
        GPT2BPETokenizer(str(truncated), merge_file)
