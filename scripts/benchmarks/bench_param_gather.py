"""Exposed parameter all-gather time of the distributed optimizer, overlap_param_gather off vs on (CPU, gloo).

dp ranks (default 8) train a GPT with the distributed optimizer through the trainer's train_step. Exposed
time per iteration = the time the rank is blocked on the param gathers: off, the whole blocking gather of
every bucket after the step (and its copy into the params); on, launching the gathers plus the time the
forward pre-hooks wait for them (and copy). Both sides copy the same bytes, so the difference is the overlap.
Modes alternate per round; the best round of each counts (the machine may be shared).

    python scripts/benchmarks/bench_param_gather.py [--ranks 8] [--rounds 3] [--iters 3] [--layers 8]
        [--hidden 256] [--bucket-mb 0.5]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_models import model_config, tied_gpt

from config.schema import OptimConfig, TrainConfig
from data.microbatch import Microbatch
from optim.optimizer import DistributedOptimizer, build_optimizer
from parallel.data_parallel import DataParallel
from parallel.layout import Layout
from parallel.state import ParallelState
from training.train_step import StepContext, train_step

SEQ, MICRO = 64, 2


class Timer:
    """Accumulates the seconds spent inside the wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def build(args: argparse.Namespace, state: ParallelState, overlap: bool) -> tuple[StepContext, Timer]:
    cfg = model_config(args.layers, args.hidden, heads=4, seq_length=SEQ, vocab_size=1000)
    model = tied_gpt(cfg, seed=1234, dtype=torch.float32)
    ddp = DataParallel([model], state, bucket_size_mb=args.bucket_mb, distributed_optimizer=True)
    optimizer = build_optimizer([model], ddp, state, OptimConfig(lr=1e-3), TrainConfig(), overlap_param_gather=overlap)
    assert isinstance(optimizer, DistributedOptimizer)
    timer = Timer()
    optimizer.copy_to_params = timer.wrap(optimizer.copy_to_params)  # type: ignore[method-assign]
    if optimizer.param_gather is not None:
        optimizer.param_gather.wait = timer.wrap(optimizer.param_gather.wait)  # type: ignore[method-assign]
    layout = Layout(tp_size=1, pp_size=1, vp_size=1, dp_size=state.dp_size, num_microbatches=2, schedule="1f1b")
    ctx = StepContext(
        chunks=[model],
        state=state,
        layout=layout,
        ddp=ddp,
        optimizer=optimizer,
        activation_shape=(SEQ, MICRO, args.hidden),
        activation_dtype=torch.float32,
        device=torch.device("cpu"),
        scatter_gather=False,
        overlap_p2p_comm=False,
    )
    return ctx, timer


def batches(step: int) -> list[Microbatch]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 1000, (2, MICRO, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    return [Microbatch.of(t[:, :-1], t[:, 1:], torch.ones(MICRO, SEQ), positions) for t in tokens]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = ParallelState.create(tp_size=1, pp_size=1)
    sides = {overlap: build(args, state, overlap) for overlap in (False, True)}
    best = {False: float("inf"), True: float("inf")}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for overlap, (ctx, timer) in sides.items():
            state.comm.barrier()
            timer.seconds = 0.0
            for step in range(args.iters):
                train_step(ctx, batches(step), 1e-3)
            ctx.optimizer.finish_param_gather()
            exposed = torch.tensor([timer.seconds / args.iters])
            state.comm.all_reduce(exposed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if round_index:
                best[overlap] = min(best[overlap], float(exposed))
    if rank == 0:
        ddp = sides[False][0].ddp
        assert isinstance(ddp, DataParallel)
        buckets = len(ddp.buckets[0])
        print(
            f"exposed param all-gather per iteration, {world} ranks, {buckets} buckets: "
            f"overlap_param_gather off {best[False] * 1e3:.2f} ms, on {best[True] * 1e3:.2f} ms "
            f"(best of {args.rounds} rounds x {args.iters} iterations, modes interleaved)"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=0.5)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(rank_main, args=(args.ranks, port, args), nprocs=args.ranks, start_method="fork")


if __name__ == "__main__":
    main()
