"""The effects the paper's figures show (Narayanan et al., SC21, Figures 7 and 11-18), as held-out checks.

None of these points is used by any fit (planner/fit_report.py fits Table 1 only). Each effect compares two
settings of one experiment: `ratio` is published throughput(setting B) / throughput(setting A), and its
`source` says where the number comes from:

- "text": a number the paper's text states (§5.x), exact as printed;
- "plot": read off the plotted figure (the figures' values are not in the text); these readings come from
  a published description of the figures and issue 22's reading, good to about +-10% of each value, so a
  ratio of two readings to about +-15%;
- "direction": the text or the figure gives only the sign of the effect (ratio > 1 or < 1), no size.

`tolerance` is the relative band the tests allow around the published ratio (the sign must always agree).
Each point runs as the paper's scripts ran it (Megatron-LM examples/academic_paper_scripts/sc21: model,
layout, batch, micro-batch, chunks, local DDP, fp16, full recomputation except Figure 17's "none").
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from config.schema import Config, load_config
from planner.cluster import ClusterSpec
from planner.predict import predict
from planner.published import PAPER_LOCAL_DDP, REPO_ROOT, PaperRun, as_paper_ran

SIZE_TOLERANCE = 0.25  # the acceptance bound on an effect's size (ratio within +-25%)


@dataclass(frozen=True)
class Setting:
    """One plotted point: model (layers, hidden, heads), layout, batch, micro-batch, schedule, recompute."""

    layers: int
    hidden: int
    heads: int
    gpus: int
    tp: int
    pp: int
    batch: int
    micro_batch: int = 1
    vp: int = 1  # chunks per pipeline rank; 1: plain 1F1B
    scatter_gather: bool = True
    recompute: str = "full"

    def config(self) -> Config:
        base = load_config(
            os.path.join(REPO_ROOT, "configs", "paper", "gpt_145.6b.yaml"),
            [
                f"model.num_layers={self.layers}",
                f"model.hidden_size={self.hidden}",
                f"model.num_attention_heads={self.heads}",
                f"parallel.tp_size={self.tp}",
                f"parallel.pp_size={self.pp}",
                f"train.global_batch_size={self.batch}",
                f"train.recompute={self.recompute}",
            ],
        )
        run = PaperRun(self.micro_batch, self.vp, scatter_gather=self.scatter_gather)  # 2021, local DDP
        return as_paper_ran(base, run)


@dataclass(frozen=True)
class Effect:
    """Published throughput(b) / throughput(a) and where it comes from."""

    figure: str
    name: str
    a: Setting
    b: Setting
    ratio: float  # published; for "direction" only its side of 1 counts
    source: str  # "text", "plot" or "direction"
    note: str
    tolerance: float = SIZE_TOLERANCE
    per_sequence: bool = False  # compare sequences/s (Figure 17), not TFLOP/s per GPU

    @property
    def sized(self) -> bool:
        return self.source != "direction"


def _gpt175(batch: int, vp: int = 1, scatter_gather: bool = True) -> Setting:
    """Figures 12 and 18: the interleaved runs keep 2 of the 8 layers per stage in each chunk (vp 4)."""
    return Setting(96, 12288, 96, 96, 8, 12, batch, vp=vp, scatter_gather=scatter_gather)


def _fig13(tp: int, batch: int) -> Setting:
    return Setting(32, 20480, 128, 64, tp, 64 // tp, batch)


def _fig14(pp: int, batch: int) -> Setting:
    return Setting(32, 3840, 32, 64, 1, pp, batch)


def _fig15(tp: int, batch: int) -> Setting:
    return Setting(32, 3840, 32, 64, tp, 1, batch)


def _fig17(batch: int, recompute: str) -> Setting:
    return Setting(80, 12288, 96, 128, 8, 16, batch, recompute=recompute)


def _fig11(pp: int, batch: int) -> Setting:
    return Setting(3 * pp, 20480, 128, 8 * pp, 8, pp, batch)


def _fig16(micro_batch: int, batch: int) -> Setting:
    return Setting(32, 15360, 128, 64, 8, 8, batch, micro_batch=micro_batch)


def _scatter_gather(batch: int, ratio: float, source: str, note: str) -> Effect:
    """Figure 18: GPT-3 175B on 96 GPUs, interleaved, with against without scatter/gather."""
    name = f"scatter/gather, interleaved, batch {batch}"
    return Effect("18", name, _gpt175(batch, 4, False), _gpt175(batch, 4), ratio, source, note)


_FIG7 = Setting(4, 4096, 128, 1, 1, 1, 16)

EFFECTS: tuple[Effect, ...] = (
    Effect(
        "7",
        "micro-batch 1 -> 8, one GPU",
        dataclasses.replace(_FIG7, micro_batch=1),
        dataclasses.replace(_FIG7, micro_batch=8),
        1.3,
        "plot",
        "~70 -> ~90 TF/GPU, 'about 1.3x'",
    ),
    Effect(
        "11", "batch 8: p 1 -> 8 (weak scaling)", _fig11(1, 8), _fig11(8, 8), 85 / 165, "plot", "~165 -> ~85 TF/GPU"
    ),
    Effect(
        "11",
        "batch 128: p 1 -> 8 (weak scaling)",
        _fig11(1, 128),
        _fig11(8, 128),
        1.0,
        "plot",
        "flat at ~170-175 TF/GPU",
        tolerance=0.10,
    ),
    Effect(
        "12",
        "interleaved vs plain, batch 12",
        _gpt175(12),
        _gpt175(12, vp=4),
        1.01,
        "direction",
        "§5.3.2: the interleaved schedule with scatter/gather is faster; the gap closes with batch",
    ),
    Effect(
        "12",
        "interleaved vs plain, batch 60",
        _gpt175(60),
        _gpt175(60, vp=4),
        1.01,
        "direction",
        "§5.3.2: still faster at batch 60, by less than at 12",
    ),
    Effect(
        "13",
        "(t, p) (8, 8) vs (16, 4), batch 128",
        _fig13(16, 128),
        _fig13(8, 128),
        1.01,
        "direction",
        "§5.4.1: peak at t = 8, the GPUs of one node",
    ),
    Effect(
        "13",
        "(t, p) (8, 8) vs (2, 32), batch 32",
        _fig13(2, 32),
        _fig13(8, 32),
        1.01,
        "direction",
        "§5.4.1: the deep pipeline's bubble costs at small batch",
    ),
    Effect(
        "14",
        "p 2 -> 32 (t 1), batch 512",
        _fig14(2, 512),
        _fig14(32, 512),
        0.99,
        "direction",
        "§5.4.2: throughput decreases as the pipeline-parallel size increases",
    ),
    Effect(
        "14",
        "p 2 -> 32 (t 1), batch 32",
        _fig14(2, 32),
        _fig14(32, 32),
        0.99,
        "direction",
        "§5.4.2: decreases for each batch size. No size: the reading '~90 -> ~40' is not one the run can give "
        "(batch 32 over d 32 is one micro-batch per pipeline, so p 2 idles half of each iteration: at most "
        "half of the no-bubble ~150-165 TF/GPU of batch 512)",
    ),
    Effect("15", "t 2 -> 32 (p 1), batch 512", _fig15(2, 512), _fig15(32, 512), 25 / 128, "plot", "~128 -> ~25 TF/GPU"),
    Effect(
        "15",
        "batch 32 -> 512 at (t, d) (2, 32)",
        _fig15(2, 32),
        _fig15(2, 512),
        128 / 58,
        "plot",
        "~58 -> ~128 TF/GPU (issue 22's reading)",
    ),
    Effect(
        "16",
        "micro-batch 1 -> 2, batch 512",
        _fig16(1, 512),
        _fig16(2, 512),
        1.01,
        "direction",
        "§5.5: the best micro-batch size is 2",
    ),
    Effect(
        "16", "micro-batch 2 -> 8, batch 128", _fig16(2, 128), _fig16(8, 128), 120 / 155, "plot", "~155 -> ~120 TF/GPU"
    ),
    Effect(
        "17",
        "recompute, batch 1",
        _fig17(1, "none"),
        _fig17(1, "full"),
        0.75,
        "text",
        "§5.6: 'up to 33% lower throughput' for small batches (1/1.33)",
        per_sequence=True,
    ),
    Effect(
        "17",
        "recompute at 256 vs none at 8",
        _fig17(8, "none"),
        _fig17(256, "full"),
        2.0,
        "text",
        "§5.6: 'up to 2x higher than the best throughput without' (batch 8)",
        per_sequence=True,
    ),
    _scatter_gather(60, 1.11, "text", "§5.7: 'up to 11%' (the plot reads ~130 -> ~150)"),
    _scatter_gather(12, 1.01, "direction", "§5.7: the gain is largest at large batch"),
)

FIGURE_17_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FIGURE_17_LARGEST_NO_RECOMPUTE_BATCH = 8  # text §5.6 and the plot: without recomputation only up to 8 fits


def figure_17(batch: int, recompute: str) -> Setting:
    """Figure 17's point: the 145B model on 128 GPUs at (t, p) = (8, 16)."""
    return _fig17(batch, recompute)


def throughput(setting: Setting, cluster: ClusterSpec, per_sequence: bool) -> float:
    """Predicted TFLOP/s per GPU, or sequences per second (Figure 17's axis)."""
    p = predict(setting.config(), cluster, setting.gpus, PAPER_LOCAL_DDP)
    if per_sequence:
        return setting.batch / p.iteration_seconds
    return p.tflops_per_gpu


def predicted_ratio(effect: Effect, cluster: ClusterSpec) -> float:
    """The planner's throughput(b) / throughput(a) for one effect."""
    return throughput(effect.b, cluster, effect.per_sequence) / throughput(effect.a, cluster, effect.per_sequence)


def agrees(effect: Effect, predicted: float) -> bool:
    """Same side of 1 as the published ratio and, for sized effects, within the stated tolerance."""
    if (predicted > 1.0) != (effect.ratio > 1.0):
        return False
    return not effect.sized or abs(predicted / effect.ratio - 1.0) <= effect.tolerance


def fits_without_recompute(batch: int, cluster: ClusterSpec) -> bool:
    """Whether Figure 17's no-recomputation point fits in the cluster's memory."""
    return predict(figure_17(batch, "none").config(), cluster, 128, PAPER_LOCAL_DDP).fits
