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
from model.config import ModelConfig, check_declared, key_spec

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here
PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision: the parameters' dtype (fp16 with dynamic loss scaling)
LR_DECAY_STYLES = ("cosine", "linear", "constant")  # optim.lr_decay_style (optim/lr_schedule.py)
# parallel.init_timeout_s below this is refused: the ranks of one node, started together, reached the first
# rendezvous up to 0.74 s apart here (torch's import alone), and each rank waits there for the last
MIN_INIT_TIMEOUT_S = 1
WEEK_S = 7 * 24 * 3600  # the longest collective timeout taken (parallel.init_timeout_s, train_timeout_s)


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Section = TypeVar("_Section", bound="DataclassInstance")  # one section's dataclass


class ConfigError(ValueError):
    """A bad config: the message names the key and the value."""


@dataclass
class ParallelConfig:
    """How the ranks split the work: tp, cp, pp, vp, dp (the rest of the world), ep, schedules, FSDP, timeouts."""

    # The sizes and the schedule are checked against the model and the world size, all in one place:
    # parallel/layout.py (build_layout), called by every entry point.
    tp_size: int = field(
        default=1,
        metadata=key_spec(
            "Tensor-parallel size: each layer's GEMMs split over tp ranks (Megatron's column/row split)."
        ),
    )
    pp_size: int = field(default=1, metadata=key_spec("Pipeline-parallel size: the layers cut into pp stages."))
    vp_size: int = field(
        default=1,
        metadata=key_spec(
            "Virtual pipeline stages (model chunks) per pipeline rank: 2 or more for the interleaved schedule, 2 "
            "for zb-v."
        ),
    )
    cp_size: int = field(
        default=1,
        metadata=key_spec(
            "Context-parallel size: each sequence cut into 2 x cp chunks over cp ranks, attention as a ring "
            "(model.seq_length must divide by 2 x cp)."
        ),
    )
    ep_size: int = field(
        default=1,
        metadata=key_spec(
            "Expert-parallel size: each MoE layer's experts divided over ep ranks, tokens sent to their experts by "
            "all-to-all. ep re-divides the dp x cp ranks (must divide dp x cp and model.num_experts); expert weights "
            "are replicated over the dp x cp / ep expert-data-parallel ranks.",
            ge=1,
        ),
    )
    cp_attention_backend: str = field(
        default="torch",
        metadata=key_spec(
            "Block attention of the ring: torch (matmul + log-sum-exp). sdpa returns no log-sum-exp and is refused "
            "with cp_size > 1."
        ),
    )
    sequence_parallel: bool = field(
        default=False,
        metadata=key_spec(
            "With tp > 1: norms, dropout and residuals work on 1/tp of the sequence; all-gather / reduce-scatter "
            "replace the all-reduces."
        ),
    )
    distributed_optimizer: bool = field(
        default=False,
        metadata=key_spec(
            "ZeRO-1: the fp32 master weights and Adam moments sharded over dp (x cp); gradients reduce-scattered, "
            "parameters all-gathered."
        ),
    )
    overlap_param_gather: bool = field(
        default=False,
        metadata=key_spec(
            "With the distributed optimizer: all-gather updated parameters in the background, each bucket waited "
            "for by the next forward (same numbers)."
        ),
    )
    schedule: str = field(
        default="1f1b",
        metadata=key_spec(
            "Pipeline schedule: gpipe, 1f1b, interleaved (vp_size > 1), zb-h1 or zb-v (vp_size=2, zero bubble). "
            "Rules: parallel/layout.py."
        ),
    )
    scatter_gather: bool = field(
        default=True,
        metadata=key_spec(
            "The paper's section 4.1: with tp > 1 and no sequence parallelism, each tp rank sends 1/tp of an "
            "activation between stages and the receiver all-gathers it."
        ),
    )
    overlap_p2p_comm: bool = field(
        default=True,
        metadata=key_spec(
            "Compute while a step's pipeline messages are in flight, unless the action needs them (same numbers)."
        ),
    )
    grad_bucket_size_mb: float = field(
        default=25.0,
        metadata=key_spec(
            "Size in MiB of the gradient buckets whose dp all-reduce (or reduce-scatter) starts while backward runs.",
            gt=0,
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=key_spec(
            "Sharded data parallelism (ZeRO-3) with torch's FSDP2 over the dp (x cp) ranks, one unit per layer; pp "
            "must be 1, instead of distributed_optimizer."
        ),
    )
    fsdp_reshard_after_forward: bool = field(
        default=True,
        metadata=key_spec(
            "With fsdp: free each layer's gathered parameters after forward and gather again in backward (false: "
            "keep them, ZeRO-2 like)."
        ),
    )
    fsdp_replicate: int = field(
        default=1,
        metadata=key_spec(
            "With fsdp: HSDP replicas of the sharded model (dp = fsdp_replicate x the shard group); 1: plain FSDP.",
            ge=1,
        ),
    )
    # torchtitan's defaults (operations/watchdog.py, docs/operations.md).
    init_timeout_s: float = field(
        default=300.0,
        metadata=key_spec(
            "Seconds a collective may wait during start-up (process groups, data indices, loading a checkpoint, "
            "the first iteration) and every checkpoint save; then the rank dumps diagnostics and exits 5. At least "
            "1 s.",
            ge=MIN_INIT_TIMEOUT_S,
            le=WEEK_S,
            note="every rank joins the process groups within it; at most a week",
        ),
    )
    train_timeout_s: float = field(
        default=100.0,
        metadata=key_spec(
            "Seconds a collective may wait after the first iteration; a rank that makes no progress for this + 5 s "
            "is stopped by its watchdog (exit 5); docs/operations.md.",
            gt=0,
            le=WEEK_S,
            note="at most a week",
        ),
    )

    def validate(self) -> None:
        """The declared checks, then the rules between this section's keys."""
        check_declared(self, "parallel")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ConfigError("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true")
        self._validate_fsdp()

    def _validate_fsdp(self) -> None:
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
    """The training loop: batch sizes, iterations, precision, recomputation, evaluation, stopping, device."""

    micro_batch_size: int = field(default=4, metadata=key_spec("Samples per micro-batch on each dp rank.", ge=1))
    global_batch_size: int = field(
        default=16, metadata=key_spec("Samples per iteration; must equal micro_batch_size x micro-batches x dp.", ge=1)
    )
    train_iters: int = field(
        default=300, metadata=key_spec("Iterations to train (the run ends with a checkpoint of the last).", ge=1)
    )
    # numpy's RandomState (the data order) takes no other seed.
    seed: int = field(
        default=1234,
        metadata=key_spec(
            "Seed of the weights, dropout streams and the data order (0 to 2^32 - 1); every layout draws the same "
            "model from it.",
            ge=0,
            le=2**32 - 1,
        ),
    )
    precision: str = field(
        default="fp32",
        metadata=key_spec(
            "Parameter and compute dtype: fp32, bf16 or fp16 (with dynamic loss scaling); 16-bit keeps fp32 master "
            "weights and gradients.",
            choices=PRECISIONS,
        ),
    )
    recompute: str = field(
        default="none",
        metadata=key_spec(
            "Activation recomputation: none, selective (core attention) or full (whole layers).",
            choices=("none", "selective", "full"),
        ),
    )
    recompute_method: str = field(
        default="uniform",
        metadata=key_spec(
            "With recompute=full: uniform (every layer) or block (the first recompute_num_layers of each model chunk).",
            choices=("uniform", "block"),
        ),
    )
    recompute_num_layers: int = field(
        default=1, metadata=key_spec("With recompute_method=block: layers recomputed per model chunk.", ge=1)
    )
    eval_interval: int = field(
        default=100, metadata=key_spec("Validation every this many iterations, and at the end.", ge=1)
    )
    eval_iters: int = field(
        default=10, metadata=key_spec("Validation batches per evaluation (0: no validation).", ge=0)
    )
    exit_interval: int = field(
        default=0,
        metadata=key_spec("Stop (with a checkpoint) after an iteration that is a multiple of this; 0 = off.", ge=0),
    )
    exit_duration_mins: float = field(
        default=0.0,
        metadata=key_spec(
            "Stop (with a checkpoint) once the job has run this many minutes (from SLURM_JOB_START_TIME, else the "
            "process start); 0 = off.",
            ge=0,
        ),
    )
    clip_grad: float = field(
        default=1.0, metadata=key_spec("Clip the global gradient norm to this (0: no clipping).", ge=0)
    )
    max_nonfinite_iters: int = field(
        default=3,
        metadata=key_spec(
            "This many iterations in a row with a non-finite loss or gradient norm (their updates skipped) stop "
            "the run with exit 4.",
            ge=1,
        ),
    )
    device: str = field(
        default="auto",
        metadata=key_spec(
            "auto (CUDA if visible; refused where GPUs were allocated but none is visible), cuda or cpu.",
            choices=("auto", "cuda", "cpu"),
        ),
    )
    allow_gpu_sharing: bool = field(
        default=False, metadata=key_spec("Allow more local ranks than visible GPUs (else an error).")
    )
    compile: bool = field(
        default=False, metadata=key_spec("torch.compile each transformer layer (regional compilation).")
    )
    compile_backend: str = field(
        default="inductor",
        metadata=key_spec(
            "torch.compile backend: inductor, aot_eager (tracing without code generation), eager or cudagraphs.",
            choices=("inductor", "aot_eager", "eager", "cudagraphs"),
        ),
    )
    num_threads: int = field(
        default=0,
        metadata=key_spec(
            "Intra-op threads per rank; 0: OMP_NUM_THREADS, else the usable cores (affinity mask) / local ranks, "
            "never the machine's load (operations/threads.py).",
            ge=0,
        ),
    )

    def validate(self) -> None:
        """The declared checks (this section has no rule between its keys)."""
        check_declared(self, "train")


@dataclass
class OptimConfig:
    """AdamW, its learning-rate schedule and fp16's dynamic loss scaler (optim/optimizer.py)."""

    lr: float = field(default=1e-3, metadata=key_spec("Peak learning rate (after warm-up)."))
    min_lr: float = field(default=1e-4, metadata=key_spec("Learning rate at the end of the decay (0 <= min_lr <= lr)."))
    weight_decay: float = field(
        default=0.1, metadata=key_spec("AdamW's decoupled weight decay (not applied to biases and norms).", ge=0)
    )
    adam_beta1: float = field(default=0.9, metadata=key_spec("Adam's beta1.", ge=0, lt=1))
    adam_beta2: float = field(default=0.95, metadata=key_spec("Adam's beta2.", ge=0, lt=1))
    adam_eps: float = field(default=1e-8, metadata=key_spec("Adam's epsilon.", gt=0))
    lr_warmup_iters: int = field(default=30, metadata=key_spec("Iterations of linear warm-up from 0 to lr.", ge=0))
    lr_decay_iters: int | None = field(
        default=None,
        metadata=key_spec("Iterations over which lr decays to min_lr (then it stays there). null: train.train_iters."),
    )
    lr_decay_style: str = field(
        default="cosine",
        metadata=key_spec("Decay shape: cosine, linear or constant (optim/lr_schedule.py).", choices=LR_DECAY_STYLES),
    )
    initial_loss_scale: float = field(
        default=2.0**32, metadata=key_spec("fp16: the loss scale the run starts with.", gt=0)
    )
    min_loss_scale: float = field(
        default=1.0,
        metadata=key_spec(
            "fp16: the loss scale never goes below this; a scale stuck there counts as divergence.", gt=0
        ),
    )
    loss_scale_window: int = field(
        default=1000,
        metadata=key_spec("fp16: after this many steps in a row without inf/NaN the loss scale doubles.", ge=1),
    )
    hysteresis: int = field(
        default=2,
        metadata=key_spec(
            "fp16: overflowing steps (counted since the scale last grew) before the loss scale is halved; each one "
            "after that halves it again.",
            ge=1,
        ),
    )
    override_lr_schedule: bool = field(
        default=False,
        metadata=key_spec(
            "On resume, use this config's LR schedule instead of the checkpoint's (differences are logged either way)."
        ),
    )

    def validate(self) -> None:
        """The declared checks, then the rules between this section's keys."""
        # lr and min_lr are checked together: one message gives the whole rule.
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} need 0 <= min_lr <= lr, lr > 0")
        check_declared(self, "optim")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"optim.min_loss_scale={self.min_loss_scale} is larger than "
                f"optim.initial_loss_scale={self.initial_loss_scale}"
            )


