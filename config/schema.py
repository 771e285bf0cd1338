"""The run configuration: YAML sections loaded strictly into typed dataclasses, with overrides and checks.

`load_config(path, overrides)` reads a YAML file (or the defaults when path is None), applies
`section.key=value` overrides (values parsed as YAML scalars), and checks types and values per section.
Relative tokenizer files (data.vocab_file / merge_file / tokenizer_model) are taken relative to the working
directory, else relative to the YAML file's folder (config/data_config.resolve_data_file).
Layout checks (tp, pp, vp, dp, schedule, micro-batches against the model and the world size) live in one
place, parallel/layout.py's `build_layout`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard, TypeVar, Union

import yaml

from config.data_config import DataConfig, resolve_data_file
from config.key_hints import closest_key
from config.yaml_reader import YamlBoundError, load_yaml_text, read_yaml_file
from model.config import ModelConfig

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here
PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision: the parameters' dtype (fp16 with dynamic loss scaling)
LR_DECAY_STYLES = ("cosine", "linear", "constant")  # optim.lr_decay_style (training/lr_schedule.py)
MIN_INIT_TIMEOUT_S = 1.0  # parallel.init_timeout_s below this is refused (ParallelConfig.validate says why)
WEEK_S = 7 * 24 * 3600  # the largest timeout taken: beyond it a typo, not a plan


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Section = TypeVar("_Section", bound="DataclassInstance")  # one section's dataclass


class ConfigError(ValueError):
    """A bad config: the message names the key and the value."""


@dataclass
class ParallelConfig:
    tp_size: int = 1
    pp_size: int = 1
    vp_size: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    cp_size: int = 1  # context parallelism: each sequence split over cp ranks, ring attention (parallel/layout.py)
    cp_attention_backend: str = "torch"  # block attention of the ring: torch (returns the log-sum-exp) | sdpa
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False  # distributed optimizer: all-gather params in the background (same numbers)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 | zb-v (vp_size=2); rules: parallel/layout.py
    scatter_gather: bool = True  # paper section 4.1: send 1/tp of each activation between stages
    overlap_p2p_comm: bool = True  # compute while a step's pipeline messages are in flight (same numbers)
    grad_bucket_size_mb: float = 25.0
    # Sharded data parallelism (ZeRO-3) with torch's FSDP2 over the dp (x cp) ranks (parallel/fsdp.py)
    fsdp: bool = False
    fsdp_reshard_after_forward: bool = True  # false: parameters stay gathered from forward to backward (ZeRO-2 like)
    fsdp_replicate: int = 1  # HSDP: replicas of the sharded model (dp = fsdp_replicate x the shard group)
    # Seconds a collective may wait (training/watchdog.py, docs/operations.md): start-up (process groups, loading a
    # checkpoint, the first iteration) and every checkpoint save, then steady training after the first step; a rank
    # that makes no progress that long (+5 s) is stopped by its watchdog. torchtitan's defaults.
    init_timeout_s: float = 300.0
    train_timeout_s: float = 100.0

    def validate(self) -> None:
        # The layout rules (sizes, schedule, divisibility) need the model and the world size: they all
        # live in parallel/layout.py (build_layout), called by every entry point.
        if self.grad_bucket_size_mb <= 0:
            raise ConfigError(f"parallel.grad_bucket_size_mb={self.grad_bucket_size_mb} must be > 0")
        # A value under a second cannot be meant: the ranks of one node, started together, reached the first
        # rendezvous up to 0.74 s apart here (torch's import alone), and each rank waits there for the last.
        if not MIN_INIT_TIMEOUT_S <= self.init_timeout_s <= WEEK_S:
            raise ConfigError(
                f"parallel.init_timeout_s={self.init_timeout_s} must be at least {MIN_INIT_TIMEOUT_S:g} s (every rank "
                f"joins the process groups within it) and at most a week ({WEEK_S})"
            )
        if not 0 < self.train_timeout_s <= WEEK_S:
            raise ConfigError(
                f"parallel.train_timeout_s={self.train_timeout_s} must be > 0 and at most a week ({WEEK_S})"
            )
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ConfigError("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true")
        self._validate_fsdp()

    def _validate_fsdp(self) -> None:
        if self.fsdp_replicate < 1:
            raise ConfigError(f"parallel.fsdp_replicate={self.fsdp_replicate} must be >= 1")
        if not self.fsdp:
            if self.fsdp_replicate > 1 or not self.fsdp_reshard_after_forward:
                key = "fsdp_replicate" if self.fsdp_replicate > 1 else "fsdp_reshard_after_forward"
                raise ConfigError(f"parallel.{key}={getattr(self, key)} needs parallel.fsdp=true")
            return
        if self.distributed_optimizer:
            raise ConfigError(
                "parallel.fsdp=true shards the optimizer state itself (ZeRO-3 includes ZeRO-1): "
                "set parallel.distributed_optimizer=false"
            )


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
    max_nonfinite_iters: int = 3  # this many iterations in a row with a non-finite loss/grad norm stop the run
    device: str = "auto"  # auto (CUDA if visible; refuses CPU where GPUs were allocated) | cuda | cpu
    allow_gpu_sharing: bool = False  # more local ranks than visible GPUs is an error unless this is true
    compile: bool = False  # torch.compile each transformer layer (regional compilation)
    compile_backend: str = "inductor"  # torch.compile backend (aot_eager: tracing without code generation)
    num_threads: int = 0  # intra-op threads per rank; 0: OMP_NUM_THREADS, else usable cores / local ranks

    def validate(self) -> None:
        for key in (
            "micro_batch_size",
            "global_batch_size",
            "train_iters",
            "eval_interval",
            "recompute_num_layers",
            "max_nonfinite_iters",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        for key, choices in (
            ("precision", PRECISIONS),
            ("recompute", ("none", "selective", "full")),
            ("recompute_method", ("uniform", "block")),
            ("device", ("auto", "cuda", "cpu")),
        ):
            if getattr(self, key) not in choices:
                raise ConfigError(f"train.{key}={getattr(self, key)!r} is not one of {', '.join(choices)}")
        if self.compile_backend not in ("inductor", "aot_eager", "eager", "cudagraphs"):
            raise ConfigError(
                f"train.compile_backend={self.compile_backend!r} is not one of inductor, aot_eager, eager, cudagraphs"
            )
        for key in ("eval_iters", "exit_interval", "exit_duration_mins", "clip_grad", "num_threads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0")
        if not 0 <= self.seed < 2**32:  # numpy's RandomState (the data order) takes no other seed
            raise ConfigError(f"train.seed={self.seed} must be in [0, {2**32 - 1}]")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    lr_warmup_iters: int = 30
    lr_decay_iters: int | None = None  # None = train.train_iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    override_lr_schedule: bool = False  # on resume, use this config's LR schedule, not the checkpoint's

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} need 0 <= min_lr <= lr, lr > 0")
        for key in ("adam_eps", "initial_loss_scale", "min_loss_scale"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be > 0")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"optim.min_loss_scale={self.min_loss_scale} is larger than "
                f"optim.initial_loss_scale={self.initial_loss_scale}"
            )
        for key in ("loss_scale_window", "hysteresis"):
            if getattr(self, key) < 1:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be >= 1")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(
                f"optim.lr_decay_style={self.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}"
            )
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"optim.lr_warmup_iters={self.lr_warmup_iters} must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # 0 = only at the end
    # true: the latest checkpoint under run.dir/checkpoints; a path: a checkpoints folder or one iter_XXXXXXX
    load: bool | str = False
    save: bool = True
    load_optimizer: bool = True  # false: weights and counters only, fresh optimizer state
    # weights only: iteration 0, fresh optimizer, LR schedule and data order; a path = load that path this way
    finetune: bool | str = False
    async_save: bool = False  # write in a background thread; the loop is blocked only while copying
    keep_last: int = 0  # keep only the newest N checkpoints (0 = all), deleted after a newer one completes

    def validate(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval={self.save_interval} must be >= 0")
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 0")
        if isinstance(self.load, str) and not self.load:
            raise ConfigError("checkpoint.load must be true, false or a path")
        if isinstance(self.finetune, str):  # one override: checkpoint.finetune=PATH
            if self.load not in (False, self.finetune):
                raise ConfigError(
                    f"checkpoint.finetune={self.finetune!r} and checkpoint.load={self.load!r} name "
                    f"different checkpoints: set one of them"
                )
            self.load, self.finetune = self.finetune, True
        if (self.finetune or not self.load_optimizer) and self.load is False:
            key = "checkpoint.finetune=true" if self.finetune else "checkpoint.load_optimizer=false"
            raise ConfigError(f"{key} needs checkpoint.load (true or a path)")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard: bool = True
    peak_tflops: float | None = None  # per GPU, for MFU; None: the known bf16/fp16 peak of the CUDA device
    wandb_project: str | None = None  # set: also log to Weights & Biases (needs `pip install wandb`)
    wandb_entity: str | None = None  # the W&B team or user; None: wandb's default
    # Every N iterations each rank's compute and wait time per iteration are gathered; the slowest and fastest
    # ranks are logged (training/straggler.py); 0 = off.
    straggler_interval: int = 100
    # A warning when a rank's compute time is above its pipeline stage's median by more than this fraction in
    # two reports in a row.
    straggler_threshold: float = 0.2

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ConfigError(f"logging.log_interval={self.log_interval} must be >= 1")
        if self.straggler_interval < 0:
            raise ConfigError(f"logging.straggler_interval={self.straggler_interval} must be >= 0 (0: no report)")
        if self.straggler_threshold <= 0:
            raise ConfigError(f"logging.straggler_threshold={self.straggler_threshold} must be > 0")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"logging.peak_tflops={self.peak_tflops} must be > 0")


@dataclass
class EvalConfig:
    """Zero-shot tasks (evaluation/, docs/evaluation.md): tools/evaluate.py reads these keys, and the trainer
    runs the tasks of the files given every `interval` iterations and at the end."""

    interval: int = 0  # 0 = the trainer runs no zero-shot task
    wikitext_file: str | None = None  # a WikiText file such as WikiText-103's wiki.test.tokens
    lambada_file: str | None = None  # lambada_test.jsonl of the GPT-2 release
    seq_length: int | None = None  # tokens per window; None: the model's max_position_embeddings
    overlapping_eval: int = 32  # Megatron's WikiText: each window after the first scores its last N tokens

    def validate(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"eval.interval={self.interval} must be >= 0")
        for key in ("seq_length", "overlapping_eval"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"eval.{key}={getattr(self, key)} must be >= 1")
        for key in ("wikitext_file", "lambada_file"):  # read (and checked) by evaluation/ before training
            path = getattr(self, key)
            setattr(self, key, os.path.expanduser(path) if path else None)
            if path and not self.interval:  # nothing else reads it: a file given and never read is refused
                raise ConfigError(
                    f"eval.{key}={path} is read only by the trainer's zero-shot tasks, which run with "
                    f"eval.interval=N (N > 0): set eval.interval, or drop eval.{key} (tools/evaluate.py takes "
                    f"its file as --data)"
                )
        if self.interval and not (self.wikitext_file or self.lambada_file):
            raise ConfigError(f"eval.interval={self.interval} needs eval.wikitext_file or eval.lambada_file")


@dataclass
class RunConfig:
    dir: str = "runs/gpt_tiny"  # everything a run writes goes under it

    def validate(self) -> None:
        if not self.dir:
            raise ConfigError("run.dir must not be empty")
        self.dir = os.path.expanduser(self.dir)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        """Per-section checks, then the cross-section ones that are not about the layout."""
        for section in dataclasses.fields(self):
            try:
                getattr(self, section.name).validate()
            except ValueError as err:
                raise ConfigError(str(err)) from None
        data = self.data
        if data.has_data and data.tokenizer_type == "GPT2BPETokenizer" and not (data.vocab_file and data.merge_file):
            raise ConfigError("data.data_path is set, so GPT2BPETokenizer needs data.vocab_file and data.merge_file")
        if data.has_data and data.tokenizer_type == "NullTokenizer" and not self.model.vocab_size:
            raise ConfigError("data.data_path is set, so NullTokenizer needs model.vocab_size (its ids plus eod)")
        if (
            data.has_data
            and data.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer")
            and not (data.tokenizer_model)
        ):
            raise ConfigError(f"data.data_path is set, so {data.tokenizer_type} needs data.tokenizer_model")
        if self.parallel.fsdp and self.train.compile:
            raise ConfigError(
                "parallel.fsdp=true does not run with train.compile=true (FSDP's hooks around each compiled "
                "layer): set train.compile=false"
            )
        decay_iters = self.optim.lr_decay_iters or self.train.train_iters
        if self.optim.lr_warmup_iters > decay_iters:
            source = "optim.lr_decay_iters" if self.optim.lr_decay_iters else "train.train_iters"
            raise ConfigError(
                f"optim.lr_warmup_iters={self.optim.lr_warmup_iters} is longer than the LR decay "
                f"({source}={decay_iters}): lower optim.lr_warmup_iters"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _type_matches(value: object, annotation: object) -> bool:
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
    return isinstance(value, typing.cast(type, annotation))  # every leaf of a field annotation is a class


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _coerce_float(value: object, annotation: object) -> object:
    """PyYAML reads `1e-4` (no dot) as a string; accept it where a float is expected."""
    accepts_float = annotation is float or float in typing.get_args(annotation)
    if accepts_float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _build_section(cls: type[_Section], values: dict[str, object], section: str) -> _Section:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        if key not in known:
            close = closest_key(section, key, known)
            hint = f"; did you mean {close}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown config key {section}.{key}{hint}")
        value = values[key] = _coerce_float(value, hints[key])
        if not _type_matches(value, hints[key]):
            expected = getattr(hints[key], "__name__", str(hints[key])).replace(" | ", " or ")
            if value is None:  # `key=` on the command line, or `key:` with nothing after it in YAML
                raise ConfigError(f"{section}.{key} is given no value: give it a {expected}, or leave it out")
            raise ConfigError(f"{section}.{key}={value!r} has the wrong type: expected {expected}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{key}={value} must be a finite number")
        if float in (hints[key], *typing.get_args(hints[key])) and _is_number(value) and abs(value) > FLOAT32_MAX:
            raise ConfigError(
                f"{section}.{key}={value} is past float32's range ({FLOAT32_MAX:.4g}): give a smaller number"
            )
        if hints[key] is float and isinstance(value, int):
            values[key] = float(value)
        if any(isinstance(item, str) and "\0" in item for item in (value if isinstance(value, list) else [value])):
            raise ConfigError(f"{section}.{key}={value!r} holds a NUL character (\\0): no path or name can hold one")
    return cls(**values)


def config_from_dict(raw: dict, validate: bool = True) -> Config:
    """Strictly build a Config from nested dicts (unknown sections/keys and wrong types are errors); then
    check the values unless validate=False."""
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
    if validate:
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
            value = load_yaml_text(text) if text != "" else None
        except YamlBoundError as err:
            raise ConfigError(f"override {dotted}=...: {err}") from None
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: value {text!r} is not valid YAML") from None
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"override {item!r}: section {section!r} is not a mapping")
        raw[section][key] = value
    return raw


def _read_config_file(path: str) -> dict:
    raw = read_yaml_file(path, "config", ConfigError)
    if raw is None:
        raise ConfigError(
            f"config file {path} is empty (no sections): give it at least one section, or leave "
            f"out --config to train the defaults"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _first_key(message: str) -> str | None:
    """The first `section.key` a ConfigError message names, e.g. 'optim.lr' in 'optim.lr=inf must be ...'."""
    match = re.search(r"\b([a-z_]+\.[a-z_0-9]+)(=|\b)", message)
    return match.group(1) if match else None


def load_config(path: str | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (None = defaults), apply overrides, build and validate. An error in the file names the file
    and the key; an error in an override names the override.

    A relative tokenizer file (data.vocab_file, merge_file, tokenizer_model) is read relative to the working
    directory when it exists there, else relative to the YAML file's folder when it exists there (then it is
    stored absolute), so a converted checkpoint's config.yaml naming `tokenizer/vocab.json` works wherever
    its folder is moved."""
    overrides = overrides or []
    raw: dict = {}
    file_keys: set[str] = set()
    if path is not None:
        path = os.path.expanduser(path)
        raw = _read_config_file(path)
        try:  # the file alone first: unknown keys, wrong types and bad sections are the file's fault
            config_from_dict(copy.deepcopy(raw), validate=False)
        except ConfigError as err:
            raise ConfigError(f"config file {path}: {err}") from None
        file_keys = {f"{section}.{key}" for section, values in raw.items() for key in values}
    overridden = {item.split("=", 1)[0] for item in overrides}
    try:
        config = config_from_dict(apply_overrides(raw, overrides))
    except ConfigError as err:
        key = _first_key(str(err))
        if key in file_keys and key not in overridden:
            raise ConfigError(f"config file {path}: {err}") from None
        raise
    try:  # a new run's data choices (not in validate: a checkpoint's saved config is loaded as it was)
        config.data.check_sources()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if path is not None:
        for key in DataConfig.FILE_KEYS:
            setattr(config.data, key, resolve_data_file(getattr(config.data, key), os.path.dirname(path)))
    return config
