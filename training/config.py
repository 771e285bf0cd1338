"""The run configuration: YAML sections loaded strictly into typed dataclasses, with overrides and checks.

`load_config(path, overrides)` reads a YAML file (or the defaults when path is None), applies
`section.key=value` overrides (values parsed as YAML scalars), and checks types and values per section.
Layout checks (tp, pp, vp, dp, schedule, micro-batches against the model and the world size) live in one
place, parallel/layout.py's `build_layout`.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import yaml

from model.config import ModelConfig


class ConfigError(ValueError):
    """A bad config: the message names the key and the value."""


@dataclass
class ParallelConfig:
    tp_size: int = 1
    pp_size: int = 1
    vp_size: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (vp_size > 1 means interleaved; parallel/layout.py)
    scatter_gather: bool = True  # paper section 4.1: send 1/tp of each activation between stages
    grad_bucket_size_mb: float = 25.0

    def validate(self) -> None:
        # The layout rules (sizes, schedule, divisibility) need the model and the world size: they all
        # live in parallel/layout.py (build_layout), called by every entry point.
        if self.grad_bucket_size_mb <= 0:
            raise ConfigError(f"parallel.grad_bucket_size_mb={self.grad_bucket_size_mb} must be > 0")


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 16
    train_iters: int = 300
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"  # uniform | block (with recompute=full)
    recompute_num_layers: int = 1
    eval_interval: int = 100
    eval_iters: int = 10
    exit_interval: int = 0  # stop (and save) after this iteration; 0 = off
    exit_duration_mins: float = 0.0  # stop (and save) when the run has lasted this long; 0 = off
    clip_grad: float = 1.0
    compile: bool = False  # torch.compile each transformer layer (regional compilation)
    compile_backend: str = "inductor"  # torch.compile backend (aot_eager: tracing without code generation)

    def validate(self) -> None:
        for key in ("micro_batch_size", "global_batch_size", "train_iters", "eval_interval",
                    "recompute_num_layers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        for key, choices in (("precision", ("fp32", "bf16", "fp16")), ("recompute", ("none", "selective", "full")),
                             ("recompute_method", ("uniform", "block"))):
            if getattr(self, key) not in choices:
                raise ConfigError(f"train.{key}={getattr(self, key)!r} is not one of {', '.join(choices)}")
        if self.compile_backend not in ("inductor", "aot_eager", "eager", "cudagraphs"):
            raise ConfigError(f"train.compile_backend={self.compile_backend!r} is not one of inductor, aot_eager, "
                              f"eager, cudagraphs")
        for key in ("eval_iters", "exit_interval", "exit_duration_mins", "clip_grad"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    lr_warmup_iters: int = 30
    lr_decay_iters: Optional[int] = None  # None = train.train_iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} need 0 <= min_lr <= lr, lr > 0")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"optim.lr_decay_style={self.lr_decay_style!r} is not one of cosine, linear, constant")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"optim.lr_warmup_iters={self.lr_warmup_iters} must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")


@dataclass
class DataConfig:
    data_path: list = field(default_factory=list)  # [prefix] or [w1, prefix1, w2, prefix2]; empty = sample corpus
    split: str = "969,30,1"
    tokenizer_type: str = "GPT2BPETokenizer"  # GPT2BPETokenizer | SentencePieceTokenizer
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    cache_dir: Optional[str] = None  # index caches; None = next to the data
    num_workers: int = 1
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    def validate(self) -> None:
        if self.tokenizer_type not in ("GPT2BPETokenizer", "SentencePieceTokenizer"):
            raise ConfigError(f"data.tokenizer_type={self.tokenizer_type!r} is not one of GPT2BPETokenizer, "
                              f"SentencePieceTokenizer")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers={self.num_workers} must be >= 0")


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # 0 = only at the end
    load: bool = False  # resume from the latest checkpoint under run.dir/checkpoints
    save: bool = True

    def validate(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval={self.save_interval} must be >= 0")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard: bool = True

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ConfigError(f"logging.log_interval={self.log_interval} must be >= 1")


@dataclass
class RunConfig:
    dir: str = "runs/gpt_tiny"  # everything a run writes goes under it

    def validate(self) -> None:
        if not self.dir:
            raise ConfigError("run.dir must not be empty")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        """Per-section checks, then the cross-section ones that are not about the layout."""
        for section in dataclasses.fields(self):
            try:
                getattr(self, section.name).validate()
            except ValueError as err:
                raise ConfigError(str(err)) from None
        data = self.data
        if data.data_path and data.tokenizer_type == "GPT2BPETokenizer" and not (data.vocab_file and data.merge_file):
            raise ConfigError("data.data_path is set, so GPT2BPETokenizer needs data.vocab_file and data.merge_file")
        if data.data_path and data.tokenizer_type == "SentencePieceTokenizer" and not data.tokenizer_model:
            raise ConfigError("data.data_path is set, so SentencePieceTokenizer needs data.tokenizer_model")
        decay_iters = self.optim.lr_decay_iters or self.train.train_iters
        if self.optim.lr_warmup_iters > decay_iters:
            source = "optim.lr_decay_iters" if self.optim.lr_decay_iters else "train.train_iters"
            raise ConfigError(f"optim.lr_warmup_iters={self.optim.lr_warmup_iters} is longer than the LR decay "
                              f"({source}={decay_iters}): lower optim.lr_warmup_iters")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _type_matches(value: Any, annotation: Any) -> bool:
    """Whether a YAML value fits a dataclass field annotation (int accepted for float)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_type_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list or annotation is list:
        return isinstance(value, list)
    return isinstance(value, annotation)


def _coerce_float(value: Any, annotation: Any) -> Any:
    """PyYAML reads `1e-4` (no dot) as a string; accept it where a float is expected."""
    accepts_float = annotation is float or float in typing.get_args(annotation)
    if accepts_float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _build_section(cls: type, values: dict, section: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {section}.{close[0]}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown config key {section}.{key}{hint}")
        value = values[key] = _coerce_float(value, hints[key])
        if not _type_matches(value, hints[key]):
            expected = getattr(hints[key], "__name__", str(hints[key]))
            raise ConfigError(f"{section}.{key}={value!r} has the wrong type: expected {expected}")
        if hints[key] is float and isinstance(value, int):
            values[key] = float(value)
    return cls(**values)


def config_from_dict(raw: dict) -> Config:
    """Strictly build a Config from nested dicts (unknown sections/keys and wrong types are errors)."""
    sections = {f.name: f for f in dataclasses.fields(Config)}
    built = {}
    for name, values in (raw or {}).items():
        if name not in sections:
            close = difflib.get_close_matches(name, list(sections), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known sections: {', '.join(sections)}"
            raise ConfigError(f"unknown config section {name!r}{hint}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {name!r} must be a mapping, got {values!r}")
        built[name] = _build_section(typing.get_type_hints(Config)[name], dict(values), name)
    config = Config(**built)
    config.validate()
    return config


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` overrides (value parsed as a YAML scalar) to a raw nested dict."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, text = item.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: value {text!r} is not valid YAML") from None
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"override {item!r}: section {section!r} is not a mapping")
        raw[section][key] = value
    return raw


def load_config(path: Optional[str], overrides: Optional[list[str]] = None) -> Config:
    """Read YAML (None = defaults), apply overrides, build and validate."""
    raw: dict = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as handle:
                raw = yaml.safe_load(handle) or {}
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    return config_from_dict(apply_overrides(raw, overrides or []))
