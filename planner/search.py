"""Rank every valid PTD-P layout of a model on a cluster: (tp, pp, vp, dp, micro-batch, recompute).

Each candidate is checked by parallel.layout.build_layout (no layout rule is repeated here) and by the memory
model (it must fit in the GPU's memory); the survivors are ranked by a first estimate (per-chunk costs with
the bubble formula (p-1)/(v m)), and the best `simulate_top` of them, plus the config's own layout, are
predicted in full (the simulator over the real action lists), which gives the final order: by a conservative
time per iteration (`conservative_seconds`: the prediction plus its error bar, wider for every dimension
outside the calibrated domain; TFLOP/s counts the recomputed forward as work, so it does not compare
recompute modes). Sequence parallelism, the distributed optimizer and
the precision are kept as the config has them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel.layout import Layout, LayoutError, build_layout
from parallel.pipeline.schedules import Op
from parallel.rank_grid import RankGrid
from planner.activations import shape_from_config
from planner.cluster import ClusterSpec
from planner.collectives import LayoutCollectives
from planner.costs import Hardware, action_comm_seconds, collective_seconds_of, layer_times, moe_layer_times
from planner.experts import expert_grid
from planner.memory import GIB
from planner.predict import Prediction, memory_of, predict
from planner.software import TRAINER, Software

if TYPE_CHECKING:
    from config.schema import Config

RECOMPUTE_MODES = ("none", "selective", "full")

# What the A100 fit saw (Table 1 as the paper ran it, planner/fit_report.py): micro-batches 1 to 16, full
# recomputation, tp within a node, at most 3 chunks per rank, no sequence parallelism or distributed optimizer.
# Outside it a prediction is an extrapolation: ranked by a conservative estimate, its time times
# (1 + IN_DOMAIN_ERROR + OUT_OF_DOMAIN_ERROR per dimension outside).
IN_DOMAIN_ERROR = 0.08  # the leave-half-out error on Table 1: worst row 6.7% (fit_report)
MAX_SEEN_MICRO_BATCH = 16  # the 1.7B-7.5B rows ran 16
OUT_OF_DOMAIN_ERROR = 0.15  # per dimension: Figures 7 and 16 (micro-batch), 17 (recompute) agree to ~15-25%


def outside_domain(p: Prediction) -> list[str]:
    """The dimensions of a prediction the calibration never saw (empty: inside the calibrated domain)."""
    lay, reasons = p.layout, []
    if p.micro_batch_size > MAX_SEEN_MICRO_BATCH:
        reasons.append(f"micro-batch {p.micro_batch_size}")
    if p.recompute != "full":
        reasons.append(f"recompute {p.recompute}")
    if lay.tp_size > 8:
        reasons.append(f"tp {lay.tp_size} beyond a node")
    if lay.vp_size > 3:
        reasons.append(f"vp {lay.vp_size}")
    if lay.sequence_parallel:
        reasons.append("sequence parallel")
    if lay.fsdp:
        reasons.append("FSDP (ZeRO-3)")
    if p.ep_size > 1:
        reasons.append(f"ep {p.ep_size} (all-to-all never calibrated)")
    return reasons


def conservative_seconds(p: Prediction) -> float:
    """The time per iteration to rank by: the prediction plus its error bar (wider outside the domain)."""
    return p.iteration_seconds * (1.0 + IN_DOMAIN_ERROR + OUT_OF_DOMAIN_ERROR * len(outside_domain(p)))


@dataclass
class SearchResult:
    """The ranked predictions and what was searched."""

    ranked: list[Prediction]
    reference: Prediction | None  # the config's own layout, when valid
    considered: int  # valid layouts
    fitting: int  # of which fit in memory

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_layout(
    config: Config, tp: int, pp: int, vp: int, micro_batch: int, recompute: str, fsdp: bool | None = None
) -> Config:
    """A copy of `config` with another layout, micro-batch and recomputation (and FSDP on or off: ZeRO-3 takes
    the optimizer's sharding over, so the distributed optimizer goes off with it)."""
    schedule = config.parallel.schedule
    if vp > 1:
        schedule = "interleaved"
    elif schedule == "interleaved":
        schedule = "1f1b"
    parallel = dataclasses.replace(config.parallel, tp_size=tp, pp_size=pp, vp_size=vp, schedule=schedule)
    if fsdp is not None:
        distributed = parallel.distributed_optimizer and not fsdp
        parallel = dataclasses.replace(
            parallel,
            fsdp=fsdp,
            distributed_optimizer=distributed,
            overlap_param_gather=False if fsdp else parallel.overlap_param_gather,
        )
    train = dataclasses.replace(config.train, micro_batch_size=micro_batch, recompute=recompute)
    return dataclasses.replace(config, parallel=parallel, train=train)


def candidate_configs(
    config: Config, world_size: int, max_vp: int = 8, micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
) -> Iterator[Config]:
    """Every (tp, pp, vp, micro-batch, recompute) combination whose layout is valid, and the sharded ones:
    FSDP (ZeRO-3) over the dp ranks at every tp, without pipeline parallelism."""
    layers = config.model.num_layers
    for tp in _divisors(world_size):
        shapes = [
            (pp, vp, False) for pp in _divisors(world_size // tp) if not layers % pp for vp in _divisors(layers // pp)
        ]
        shapes = [(pp, vp, False) for pp, vp, _ in shapes if vp <= max_vp and (vp == 1 or pp > 1)]
        for pp, vp, fsdp in shapes + [(1, 1, True)]:
            for mb in micro_batches:
                for recompute in RECOMPUTE_MODES:
                    candidate = with_layout(config, tp, pp, vp, mb, recompute, fsdp)
                    try:
                        layout = build_layout(candidate.model, candidate.parallel, candidate.train, world_size)
                    except LayoutError:
                        continue
                    if fsdp and not layout.fsdp:  # one data-parallel rank: the same run as without FSDP
                        continue
                    if fsdp and config.model.num_experts:  # not modelled for MoE (planner.predict refuses it)
                        continue
                    yield candidate


def candidate_eps(config: Config, layout: Layout) -> list[int]:
    """The expert-parallel sizes to try with `layout`: every ep dividing dp x cp and model.num_experts (ep 1 only
    for a dense model)."""
    experts = config.model.num_experts
    if not experts:
        return [1]
    return [ep for ep in _divisors(layout.dp_size * layout.cp_size) if experts % ep == 0]


def first_estimate(
    config: Config, cluster: ClusterSpec, world_size: int, software: Software = TRAINER, ep_size: int = 1
) -> float:
    """Seconds per iteration from per-layer costs and the bubble formula (only to order the candidates); a
    sharded layout (pp = 1: no pipeline to simulate) is predicted in full."""
    model, par, train = config.model, config.parallel, config.train
    layout = build_layout(model, par, train, world_size)
    if layout.fsdp:
        return predict(config, cluster, world_size, software, ep_size).iteration_seconds
    shape = shape_from_config(config, layout, attention=cluster.efficiency.attention)
    comms = LayoutCollectives(config, layout, ep_size=ep_size)
    experts = expert_grid(layout, ep_size) if comms.experts is not None else None
    hw = Hardware(cluster, train.precision == "fp32", RankGrid.of(layout), experts)
    layer = layer_times(shape, model, hw, train.recompute)
    if comms.experts is not None:  # every layer priced as an MoE one: only to order the candidates
        layer = moe_layer_times(shape, model, hw, train.recompute, comms.experts)
    stages = comms.run.stages
    block = layer.core / layout.cp_size
    actions = [comms.action(stage, op) for stage in range(stages.num_stages) for op in (Op.FORWARD, Op.BACKWARD)]
    # what every virtual stage's forward and backward issue, spread over the pipeline
    collectives = sum(action_comm_seconds(hw, action, block) for action in actions)
    collectives += sum(collective_seconds_of(hw, c) for action in actions for c in action.ep)
    layers_per_rank = sum(len(chunk.layer_ids) for chunk in comms.run.chunks(0))
    per_microbatch = layers_per_rank * (layer.forward + layer.backward)
    per_microbatch += collectives / layout.pp_size
    bubble = (layout.pp_size - 1) / (layout.vp_size * layout.num_microbatches)
    return layout.num_microbatches * per_microbatch * (1.0 + bubble)


def search(
    config: Config,
    cluster: ClusterSpec,
    world_size: int,
    simulate_top: int = 30,
    software_of: Callable[[Config], Software] = lambda config: TRAINER,
    ep_size: int | None = None,
) -> SearchResult:
    """Rank the layouts of `config`'s model, batch and precision on `world_size` GPUs of `cluster`, each run by
    `software_of(candidate)` (this trainer by default); an MoE model's at every ep `candidate_eps` allows, its
    own at `ep_size` (None: the config's, planner/experts.ep_size_of)."""
    fitting: list[tuple[float, Config, int]] = []
    considered = 0
    for candidate in candidate_configs(config, world_size):
        model, par, train = candidate.model, candidate.parallel, candidate.train
        layout = build_layout(model, par, train, world_size)
        shape = shape_from_config(candidate, layout, attention=cluster.efficiency.attention)
        for ep in candidate_eps(candidate, layout):
            considered += 1
            memory = memory_of(candidate, layout, cluster, shape, software_of(candidate), ep)
            if memory.total / GIB <= cluster.memory_gib:
                estimate = first_estimate(candidate, cluster, world_size, software_of(candidate), ep)
                fitting.append((estimate, candidate, ep))
    fitting.sort(key=lambda item: item[0])
    ranked = [predict(c, cluster, world_size, software_of(c), ep) for _, c, ep in fitting[:simulate_top]]
    try:
        reference = predict(config, cluster, world_size, software_of(config), ep_size)
    except LayoutError:
        reference = None
    if reference is not None and not any(_same_layout(reference, p) for p in ranked):
        ranked.append(reference)  # the config's own layout always competes
    ranked = [p for p in ranked if p.fits]
    ranked.sort(key=conservative_seconds)
    return SearchResult(ranked, reference, considered, len(fitting))


def _same_layout(a: Prediction, b: Prediction) -> bool:
    return a.describe_layout() == b.describe_layout()


def why_best_wins(result: SearchResult) -> str:
    """One paragraph: how the best layout compares with the config's own (or the runner-up), term by term."""
    if not result.ranked:
        return "no layout fits in memory"
    best = result.best
    other, name = result.reference, "the config's layout"
    if other is None or _same_layout(other, best) or not other.fits:
        if other is not None and not other.fits and not _same_layout(other, best):
            prefix = (
                f"the config's layout ({other.describe_layout()}) does not fit "
                f"({other.memory_gib:.1f} GiB > {other.memory_capacity_gib:.0f} GiB); "
            )
        elif other is not None and _same_layout(other, best):
            prefix = "the config's layout is the best; "
        else:
            prefix = ""
        if len(result.ranked) < 2:
            return prefix + "it is the only layout that fits"
        other, name = result.ranked[1], "the runner-up"
    else:
        prefix = ""
    gain = other.iteration_seconds / best.iteration_seconds - 1.0
    deltas = {k: other.breakdown[k] - best.breakdown[k] for k in best.breakdown}
    saved = sorted((k for k in deltas if deltas[k] > 0), key=lambda k: -deltas[k])
    paid = sorted((k for k in deltas if deltas[k] < 0), key=lambda k: deltas[k])
    parts = [f"{k.replace('_', ' ')} -{deltas[k]:.2f} s" for k in saved[:3]]
    costs = [f"{k.replace('_', ' ')} +{-deltas[k]:.2f} s" for k in paid[:2]]
    text = (
        f"{prefix}{best.describe_layout()} is {gain:.1%} faster than {name} ({other.describe_layout()}): "
        f"{', '.join(parts) or 'no term'} per iteration"
    )
    if costs:
        text += f", against {', '.join(costs)}"
    return text + f"; it needs {best.memory_gib:.1f} of {best.memory_capacity_gib:.0f} GiB."
