"""Published measurements on DGX A100 80GB (Narayanan et al., SC21), used to calibrate and check the model.

Table 1 (weak scaling, the ten configs of configs/paper/), the PTD-P rows of Table 2 (GPT-3 175B and the
530B model at fixed batch on more and more GPUs) and its ZeRO-3 rows (DeepSpeed, no model parallelism: one
constant fitted on one row, `fit_sharded_bandwidth`). Each row runs as the paper ran it, from the scripts the
authors published with it (Megatron-LM examples/academic_paper_scripts/sc21, for Megatron-LM commit 6985e58):
sequence 2048, vocabulary 51,200, fp16 with full ("uniform") activation recomputation, and per row the
micro-batch size, the chunks of the interleaved schedule (`--num-layers-per-virtual-pipeline-stage`; rows
without it ran plain 1F1B, except that the 1T row, whose script has none, runs at 2 chunks: §5.1 says Table 1
ran the interleaved schedule, and plain 1F1B leaves that row the one outlier, at -10%) and the data-parallel implementation: PyTorch DDP for rows
1-4 (buckets overlapping the last micro-batch's backward), Megatron's local DDP for the others (one flattened
all-reduce after the pipeline flush). Scatter/gather was on (the default). Table 2 has no script: its 530B row
is Table 1's run, and its 175B rows take the 175B model's settings from the Figure 12/18 scripts (t 8, p 12,
micro-batch 1, two layers per virtual stage). The figures' points are in planner/paper_figures.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from config.schema import Config, config_from_dict, load_config
from parallel.layout import layout_from_config
from parallel.run_shape import RunShape
from planner.calibrate import Observation
from planner.predict import predict
from planner.software import Software

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Megatron-LM of 2021 in fp16: the gradients are fp16 (`param.grad`; fp32 main grads only for bf16) and the
# step is the fp16 optimizer's: grads copied to fp32 (2 + 4 B), unscaled with the inf check (4 + 4), their
# norm (4), Adam (28) and the fp32 -> fp16 copy-back (4 + 2): 52 B per parameter.
_PAPER_STEP_BYTES = 52.0
# local DDP: after the flush, one all-reduce of the flattened fp16 grads (flatten 2 + 2 B, divide 2 + 2,
# copy back 2 + 2), overlapping nothing
PAPER_LOCAL_DDP = Software(
    grad_reduce_bytes=2.0,
    bucketed_grads=False,
    overlap_grad_reduce=False,
    planned_p2p=False,  # Megatron-LM 2021's schedules: a synchronous batch per step, for the next action
    step_bytes=_PAPER_STEP_BYTES,
    copy_bytes=12.0,
)
# PyTorch DDP: fp16 buckets during the last micro-batch's backward (copies into and out of them, 2 + 2 B each)
PAPER_TORCH_DDP = Software(
    grad_reduce_bytes=2.0, overlap_grad_reduce=True, planned_p2p=False, step_bytes=_PAPER_STEP_BYTES, copy_bytes=8.0
)
# DeepSpeed's ZeRO-3 as Table 2 ran it (Megatron-LM's model integrated with the DeepSpeed library, 2021, fp16): each
# parameter partitioned over all ranks and all-gathered by its own collective (per parameter, not per layer), in
# fp16, before its module's forward and again before its backward; the fp16 gradients reduce-scattered after it;
# defaults stage3_prefetch_bucket_size = 5e7 parameters fetched ahead and overlap_comm = false (the reductions
# do not overlap the backward); the fp16 optimizer's step on the rank's partition (as Megatron's, 52 B per
# element). One constant is fitted, on one row (`fit_sharded_bandwidth`: 174.6B on 768 GPUs, the doubled count):
# the share of the cost model's collective bandwidth these collectives reached, 0.218, about 1.7 network cards'
# worth per GPU where NCCL's ring over eight GPUs per node would use all eight; the other five rows are held out.
PAPER_DEEPSPEED_ZERO3 = Software(
    grad_reduce_bytes=2.0,
    bucketed_grads=False,
    overlap_grad_reduce=False,
    planned_p2p=False,
    step_bytes=_PAPER_STEP_BYTES,
    copy_bytes=0.0,
    gather_bytes=2.0,
    prefetch_params=5e7,
    gather_per_param=True,
    sharded_bandwidth=0.218,
)
PAPER_SOFTWARE = {"local": PAPER_LOCAL_DDP, "torch": PAPER_TORCH_DDP, "zero3": PAPER_DEEPSPEED_ZERO3}


@dataclass(frozen=True)
class PaperRun:
    """How the paper ran one point (the sc21 scripts): micro-batch, chunks per pipeline rank, DDP kind."""

    micro_batch: int = 1
    vp: int = 1  # (layers / p) / --num-layers-per-virtual-pipeline-stage; 1: plain 1F1B
    ddp: str = "local"
    scatter_gather: bool = True  # the default; only Figure 18's baseline turned it off

    @property
    def software(self) -> Software:
        return PAPER_SOFTWARE[self.ddp]


@dataclass(frozen=True)
class PublishedRow:
    """One published throughput: config, GPUs, achieved TFLOP/s per GPU and % of the 312 TF peak."""

    label: str
    world_size: int
    tflops_per_gpu: float
    percent_of_peak: float | None
    run: PaperRun
    config_name: str = ""  # configs/paper/<name>.yaml (Table 1)
    model: tuple[int, int, int] = (0, 0, 0)  # (layers, hidden, heads) for Table 2
    layout: tuple[int, int, int] = (0, 0, 0)  # (tp, pp, global batch) for Table 2
    fsdp: bool = False  # Table 2's ZeRO-3 rows (parallel.fsdp: sharded data parallelism)

    def config(self) -> Config:
        """The row's config as the paper ran it (micro-batch, schedule, scatter/gather)."""
        return as_paper_ran(self._plain_config(), self.run)

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
                    "fused_kernels": True,  # the paper's runs fused their memory-bound chains (§4.2)
                },
                "parallel": {"tp_size": tp, "pp_size": pp, "schedule": "1f1b", "fsdp": self.fsdp},
                "train": {"micro_batch_size": 1, "global_batch_size": batch, "precision": "bf16", "recompute": "full"},
            }
        )


