"""Published measurements on DGX A100 80GB (Narayanan et al., SC21), used to calibrate and check the model.

Table 1 (weak scaling, the ten configs of configs/paper/) and the PTD-P rows of Table 2 (GPT-3 175B and the
530B model at fixed batch on more and more GPUs). Both: bf16, sequence 2048, vocabulary 51,200, full
activation recomputation, micro-batch 1, the interleaved schedule with scatter/gather (§5.1). The paper does
not give the number of chunks: `paper_vp` SETS it (not fitted) to the smallest v > 1 that divides the layers
per pipeline stage (the least interleaving the text allows; 2 for most rows, 3 for 15 or 3 layers per
stage), and Megatron's interleaved schedule of 2021 needed the micro-batches to be a multiple of p, which
every row satisfies. Rows without a pipeline (p = 1) run plain. The data-parallel all-reduce of 2021 was not
overlapped with the backward and ran in 16 bits (PAPER_SOFTWARE). The figures' points are in
planner/paper_figures.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from config.schema import Config, config_from_dict, load_config
from model.shape import iteration_flops
from planner.predict import Software

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class PublishedRow:
    """One published throughput: config, GPUs, achieved TFLOP/s per GPU and % of the 312 TF peak."""

    label: str
    world_size: int
    tflops_per_gpu: float
    percent_of_peak: float | None
    config_name: str = ""  # configs/paper/<name>.yaml (Table 1)
    model: tuple[int, int, int] = (0, 0, 0)  # (layers, hidden, heads) for Table 2
    layout: tuple[int, int, int] = (0, 0, 0)  # (tp, pp, global batch) for Table 2

    def config(self, paper_schedule: bool = True) -> Config:
        """The row's config at the paper's schedule (`paper_schedule`) or the configs' plain 1F1B."""
        base = self._plain_config()
        return with_paper_schedule(base) if paper_schedule else base

    def _plain_config(self) -> Config:
        if self.config_name:
            return load_config(os.path.join(REPO_ROOT, "configs", "paper", f"{self.config_name}.yaml"))
        layers, hidden, heads = self.model
        tp, pp, batch = self.layout
        return config_from_dict(
            {
                "model": {
                    "num_layers": layers,
                    "hidden_size": hidden,
                    "num_attention_heads": heads,
                    "seq_length": 2048,
                    "vocab_size": 51200,
                },
                "parallel": {"tp_size": tp, "pp_size": pp, "schedule": "1f1b"},
                "train": {"micro_batch_size": 1, "global_batch_size": batch, "precision": "bf16", "recompute": "full"},
            }
        )


# Megatron-LM of 2021 (local DDP, fp16 mixed precision): the gradients are reduced in 16 bits (it kept fp32
# gradients only for bf16) as one contiguous buffer after the pipeline flush, overlapping nothing
PAPER_SOFTWARE = Software(grad_reduce_bytes=2.0, overlap_grad_reduce=False)


def paper_vp(layers_per_stage: int) -> int:
    """The chunks per pipeline rank the planner assumes for the paper's interleaved runs: the smallest v > 1
    dividing the layers per stage (1 when the stage holds one layer)."""
    return next((v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0), 1)


def with_paper_schedule(config: Config, world_size: int | None = None, vp: int | None = None) -> Config:
    """`config` at the paper's schedule: interleaved with `vp` (default `paper_vp`) chunks and scatter/gather
    where there is a pipeline and the micro-batches m allow it (Megatron's 2021 rule: m a multiple of p,
    checked when `world_size` is given), else plain 1F1B with scatter/gather."""
    par, train = config.parallel, config.train
    p = par.pp_size
    chunks = vp if vp is not None else paper_vp(config.model.num_layers // p)
    if world_size is not None:
        dp = world_size // (par.tp_size * p)
        m = train.global_batch_size // (train.micro_batch_size * max(1, dp))
        chunks = chunks if m % p == 0 else 1
    if p == 1:
        chunks = 1
    schedule = "interleaved" if chunks > 1 else "1f1b"
    parallel = dataclasses.replace(par, vp_size=chunks, schedule=schedule, scatter_gather=True)
    return dataclasses.replace(config, parallel=parallel)


TABLE_1 = [
    PublishedRow("1.7B", 32, 137, 44, "gpt_1.7b"),
    PublishedRow("3.6B", 64, 138, 44, "gpt_3.6b"),
    PublishedRow("7.5B", 128, 142, 46, "gpt_7.5b"),
    PublishedRow("18.4B", 256, 135, 43, "gpt_18.4b"),
    PublishedRow("39.1B", 512, 138, 44, "gpt_39.1b"),
    PublishedRow("76.1B", 1024, 140, 45, "gpt_76.1b"),
    PublishedRow("145.6B", 1536, 148, 47, "gpt_145.6b"),
    PublishedRow("310.1B", 1920, 155, 50, "gpt_310.1b"),
    PublishedRow("529.6B", 2520, 163, 52, "gpt_529.6b"),
    PublishedRow("1008.0B", 3072, 163, 52, "gpt_1t"),
]

TABLE_2_PTDP = [
    PublishedRow(f"{name} on {gpus} GPUs", gpus, tflops, None, model=model, layout=layout)
    for name, model, layout, runs in (
        ("174.6B", (96, 12288, 96), (8, 12, 1536), ((384, 153), (768, 149), (1536, 141))),
        ("529.6B", (105, 20480, 128), (8, 35, 2240), ((560, 171), (1120, 167), (2240, 159))),
    )
    for gpus, tflops in runs
]


def observations(rows: list[PublishedRow]) -> list:
    """Calibration observations (planner.calibrate.Observation) of published rows."""
    from planner.calibrate import Observation

    result = []
    for row in rows:
        config = row.config()  # full recomputation: the achieved FLOPs are the paper's equation (3)
        par = config.parallel
        vocab = config.model.padded_vocab_size(par.tp_size)
        flops = iteration_flops(config.model, vocab, config.train, par.pp_size * par.vp_size).with_recompute
        seconds = flops / (row.tflops_per_gpu * 1e12 * row.world_size)
        result.append(Observation(row.label, config, row.world_size, seconds, PAPER_SOFTWARE))
    return result
