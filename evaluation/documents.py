"""The evaluation files a user hands over, read and checked: WikiText (wiki.test.tokens, raw text) and
LAMBADA (lambada_test.jsonl of the GPT-2 release, {"text": ...} per line). Nothing is downloaded.

Every problem is an `EvalInputError`: one line naming the file (and line) and what to do. The counts that
the conventions divide by live here too, each as its source computes it.
"""

from __future__ import annotations

import json
import os
import re
import stat


class EvalInputError(ValueError):
    """A file to evaluate on is missing, empty or not of the expected format (one line, exit 2)."""


# The most bytes an evaluation file may hold. WikiText-103's and LAMBADA's test files are a few MB; the bound
# keeps /dev/zero, a device or a wrong multi-GB file from being read into memory (and tokenized) whole.
MAX_EVAL_FILE_BYTES = 256 << 20
READ_CHUNK_BYTES = 1 << 20


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of `path`; EvalInputError for a missing, unreadable, binary, non-UTF-8, empty or too
    large (MAX_EVAL_FILE_BYTES) file. Read in chunks, each checked, so that an endless source stops early."""
    if not os.path.exists(path):
        raise EvalInputError(f"{path}: no such file (give the {what})")
    if os.path.isdir(path):
        raise EvalInputError(f"{path} is a folder: give the {what} file itself")
    too_large = (
        f"{path} is larger than {MAX_EVAL_FILE_BYTES >> 20} MiB, the bound on an evaluation file: give the {what}"
    )
    raw = bytearray()
    try:
        with open(path, "rb") as handle:
            status = os.fstat(handle.fileno())
            if stat.S_ISREG(status.st_mode) and status.st_size > MAX_EVAL_FILE_BYTES:
                raise EvalInputError(too_large)
            while chunk := handle.read(READ_CHUNK_BYTES):
                if b"\0" in chunk:
                    raise EvalInputError(f"{path} holds NUL bytes: a binary file, not the {what} (UTF-8 text)")
                raw += chunk
                if len(raw) > MAX_EVAL_FILE_BYTES:  # a device or a pipe: no size to check beforehand
                    raise EvalInputError(too_large)
    except OSError as err:
        raise EvalInputError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise EvalInputError(f"{path}: not UTF-8 text (byte {err.start}): give the {what} (UTF-8 text)") from None
    if not text.strip():
        raise EvalInputError(f"{path} is empty: give the {what}")
    return text


def read_wikitext(path: str) -> str:
    """The raw text of a WikiText file (wiki.test.tokens of WikiText-103, or any text in its format)."""
    text = read_text_file(path, "WikiText file, such as WikiText-103's wiki.test.tokens")
    first = text.lstrip().split("\n", 1)[0]
    if first.startswith("{") and _is_json_object(first):
        raise EvalInputError(
            f"{path} holds JSON lines: the wikitext task reads raw text such as wiki.test.tokens "
            f"(lambada_test.jsonl is for the lambada task)"
        )
    return text


def read_lambada(path: str) -> list[str]:
    """The texts of a LAMBADA file: one JSON object with a non-empty "text" string per line (blank lines
    skipped); the last word of each text is the target."""
    texts = []
    for number, line in enumerate(
        read_text_file(path, "LAMBADA file, lambada_test.jsonl of the GPT-2 release").splitlines(), start=1
    ):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalInputError(
                f"{path}:{number}: not JSON ({err.msg}): the lambada task reads lambada_test.jsonl, one "
                f'{{"text": ...}} object per line'
            ) from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.split():
            raise EvalInputError(f'{path}:{number}: expected an object with a non-empty "text" string')
        texts.append(text)
    return texts


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def split_articles(text: str) -> list[str]:
    """WikiText's articles as lm-evaluation-harness reads them (the EleutherAI/wikitext_document_level
    dataset's rule): a line that is ` = Title = ` (one `=` on each side, after `= = =` / `= =` are joined)
    starts an article; what precedes the first title is an article only if it holds more than whitespace;
    lines are joined with "\\n". A file without a title line is one article."""
    articles: list[str] = []
    lines: list[str] = []
    for line in text.split("\n"):
        joined = line.replace("= = =", "===").replace("= =", "==").strip()
        if joined.startswith("= ") and joined.endswith(" ="):
            article = "\n".join(lines)
            if article.strip():
                articles.append(article)
            lines = []
        lines.append(line)
    articles.append("\n".join(lines))
    return articles


def megatron_word_count(text: str) -> int:
    """Megatron's "original tokens" of a WikiText file: len(text.strip().split(" ")) (single spaces, so a
    line break between spaces counts as a token, as in tasks/zeroshot_gpt/datasets.py)."""
    return len(text.strip().split(" "))


def harness_word_count(article: str) -> int:
    """lm-evaluation-harness's words of one article: len(re.split(r"\\s+", article)) on the text before
    detokenization (preprocess_wikitext.process_results)."""
    return len(re.split(r"\s+", article))
