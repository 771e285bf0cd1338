"""The zero-shot tasks: a text turned into windows (evaluation/windows.py), their scores (evaluation/scoring.py)
turned into the figures of each convention, stated next to them (docs/evaluation.md).

A `Task` is prepared once (tokenized, windowed) and scored any number of times: tools/evaluate.py scores it
once, the trainer (eval.*) at every eval.interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evaluation.detokenizers import wikitext_detokenizer
from evaluation.documents import EvalInputError, harness_word_count, megatron_word_count, split_articles
from evaluation.scoring import WindowScore, WindowScorer
from evaluation.windows import (
    Window,
    continuation_window,
    lambada_loose_tokens,
    lambada_strict_tokens,
    megatron_windows,
    rolling_windows,
)

Figures = dict[str, str | int | float]  # a task's named results (metrics.jsonl, --json)


def safe_exp(value: float) -> float:
    """exp(value), inf where it overflows a float."""
    return math.exp(value) if value < 709.0 else math.inf


def capped_perplexity(loss: float) -> float:
    """Megatron's perplexity of a mean loss: exp(min(20, loss))."""
    return math.exp(min(20.0, loss))


@dataclass(frozen=True)
class Task:
    """A task ready to score: its windows and what turns their scores into figures."""

    name: str
    windows: list[Window]
    figures: Callable[[list[WindowScore]], Figures]

    def run(self, scorer: WindowScorer) -> Figures:
        return self.figures(scorer.score(self.windows))


def wikitext_convention(window: int, overlap: int) -> str:
    return (
        f"Megatron-LM: the whole file detokenized, then tokenized; windows of {window} tokens, each after the "
        f"first scoring its last {overlap}; loss = summed token losses / (tokens - 1), perplexity = exp(min(20, "
        f"loss)), adjusted_perplexity = exp(loss * (tokens - 1) / (original_tokens - 1)), original_tokens = "
        f"len(text.strip().split(' ')). lm-evaluation-harness wikitext: each article detokenized, rolling "
        f"windows of {window} tokens after the end-of-document token; word_perplexity = exp(-loglikelihood / "
        f"words), byte_perplexity = exp(-loglikelihood / bytes), bits_per_byte = -loglikelihood / bytes / ln 2, "
        f"words = len(re.split(r'\\s+', article)) and bytes (UTF-8) of the articles before detokenization"
    )


def wikitext_task(text: str, encode: Callable[[str], list[int]], eod: int, window: int, overlap: int) -> Task:
    """Both WikiText conventions over one file (see `wikitext_convention`)."""
    tokens = encode(wikitext_detokenizer(text))
    original = megatron_word_count(text)
    if len(tokens) < 2 or original < 2:
        raise EvalInputError(
            f"the WikiText text is too short: {len(tokens)} tokens and {original} words (Megatron's "
            f"figures divide by tokens - 1 and words - 1)"
        )
    megatron = megatron_windows(tokens, window, overlap)
    articles = split_articles(text)
    harness = [w for article in articles for w in rolling_windows(encode(wikitext_detokenizer(article)), eod, window)]
    words = sum(harness_word_count(article) for article in articles)
    size = sum(len(article.encode("utf-8")) for article in articles)

    def figures(scores: list[WindowScore]) -> Figures:
        loss = -sum(float(s.logprobs.sum()) for s in scores[: len(megatron)]) / (len(tokens) - 1)  # fp64 sum
        ratio = (len(tokens) - 1) / (original - 1)
        loglikelihood = sum(s.total for s in scores[len(megatron) :])
        return {
            "task": "wikitext",
            "convention": wikitext_convention(window, overlap),
            "seq_length": window,
            "overlapping_eval": overlap,
            "tokens": len(tokens),
            "original_tokens": original,
            "token_ratio": ratio,
            "loss": loss,
            "perplexity": capped_perplexity(loss),
            "adjusted_perplexity": safe_exp(loss * ratio),
            "articles": len(articles),
            "words": words,
            "bytes": size,
            "loglikelihood": loglikelihood,
            "word_perplexity": safe_exp(-loglikelihood / words),
            "byte_perplexity": safe_exp(-loglikelihood / size),
            "bits_per_byte": -loglikelihood / size / math.log(2),
        }

    return Task("wikitext", megatron + harness, figures)


def lambada_convention(window: int) -> str:
    return (
        f"LAMBADA: the target is the last word; correct when every target token is the argmax; strict "
        f"(accuracy, lm-evaluation-harness's lambada_openai acc): context = ' '.join(text.split(' ')[:-1]), target "
        f"= ' ' + text.split(' ')[-1] (single spaces: a newline or tab before the last word stays in the target), "
        f"the context's trailing whitespace moved to the target, the whole encoded and split after the context's "
        f"tokens (on prose: Megatron-LM's --strict-lambada); loose (loose_accuracy, Megatron-LM's default): the "
        f"text tokenized whole, its last token the target; windows of at most {window} tokens, the context cut "
        f"from the left (as lm-evaluation-harness). target_perplexity = exp(-mean over examples of the strict "
        f"target's summed log-likelihood) (lm-evaluation-harness's lambada perplexity)"
    )


def lambada_task(texts: Sequence[str], encode: Callable[[str], list[int]], eod: int, window: int) -> Task:
    """LAMBADA strict and loose (see `lambada_convention`); an empty context reads the end-of-document token."""
    strict = [continuation_window(*lambada_strict_tokens(encode, text, eod), window) for text in texts]
    loose = []
    for text in texts:
        context, target = lambada_loose_tokens(encode, text)
        loose.append(continuation_window(context or [eod], target, window))

    def figures(scores: list[WindowScore]) -> Figures:
        total = len(texts)
        correct = sum(s.all_greedy for s in scores[:total])
        loose_correct = sum(s.all_greedy for s in scores[total:])
        mean_loglikelihood = sum(s.total for s in scores[:total]) / total
        return {
            "task": "lambada",
            "convention": lambada_convention(window),
            "seq_length": window,
            "correct": correct,
            "total": total,
            "accuracy": correct / total,
            "loose_correct": loose_correct,
            "loose_accuracy": loose_correct / total,
            "target_loglikelihood": mean_loglikelihood,
            "target_perplexity": safe_exp(-mean_loglikelihood),
        }

    return Task("lambada", strict + loose, figures)


# The figures the trainer logs (counts of the fixed files are left to tools/evaluate.py's record).
TRAINER_FIGURES = (
    "loss",
    "perplexity",
    "adjusted_perplexity",
    "word_perplexity",
    "byte_perplexity",
    "bits_per_byte",
    "accuracy",
    "loose_accuracy",
    "target_perplexity",
)


def trainer_record(figures: Figures) -> dict[str, float]:
    """A task's figures as metrics keys: `wikitext_word_perplexity`, `lambada_accuracy`, ..."""
    return {f"{figures['task']}_{key}": float(figures[key]) for key in TRAINER_FIGURES if key in figures}