@dataclass
class CheckpointConfig:
    """Saving and resuming (checkpoint/): layout-free checkpoints under run.dir/checkpoints."""

    save_interval: int = field(
        default=0,
        metadata=key_spec(
            "Save every this many iterations (0: only at the end, at exit_interval and on a stop signal).", ge=0
        ),
    )
    load: bool | str = field(
        default=False,
        metadata=key_spec(
            "true: resume from the latest checkpoint under run.dir/checkpoints; a path: a checkpoints folder (its "
            "latest complete one) or one iter_XXXXXXX folder."
        ),
    )
    save: bool = field(default=True, metadata=key_spec("Write checkpoints (false: none, not even at the end)."))
    load_optimizer: bool = field(
        default=True,
        metadata=key_spec("With load: restore the optimizer state (false: weights and counters, fresh optimizer)."),
    )
    finetune: bool | str = field(
        default=False,
        metadata=key_spec(
            "Load weights only: iteration 0, fresh optimizer, LR schedule and data order; true with load, or a path "
            "to load that way."
        ),
    )
    async_save: bool = field(
        default=False,
        metadata=key_spec("Write checkpoints in a background thread; the loop waits only for a memory copy."),
    )
    keep_last: int = field(
        default=0,
        metadata=key_spec(
            "Keep only the newest N checkpoints, older ones deleted after a newer one is complete (0: keep all).", ge=0
        ),
    )

    def source(self) -> bool | str:
        """The checkpoint to load: checkpoint.load, or the path of checkpoint.finetune=PATH (one override meaning
        load=PATH with finetune=true); false: none. Derived here, so the config stays as it was given."""
        return self.finetune if isinstance(self.finetune, str) else self.load

    def validate(self) -> None:
        """The declared checks, then the rules between this section's keys (finetune=PATH names the source)."""
        check_declared(self, "checkpoint")
        if isinstance(self.load, str) and not self.load:
            raise ConfigError("checkpoint.load must be true, false or a path")
        if isinstance(self.finetune, str) and self.load not in (False, self.finetune):  # one override: finetune=PATH
            raise ConfigError(
                f"checkpoint.finetune={self.finetune!r} and checkpoint.load={self.load!r} name "
                f"different checkpoints: set one of them"
            )
        if (self.finetune or not self.load_optimizer) and self.source() is False:
            key = "checkpoint.finetune=true" if self.finetune else "checkpoint.load_optimizer=false"
            raise ConfigError(f"{key} needs checkpoint.load (true or a path)")