def as_paper_ran(config: Config, run: PaperRun) -> Config:
    """`config` with the run's micro-batch, schedule (interleaved with `run.vp` chunks, else plain 1F1B) and
    scatter/gather, as Megatron-LM 2021 ran it (its interleaved schedule needed p > 2 and the
    micro-batches a multiple of p; every published run satisfies both)."""
    chunks = run.vp if config.parallel.pp_size > 1 else 1
    schedule = "interleaved" if chunks > 1 else "1f1b"
    parallel = dataclasses.replace(
        config.parallel, vp_size=chunks, schedule=schedule, scatter_gather=run.scatter_gather
    )
    train = dataclasses.replace(config.train, micro_batch_size=run.micro_batch)
    return dataclasses.replace(config, parallel=parallel, train=train)


# run_table_1.sh: MBS, layers per virtual stage (76B: 5 of 15, 145B: 5 of 10, 310B: 3 of 6, 530B: 1 of 3;
# 1T: none in the script, 2 chunks from §5.1, see above) and DDP per model
TABLE_1 = [
    PublishedRow("1.7B", 32, 137, 44, PaperRun(16, 1, "torch"), "gpt_1.7b"),
    PublishedRow("3.6B", 64, 138, 44, PaperRun(16, 1, "torch"), "gpt_3.6b"),
    PublishedRow("7.5B", 128, 142, 46, PaperRun(16, 1, "torch"), "gpt_7.5b"),
    PublishedRow("18.4B", 256, 135, 43, PaperRun(8, 1, "torch"), "gpt_18.4b"),
    PublishedRow("39.1B", 512, 138, 44, PaperRun(4, 1), "gpt_39.1b"),
    PublishedRow("76.1B", 1024, 140, 45, PaperRun(2, 3), "gpt_76.1b"),
    PublishedRow("145.6B", 1536, 148, 47, PaperRun(2, 2), "gpt_145.6b"),
    PublishedRow("310.1B", 1920, 155, 50, PaperRun(1, 2), "gpt_310.1b"),
    PublishedRow("529.6B", 2520, 163, 52, PaperRun(1, 3), "gpt_529.6b"),
    PublishedRow("1008.0B", 3072, 163, 52, PaperRun(1, 2), "gpt_1t"),
]

