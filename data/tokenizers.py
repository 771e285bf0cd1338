"""Tokenizers with Megatron's GPT semantics: GPT-2 byte-level BPE and SentencePiece.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size` (unpadded) and `eod`.
"""

from __future__ import annotations

import unicodedata
from itertools import chain

import regex

from data.bpe import GPT2_PATTERN, ReferenceBPE, TiktokenBPE, bytes_to_unicode, load_vocab_and_merges

EOD_TOKEN = "<|endoftext|>"
# Bounds the per-word cache so a long preprocessing run over an open-ended vocabulary of words cannot
# grow without limit; natural text re-hits a few hundred thousand words most of the time.
_CACHE_LIMIT = 1_000_000


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from vocab.json + merges.txt; ids equal transformers' GPT2Tokenizer's.

    Hot path: text goes whole to tiktoken (built in memory from these files; see data/bpe.py for why its
    merges give the same ids) unless it holds characters unknown to this Python's Unicode database. Such
    text, and any tiktoken result flagged by the check in data/bpe.py: `regex` pre-tokenisation, then a
    per-piece cache of ids;
    cache misses go to tiktoken per piece where it provably agrees, else to the reference merge loop.
    """

    def __init__(self, vocab_file: str, merge_file: str, use_tiktoken: bool = True):
        self.vocab, merges = load_vocab_and_merges(vocab_file, merge_file)
        if EOD_TOKEN not in self.vocab:
            raise ValueError(f"{vocab_file}: vocabulary has no {EOD_TOKEN} token")
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.reference = ReferenceBPE(merges)
        self.fast = TiktokenBPE.build(self.vocab, merges) if use_tiktoken else None
        self.cache: dict[str, list[int]] = {}
        self.known_chars: set[str] = set()

    @property
    def vocab_size(self) -> int:
        """Number of entries in vocab.json (unpadded)."""
        return len(self.vocab)

    @property
    def eod(self) -> int:
        """Id of <|endoftext|>."""
        return self.vocab[EOD_TOKEN]

    def _encode_piece(self, piece: str) -> list[int]:
        raw = piece.encode("utf-8")
        if self.fast is not None:
            ids = self.fast.encode_piece(raw)
            if ids is not None:
                return ids
        word = "".join(self.byte_encoder[b] for b in raw)
        # An id missing from vocab.json cannot happen for a consistent vocab/merges pair; fail loudly.
        return [self.vocab[tok] for tok in self.reference(word)]

    def _tiktoken_can_split(self, text: str) -> bool:
        """Whether tiktoken's regex may split `text`: every character was assigned in this Python's
        Unicode database (letters, digits and spaces then mean the same in every engine's tables;
        characters newer than that may be classified differently by tiktoken, `regex` and HF)."""
        if text.isascii():
            return True
        new = set(text) - self.known_chars
        if any(unicodedata.category(c) in ("Cn", "Cs") for c in new):
            return False
        self.known_chars |= new
        return True

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special-token parsing, as Megatron's GPT-2 tokenizer)."""
        if self.fast is not None and self._tiktoken_can_split(text):
            ids = self.fast.encode_text(text)
            if ids is not None:
                return ids
        pieces = self.pattern.findall(text)
        cache = self.cache
        try:
            # C-level lookups and concatenation: the common all-hits case runs no Python per piece.
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))
        except KeyError:
            pass
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        for piece in pieces:
            if piece not in cache:
                cache[piece] = self._encode_piece(piece)
        return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    def decode(self, ids) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 decode with replacement characters."""
        text = "".join(self.id_to_token[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model with Megatron's GPT semantics: end of document = the model's eos id."""

    def __init__(self, model_file: str):
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{model_file}: cannot load SentencePiece model: {exc}") from None
        if self.sp.eos_id() < 0:
            raise ValueError(f"{model_file}: SentencePiece model has no eos piece (needed as end of document)")

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model (unpadded)."""
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        """The model's eos id."""
        return self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        """Text of `ids`."""
        return self.sp.decode([int(i) for i in ids])


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None, tokenizer_model=None):
    """Build the tokenizer named `tokenizer_type` (GPT2BPETokenizer or SentencePieceTokenizer)."""
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError("GPT2BPETokenizer needs vocab_file and merge_file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise ValueError("SentencePieceTokenizer needs tokenizer_model")
        return SentencePieceTokenizer(tokenizer_model)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r} (expected GPT2BPETokenizer or SentencePieceTokenizer)")
