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


# Characters unassigned in Python 3.11's Unicode 14 (U+1FAE8 and U+1FA77 came in Unicode 15), on which the
# `tokenizers` library's regex tables and `regex`'s differ (the split stays `regex`'s).
_NEWER_THAN_PYTHON = "\U0001fae8 shaking face, \U0001fa77 pink heart, mixed\U0001fae8word 日本\U0001fae8 \U0010fffd"


def _cases():
    extra = [a + b for a, b in zip(VARIED_TEXTS, VARIED_TEXTS[1:])]
    long_runs = ["x" * 300, "y" * 20000, "supercalifragilistic" * 300 + " tail", " " * 17 + "y", "\n" * 9]
    line_ends = ["a\r\nb\r\n\r\n", " \r\n \t\r\n  z  ", "\r" * 5 + "\n" * 5]
    return VARIED_TEXTS + extra + ["".join(VARIED_TEXTS), *long_runs, *line_ends, _NEWER_THAN_PYTHON]


@pytest.mark.parametrize("use_tokenizers", [True, False])
def test_gpt2_ids_equal_transformers(bpe_files, hf_tokenizer, use_tokenizers):
    ours = GPT2BPETokenizer(bpe_files[0], bpe_files[1], use_tokenizers=use_tokenizers)
    assert ours.library_merges == use_tokenizers  # a trained merges.txt is in order: the library merges
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
    symbol = bytes_to_unicode()
    lead, letter = tok.vocab[symbol["é".encode()[0]]], tok.vocab["a"]  # half of a two-byte character, then "a"
    assert tok.decode([lead, letter]) == b"\xc3a".decode("utf-8", errors="replace") == "\ufffda"
    with pytest.raises(ValueError, match=rf"id {tok.vocab_size} is outside the vocabulary \[0, {tok.vocab_size}\)"):
        tok.decode([0, tok.vocab_size])


def test_merges_out_of_order_keep_gpt2s_merge_loop(tmp_path, caplog):
    """A merge listed before the merge that makes its part ("aa a" before "a a"): the library would give
    "aaaa" -> [aaa, a], GPT-2's loop (OpenAI's encoder.py, Megatron-LM's gpt2_tokenization.py) [aa, aa]; the
    tokenizer keeps GPT-2's. (transformers 5's GPT2Tokenizer runs on the library and gives [aaa, a].)"""
    import json

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    for token in ("aa", "aaa", "<|endoftext|>"):
        vocab[token] = len(vocab)
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text("#version: 0.2\naa a\na a\n", encoding="utf-8")
    with caplog.at_level("WARNING"):
        ours = GPT2BPETokenizer(str(vocab_file), str(merge_file))
    assert not ours.library_merges and "merges.txt: a merge ranks before" in caplog.text
    assert ours.library.encode("aaaa").tokens == ["aaa", "a"]  # what the library would give
    assert ours.encode("aaaa") == [vocab["aa"], vocab["aa"]]
    in_order = tmp_path / "in_order.txt"
    in_order.write_text("a a\naa a\n", encoding="utf-8")
    assert GPT2BPETokenizer(str(vocab_file), str(in_order)).library_merges


def test_a_lone_surrogate_is_a_unicode_encode_error(bpe_files):
    """Preprocessing turns UnicodeEncodeError into "not encodable as UTF-8" naming the line."""
    tok = GPT2BPETokenizer(*bpe_files)
    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
        tok.encode("text \ud800 more")


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