@dataclass
class LoggingConfig:
    """The console line, metrics.jsonl, TensorBoard, Weights & Biases and the straggler report."""

    log_interval: int = field(
        default=10, metadata=key_spec("A console line and a metrics.jsonl record every this many iterations.", ge=1)
    )
    tensorboard: bool = field(default=True, metadata=key_spec("Also write the records to run.dir/tensorboard."))
    peak_tflops: float | None = field(
        default=None,
        metadata=key_spec(
            "Dense 16-bit peak TFLOP/s per GPU for MFU. null: the known peak of the CUDA device (A100, H100, H200, "
            "...); none on CPU or for fp32.",
            gt=0,
        ),
    )
    wandb_project: str | None = field(
        default=None,
        metadata=key_spec("Also log to this Weights & Biases project (needs `pip install wandb`); null: off."),
    )
    wandb_entity: str | None = field(default=None, metadata=key_spec("The W&B team or user; null: wandb's default."))
    straggler_interval: int = field(
        default=100,
        metadata=key_spec(
            "Every N iterations the slowest and fastest ranks' compute and wait times are logged "
            "(operations/straggler.py); 0 = off.",
            ge=0,
            note="0: no report",
        ),
    )
    straggler_threshold: float = field(
        default=0.2,
        metadata=key_spec(
            "Warn when a rank's compute is above its pipeline stage's median by more than this fraction in two "
            "reports in a row.",
            gt=0,
        ),
    )

    def validate(self) -> None:
        """The declared checks (this section has no rule between its keys)."""
        check_declared(self, "logging")


