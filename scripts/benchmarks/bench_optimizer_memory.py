"""Optimizer memory per rank on a tiny GPT: dp = 1, 2, 4 x distributed optimizer off / on x fp32 / bf16.

Runs each layout on forked gloo ranks (CPU) and prints, for dp rank 0, the bytes of model params, fp32
main-grad buffers and optimizer state (fp32 masters + exp_avg + exp_avg_sq), and bytes per parameter next
to the mixed-precision formula (Megatron / ZeRO-1): 16-bit params 2 + fp32 grads 4 + 12 (plain) or 12 / dp
(distributed) = 18 or 6 + 12/dp bytes per parameter. fp32 plain aliases params as masters: 4 + 4 + 8 = 16.

    python scripts/benchmarks/bench_optimizer_memory.py [--layers 4 --hidden 128]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from bench_models import fork_ranks, model_config, tied_gpt

from config.schema import OptimConfig, TrainConfig
from model.precision import precision_dtype
from optim.optimizer import build_optimizer
from parallel.data_parallel import DataParallel
from parallel.state import ParallelState


def _rank(
    rank: int, world_size: int, port: int, layers: int, hidden: int, distributed: bool, precision: str, results
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    state = ParallelState.create(tp_size=1, pp_size=1)
    cfg = model_config(layers, hidden, heads=4, seq_length=64, vocab_size=1000)
    model = tied_gpt(cfg, seed=0, dtype=precision_dtype(precision))
    ddp = DataParallel([model], state, bucket_size_mb=0.25, distributed_optimizer=distributed)
    train = TrainConfig(precision=precision)
    optimizer = build_optimizer([model], ddp, state, OptimConfig(lr=1e-4), train, overlap_param_gather=False)
    if rank == 0:
        params = list(model.parameters())
        results.put(
            (
                sum(p.numel() for p in params),
                sum(p.numel() * p.element_size() for p in params),
                ddp.grad_buffer_bytes(),
                optimizer.state_bytes(),
            )
        )
    state.comm.barrier()
    dist.destroy_process_group()


def measure(dp: int, layers: int, hidden: int, distributed: bool, precision: str) -> tuple[int, ...]:
    """(numel, param bytes, grad buffer bytes, optimizer state bytes) of dp rank 0."""
    return fork_ranks(_rank, dp, layers, hidden, distributed, precision).get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    with torch.device("meta"):
        torch.nn.Embedding(2, 2)  # pay torch's one-time meta-init imports before forking, not once per rank
    print("| precision | dp | distributed | params | param B | grad B | optimizer B | B/param | formula |")
    print("|-----------|----|-------------|--------|---------|--------|-------------|---------|---------|")
    for precision in ("fp32", "bf16"):
        for distributed in (False, True):
            for dp in (1, 2, 4):
                numel, param_b, grad_b, opt_b = measure(dp, args.layers, args.hidden, distributed, precision)
                per_param = (param_b + grad_b + opt_b) / numel
                size = 4 if precision == "fp32" else 2
                formula = size + 4 + (12 / dp if distributed else (8 if precision == "fp32" else 12))
                print(
                    f"| {precision} | {dp} | {'on' if distributed else 'off'} | {numel} | {param_b} | "
                    f"{grad_b} | {opt_b} | {per_param:.3f} | {formula:.3f} |"
                )


if __name__ == "__main__":
    main()
