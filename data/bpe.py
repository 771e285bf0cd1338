"""Byte-level BPE (GPT-2) building blocks: the byte<->unicode map, vocab/merges reading and checks, the
`tokenizers` (Rust) BPE merges built in memory from them, and GPT-2's reference merge loop for what they
cannot take.

Why the library's merges equal GPT-2's only for merges in order: GPT-2 applies the lowest-ranked listed pair
at every occurrence in one left-to-right pass, then looks again; `tokenizers` takes one (rank, position) at a
time from a queue, so a pair formed by a merge and ranked *before* it is applied before the rest of that pass
(merges [(aa, a), (a, a)] give "aaaa" -> [aaa, a] there, [aa, aa] in GPT-2). When every merge ranks after all
merges that make its two parts (true of GPT-2's files and of every file a BPE trainer writes), a merge only
forms pairs ranked after it, and the queue applies each rank's pairs exactly as GPT-2's pass does.
"""

from __future__ import annotations

import json

from data.tokenizer_libraries import hf_tokenizers

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def load_vocab_and_merges(vocab_file: str, merge_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Read vocab.json (token -> id) and merges.txt (optional `#version` header, one "a b" per line)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{vocab_file}: cannot read GPT-2 vocabulary: {exc}") from None
    merges = []
    try:
        with open(merge_file, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if line_no == 1 and line.startswith("#version"):
                    continue
                if not line:
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"{merge_file}:{line_no}: expected 'a b', got {line!r}")
                merges.append((parts[0], parts[1]))
    except OSError as exc:
        raise ValueError(f"{merge_file}: cannot read GPT-2 merges: {exc}") from None
    return vocab, merges


def check_vocab_and_merges(
    vocab: object, merges: list[tuple[str, str]], vocab_file: str, merge_file: str, special: set[str]
) -> str | None:
    """ValueError unless vocab.json is an object of token -> id numbering its entries 0..n-1 with every byte
    symbol, and every merge of merges.txt is made of and makes tokens it holds (a truncated vocab.json fails
    here, not as a KeyError when some text is encoded). Returns a warning when many tokens are made by no merge
    (a truncated merges.txt); `special` tokens (the end-of-document token) need no merge."""
    if not isinstance(vocab, dict) or not all(type(i) is int and isinstance(t, str) for t, i in vocab.items()):
        raise ValueError(f"{vocab_file} is not a GPT-2 vocabulary: expected a JSON object of token -> integer id")
    if sorted(vocab.values()) != list(range(len(vocab))):
        outside = [token for token, i in vocab.items() if not 0 <= i < len(vocab)]
        detail = f"{outside[0]!r} has id {vocab[outside[0]]}" if outside else "some ids repeat"
        raise ValueError(f"{vocab_file}: the ids must number its {len(vocab)} entries 0..{len(vocab) - 1}; {detail}")
    symbols = set(bytes_to_unicode().values())
    missing = sorted(symbols - set(vocab))
    if missing:
        raise ValueError(
            f"{vocab_file} lacks {len(missing)} of the 256 byte symbols (e.g. {missing[0]!r}): not a complete "
            "GPT-2 byte-level vocabulary (truncated?)"
        )
    for number, (left, right) in enumerate(merges, 1):
        for token in (left, right, left + right):
            if token not in vocab:
                raise ValueError(
                    f"{merge_file}: merge {number} ({left} {right}) needs {token!r}, which {vocab_file} does not "
                    "hold: the two files do not belong together (a truncated or another model's vocab.json?)"
                )
    made = symbols | {left + right for left, right in merges} | special
    unmade = [token for token in vocab if token not in made]
    if len(unmade) > max(8, len(vocab) // 100):
        return (
            f"{len(unmade)} of the {len(vocab)} tokens of {vocab_file} are made by no merge of "
            f"{merge_file} (e.g. {unmade[0]!r}): a truncated merges.txt encodes text differently"
        )
    return None


class ReferenceBPE:
    """GPT-2's own merge loop (as in OpenAI's encoder.py and Megatron): lowest-ranked listed pair first."""

    def __init__(self, merges: list[tuple[str, str]]):
        self.ranks = {pair: i for i, pair in reversed(list(enumerate(merges)))}

    def __call__(self, word: str) -> list[str]:
        """Split `word` (already byte->unicode mapped) into its BPE tokens."""
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:]):
                rank = self.ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == best[0] and parts[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts


def first_listings(merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`merges` without repeated pairs; a pair keeps its first rank, as in GPT-2's loop (the library would
    keep the last)."""
    return list(dict.fromkeys(merges))


def merges_in_order(merges: list[tuple[str, str]]) -> bool:
    """Whether every merge ranks after every merge that makes one of its parts: then `tokenizers`' BPE
    merges as GPT-2's loop does (the module docstring says why). `merges` holds no repeated pair."""
    last_made: dict[str, int] = {}  # token -> rank of the last merge that makes it
    for rank, (left, right) in enumerate(merges):
        last_made[left + right] = rank
    return all(
        last_made.get(left, -1) < rank and last_made.get(right, -1) < rank for rank, (left, right) in enumerate(merges)
    )


def library_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A `tokenizers.Tokenizer` that merges one piece of GPT-2's regex split (the caller splits): the bytes
    mapped to their symbols with no further split and no prefix space, the listed merges (no special tokens
    parsed: <|endoftext|> in text is text), byte-level decoding that replaces invalid UTF-8 as
    bytes.decode(errors="replace") does."""
    tokenizers = hf_tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer
