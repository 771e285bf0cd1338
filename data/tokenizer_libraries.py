"""The tokenizer libraries, imported on first use: the one place that imports them.

sentencepiece and HuggingFace's `tokenizers` (requirements.txt; ~0.01 CPU s each after torch, measured on
the 2-core CPU machine) are needed only by the runs and tools that read or train such a tokenizer (the
default byte-level tokenizer and a GPT-2 vocab.json use neither): `import pretrain_gpt`, which every rank
pays, leaves them out. data/ imports no other package of ours, so these live here rather than in
compat/optional.py; convert/ uses them too.
"""

from __future__ import annotations

from types import ModuleType


def sentencepiece() -> ModuleType:
    """The sentencepiece package (SentencePieceProcessor, SentencePieceTrainer)."""
    import sentencepiece

    return sentencepiece


def sentencepiece_model_pb2() -> ModuleType:
    """sentencepiece's generated protobuf module of a .model file (ModelProto)."""
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2


def hf_tokenizers() -> ModuleType:
    """HuggingFace's `tokenizers` package (Tokenizer, models, pre_tokenizers, decoders, trainers)."""
    import tokenizers

    return tokenizers
