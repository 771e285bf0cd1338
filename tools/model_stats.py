"""Parameter counts, FLOPs per iteration and a memory estimate per device, on the meta device (no weights).

python tools/model_stats.py --config configs/paper/gpt_1t.yaml [section.key=value ...] [--dp N]
"""

from __future__ import annotations

import argparse
import sys

import torch

from config.cli import one_config_file
from config.schema import Config, ConfigError, load_config
from model.gpt import GPTModel
from model.kernels import KernelSelection
from model.rank_spec import RankSpec
from model.shape import active_params
from parallel.layout import Layout, layout_from_config
from parallel.model_builder import build_chunk_modules
from parallel.rank_grid import RankGrid
from parallel.run_shape import RunShape
from parallel.state import ParallelState
from parallel.tensor_parallel import tensor_parallel_hooks, tp_comm
from planner.activations import shape_from_config
from planner.collectives import LayoutCollectives
from planner.memory import config_memory


def meta_chunks(config: Config, tp_rank: int, pp_rank: int, dp_size: int) -> list[GPTModel]:
    """The chunks one rank would hold, built on the meta device (tensor-parallel shards included)."""
    par = config.parallel
    if not (0 <= tp_rank < par.tp_size and 0 <= pp_rank < par.pp_size):
        raise ValueError(f"no rank tp {tp_rank}, pp {pp_rank} at tp_size {par.tp_size}, pp_size {par.pp_size}")
    shape = RunShape.of(config, layout_from_config(config, par.tp_size * par.cp_size * par.pp_size * dp_size))
    grid = RankGrid.megatron(tp=par.tp_size, cp=par.cp_size, dp=dp_size, pp=par.pp_size)
    state = ParallelState(
        world_size=grid.world_size,
        rank=grid.rank_of(tp=tp_rank, pp=pp_rank),
        tp_size=par.tp_size,
        pp_size=par.pp_size,
        dp_size=dp_size,
        vp_size=par.vp_size,
        cp_size=par.cp_size,
        v_shape=shape.stages.v_shape,
    )
    # the parameters depend on the tp split alone: the spec of the rank's tp group, nothing else
    spec = RankSpec(kernels=KernelSelection(), tp=tensor_parallel_hooks(tp_comm(state), par.sequence_parallel))
    return build_chunk_modules(config.model, state, spec)  # zb-v: chunks in a V (state.stages)


def count(chunks: list[GPTModel]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def total_parameters(config: Config) -> int:
    """Parameters of the whole model, counted once (one process, tied embedding once)."""
    with torch.device("meta"):
        model = GPTModel(config.model, config.model.padded_vocab_size(config.parallel.tp_size))
    return sum(p.numel() for p in model.parameters())


def report(config: Config, dp_size: int, layout: Layout | None = None) -> list[str]:
    """The report's lines; `layout` is the trainer's Layout of the config at this dp (built when not given)."""
    par, train = config.parallel, config.train
    layout = layout or layout_from_config(config, par.tp_size * par.cp_size * par.pp_size * dp_size)
    shape = RunShape.of(config, layout)
    total = total_parameters(config)
    lines = [
        f"total parameters: {total:,} ({total / 1e9:.1f} B)",
        f"layout: tp {par.tp_size} x cp {par.cp_size} x pp {par.pp_size} x dp {dp_size} (vp {par.vp_size}), "
        f"padded vocabulary {shape.padded_vocab}",
    ]
    model = config.model
    if model.num_experts:  # what one token goes through: top_k of each MoE layer's routed experts
        active = active_params(model)
        lines.insert(
            1,
            f"active parameters per token: {active:,} ({active / 1e9:.1f} B; top-{model.moe_router_topk} of "
            f"{model.num_experts} experts)",
        )
    for pp_rank in range(par.pp_size):
        chunks = meta_chunks(config, 0, pp_rank, dp_size)
        layers = sum(len(chunk.layers) for chunk in chunks)
        local = count(chunks)
        lines.append(f"  stage {pp_rank}: {layers} layers, {local:,} parameters per tp rank ({local / 1e9:.3f} B)")
    flops, devices = shape.flops, layout.world_size
    lines.append(
        f"training FLOPs per iteration (batch {train.global_batch_size}): {flops.with_recompute:.4e} with "
        f"recompute {train.recompute} ({flops.with_recompute / devices / 1e12:.1f} TFLOP per device), "
        f"model FLOPs {flops.model:.4e} (recomputation excluded, for MFU)"
    )
    # the planner's estimate, as the trainer's size check uses it (no cluster allowance)
    activations = shape_from_config(config, layout)
    memory = config_memory(config, layout, activations, 0.0).as_gib()
    lines.append(
        f"memory estimate per device (busiest stage, {train.precision}, recompute {train.recompute}, "
        f"micro-batch {train.micro_batch_size}): weights+grads+optimizer "
        f"{memory['weights'] + memory['grads'] + memory['optimizer']:.1f} GiB, activations "
        f"{memory['activations'] + memory['working_set']:.1f} GiB, total {memory['total']:.1f} GiB"
    )
    if par.cp_size > 1:  # what one layer's ring attention sends, as the planner lists it
        ring = LayoutCollectives(config, layout)
        forward, backward = (sum(c.nbytes for c in ring.ring(1, way) if c.kind == "send") for way in (True, False))
        lines.append(
            f"ring attention (cp {par.cp_size}, {shape.local_seq_length} tokens per rank): each rank sends "
            f"{forward / 2**20:.1f} MiB forward + {backward / 2**20:.1f} MiB backward per layer and micro-batch"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="YAML config, given once")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (for the optimizer share)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        config = load_config(one_config_file(args.config, None), args.overrides)
        if config.model.vocab_size is None:
            raise ConfigError("model.vocab_size must be set for model_stats (no tokenizer is loaded)")
        if args.dp < 1:
            raise ConfigError(f"--dp {args.dp} must be >= 1")
        par = config.parallel
        layout = layout_from_config(config, par.tp_size * par.cp_size * par.pp_size * args.dp)  # the trainer's rules
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(report(config, args.dp, layout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