TABLE_2_PTDP = [
    PublishedRow(f"{name} on {gpus} GPUs", gpus, tflops, None, PaperRun(1, vp), model=model, layout=layout)
    for name, model, layout, vp, runs in (
        ("174.6B", (96, 12288, 96), (8, 12, 1536), 4, ((384, 153), (768, 149), (1536, 141))),
        ("529.6B", (105, 20480, 128), (8, 35, 2240), 3, ((560, 171), (1120, 167), (2240, 159))),
    )
    for gpus, tflops in runs
]


def paper_software(config: Config) -> Software:
    """How the paper's software ran a layout: DeepSpeed's ZeRO-3 with parallel.fsdp, else Megatron-LM 2021's
    local DDP (the DDP of every row above 18.4B, Table 2's PTD-P rows included)."""
    return PAPER_DEEPSPEED_ZERO3 if getattr(config.parallel, "fsdp", False) else PAPER_LOCAL_DDP


# ZeRO-3 without model parallelism (DeepSpeed; the 530B model needed 640 GPUs and batch 2560 at micro-batch 4)
TABLE_2_ZERO3 = [
    PublishedRow(
        f"{name} ZeRO-3 on {gpus} GPUs",
        gpus,
        tflops,
        None,
        PaperRun(mb, 1, "zero3"),
        model=model,
        layout=(1, 1, batch),
        fsdp=True,
    )
    for name, model, runs in (
        ("174.6B", (96, 12288, 96), ((384, 4, 1536, 144), (768, 2, 1536, 88), (1536, 1, 1536, 44))),
        ("529.6B", (105, 20480, 128), ((640, 4, 2560, 138), (1120, 2, 2240, 98), (2240, 1, 2240, 48))),
    )
    for gpus, mb, batch, tflops in runs
]
ZERO3_FIT_ROW = 1  # the row the one constant of PAPER_DEEPSPEED_ZERO3 is fitted on: 174.6B on 768 GPUs


def fit_sharded_bandwidth(cluster: ClusterSpec, row: PublishedRow = TABLE_2_ZERO3[ZERO3_FIT_ROW]) -> float:
    """The `sharded_bandwidth` at which the planner gives `row`'s published TFLOP/s (bisection in log space:
    throughput rises with it)."""

    def tflops(share: float) -> float:
        software = dataclasses.replace(row.run.software, sharded_bandwidth=share)
        return predict(row.config(), cluster, row.world_size, software).tflops_per_gpu

    low, high = 0.01, 1.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if tflops(middle) < row.tflops_per_gpu else (low, middle)
    return (low * high) ** 0.5


def observations(rows: list[PublishedRow]) -> list:
    """Calibration observations (planner.calibrate.Observation) of published rows."""
    result = []
    for row in rows:
        config = row.config()  # full recomputation: the achieved FLOPs are the paper's equation (3)
        flops = RunShape.of(config, layout_from_config(config, row.world_size)).flops.with_recompute
        seconds = flops / (row.tflops_per_gpu * 1e12 * row.world_size)
        result.append(Observation(row.label, config, row.world_size, seconds, row.run.software))
    return result
