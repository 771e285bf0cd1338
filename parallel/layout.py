"""The PTD-P layout of a run: one frozen value, built and validated in one place.

`build_layout(model, parallel, train, world_size)` turns the config sections and the world size into a
`Layout` (tp, cp, pp, vp, dp, number of micro-batches, the schedule that will run, sequence parallelism) or
raises `LayoutError` with one line naming the offending keys and values. Every layout rule of the project
lives in this file: the trainer, tools/model_stats.py, the planner, the schedule builder and the
tensor-parallel layers all call these functions, so the same input gets the same answer everywhere.
Nothing here needs torch.distributed or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel.pipeline.stages import StageMap

if TYPE_CHECKING:
    from config.schema import Config, ParallelConfig, TrainConfig
    from model.config import ModelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-v")  # backward split into input (B) and weight (W) gradients
# Block attention backends of context parallelism and whether each returns the log-sum-exp that the ring's
# online-softmax merge needs: "torch" is plain matmul + logsumexp (CPU and GPU); SDPA returns no LSE.
CP_ATTENTION_BACKENDS = {"torch": True, "sdpa": False}


class LayoutError(ValueError):
    """A layout that cannot run: the message names the keys and values."""


@dataclass(frozen=True)
class Layout:
    """How one run is laid out over its ranks. Ranks are ordered as Megatron's: tp fastest, then cp, dp, pp.

    `schedule` is the schedule that runs: with pp = 1 that is always "1f1b" (forward, backward per
    micro-batch), and "1f1b" with vp > 1 is Megatron's interleaved 1F1B ("interleaved").
    """

    tp_size: int
    pp_size: int
    vp_size: int
    dp_size: int
    num_microbatches: int
    schedule: str
    sequence_parallel: bool = False
    cp_size: int = 1  # context parallelism: each micro-batch's sequence split over cp ranks
    fsdp: bool = False  # parameters, gradients and optimizer state sharded over dp x cp (parallel/fsdp.py)
    fsdp_replicate: int = 1  # HSDP: the dp x cp ranks are fsdp_replicate replicas of a sharded model
    ep_size: int = 1  # expert parallelism: the dp x cp ranks re-divided as ep x expert-dp for the experts

    @property
    def expert_dp_size(self) -> int:
        """Replicas of each expert weight: dp x cp / ep (Megatron-core's expert data parallelism)."""
        return self.dp_size * self.cp_size // self.ep_size

    @property
    def fsdp_shard_size(self) -> int:
        """Ranks one FSDP shard group spans: dp x cp, or its part of one HSDP replica (0 without FSDP)."""
        return self.dp_size * self.cp_size // self.fsdp_replicate if self.fsdp else 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size * self.dp_size

    @property
    def model_parallel_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stages(self) -> StageMap:
        """Where this layout's virtual stages sit (interleaved, or in a V under zb-v)."""
        return StageMap(self.pp_size, self.vp_size, uses_v_shape(self.schedule))

    def describe(self) -> str:
        """One line for the start-up log."""
        sp = ", sequence parallel" if self.sequence_parallel else ""
        cp = f" x cp {self.cp_size}" if self.cp_size > 1 else ""
        ep = f", experts over ep {self.ep_size} x expert-dp {self.expert_dp_size}" if self.ep_size > 1 else ""
        return (
            f"world {self.world_size} = tp {self.tp_size}{cp} x dp {self.dp_size} x pp {self.pp_size} "
            f"(vp {self.vp_size}), {self.num_microbatches} micro-batches per dp rank, schedule "
            f"{self.schedule}{sp}{self._describe_fsdp()}{ep}"
        )

    def _describe_fsdp(self) -> str:
        if not self.fsdp:
            return ""
        hsdp = f" in {self.fsdp_replicate} replicas (HSDP)" if self.fsdp_replicate > 1 else ""
        return f", FSDP over {self.fsdp_shard_size} ranks{hsdp}"

    @classmethod
    def single(cls, num_microbatches: int = 1) -> Layout:
        """The layout of one process."""
        return cls(1, 1, 1, 1, num_microbatches, "1f1b")


def require_divisible(value_name: str, value: int, size_name: str, size: int) -> None:
    """LayoutError `"<value_name>=<value> is not divisible by <size_name>=<size>"` unless size divides value."""
    if size < 1 or value % size:
        raise LayoutError(f"{value_name}={value} is not divisible by {size_name}={size}")


def derive_dp_size(world_size: int, tp_size: int, pp_size: int, cp_size: int = 1) -> int:
    """dp = world / (tp * cp * pp)."""
    check_positive(tp_size=tp_size, pp_size=pp_size, cp_size=cp_size)
    model_ranks = tp_size * cp_size * pp_size
    if world_size % model_ranks:
        cp_name, cp_value = (" * parallel.cp_size", f" * {cp_size}") if cp_size > 1 else ("", "")
        raise LayoutError(
            f"world size {world_size} is not divisible by parallel.tp_size{cp_name} * parallel.pp_size "
            f"= {tp_size}{cp_value} * {pp_size} = {model_ranks}"
        )
    return world_size // model_ranks


def check_positive(**sizes: int) -> None:
    for key, value in sizes.items():
        if value < 1:
            raise LayoutError(f"parallel.{key}={value} must be >= 1")


def effective_schedule(schedule: str, pp_size: int, vp_size: int) -> str:
    """The schedule that runs for `parallel.schedule`, or LayoutError.

    Megatron's rule: virtual stages (vp > 1) mean the interleaved 1F1B schedule, so "1f1b" with vp > 1 is
    "interleaved". With one stage every schedule is forward then backward per micro-batch ("1f1b").
    Zero bubble: "zb-h1" runs one chunk per rank, "zb-v" exactly two in a V (`uses_v_shape`).
    """
    if schedule not in SCHEDULES:
        raise LayoutError(f"parallel.schedule={schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
    check_positive(pp_size=pp_size, vp_size=vp_size)
    if vp_size > 1 and pp_size == 1:
        raise LayoutError(f"parallel.vp_size={vp_size} needs parallel.pp_size > 1")
    if schedule == "zb-v" and (vp_size != 2 or pp_size == 1):
        raise LayoutError(
            f"parallel.schedule=zb-v places two chunks per rank in a V: it needs parallel.vp_size=2 and "
            f"parallel.pp_size > 1; got vp_size={vp_size}, pp_size={pp_size}"
        )
    if schedule == "zb-h1" and vp_size > 1:
        raise LayoutError(
            f"parallel.schedule=zb-h1 runs one chunk per rank: set parallel.vp_size=1 (got {vp_size}), or use "
            f"parallel.schedule=zb-v with vp_size=2"
        )
    if schedule == "zb-v":
        return schedule
    if vp_size > 1 and schedule == "gpipe":
        raise LayoutError(
            f"parallel.vp_size={vp_size} needs parallel.schedule=interleaved (or 1f1b, which "
            f"means interleaved with vp > 1); got parallel.schedule=gpipe"
        )
    if vp_size > 1:
        return "interleaved"
    if pp_size == 1 or schedule == "interleaved":
        return "1f1b"  # interleaving one chunk per rank is plain 1F1B
    return schedule


def uses_v_shape(schedule: str) -> bool:
    """Whether the (effective) schedule places its two chunks per rank in a V (parallel/pipeline/stages.py)."""
    return schedule == "zb-v"


def check_schedule(schedule: str, pp_size: int, vp_size: int, num_microbatches: int, per_step_samples: int = 0) -> str:
    """effective_schedule plus the micro-batch rule of the interleaved schedule; returns the schedule.

    `per_step_samples` (micro-batch size * dp), when known, lets the message suggest global batch sizes.
    """
    resolved = effective_schedule(schedule, pp_size, vp_size)
    if num_microbatches < 1:
        raise LayoutError(f"the number of micro-batches ({num_microbatches}) must be >= 1")
    if resolved == "interleaved" and pp_size > 1 and num_microbatches % pp_size:
        if per_step_samples:
            good = ", ".join(str(per_step_samples * pp_size * k) for k in (1, 2, 3))
            hint = f": e.g. train.global_batch_size = {good}"
        else:
            hint = f": use {', '.join(str(pp_size * k) for k in (1, 2, 3))}, ..."
        raise LayoutError(
            f"the interleaved schedule (parallel.vp_size={vp_size}) needs the number of "
            f"micro-batches ({num_microbatches}) to be a multiple of parallel.pp_size={pp_size}"
            f"{hint}"
        )
    return resolved


def check_tensor_parallel(model: ModelConfig, tp_size: int, sequence_parallel: bool) -> None:
    """Every size tensor parallelism splits must be divisible by tp."""
    check_positive(tp_size=tp_size)
    require_divisible("model.num_attention_heads", model.num_attention_heads, "parallel.tp_size", tp_size)
    require_divisible("model.num_query_groups", model.query_groups, "parallel.tp_size", tp_size)
    ffn_name = (
        "model.ffn_hidden_size"
        if model.ffn_hidden_size
        else f"the ffn size derived from model.hidden_size={model.hidden_size} (model.ffn_hidden_size unset)"
    )
    require_divisible(ffn_name, model.ffn_size, "parallel.tp_size", tp_size)
    if sequence_parallel:
        require_divisible(
            "model.seq_length", model.seq_length, "parallel.tp_size (needed by parallel.sequence_parallel)", tp_size
        )


def check_context_parallel(
    model: ModelConfig, cp_size: int, tp_size: int, sequence_parallel: bool, backend: str
) -> None:
    """Context parallelism cuts each sequence into 2 * cp chunks (rank i holds chunks i and 2cp-1-i) and merges
    attention blocks by their log-sum-exp, so the block attention backend must return it."""
    check_positive(cp_size=cp_size)
    if backend not in CP_ATTENTION_BACKENDS:
        raise LayoutError(
            f"parallel.cp_attention_backend={backend!r} is unknown: use one of {', '.join(CP_ATTENTION_BACKENDS)}"
        )
    if cp_size == 1:
        return
    require_divisible("model.seq_length", model.seq_length, "2 * parallel.cp_size", 2 * cp_size)
    if not CP_ATTENTION_BACKENDS[backend]:
        raise LayoutError(
            f"parallel.cp_size={cp_size} needs an attention backend that returns the log-sum-exp; "
            f"parallel.cp_attention_backend={backend} does not: use torch"
        )
    if model.attention_dropout > 0:
        raise LayoutError(
            f"parallel.cp_size={cp_size} does not support model.attention_dropout={model.attention_dropout}: set 0"
        )
    if sequence_parallel:
        require_divisible(
            "the sequence per context-parallel rank (model.seq_length / parallel.cp_size = "
            f"{model.seq_length} / {cp_size})",
            model.seq_length // cp_size,
            "parallel.tp_size (needed by parallel.sequence_parallel)",
            tp_size,
        )


def check_expert_parallel(model: ModelConfig, ep_size: int, dp_size: int, cp_size: int, hsdp_replicas: int) -> None:
    """Expert parallelism re-divides the dp x cp ranks (Megatron-core: for the experts the world is tp x ep x
    expert-dp x pp with expert-dp = dp x cp / ep), and each ep rank holds num_experts / ep whole experts."""
    check_positive(ep_size=ep_size)
    if ep_size == 1:
        return
    if not model.num_experts:
        raise LayoutError(f"parallel.ep_size={ep_size} needs an MoE model: model.num_experts={model.num_experts}")
    require_divisible("dp x cp (world / (tp * pp))", dp_size * cp_size, "parallel.ep_size", ep_size)
    require_divisible("model.num_experts", model.num_experts, "parallel.ep_size", ep_size)
    if hsdp_replicas > 1:
        raise LayoutError(
            f"parallel.ep_size={ep_size} with parallel.fsdp_replicate={hsdp_replicas} (HSDP) is not supported: "
            f"use plain FSDP (fsdp_replicate=1) or the distributed optimizer with expert parallelism"
        )


def check_pipeline_split(num_layers: int, pp_size: int, vp_size: int) -> None:
    """Each of the pp * vp virtual stages holds the same number of layers."""
    check_positive(pp_size=pp_size, vp_size=vp_size)
    if num_layers % (pp_size * vp_size):
        raise LayoutError(
            f"model.num_layers={num_layers} is not divisible by parallel.pp_size * "
            f"parallel.vp_size = {pp_size} * {vp_size}"
        )


def build_layout(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, world_size: int) -> Layout:
    """Validate every layout rule for these config sections (config.schema's model, parallel and train) and
    world size. No process group is needed.
    """
    tp, pp, vp, cp, ep = parallel.tp_size, parallel.pp_size, parallel.vp_size, parallel.cp_size, parallel.ep_size
    check_positive(tp_size=tp, pp_size=pp, vp_size=vp, cp_size=cp, ep_size=ep)
    effective_schedule(parallel.schedule, pp, vp)
    dp = derive_dp_size(world_size, tp, pp, cp)
    check_tensor_parallel(model, tp, parallel.sequence_parallel and cp == 1)
    check_context_parallel(model, cp, tp, parallel.sequence_parallel, parallel.cp_attention_backend)
    check_pipeline_split(model.num_layers, pp, vp)
    check_expert_parallel(model, ep, dp, cp, parallel.fsdp_replicate if parallel.fsdp else 1)
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise LayoutError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by "
            f"train.micro_batch_size * dp = {train.micro_batch_size} * {dp}"
        )
    num_microbatches = train.global_batch_size // per_step
    schedule = check_schedule(parallel.schedule, pp, vp, num_microbatches, per_step)
    fsdp, replicate = parallel.fsdp, parallel.fsdp_replicate
    if fsdp:
        check_fsdp(pp, dp, replicate)
        fsdp = dp * cp > 1  # one data-parallel rank: nothing to shard (the trainer says so, runs it plain)
    return Layout(tp, pp, vp, dp, num_microbatches, schedule, parallel.sequence_parallel, cp, fsdp, replicate, ep)


def check_fsdp(pp_size: int, dp_size: int, replicate: int) -> None:
    """FSDP runs without pipeline parallelism (one chunk per rank: FSDP's per-backward reduce-scatter and
    reshard have no place in the executor's interleaved forwards and split backwards), and HSDP's replicas
    cut the dp ranks evenly."""
    if pp_size > 1:
        raise LayoutError(
            f"parallel.fsdp=true runs with parallel.pp_size=1 (got {pp_size}): shard over dp with tp, cp and "
            f"HSDP, or use parallel.distributed_optimizer=true with pipeline parallelism"
        )
    check_positive(fsdp_replicate=replicate)
    require_divisible("dp (world / (tp * cp * pp))", dp_size, "parallel.fsdp_replicate", replicate)


def layout_from_config(config: Config, world_size: int) -> Layout:
    """build_layout on a config.schema.Config."""
    return build_layout(config.model, config.parallel, config.train, world_size)
