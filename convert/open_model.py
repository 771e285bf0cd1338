"""One door to open a model: a checkpoint of this trainer (saved at any layout) or a transformers folder ->
its run config (model and tokenizer sections), its tokenizer, and its weights placed at a layout.

tools/generate.py, evaluation/model_source.py and tools/convert_checkpoint.py open models only here, so a
model opens (and is refused: a transformers folder without a tokenizer, a tokenizer that is not the model's)
the same way everywhere. It lives in convert/ rather than checkpoint/ because it reads transformers folders
(convert/hf_folder.py), and convert/ imports checkpoint/, not the other way round.

    source = ModelSource.at(path)                 # or ModelSource.given(checkpoint, hf, "--hf DIR")
    config = open_config(source, overrides)       # Config: the model and tokenizer sections, dropout off
    tokenizer = run_tokenizer(config)             # checked against model.vocab_size
    chunks = open_model(config, source, state, device, dtype)   # this rank's chunks at `state`, eval mode
    run_config, tensors = global_state(source)    # the converters: the single-process state dict
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from checkpoint import CheckpointError, resolve_checkpoint
from config.schema import Config, apply_overrides, config_from_dict
from convert.hf_folder import HFFolderError, hf_model_config, read_hf_weights, tokenizer_section
from convert.model_weights import Tensors, checkpoint_chunks, load_global_state, place_global_weights, read_run_config
from data.tokenizers import build_tokenizer
from model.config import ModelConfig
from model.gpt import GPTModel
from model.rank_spec import RankSpec
from parallel.model_builder import build_chunk_modules, rank_spec
from parallel.state import ParallelState

# The sections of a checkpoint's saved config that belong to the run that trained it, not to its model: the
# layout it trained at (the opener chooses one), its W&B run and logs, its zero-shot files.
RUN_SECTIONS = ("parallel", "logging", "eval")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a checkpoint's iteration folder, or a transformers folder."""

    iter_dir: str | None = None
    hf_dir: str | None = None

    @classmethod
    def at(cls, path: str) -> ModelSource:
        """The model at `path`: a transformers folder (one holding config.json), else a checkpoint (a
        checkpoints folder, its latest complete iteration, or one iter_XXXXXXX folder)."""
        if os.path.isfile(os.path.join(path, "config.json")):
            return cls(hf_dir=path)
        return cls(iter_dir=resolve_checkpoint(path))

    @classmethod
    def checkpoint(cls, path: str, hf_option: str | None = None) -> ModelSource:
        """The checkpoint at `path`; a transformers folder given as one is refused naming `hf_option`, how the
        caller's user names a transformers folder (None: refused as any folder that is not a checkpoint)."""
        try:
            return cls(iter_dir=resolve_checkpoint(path))
        except CheckpointError:
            if hf_option is not None and os.path.isfile(os.path.join(path, "config.json")):
                raise HFFolderError(
                    f"{path} is a transformers folder (config.json), not a checkpoint of this trainer: "
                    f"give it as {hf_option}"
                ) from None
            raise

    @classmethod
    def given(cls, checkpoint: str | None, hf: str | None, hf_option: str = "--hf DIR") -> ModelSource:
        """Exactly one of a checkpoint path and a transformers folder (the --checkpoint / --hf pair)."""
        if (checkpoint is None) == (hf is None):
            raise ValueError("give one model: --checkpoint DIR or --hf DIR")
        if checkpoint is not None:
            return cls.checkpoint(checkpoint, hf_option)
        return cls(hf_dir=hf)

    @property
    def iteration(self) -> int | None:
        """The iteration a checkpoint was saved at (iter_0000120 -> 120; a release folder: 0); None for a
        transformers folder."""
        if self.iter_dir is None:
            return None
        digits = os.path.basename(self.iter_dir).removeprefix("iter_")
        return int(digits) if digits.isdigit() else 0

    def describe(self) -> str:
        """Which weights these are, for the user ("iteration 120 of DIR", "transformers folder DIR")."""
        if self.iter_dir is not None:
            return f"iteration {self.iteration} of {self.iter_dir}"
        return f"transformers folder {self.hf_dir}"

    def broken_weights(self) -> str:
        """The one-line refusal of these weights when they hold NaN or inf."""
        return f"{self.describe()}: the weights hold NaN or inf (a diverged run or a bad export)"

    def tokenizer_keys(self, required: bool = True) -> dict | None:
        """The data-section tokenizer keys of a transformers folder (None when it holds none and not
        `required`; HFFolderError when required)."""
        assert self.hf_dir is not None
        keys = tokenizer_section(self.hf_dir)
        if keys is None and required:
            raise HFFolderError(
                f"{self.hf_dir} holds no tokenizer this project reads (vocab.json + merges.txt, tokenizer.model "
                "or tokenizer.json)"
            )
        return keys

    def run_config(self) -> dict:
        """The run config (Config.to_dict() form) the model was saved with: a checkpoint's saved config (its
        tokenizer files resolved against the checkpoint root), or a transformers folder's model and
        tokenizer sections."""
        if self.iter_dir is not None:
            return read_run_config(self.iter_dir)
        assert self.hf_dir is not None
        return {"model": dataclasses.asdict(hf_model_config(self.hf_dir)), "data": self.tokenizer_keys()}


