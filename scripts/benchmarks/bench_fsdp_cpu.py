"""FSDP (ZeRO-3, parallel.fsdp) against the distributed optimizer (ZeRO-1) at 4 ranks, and one process, on CPU.

Runs the real trainer (training/run.py build_run, training/loop.py train) on forked gloo ranks, a deep narrow GPT on
the sample corpus (many layers: FSDP's transient gathered layers are a small part of the model, as on a real one),
fp32, one micro-batch per rank, and prints per rank (rank 0; the ranks are alike):
  - ms per iteration: the median of the iterations after the first (metrics.jsonl),
  - bytes moved per iteration: every collective of one training iteration as this rank issued it (parallel/comm.py's
    recorder: all-gather outputs, reduce-scatter inputs, all-reduced buffers),
  - parameters, gradients, optimizer state: the bytes each holds between iterations (exact: the tensors), and
  - their peak during the iteration: those plus, under FSDP, what is gathered at once: the gathered parameters
    registered on the modules (plain tensors while a unit is unsharded), the gradients of those, and FSDP's
    flat all-gather and reduce-scatter buffers (allocated through the trainer's custom collectives, tracked until
    freed); sampled at every unit's forward and backward hooks (the moment a copy-out overlaps its buffer falls
    between two samples: at most one layer's buffer unseen).
The one-process figure is the same model on one rank (fp32: 16 bytes per parameter, no transient), and the
target is a quarter of it.

    python scripts/benchmarks/bench_fsdp_cpu.py [--layers 96 --hidden 64 --iters 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import weakref

import torch
from bench_models import fork_ranks, set_rank_environment, short_run

from config.schema import load_config
from operations.startup import DEFAULT_CONFIG, init_distributed
from parallel.comm_recorder import CommRecorder
from parallel.fsdp import RecordedAllGather, RecordedReduceScatter, local_tensor
from parallel.layout import layout_from_config
from training.loop import train
from training.run import build_run

CASES = [
    ("one process", 1, []),
    ("dp 4 FSDP", 4, ["parallel.fsdp=true"]),
    ("dp 4 distributed optimizer", 4, ["parallel.distributed_optimizer=true"]),
]


class BufferMeter:
    """Live bytes of FSDP's flat communication buffers (the custom collectives' `allocate`), until freed."""

    def __init__(self) -> None:
        self.live = 0

    def wrap(self, comm_class: type[RecordedAllGather | RecordedReduceScatter], every: int = 1) -> None:
        """Count the buffers `comm_class.allocate` makes (only the first of every `every` calls)."""
        meter, allocate, calls = self, comm_class.allocate, [0]

        def counted(self, size, *, dtype, device):
            tensor = allocate(self, size, dtype=dtype, device=device)
            calls[0] += 1
            if (calls[0] - 1) % every == 0:
                nbytes = tensor.numel() * tensor.element_size()
                meter.live += nbytes
                weakref.finalize(tensor, meter.release, nbytes)
            return tensor

        comm_class.allocate = counted  # type: ignore[method-assign]

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class StateMeter:
    """Bytes of parameters, gradients and optimizer state of the rank's chunks, now, and their peak at samples."""

    def __init__(self, run, buffers: BufferMeter):
        self.run, self.buffers, self.peak = run, buffers, 0
        for chunk in run.ctx.chunks:
            for module in [chunk, *[layer for _, layer in chunk.transformer_layers()]]:
                module.register_forward_pre_hook(lambda *_: self.sample())
                module.register_forward_hook(lambda *_: self.sample())
                module.register_full_backward_pre_hook(lambda *_: self.sample())
                module.register_full_backward_hook(lambda *_: self.sample())

    def parts(self) -> dict[str, int]:
        storages: dict[int, int] = {}
        grads: dict[int, int] = {}
        for chunk in self.run.ctx.chunks:
            for param in chunk.parameters():  # sharded DTensors, or the gathered plain ones while unsharded
                local = local_tensor(param)
                storages[local.data_ptr()] = local.numel() * local.element_size()
                if param.grad is not None:
                    grad = local_tensor(param.grad)
                    grads[grad.data_ptr()] = grad.numel() * grad.element_size()
        optimizer = self.run.ctx.optimizer
        main_grads = getattr(self.run.ctx.ddp, "buffers", [])  # DataParallel's flat fp32 gradient buffers
        return {
            "params": sum(storages.values()),
            "grads": sum(grads.values()) + sum(b.numel() * b.element_size() for b in main_grads),
            "optimizer": optimizer.state_bytes(),
            "buffers": self.buffers.live,
        }

    def sample(self) -> None:
        self.peak = max(self.peak, sum(self.parts().values()))


def _rank(rank: int, world_size: int, port: int, overrides: list[str], meter_memory: bool, results) -> None:
    set_rank_environment(rank, world_size, port)
    logging.disable(logging.INFO)
    config = load_config(DEFAULT_CONFIG, overrides)
    buffers = BufferMeter()
    if meter_memory:
        buffers.wrap(RecordedAllGather)
        # a reduce-scatter allocates its input, then its output, which becomes the gradient shards (counted there)
        buffers.wrap(RecordedReduceScatter, every=2)
    run = build_run(config, init_distributed(), layout_from_config(config, world_size))
    recorder = run.state.comm.recorder = CommRecorder(keep_all=True)
    meter = StateMeter(run, buffers) if meter_memory else None
    train(run)
    with open(os.path.join(config.run.dir, "metrics.jsonl"), encoding="utf-8") as handle:
        times = [json.loads(line)["ms_per_iter"] for line in handle if "ms_per_iter" in line]
    moved = sum(r.nbytes for r in recorder.records("train", 2))
    figures = {"ms": statistics.median(times[1:]), "moved": moved}
    if meter is not None:
        figures.update(peak=meter.peak, **meter.parts())
    results.put((rank, figures))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def measure(world_size: int, overrides: list[str], meter_memory: bool) -> dict:
    """Rank 0's figures of one run."""
    results = fork_ranks(_rank, world_size, overrides, meter_memory)
    return dict(results.get() for _ in range(world_size))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--iters", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = [
            f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}",
            "model.num_attention_heads=4",
            "model.seq_length=64",
            "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "data.num_workers=0",
            f"data.cache_dir={os.path.join(tmp, 'index-cache')}",
        ]
        rows = {}
        for name, world, extra in CASES:  # timed without the meter's hooks, then measured with them (2 iterations)
            timed = short_run(args.iters, tempfile.mkdtemp(dir=tmp))
            rows[name] = measure(world, model + extra + timed, False)
            metered = measure(world, model + extra + short_run(2, tempfile.mkdtemp(dir=tmp)), True)
            rows[name].update({k: v for k, v in metered.items() if k != "ms"})
    one = rows["one process"]
    quarter = (one["params"] + one["grads"] + one["optimizer"]) / 4
    print(f"model: {args.layers} layers, hidden {args.hidden}; fp32; rank 0 of each run; MiB")
    print(
        "| run | ms/iter | MiB moved/iter | params | grads | optimizer | between iterations | peak | peak / (one process / 4) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        held = row["params"] + row["grads"] + row["optimizer"]
        peak = max(row["peak"], held)
        print(
            f"| {name} | {row['ms']:.0f} | {row['moved'] / 2**20:.2f} | {row['params'] / 2**20:.2f} | "
            f"{row['grads'] / 2**20:.2f} | {row['optimizer'] / 2**20:.2f} | {held / 2**20:.2f} | {peak / 2**20:.2f} | "
            f"{peak / quarter:.3f} |"
        )


if __name__ == "__main__":
    main()
