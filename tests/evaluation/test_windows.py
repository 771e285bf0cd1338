"""evaluation's text handling, without a model: the detokenizer and the rolling windows against
lm-evaluation-harness's own functions, Megatron's WikiText windows against its _LMDataset's masks, the article
split and word counts, LAMBADA's splits, and bad files (one line each)."""

import contextlib
import functools
import json
import os
import random
import re
import threading
import types

import lm_eval.utils
import pytest
import yaml
from lm_eval.api.model import TemplateLM

from evaluation import documents
from evaluation.detokenizers import wikitext_detokenizer
from evaluation.documents import (
    MAX_EVAL_FILE_BYTES,
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
from tests.evaluation.conftest import LAMBADA, WHITESPACE_LAMBADA, WIKITEXT

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
    assert lambada_strict_tokens(encode, text, 0) == (encode("the cat sat on the"), encode(" mat"))
    assert lambada_loose_tokens(encode, text) == (encode("the cat sat on the ma"), encode("t"))
    assert encode_pair(encode, "the cat ", "mat", 0) == (encode("the cat"), encode(" mat"))
    assert encode_pair(encode, "", "mat", 0) == ([0], encode("mat"))
    assert continuation_window([1, 2, 3, 4], [5, 6], 4) == Window((2, 3, 4, 5, 6), 2)


def harness_lambada_tokens(encode, texts: list[str], prefix_token: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) ids of each text by the harness's own code: lambada_openai.yaml's templates
    rendered as its tasks render them, then TemplateLM.loglikelihood's encoding (the empty context included)
    on a causal model whose tokenizer is `encode`."""
    task_file = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "lambada", "lambada_openai.yaml")
    with open(task_file, encoding="utf-8") as handle:
        task = yaml.safe_load(handle)
    model = types.SimpleNamespace(backend="causal", prefix_token_id=prefix_token, tok_encode=lambda s, **_: encode(s))
    model._encode_pair = functools.partial(TemplateLM._encode_pair, model)
    model._loglikelihood_tokens = lambda requests, disable_tqdm: [(c, t) for _, c, t in requests]
    requests = [
        types.SimpleNamespace(
            args=tuple(
                lm_eval.utils.apply_template(task[key], {"text": text}) for key in ("doc_to_text", "doc_to_target")
            )
        )
        for text in texts
    ]
    return TemplateLM.loglikelihood(model, requests, disable_tqdm=True)


def test_the_strict_lambada_split_is_the_harness_one_with_newlines_and_tabs():
    encode = lambda text: list(text.encode("utf-8"))  # noqa: E731  (byte-level: whitespace is its own id)
    texts = [*LAMBADA, *WHITESPACE_LAMBADA, "one\ttwo\nthree", "trailing space "]
    theirs = harness_lambada_tokens(encode, texts, 999)
    assert [lambada_strict_tokens(encode, text, 999) for text in texts] == theirs
    # the texts hold the cases Megatron's split (`text.split()`, stripped) scores differently: a newline
    # or tab before the last word, kept in the harness's target
    assert theirs[len(LAMBADA)] == (encode("import os,"), encode(" sys\nsys"))
    assert theirs[-2] == ([999], encode(" one\ttwo\nthree"))  # no space: the whole text is the target


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


def test_evaluation_files_are_read_within_a_bound(tmp_path, monkeypatch):
    """/dev/zero stops at its first chunk (NUL bytes); a regular file past the bound is refused by its size
    before a byte is read (a sparse file here); a pipe, which has no size, once the bytes read pass it."""
    sparse = tmp_path / "wiki.test.tokens"
    with open(sparse, "wb") as handle:
        handle.truncate(MAX_EVAL_FILE_BYTES + 1)
    for path, reader, message in (
        ("/dev/zero", read_wikitext, "/dev/zero holds NUL bytes"),
        ("/dev/zero", read_lambada, "/dev/zero holds NUL bytes"),
        (str(sparse), read_wikitext, f"{sparse} is larger than 256 MiB, the bound on an evaluation file"),
    ):
        with pytest.raises(EvalInputError, match=f"^{re.escape(message)}") as caught:
            reader(path)
        assert "\n" not in str(caught.value)
    monkeypatch.setattr(documents, "MAX_EVAL_FILE_BYTES", 3 << 20)  # 3 chunks: a pipe past it, written here
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    def write_forever() -> None:
        with contextlib.suppress(BrokenPipeError), open(pipe, "wb") as handle:
            while True:
                handle.write(b"word " * 100_000)

    writer = threading.Thread(target=write_forever, daemon=True)
    writer.start()
    with pytest.raises(EvalInputError, match=f"^{re.escape(str(pipe))} is larger than 3 MiB"):
        read_wikitext(str(pipe))
    writer.join(timeout=10)
    assert not writer.is_alive()


def test_a_good_lambada_file(tmp_path):
    path = tmp_path / "lambada_test.jsonl"
    path.write_text(json.dumps({"text": "a b c"}) + "\n\n" + json.dumps({"text": "d e"}) + "\n", encoding="utf-8")
    assert read_lambada(str(path)) == ["a b c", "d e"]
