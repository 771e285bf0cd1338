"""ZB-H1 against 1F1B on two CPU pipeline ranks: ms per iteration and each rank's idle time.

Two forked gloo ranks with one thread each, so a rank's bubble is a core's idle time. The model is a stack of
MLP blocks ([s*b, h] -> [s*b, 4h] -> [s*b, h], GELU, residual), big enough that the GEMMs dominate: a
block's weight gradients cost about as much as its input gradient, as in a transformer layer. Each rank runs
the real executor (parallel/pipeline/executor.py) on the plan of the schedule; idle time is the time a rank
spends waiting for its pipeline messages (StageComm.complete). Reported: the best of --repeats timed
iterations after one warm-up, per schedule and number of micro-batches.

    python scripts/benchmarks/bench_zero_bubble.py [--hidden 512] [--tokens 256] [--blocks 4]
        [--microbatches 4,8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.pipeline import p2p
from parallel.pipeline.executor import execute_schedule
from parallel.pipeline.plan import build_plan
from parallel.state import ParallelState

SCHEDULES = ("1f1b", "zb-h1")


class Block(torch.nn.Module):
    """x + fc2(gelu(fc1(x))): [t, h] -> [t, h]."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _forward_fn(m: int, is_last: bool):
    def forward_fn(chunk_index, chunk, input_tensor, microbatch):
        out = chunk(microbatch["x"] if input_tensor is None else input_tensor)
        return (out.float().pow(2).mean() / m) if is_last else out

    return forward_fn


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = ParallelState.create(1, 2)
    torch.manual_seed(rank)
    chunk = torch.nn.Sequential(*[Block(args.hidden) for _ in range(args.blocks)])
    waited = [0.0]
    complete = p2p.StageComm.complete

    def timed_complete(self, in_flight):  # idle time: waiting for pipeline messages
        start = time.perf_counter()
        complete(self, in_flight)
        waited[0] += time.perf_counter() - start

    p2p.StageComm.complete = timed_complete  # type: ignore[method-assign]
    for m in args.microbatches:
        batches = [{"x": torch.randn(args.tokens, args.hidden)} for _ in range(m)]
        for schedule in SCHEDULES:
            plan = build_plan(schedule, 2, rank, m)
            best = (float("inf"), 0.0)
            for repeat in range(args.repeats + 1):
                chunk.zero_grad(set_to_none=True)
                state.comm.barrier()
                waited[0], start = 0.0, time.perf_counter()
                execute_schedule(
                    plan,
                    [chunk],
                    batches,
                    _forward_fn(m, rank == 1),
                    state,
                    (args.tokens, args.hidden),
                    torch.float32,
                    scatter_gather=False,
                    overlap_p2p_comm=False,
                )
                elapsed = torch.tensor([time.perf_counter() - start])
                state.comm.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration ends when both ranks are done
                if repeat and elapsed.item() < best[0]:  # repeat 0 warms up
                    best = (elapsed.item(), waited[0])
            queue.put((schedule, m, rank, best[0] * 1e3, best[1] * 1e3))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256, help="s * b of a micro-batch")
    parser.add_argument("--blocks", type=int, default=4, help="MLP blocks per pipeline rank")
    parser.add_argument("--microbatches", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(rank, args, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    rows: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    while not queue.empty():
        schedule, m, rank, ms, idle = queue.get()
        rows.setdefault((schedule, m), {})[rank] = (ms, idle)
    print(f"pp=2, h={args.hidden}, tokens={args.tokens}, {args.blocks} blocks per rank, best of {args.repeats}")
    print(f"{'schedule':8s} {'m':>3s} {'ms/iter':>9s} {'idle rank 0':>12s} {'idle rank 1':>12s}")
    for (schedule, m), ranks in sorted(rows.items(), key=lambda kv: (kv[0][1], SCHEDULES.index(kv[0][0]))):
        ms = max(ranks[r][0] for r in ranks)
        print(f"{schedule:8s} {m:3d} {ms:9.1f} {ranks[0][1]:10.1f}ms {ranks[1][1]:10.1f}ms")


if __name__ == "__main__":
    main()
