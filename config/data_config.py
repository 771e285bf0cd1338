"""The `data` section of the run config: where the tokens come from and how samples are built.

Errors are ValueErrors naming the key; config/schema.py turns them into ConfigErrors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from model.config import check_declared, key_spec


def _expand_home(value: object) -> object:
    """`~/x` -> `/home/me/x` for path strings; anything else (numbers, None) unchanged."""
    return os.path.expanduser(value) if isinstance(value, str) else value


def _parse_data_path(value: list, key: str) -> tuple[list[float] | None, list[str]]:
    """data.builder.parse_data_path (the one parser of blend lists), imported here: data.builder costs ~0.2 CPU s
    (numpy and the dataset modules), which a config read without data paths (the planner, the tools) never needs."""
    from data.builder import parse_data_path

    return parse_data_path(value, key)


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
    """Where tokens come from (Megatron's .bin/.idx, or the bundled sample corpus), tokenizers, samples."""

    TOKENIZER_TYPES: ClassVar[tuple[str, ...]] = (
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "HuggingFaceTokenizer",
        "NullTokenizer",
    )
    SPLIT_KEYS: ClassVar[tuple[str, str, str]] = ("train_data_path", "valid_data_path", "test_data_path")
    FILE_KEYS: ClassVar[tuple[str, str, str]] = ("vocab_file", "merge_file", "tokenizer_model")

    data_path: list = field(
        default_factory=list,
        metadata=key_spec(
            "A blend of .bin/.idx prefixes: [prefix], [w1, prefix1, w2, prefix2] or [prefix1, prefix2] (by size); "
            "split by data.split. Empty: the bundled sample corpus."
        ),
    )
    split: str = field(
        default=DEFAULT_SPLIT,
        metadata=key_spec(
            "Train, validation and test shares of data_path's documents, e.g. 969,30,1 (Megatron's order)."
        ),
    )
    train_data_path: list = field(
        default_factory=list,
        metadata=key_spec(
            "Megatron's separate splits: a blend list as data_path, all of its documents for training (instead of "
            "data_path and split)."
        ),
    )
    valid_data_path: list = field(
        default_factory=list,
        metadata=key_spec("With train_data_path: the validation blend (no prefix of the training one)."),
    )
    test_data_path: list = field(
        default_factory=list, metadata=key_spec("With train_data_path: the test blend (no prefix of the training one).")
    )
    tokenizer_type: str = field(
        default="GPT2BPETokenizer",
        metadata=key_spec(
            "GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer (a tokenizer.json) or NullTokenizer (the "
            "text is already ids; the vocabulary is model.vocab_size).",
            choices=TOKENIZER_TYPES,
        ),
    )
    # Relative tokenizer file paths: see resolve_data_file.
    vocab_file: str | None = field(
        default=None,
        metadata=key_spec(
            "GPT-2 BPE vocab.json (relative: from the working directory, else the config file's folder)."
        ),
    )
    merge_file: str | None = field(
        default=None, metadata=key_spec("GPT-2 BPE merges.txt (relative paths as vocab_file).")
    )
    tokenizer_model: str | None = field(
        default=None,
        metadata=key_spec("SentencePiece .model, or a tokenizer.json (or its folder) for HuggingFaceTokenizer."),
    )
    # Throughput measurements of a real model size need no real data; false refuses it (operations/startup.py).
    use_sample_corpus: bool = field(
        default=False,
        metadata=key_spec(
            "With no data path: train on the sample corpus even where model.vocab_size is set for another "
            "tokenizer (speed measurements at that size); false refuses that."
        ),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=key_spec(
            "Folder of the sample-index caches (Megatron's --data-cache-path). null: index-cache/ beside the first "
            "prefix."
        ),
    )
    num_workers: int = field(
        default=1, metadata=key_spec("Data loader processes per rank (0: load in the training process).", ge=0)
    )
    eod_mask_loss: bool = field(default=False, metadata=key_spec("Give end-of-document tokens loss weight 0."))
    reset_position_ids: bool = field(
        default=False, metadata=key_spec("Restart position ids after each end-of-document token.")
    )
    reset_attention_mask: bool = field(
        default=False, metadata=key_spec("Tokens after an end-of-document token do not attend to those before it.")
    )
    # Megatron's GPTDatasetConfig options (same names, same defaults), see data/builder.py BuildOptions.
    add_extra_token_to_sequence: bool = field(
        default=True,
        metadata=key_spec(
            "Megatron's: samples of seq_length + 1 tokens (inputs and shifted labels); false: exactly seq_length."
        ),
    )
    drop_last_partial_validation_sequence: bool = field(
        default=True, metadata=key_spec("Megatron's: drop the validation split's last partial sample.")
    )
    mid_level_dataset_surplus: float = field(
        default=0.005,
        metadata=key_spec("Megatron's: margin of extra samples each weighted blend component is built with.", ge=0),
    )

    @property
    def has_data(self) -> bool:
        """Whether any data path is given (else the run trains on the bundled sample corpus)."""
        return bool(self.data_path) or any(getattr(self, key) for key in self.SPLIT_KEYS)

    def validate(self) -> None:
        """The declared checks, then each blend list's shape and the rules between this section's keys."""
        check_declared(self, "data")
        for key in ("data_path", *self.SPLIT_KEYS):
            setattr(self, key, [_expand_home(item) for item in getattr(self, key)])
        for key in ("vocab_file", "merge_file", "tokenizer_model", "cache_dir"):
            setattr(self, key, _expand_home(getattr(self, key)))
        for key in ("data_path", *self.SPLIT_KEYS):
            if getattr(self, key):  # each blend list's shape and weights, before any work (one parser: data/)
                _parse_data_path(getattr(self, key), f"data.{key}")
        if self.data_path and any(getattr(self, key) for key in self.SPLIT_KEYS):
            given = next(key for key in self.SPLIT_KEYS if getattr(self, key))
            raise ValueError(
                f"data.data_path and data.{given} are both set: give data_path (with data.split) or the per-split paths"
            )
        if not self.data_path and any(getattr(self, key) for key in self.SPLIT_KEYS) and not self.train_data_path:
            raise ValueError("data.valid_data_path / test_data_path are set without data.train_data_path: give it too")
        if self.use_sample_corpus and self.has_data:
            raise ValueError("data.use_sample_corpus=true and a data path are both set: give one of them")

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

        def data_files(key: str) -> list[tuple[str, str]]:  # (prefix, its .bin with every link resolved)
            prefixes = _parse_data_path(getattr(self, key), f"data.{key}")[1] if getattr(self, key) else []
            return [(prefix, os.path.realpath(prefix + ".bin")) for prefix in prefixes]

        train = {resolved for _, resolved in data_files("train_data_path")}
        for key in self.SPLIT_KEYS[1:]:
            shared = [prefix for prefix, resolved in data_files(key) if resolved in train]
            if shared:
                raise ValueError(
                    f"data.{key} and data.train_data_path both hold {shared[0]}: evaluating on it would "
                    f"measure the training data; give it documents of its own (or data.data_path with data.split)"
                )
