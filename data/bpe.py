"""Byte-level BPE (GPT-2) building blocks: the byte<->unicode map, the reference merge loop, and a fast
merge engine built in memory on tiktoken that is used only where it provably gives the same ids.

Why two engines: tiktoken merges any adjacent pair whose *concatenation* is a known token, while GPT-2's
BPE applies listed merges only. Up to the first step where tiktoken merges an unlisted pair (x, y) into t,
both run the same merges (tiktoken's lowest-ranked candidate is then a listed merge, hence GPT-2's choice
too). At that step the state is one GPT-2 reaches, and x, y sit side by side; GPT-2 run on t's bytes alone
then also reaches [x, y] and stops there, so GPT-2 does not encode t as [t]. Call those tokens tainted, and
(closure) any token with a split into two tokens one of which is tainted. A tiktoken result that holds no
tainted token therefore took listed merges only and equals GPT-2's; the rest go to the reference loop.
Whole pieces that are tokens (tiktoken's shortcut) are covered by the same [t] test.
"""

from __future__ import annotations

import json

import numpy as np

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


class TiktokenBPE:
    """tiktoken's Rust merge loop over the same vocabulary, plus the taint check described above.

    `encode_piece(piece_bytes)` returns vocabulary ids, or None where the result must be recomputed.
    """

    def __init__(self, encoding, rank_to_id: list[int], tainted: set[int]):
        self._encoding = encoding
        self._encode = encoding._encode_single_piece
        self._rank_to_id = rank_to_id
        self._rank_to_id_array = np.asarray(rank_to_id, dtype=np.int64)
        self._tainted = tainted
        self._tainted_array = np.asarray(sorted(tainted), dtype=np.int64)

    @classmethod
    def build(cls, vocab: dict[str, int], merges: list[tuple[str, str]]) -> TiktokenBPE | None:
        """Build from vocab/merges in memory (no download); None when tiktoken is unusable here."""
        try:
            import tiktoken
        except ImportError:
            return None
        byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        to_bytes = lambda tok: bytes(byte_decoder[c] for c in tok)  # noqa: E731
        ranks: dict[bytes, int] = {}
        for byte, ch in sorted(bytes_to_unicode().items()):
            if ch not in vocab:
                return None  # a missing byte would make tiktoken fail on some input
            ranks[bytes([byte])] = len(ranks)
        try:
            for a, b in merges:
                tok = to_bytes(a + b)
                if a + b not in vocab:
                    return None
                if tok in ranks:
                    return None  # a token made by two merges: ranks would no longer be merge order
                ranks[tok] = len(ranks)
        except KeyError:
            return None  # a merge with characters outside the byte alphabet
        rank_to_id = [0] * len(ranks)
        unicode_of = bytes_to_unicode()
        for tok, rank in ranks.items():
            rank_to_id[rank] = vocab["".join(unicode_of[x] for x in tok)]
        try:
            enc = tiktoken.Encoding("local_gpt2_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
        except Exception:
            return None
        if not hasattr(enc, "_encode_single_piece"):
            return None
        return cls(enc, rank_to_id, cls._tainted_ranks(ranks, ReferenceBPE(merges)))

    @staticmethod
    def _tainted_ranks(ranks: dict[bytes, int], reference: ReferenceBPE) -> set[int]:
        """Ranks of tokens GPT-2 does not encode as themselves, closed over two-token splits."""
        unicode_of = bytes_to_unicode()
        tainted: set[bytes] = set()
        for tok in sorted(ranks, key=len):  # shorter first, so the split closure sees its parts done
            if len(tok) < 2:
                continue
            word = "".join(unicode_of[x] for x in tok)
            if reference(word) != [word] or any(
                (tok[:k] in tainted and tok[k:] in ranks) or (tok[k:] in tainted and tok[:k] in ranks)
                for k in range(1, len(tok))
            ):
                tainted.add(tok)
        return {ranks[tok] for tok in tainted}

    def encode_piece(self, piece: bytes) -> list[int] | None:
        """Ids of one pre-tokenised piece, or None if tiktoken's answer may differ from GPT-2's."""
        out = self._encode(piece)
        tainted = self._tainted
        if tainted and any(r in tainted for r in out):
            return None
        to_id = self._rank_to_id
        return [to_id[r] for r in out]

    def encode_text(self, text: str) -> list[int] | None:
        """Ids of a whole text, split by tiktoken's own (Rust) regex, or None if a result is tainted.

        The caller decides whether the Rust regex's Unicode tables can be trusted for this text.
        """
        # encode_to_numpy skips building a Python list; with no special tokens it equals encode_ordinary.
        out = self._encoding.encode_to_numpy(text, disallowed_special=()).astype(np.int64)
        if len(self._tainted_array) and np.isin(out, self._tainted_array).any():
            return None
        return self._rank_to_id_array[out].tolist()
