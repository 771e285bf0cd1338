"""The `data` section of the run config: where the tokens come from and how samples are built.

Errors are ValueErrors naming the key; config/schema.py turns them into ConfigErrors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar


def _expand_home(value: object) -> object:
    """`~/x` -> `/home/me/x` for path strings; anything else (numbers, None) unchanged."""
    return os.path.expanduser(value) if isinstance(value, str) else value


def resolve_data_file(path: str | None, base: str, base_first: bool = False) -> str | None:
    """A relative tokenizer file path made usable from anywhere: taken relative to the working directory when
    it exists there (base_first=False, the YAML rule) and else relative to `base` when it exists there
    (absolute then); base_first=True tries `base` first (a checkpoint's saved config: converters record
    their copied files relative to the checkpoint root). Absolute, `~`, missing or None paths: unchanged."""
    if not path or os.path.isabs(path) or path.startswith("~"):
        return path
    beside = os.path.abspath(os.path.join(base, path))
    if os.path.exists(beside) and (base_first or not os.path.exists(path)):
        return beside
    return path


DEFAULT_SPLIT = "969,30,1"


@dataclass
class DataConfig:
    data_path: list = field(default_factory=list)  # [prefix] or [w1, prefix1, w2, prefix2]; empty = sample corpus
    split: str = DEFAULT_SPLIT
    # Megatron's separate splits: each a blend list as data_path, all of its documents in that split (instead
    # of data_path and split)
    train_data_path: list = field(default_factory=list)
    valid_data_path: list = field(default_factory=list)
    test_data_path: list = field(default_factory=list)
    # GPT2BPETokenizer | SentencePieceTokenizer | HuggingFaceTokenizer | NullTokenizer (text = ids; its size is
    # model.vocab_size). Relative file paths: see resolve_data_file.
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None  # SentencePiece .model, or a tokenizer.json (or its folder)
    # With no data path: true trains on the bundled sample corpus even where model.vocab_size is set for another
    # tokenizer (throughput measurements of a real model size); false refuses that (training/setup.py).
    use_sample_corpus: bool = False
    cache_dir: str | None = None  # index caches (Megatron's --data-cache-path); None = next to the data
    num_workers: int = 1
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # Megatron's GPTDatasetConfig options (same names, same defaults), see data/builder.py BuildOptions.
    add_extra_token_to_sequence: bool = True  # False: samples of exactly seq_length tokens
    drop_last_partial_validation_sequence: bool = True
    mid_level_dataset_surplus: float = 0.005  # margin each weighted blend component is built with

    SPLIT_KEYS: ClassVar[tuple[str, str, str]] = ("train_data_path", "valid_data_path", "test_data_path")
    TOKENIZER_TYPES: ClassVar[tuple[str, ...]] = (
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "HuggingFaceTokenizer",
        "NullTokenizer",
    )
    FILE_KEYS: ClassVar[tuple[str, str, str]] = ("vocab_file", "merge_file", "tokenizer_model")

    @property
    def has_data(self) -> bool:
        """Whether any data path is given (else the run trains on the bundled sample corpus)."""
        return bool(self.data_path) or any(getattr(self, key) for key in self.SPLIT_KEYS)

    def validate(self) -> None:
        if not self.mid_level_dataset_surplus >= 0:
            raise ValueError(f"data.mid_level_dataset_surplus={self.mid_level_dataset_surplus} must be >= 0")
        for key in ("data_path", *self.SPLIT_KEYS):
            setattr(self, key, [_expand_home(item) for item in getattr(self, key)])
        for key in ("vocab_file", "merge_file", "tokenizer_model", "cache_dir"):
            setattr(self, key, _expand_home(getattr(self, key)))
        for key in ("data_path", *self.SPLIT_KEYS):
            if getattr(self, key):  # each blend list's shape and weights, before any work (one parser: data/)
                from data.builder import parse_data_path  # here: numba behind data/ is needed only with data

                parse_data_path(getattr(self, key), f"data.{key}")
        if self.data_path and any(getattr(self, key) for key in self.SPLIT_KEYS):
            given = next(key for key in self.SPLIT_KEYS if getattr(self, key))
            raise ValueError(
                f"data.data_path and data.{given} are both set: give data_path (with data.split) or the per-split paths"
            )
        if not self.data_path and any(getattr(self, key) for key in self.SPLIT_KEYS) and not self.train_data_path:
            raise ValueError("data.valid_data_path / test_data_path are set without data.train_data_path: give it too")
        if self.use_sample_corpus and self.has_data:
            raise ValueError("data.use_sample_corpus=true and a data path are both set: give one of them")
        if self.tokenizer_type not in self.TOKENIZER_TYPES:
            raise ValueError(
                f"data.tokenizer_type={self.tokenizer_type!r} is not one of {', '.join(self.TOKENIZER_TYPES)}"
            )
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0")

    def check_sources(self) -> None:
        """What a new run is asked to read: an empty file or folder name (data.cache_dir="" would silently keep
        the indices in memory), and with per-split paths data.split (ignored) and a prefix of
        data.train_data_path in valid or test (evaluation on training data). Not part of validate(): a
        checkpoint's saved config is still converted and sampled from as it was."""
        for key in (*self.FILE_KEYS, "cache_dir"):
            if getattr(self, key) == "":
                raise ValueError(f"data.{key} is an empty string: give a path, or leave the key out")
        if not self.train_data_path:
            return
        if self.split != DEFAULT_SPLIT:
            raise ValueError(
                f"data.split={self.split!r} is not used with data.train_data_path (each split reads its own "
                f"path): drop data.split, or give data.data_path instead of the per-split paths"
            )
        from data.builder import parse_data_path

        def data_files(key: str) -> list[tuple[str, str]]:  # (prefix, its .bin with every link resolved)
            prefixes = parse_data_path(getattr(self, key), f"data.{key}")[1] if getattr(self, key) else []
            return [(prefix, os.path.realpath(prefix + ".bin")) for prefix in prefixes]

        train = {resolved for _, resolved in data_files("train_data_path")}
        for key in self.SPLIT_KEYS[1:]:
            shared = [prefix for prefix, resolved in data_files(key) if resolved in train]
            if shared:
                raise ValueError(
                    f"data.{key} and data.train_data_path both hold {shared[0]}: evaluating on it would "
                    f"measure the training data; give it documents of its own (or data.data_path with data.split)"
                )
