"""CPU memory per rank of the real trainer: dp and the distributed optimizer, and each recompute mode.

Runs the trainer's own build_run + train (training/run.py, training/loop.py) on forked gloo ranks
(configs/gpt_tiny.yaml on the sample corpus, enlarged so that differences stand out of the Python/torch baseline) for a few iterations per case and prints,
for each rank (the table shows rank 0; dp ranks are alike):
  - maxrss: the process's resident-set high-water mark (ru_maxrss; a forked rank starts from the parent's
    ~torch-import RSS, the same in every case),
  - train peak: the largest RSS sampled (every 2 ms) during training minus the RSS just before it,
  - params / grads / optimizer: exact bytes of the model params, fp32 main-grad buffers and optimizer state
    (fp32 masters + Adam moments) as the trainer reports them at start-up,
  - activations: the peak bytes of tensors saved for backward (torch.autograd.graph.saved_tensors_hooks,
    counted once per storage, parameters excluded); activation checkpointing shows here, allocator-independent.

    python scripts/benchmarks/bench_cpu_memory.py [--iters 2] [--verbose]
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp
from bench_models import set_rank_environment

from config.schema import load_config
from operations.startup import DEFAULT_CONFIG, init_distributed
from parallel.layout import layout_from_config
from training.loop import train
from training.run import build_run

# Twin of the model in tests/planner/test_model_size_and_memory.py, whose MEASURED figures this benchmark printed.
MODEL = [
    "model.hidden_size=256",
    "model.num_layers=8",
    "model.seq_length=256",
    "model.num_attention_heads=4",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "train.micro_batch_size=8",
]
# (label, dp, overrides): one micro-batch per rank per iteration, so activation memory is comparable.
CASES = [
    ("dp=1", 1, []),
    ("dp=1 selective", 1, ["train.recompute=selective"]),
    ("dp=1 full", 1, ["train.recompute=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]),
    # SDPA's CPU kernel keeps no [s, s] tensor without dropout; with attention dropout it takes the math path
    ("dp=1 attn-dropout", 1, ["model.attention_dropout=0.1"]),
    ("dp=1 attn-dropout selective", 1, ["model.attention_dropout=0.1", "train.recompute=selective"]),
    ("dp=2", 2, []),
    ("dp=2 distopt", 2, ["parallel.distributed_optimizer=true"]),
    ("dp=4", 4, []),
    ("dp=4 distopt", 4, ["parallel.distributed_optimizer=true"]),
]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class RSSSampler(threading.Thread):
    """Largest RSS seen while running (sampled; a short spike between two samples can be missed)."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.peak, self.running = interval, rss_bytes(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, rss_bytes())


class SavedTensorMeter:
    """Peak bytes of tensors autograd saves for backward, once per storage, parameters excluded."""

    class _Handle:
        __slots__ = ("__weakref__", "tensor")
        tensor: torch.Tensor

    def __init__(self, params: Sequence[torch.Tensor]):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.bytes = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.param_storages or tensor.device.type == "meta":
            return tensor
        if key not in self.live:
            self.live[key] = [0, storage.nbytes()]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        self.live[key][0] += 1
        handle = self._Handle()
        handle.tensor = tensor
        weakref.finalize(handle, self._release, key)  # the graph dropped this saved tensor
        return handle

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= self.live.pop(key)[1]

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, SavedTensorMeter._Handle) else packed


def _rank(rank: int, world_size: int, port: int, overrides: list[str], verbose: bool, results) -> None:
    set_rank_environment(rank, world_size, port)
    if not verbose:
        logging.disable(logging.INFO)
    config = load_config(DEFAULT_CONFIG, overrides)
    layout = layout_from_config(config, world_size)
    run = build_run(config, init_distributed(), layout)
    params = [p for chunk in run.ctx.chunks for p in chunk.parameters()]
    meter = SavedTensorMeter(params)
    start_rss = rss_bytes()
    sampler = RSSSampler()
    sampler.start()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        train(run)
    peak_rss = sampler.stop()

    results.put(
        (
            rank,
            {
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "train_peak": peak_rss - start_rss,
                "params": sum(p.numel() * p.element_size() for p in params),
                "numel": sum(p.numel() for p in params),
                "grads": run.ctx.ddp.grad_buffer_bytes(),
                "optimizer": run.ctx.optimizer.state_bytes(),
                "activations": meter.peak,
            },
        )
    )
    if world_size > 1:
        torch.distributed.destroy_process_group()


def measure(dp: int, overrides: list[str], iters: int, verbose: bool, tmp: str) -> dict[int, dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    all_overrides = [  # on configs/gpt_tiny.yaml (DEFAULT_CONFIG)
        *MODEL,
        f"train.global_batch_size={8 * dp}",
        f"train.train_iters={iters}",
        "optim.lr_warmup_iters=1",
        "train.eval_iters=0",
        "data.num_workers=0",
        f"data.cache_dir={os.path.join(tmp, 'index-cache')}",
        "checkpoint.save=false",
        "logging.tensorboard=false",
        "logging.log_interval=1",
        f"run.dir={tempfile.mkdtemp(dir=tmp)}",
        *overrides,
    ]
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _rank, args=(dp, port, all_overrides, verbose, results), nprocs=dp, join=True, start_method="fork"
    )
    return dict(results.get() for _ in range(dp))


def mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="keep the trainer's INFO logging")
    args = parser.parse_args()
    print(
        f"parent RSS before forking ranks: {mib(rss_bytes())} MiB; model: {' '.join(MODEL)}; "
        f"{args.iters} iterations, one micro-batch of 8 per rank per iteration, fp32"
    )
    header = (
        "| case | maxrss MiB | train peak MiB | params MiB | grads MiB | optimizer MiB | activations MiB | seconds |"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, dp, overrides in CASES:
            started = time.time()
            ranks = measure(dp, overrides, args.iters, args.verbose, tmp)
            r0 = ranks[0]
            rows.append(
                f"| {label} | {mib(r0['maxrss'])} | {mib(r0['train_peak'])} | {mib(r0['params'])} | "
                f"{mib(r0['grads'])} | {mib(r0['optimizer'])} | {mib(r0['activations'])} | "
                f"{time.time() - started:.0f} |"
            )
            others = ", ".join(
                f"rank {k}: maxrss {mib(v['maxrss'])}, optimizer {mib(v['optimizer'])}"
                for k, v in sorted(ranks.items())
                if k
            )
            print(rows[-1] + (f"  ({others})" if others else ""), flush=True)
    print(f"\n{ranks[0]['numel']:,} parameters (rank 0)\n" + header + "\n|" + "---|" * 8 + "\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
