"""evaluation's text handling, without a model: the detokenizer and the rolling windows against
lm-evaluation-harness's own functions, Megatron's WikiText windows against its _LMDataset's masks, the article
split and word counts, LAMBADA's splits, and bad files (one line each)."""

import json
import random
import re

import lm_eval.utils
import pytest

from evaluation.detokenizers import wikitext_detokenizer
from evaluation.documents import (
    EvalInputError,
    harness_word_count,
    megatron_word_count,
    read_lambada,
    read_wikitext,
    split_articles,
)
from evaluation.windows import (
    Window,
    continuation_window,
    encode_pair,
    lambada_loose_tokens,
    lambada_openai_request,
    lambada_strict_tokens,
    megatron_windows,
    rolling_windows,
)
from tests.evaluation.conftest import WIKITEXT

pytestmark = pytest.mark.tier("fast")


def test_the_detokenizer_is_the_harness_one():
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer as theirs

    for text in (WIKITEXT, *split_articles(WIKITEXT), " s ' a ( b ) [ c ] { d } \" e \" ' f ' N 3 ° 4 "):
        assert wikitext_detokenizer(text) == theirs({"page": text})


@pytest.mark.parametrize("length", [0, 1, 5, 8, 9, 16, 17, 40])
def test_rolling_windows_are_the_harness_ones(length):
    tokens = [random.Random(length).randrange(100) for _ in range(length)]
    max_length, prefix = 8, 999
    theirs = []
    for pair in lm_eval.utils.get_rolling_token_windows(tokens, prefix, max_length, context_len=1):
        context, continuation = lm_eval.utils.make_disjoint_window(pair)
        # _loglikelihood_tokens: (context + continuation)[-(max_length + 1):], the continuation scored
        theirs.append(Window(tuple((context + continuation)[-(max_length + 1) :]), len(continuation)))
    assert rolling_windows(tokens, prefix, max_length) == theirs
    assert [t for w in theirs for t in w.targets] == tokens


def megatron_masks(tokens, seq_len, overlap):
    """tasks/zeroshot_gpt/datasets.py _LMDataset.__getitem__, for every index: (text, pad_mask)."""
    total_targets = len(tokens) - 1
    targets = max(total_targets - overlap, 0)
    count = max(-(-targets // overlap) + 1, 1)
    for idx in range(count):
        start = idx * overlap
        piece = list(tokens[start : start + seq_len + 1])
        mask = [1] * len(piece)
        if len(piece) < seq_len + 1:
            mask += [0] * (seq_len + 1 - len(piece))
            piece += [-1] * (seq_len + 1 - len(piece))
        mask = mask[1:]
        if overlap != seq_len and idx != 0:
            mask[:-overlap] = [0] * (seq_len - overlap)
        yield piece, mask


@pytest.mark.parametrize("length,seq_len,overlap", [(50, 8, 3), (50, 8, 8), (9, 8, 2), (5, 8, 2), (100, 16, 1)])
def test_megatron_windows_score_what_its_masks_score(length, seq_len, overlap):
    tokens = list(range(100, 100 + length))
    expected = []  # (target, its context) of every unmasked position
    for piece, mask in megatron_masks(tokens, seq_len, overlap):
        expected += [(piece[i + 1], tuple(piece[: i + 1])) for i, keep in enumerate(mask) if keep]
    ours = []
    for window in megatron_windows(tokens, seq_len, overlap):
        n = len(window.tokens) - 1
        ours += [(window.tokens[i + 1], window.tokens[: i + 1]) for i in range(n - window.scored, n)]
    assert ours == expected
    assert [target for target, _ in ours] == tokens[1:]  # every token after the first, once


def test_articles_and_word_counts():
    articles = split_articles(WIKITEXT)
    assert [a.split("\n")[0] for a in articles] == [" = Robert Boulter = ", " = Du Fu = "]  # "= = Career" is no title
    assert "\n".join(articles) == WIKITEXT.removeprefix(" \n")  # the whitespace-only head is dropped
    assert split_articles("no title here\nat all\n") == ["no title here\nat all\n"]
    assert harness_word_count(articles[0]) == len(re.split(r"\s+", articles[0]))
    assert megatron_word_count(" a b \n c \n") == 4  # "a b \n c".split(" "): a, b, \n, c (split() gives 3)


def test_lambada_splits():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731  (one id per character)
    text = "the cat sat on the mat"
    assert lambada_openai_request(text) == ("the cat sat on the", " mat")
    assert lambada_strict_tokens(encode, text) == (encode("the cat sat on the"), encode(" mat"))
    assert lambada_loose_tokens(encode, text) == (encode("the cat sat on the ma"), encode("t"))
    assert encode_pair(encode, "the cat ", "mat", 0) == (encode("the cat"), encode(" mat"))
    assert encode_pair(encode, "", "mat", 0) == ([0], encode("mat"))
    assert continuation_window([1, 2, 3, 4], [5, 6], 4) == Window((2, 3, 4, 5, 6), 2)


@pytest.mark.parametrize(
    "content,reader,message",
    [
        (None, read_wikitext, "no such file"),
        ("", read_wikitext, "is empty"),
        (" \n \n", read_wikitext, "is empty"),
        (b"\x00\x01binary", read_wikitext, "NUL bytes"),
        (b"caf\xe9", read_wikitext, "not UTF-8"),
        ('{"text": "a b"}\n', read_wikitext, "holds JSON lines"),
        (WIKITEXT, read_lambada, ":2: not JSON"),
        ('{"text": "a b"}\n{"txt": "c"}\n', read_lambada, ':2: expected an object with a non-empty "text"'),
        ("", read_lambada, "is empty"),
    ],
)
def test_bad_files_are_one_line(content, reader, message, tmp_path):
    path = tmp_path / "input"
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(EvalInputError) as caught:
        reader(str(path))
    assert message in str(caught.value) and "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_good_lambada_file(tmp_path):
    path = tmp_path / "lambada_test.jsonl"
    path.write_text(json.dumps({"text": "a b c"}) + "\n\n" + json.dumps({"text": "d e"}) + "\n", encoding="utf-8")
    assert read_lambada(str(path)) == ["a b c", "d e"]
