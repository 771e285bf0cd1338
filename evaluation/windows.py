"""Token windows: what the model reads and which of its predictions count, for each convention.

A `Window` holds tokens t_0..t_n: the model reads t_0..t_{n-1} at positions 0..n-1 and predicts t_1..t_n; the
last `scored` predictions count. Every task turns its text into windows here, and evaluation/scoring.py scores
any window list at any layout, so a convention is only the function that builds its windows:

- Megatron-LM (tasks/zeroshot_gpt/datasets.py): WikiText as one token stream, windows of seq_length tokens
  starting every `overlapping_eval` tokens, each after the first scoring only its last `overlapping_eval`
  predictions (so every token after the first is predicted exactly once); LAMBADA's loose split. Its strict
  split is the harness's lambada_openai one below: the two agree on prose, and only the harness's is defined
  the same way on text with newlines or tabs.
- lm-evaluation-harness (lm_eval/utils.py get_rolling_token_windows + make_disjoint_window, models/
  huggingface.py _loglikelihood_tokens, api/model.py TemplateLM._encode_pair): rolling windows of the model's
  length with the end-of-document token before the first, and (context, continuation) pairs truncated
  from the left to max_length + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evaluation.documents import EvalInputError

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Window:
    """tokens [n + 1]: the model reads tokens[:-1] and predicts tokens[1:]; the last `scored` count."""

    tokens: tuple[int, ...]
    scored: int

    def __post_init__(self) -> None:
        if not 0 <= self.scored <= len(self.tokens) - 1:
            raise ValueError(f"a window of {len(self.tokens)} tokens cannot score {self.scored} predictions")

    @property
    def targets(self) -> tuple[int, ...]:
        """The scored target tokens, in order."""
        return self.tokens[len(self.tokens) - self.scored :]


def megatron_windows(tokens: Sequence[int], seq_length: int, overlapping_eval: int) -> list[Window]:
    """Megatron's _LMDataset: window k reads tokens[k * o : k * o + seq_length] (o = overlapping_eval);
    window 0 scores every prediction, later ones the predictions among their last o positions. Windows that
    would score nothing (Megatron's count overshoots by up to seq_length / o windows of padding) are left out."""
    if not 1 <= overlapping_eval <= seq_length:
        raise ValueError(f"eval.overlapping_eval={overlapping_eval} must be in [1, the window {seq_length}]")
    total_targets = len(tokens) - 1
    count = max(-(-max(total_targets - overlapping_eval, 0) // overlapping_eval) + 1, 1)
    windows = []
    for index in range(count):
        start = index * overlapping_eval
        piece = tuple(tokens[start : start + seq_length + 1])
        real = len(piece) - 1
        scored = real if index == 0 else max(0, real - (seq_length - overlapping_eval))
        if scored > 0:
            windows.append(Window(piece, scored))
    return windows


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[Window]:
    """The harness's loglikelihood_rolling windows (context_len 1, disjoint): the first reads the prefix
    token and predicts up to max_length tokens, each later one predicts the next max_length tokens (fewer
    at the end) from the max_length tokens before each."""
    windows = []
    first = min(max_length, len(tokens))
    if first:
        windows.append(Window((prefix_token, *tokens[:first]), first))
    predicted = first
    while predicted < len(tokens):
        count = min(len(tokens) - predicted, max_length)
        end = predicted + count
        windows.append(Window(tuple(tokens[max(end - max_length - 1, 0) : end]), count))
        predicted = end
    return windows


def continuation_window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Window:
    """The harness's window of a (context, continuation) pair: their tokens, the first ones dropped to fit
    max_length + 1; the continuation's predictions count."""
    if not context or not continuation:
        raise ValueError("a loglikelihood request needs context and continuation tokens")
    if len(continuation) > max_length:
        raise EvalInputError(
            f"a continuation of {len(continuation)} tokens does not fit the window of {max_length} tokens"
        )
    return Window(tuple((*context, *continuation)[-(max_length + 1) :]), len(continuation))


def encode_pair(encode: Encode, context: str, continuation: str, prefix_token: int) -> tuple[list[int], list[int]]:
    """(context, continuation) tokens as the harness's TemplateLM makes them for a causal model: trailing
    spaces of the context move to the continuation; the whole text is encoded and split after the context's
    own tokens; an empty context becomes the prefix token (unless the continuation starts with it)."""
    if context == "":
        tokens = encode(continuation)
        return ([prefix_token], tokens) if tokens[:1] != [prefix_token] else (tokens[:1], tokens[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_tokens = encode(context + continuation), encode(context)
    return context_tokens, whole[len(context_tokens) :]


def lambada_openai_request(text: str) -> tuple[str, str]:
    """lambada_openai's (context, continuation) strings: doc_to_text and doc_to_target of its task YAML
    (`text.split(' ')`: single spaces only, so a newline or tab before the last word stays with it)."""
    words = text.split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def lambada_strict_tokens(encode: Encode, text: str, prefix_token: int) -> tuple[list[int], list[int]]:
    """The strict LAMBADA split, as lm-evaluation-harness's lambada_openai makes it: its (context,
    continuation) strings (`lambada_openai_request`) encoded as TemplateLM encodes a pair (`encode_pair`:
    trailing whitespace of the context moves to the target; an empty context reads `prefix_token`).
    On prose this is Megatron's --strict-lambada (the context before the last word, stripped, and ' ' + the
    word, tokenized apart); where a newline or tab sits next to the last word Megatron's `text.split()`
    and `.strip()` would move it out of the target, and its figures would no longer be the harness's."""
    return encode_pair(encode, *lambada_openai_request(text), prefix_token)


def lambada_loose_tokens(encode: Encode, text: str) -> tuple[list[int], list[int]]:
    """Megatron's default LAMBADA: the text tokenized whole, its last token the target."""
    tokens = encode(text)
    return tokens[:-1], tokens[-1:]