@dataclass
class EvalConfig:
    """Zero-shot tasks (WikiText perplexity, LAMBADA accuracy): tools/evaluate.py and the trainer read them.

    evaluation/, docs/evaluation.md: the trainer runs the tasks of the files given every `interval` iterations
    and at the end."""

    interval: int = field(
        default=0,
        metadata=key_spec(
            "The trainer runs the zero-shot tasks of the files given every this many iterations and at the end; 0 "
            "= never.",
            ge=0,
        ),
    )
    wikitext_file: str | None = field(
        default=None,
        metadata=key_spec(
            "A WikiText file (e.g. WikiText-103's wiki.test.tokens) for perplexity; docs/evaluation.md. Needs "
            "eval.interval."
        ),
    )
    lambada_file: str | None = field(
        default=None,
        metadata=key_spec("lambada_test.jsonl of the GPT-2 release, for last-word accuracy. Needs eval.interval."),
    )
    seq_length: int | None = field(
        default=None, metadata=key_spec("Tokens per evaluation window. null: model.max_position_embeddings.", ge=1)
    )
    overlapping_eval: int = field(
        default=32,
        metadata=key_spec("Megatron's WikiText windows: each window after the first scores its last N tokens.", ge=1),
    )

    def validate(self) -> None:
        """The declared checks, then the rules between this section's keys (a file needs the interval)."""
        check_declared(self, "eval")
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
    """Where a run writes."""

    dir: str = field(
        default="runs/gpt_tiny",
        metadata=key_spec(
            "Everything a run writes goes under it: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, "
            "diagnostics/, run.lock."
        ),
    )

    def validate(self) -> None:
        """A run folder is given; `~` expanded."""
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
