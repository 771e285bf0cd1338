"""Tokenizers with Megatron's GPT semantics: GPT-2 byte-level BPE, SentencePiece, a HuggingFace
tokenizer.json (what Llama-3 and most current models ship) and Megatron's NullTokenizer (text = ids).

All expose `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size` (unpadded) and `eod`.
"""

from __future__ import annotations

import json
import logging
import os
from itertools import chain
from typing import Protocol

import regex

from data.bpe import (
    GPT2_PATTERN,
    ReferenceBPE,
    bytes_to_unicode,
    check_vocab_and_merges,
    first_listings,
    library_tokenizer,
    load_vocab_and_merges,
    merges_in_order,
)
from data.tokenizer_libraries import hf_tokenizers, sentencepiece

EOD_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    """What every tokenizer here exposes (the module docstring)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eod(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...


# Bounds the per-word cache so a long run over an open-ended vocabulary of words
# cannot grow without limit; natural text re-hits a few hundred thousand words most of the time.
_CACHE_LIMIT = 1_000_000


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from vocab.json + merges.txt; ids equal transformers' GPT2Tokenizer's.

    Text is split by GPT-2's regex (the `regex` module, as GPT-2 and Megatron: the library's own regex
    engine has other Unicode tables, and on Python source it split 4x slower), each piece is looked up
    in a cache of ids, and a piece not seen yet is merged by the `tokenizers` library (Rust, built in memory
    from these files by data/bpe.py), or by GPT-2's merge loop in Python where the merges are out of order
    (data/bpe.py says why the library then merges differently). use_tokenizers=False takes the merge loop
    for every file (to compare the two).
    """

    def __init__(self, vocab_file: str, merge_file: str, use_tokenizers: bool = True):
        self.vocab, merges = load_vocab_and_merges(vocab_file, merge_file)
        warning = check_vocab_and_merges(self.vocab, merges, vocab_file, merge_file, {EOD_TOKEN})
        if warning:
            logging.getLogger(__name__).warning(warning)
        if EOD_TOKEN not in self.vocab:
            raise ValueError(f"{vocab_file}: vocabulary has no {EOD_TOKEN} token")
        merges = first_listings(merges)
        self.pattern = regex.compile(GPT2_PATTERN)
        self.byte_encoder = bytes_to_unicode()
        self.reference = ReferenceBPE(merges)
        # Decoding needs no merges: the library decodes for both merge engines.
        self.library = library_tokenizer(self.vocab, merges)
        self.library_merges = use_tokenizers and merges_in_order(merges)
        if use_tokenizers and not self.library_merges:
            logging.getLogger(__name__).warning(
                f"{merge_file}: a merge ranks before a merge that makes one of its parts; merging with GPT-2's "
                "loop in Python (slower) to keep its ids"
            )
        self.cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        """Number of entries in vocab.json (unpadded)."""
        return len(self.vocab)

    @property
    def eod(self) -> int:
        """Id of <|endoftext|>."""
        return self.vocab[EOD_TOKEN]

    def _encode_piece(self, piece: str) -> list[int]:
        if self.library_merges:
            # Passing a lone surrogate to Rust would be a TypeError; str.encode names it (preprocessing
            # reports the line as "not encodable as UTF-8").
            piece.encode("utf-8")
            return self.library.encode(piece, add_special_tokens=False).ids
        word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
        # An id missing from vocab.json cannot happen for a consistent vocab/merges pair; fail loudly.
        return [self.vocab[tok] for tok in self.reference(word)]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special-token parsing, as Megatron's GPT-2 tokenizer)."""
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
        """Text of `ids`; byte sequences that are not valid UTF-8 decode with replacement characters. An id
        outside the vocabulary: ValueError (the library would drop it silently)."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < len(self.vocab)), None)
        if bad is not None:
            raise ValueError(f"GPT2BPETokenizer: id {bad} is outside the vocabulary [0, {len(self.vocab)})")
        return self.library.decode(ids)


class SentencePieceTokenizer:
    """A SentencePiece model with Megatron's GPT semantics: end of document = the model's eos id."""

    def __init__(self, model_file: str):
        try:
            self.sp = sentencepiece().SentencePieceProcessor(model_file=model_file)
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


# End-of-document tokens of common tokenizer.json files, tried in order when no tokenizer_config.json says.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<|eot_id|>", "<eos>", "<|im_end|>")


def _configured_eos(config_path: str) -> str | None:
    """The eos_token a tokenizer_config.json names (None when it names none); unreadable: ValueError naming it."""
    try:
        with open(config_path, encoding="utf-8") as handle:
            settings = json.load(handle)
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"{config_path}: cannot read it as JSON ({err}): fix or remove the file") from None
    eos = settings.get("eos_token") if isinstance(settings, dict) else None
    if isinstance(eos, dict):  # AddedToken form: {"content": "</s>", ...}
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise ValueError(f"{config_path}: eos_token {eos!r} is not a token string: give the token's text")
    return eos


class HuggingFaceTokenizer:
    """A HuggingFace `tokenizer.json` (the `tokenizers` library, the engine of transformers' fast tokenizers).

    `tokenizer_model` is the file or the folder holding it. Text is encoded without special tokens (no BOS),
    as the GPT-2 tokenizer here: documents are separated by `eod` only. The end of document is the
    `eos_token` of a tokenizer_config.json beside the file (an error when the tokenizer lacks it), else the
    first of <|endoftext|>, <|end_of_text|>, </s>, <|eot_id|>, <eos>, <|im_end|> it holds.
    """

    def __init__(self, tokenizer_model: str):
        path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
        try:
            self.tokenizer = hf_tokenizers().Tokenizer.from_file(path)
        except Exception as exc:  # the Rust library raises its own exception types: name the file
            raise ValueError(f"{path}: cannot load a HuggingFace tokenizer.json: {str(exc).splitlines()[0]}") from None
        self.path = path
        self._eod = self._find_eod(os.path.join(os.path.dirname(path), "tokenizer_config.json"))

    def _find_eod(self, config_path: str) -> int:
        eos = _configured_eos(config_path) if os.path.isfile(config_path) else None
        if eos is not None:  # the configured token or nothing: another one would end documents where it does not
            token_id = self.tokenizer.token_to_id(eos)
            if token_id is None:
                raise ValueError(
                    f"{config_path} names eos_token {eos!r}, which {self.path} does not hold: add the token to "
                    f"the tokenizer.json, or correct eos_token"
                )
            return token_id
        names = list(_EOD_CANDIDATES)
        for name in names:
            token_id = self.tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ValueError(f"{self.path}: no end-of-document token (tried {', '.join(names)})")

    @property
    def vocab_size(self) -> int:
        """Entries of the vocabulary, added (special) tokens included (unpadded)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        """Id of the end-of-document token."""
        return self._eod

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of `ids`."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class NullTokenizer:
    """Megatron's NullTokenizer: text is space-separated integer ids, already tokenized.

    `vocab_size` counts every id, the end-of-document id included: ids 0 .. vocab_size - 2 are the data's,
    eod = vocab_size - 1 (Megatron's `--vocab-size V` gives V + 1 entries with eod = V).
    """

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs a vocabulary size >= 1, got {vocab_size}")
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        """The ids plus the end-of-document id."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The last id."""
        return self._vocab_size - 1

    def encode(self, text: str) -> list[int]:
        """The integers of `text` ("12 7 3" -> [12, 7, 3]); a word that is no id in the vocabulary: ValueError."""
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integer ids, got {text[:40]!r}") from None
        bad = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise ValueError(f"NullTokenizer: id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return ids

    def decode(self, ids) -> str:
        """The ids as space-separated integers (Megatron's detokenize)."""
        return " ".join(str(int(i)) for i in ids)


TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
):
    """Build the tokenizer named `tokenizer_type` (one of TOKENIZER_TYPES). vocab_size (model.vocab_size: the
    ids plus the end-of-document id) is what NullTokenizer is built from; the other types ignore it."""
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise ValueError("NullTokenizer needs model.vocab_size (its ids plus the end-of-document id)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError("GPT2BPETokenizer needs vocab_file and merge_file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        if not tokenizer_model:
            raise ValueError(f"{tokenizer_type} needs tokenizer_model")
        if tokenizer_type == "HuggingFaceTokenizer":
            return HuggingFaceTokenizer(tokenizer_model)
        return SentencePieceTokenizer(tokenizer_model)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r} (expected one of {', '.join(TOKENIZER_TYPES)})")
