"""Train tokenizers from text: GPT-2-style byte-level BPE (vocab.json + merges.txt) or SentencePiece.

The BPE files load in transformers' GPT2Tokenizer and in our GPT2BPETokenizer. `<|endoftext|>` is the
first vocabulary entry (id 0), all 256 byte symbols follow, then one token per merge.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

from data.tokenizer_libraries import hf_tokenizers, sentencepiece
from data.tokenizers import EOD_TOKEN

MAX_VOCAB_SIZE = 1 << 22  # 16x the largest vocabularies in use (~256k); the trainers allocate by it up front


def check_not_too_large(vocab_size: int) -> None:
    """A vocabulary past MAX_VOCAB_SIZE: ValueError (the Rust BPE trainer aborts the process on 10**11)."""
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} is larger than {MAX_VOCAB_SIZE:,}: give a real vocabulary size")


def iter_jsonl_texts(path: str, json_key: str = "text") -> Iterator[str]:
    """Yield `json_key` of every line of a JSONL file; a bad line raises ValueError naming it."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))[json_key]
            except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
                raise ValueError(f"{path}:{line_no}: bad JSONL line ({type(exc).__name__}: {exc})") from None
            if not isinstance(value, str):
                raise ValueError(f"{path}:{line_no}: {json_key!r} is not a string")
            yield value


def train_gpt2_bpe(
    texts: Iterable[str], vocab_size: int, output_dir: str, min_frequency: int = 2, show_progress: bool = False
) -> tuple[str, str]:
    """Train byte-level BPE; write output_dir/vocab.json and merges.txt; return their paths."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} is too small for byte-level BPE (needs >= 257)")
    check_not_too_large(vocab_size)
    tokenizers = hf_tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    # Same pre-tokenisation as GPT-2 (the regex split, no prefix space), so merges never cross pieces.
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        show_progress=show_progress,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    os.makedirs(output_dir, exist_ok=True)
    model = json.loads(tokenizer.to_str())["model"]
    vocab_path = os.path.join(output_dir, "vocab.json")
    merges_path = os.path.join(output_dir, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(model["vocab"], f, ensure_ascii=False)
    with open(merges_path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for merge in model["merges"]:
            f.write((merge if isinstance(merge, str) else " ".join(merge)) + "\n")
    return vocab_path, merges_path


def train_sentencepiece(texts: Iterable[str], vocab_size: int, model_prefix: str, model_type: str = "bpe") -> str:
    """Train a SentencePiece model (with eos, used as end of document); return the .model path."""
    check_not_too_large(vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    sentencepiece().SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        max_sentence_length=1 << 20,
        minloglevel=2,
    )
    return model_prefix + ".model"