def open_config(source: ModelSource, overrides: Sequence[str] = ()) -> Config:
    """The config to run `source`'s model with: its model and tokenizer sections (a checkpoint's saved config
    without the sections of the run that trained it, RUN_SECTIONS), `section.key=value` overrides on top
    (parallel.tp_size=2, another tokenizer), dropout off (the model runs in eval mode anyway)."""
    raw = source.run_config()
    for section in RUN_SECTIONS:
        raw.pop(section, None)
    config = config_from_dict(apply_overrides(raw, list(overrides)))
    config.model.hidden_dropout = config.model.attention_dropout = 0.0
    return config


class TextTokenizer(Protocol):
    """What the openers ask of data/tokenizers.py's tokenizers: text to ids and back, and their sizes."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def run_tokenizer(config: Config, exact: bool = True) -> TextTokenizer:
    """The run's tokenizer; ValueError when its vocabulary is not the model's (a tokenizer the model was not
    trained with; exact=False allows a model vocabulary larger than the tokenizer's, as the trainer does) or
    when it cannot turn text into ids (NullTokenizer)."""
    data = config.data
    if data.tokenizer_type == "NullTokenizer":
        raise ValueError(
            "the model's tokenizer is NullTokenizer (its text is ids): give the tokenizer it was trained with "
            "(data.tokenizer_type=... and data.vocab_file / data.merge_file / data.tokenizer_model)"
        )
    tokenizer = build_tokenizer(
        data.tokenizer_type,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        tokenizer_model=data.tokenizer_model,
        vocab_size=config.model.vocab_size,
    )
    vocab_size = config.model.vocab_size
    if tokenizer.vocab_size != vocab_size and (exact or vocab_size is None or tokenizer.vocab_size > vocab_size):
        source = data.vocab_file or data.tokenizer_model or data.tokenizer_type
        raise ValueError(
            f"tokenizer {source} has {tokenizer.vocab_size} entries but the model's vocabulary is "
            f"model.vocab_size={config.model.vocab_size}: give the tokenizer the model was trained with"
        )
    return tokenizer


def open_model(
    config: Config,
    source: ModelSource,
    state: ParallelState,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    spec: RankSpec | None = None,
) -> list[GPTModel]:
    """This rank's chunks of `source`'s model at `state`'s layout (`spec` default: rank_spec(cfg, state)), in
    `dtype` on `device`, in eval mode. A checkpoint is read through the layout-free loader (collective under
    torchrun; each rank reads its shards); a transformers folder is read whole, checked (dtypes, shapes
    against its config.json, finite values) and each parameter given its shard."""
    cfg = config.model
    spec = spec or rank_spec(cfg, state)
    if source.iter_dir is not None:
        chunks = checkpoint_chunks(source.iter_dir, cfg, state, config.train.seed, device, dtype, spec)
    else:
        assert source.hf_dir is not None
        chunks = build_chunk_modules(cfg, state, spec)  # on the meta device: the folder's weights fill them
        place_global_weights(chunks, read_hf_weights(source.hf_dir, cfg), cfg, device, dtype)
    for chunk in chunks:
        chunk.eval()
    return chunks


def global_state(source: ModelSource, model: ModelConfig | None = None) -> tuple[dict, Tensors]:
    """(run config dict, global state dict: the single-process names and shapes) of `source`, the form the
    converters map. A transformers folder's tokenizer is optional here (a conversion carries the weights
    without one); `model` skips reading its config.json again."""
    if source.iter_dir is not None:
        return load_global_state(source.iter_dir)
    assert source.hf_dir is not None
    cfg = model or hf_model_config(source.hf_dir)
    config = {"model": dataclasses.asdict(cfg), "data": source.tokenizer_keys(required=False)}
    return config, read_hf_weights(source.hf_dir, cfg)
