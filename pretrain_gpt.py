"""Pretrain a GPT with tensor, pipeline and data parallelism (PTD-P).

    python pretrain_gpt.py [--config configs/gpt_tiny.yaml] [section.key=value ...]
    torchrun --nproc-per-node 8 pretrain_gpt.py parallel.tp_size=2 parallel.pp_size=2 ...

Reads the config, joins torch.distributed, takes the run folder's lock, then builds and trains the run
(training/run.py, training/loop.py) and exits with its code (operations/guards.py). Everything the run writes goes
under run.dir.
"""

from __future__ import annotations

import argparse
import os
import sys

from operations.openmp_wait import passive_wait_default

# Before torch is imported: libgomp reads its wait policy once, when torch loads it (operations/openmp_wait.py).
os.environ.update(passive_wait_default(os.environ, sys.modules))

import torch.distributed as dist

from config.cli import one_config_file
from config.megatron_flags import megatron_hint
from config.schema import ConfigError, load_config
from evaluation.in_training import zero_shot_tasks
from operations.faults import fault_from_env
from operations.guards import EXIT_HUNG, EXIT_INPUT_ERROR, EXIT_INTERRUPTED
from operations.preemption import Interrupted, PreemptionHandler
from operations.run_lock import RunLock, take_run_lock
from operations.startup import DEFAULT_CONFIG, check_devices, check_sample_corpus_fits, init_distributed
from operations.threads import check_cpu_requests, usable_cores
from parallel.group_setup import GroupCreationTimeout
from parallel.layout import layout_from_config
from training.loop import run_training
from training.size_check import check_fits
from training.wandb_logging import check_wandb_importable

__all__ = ["DEFAULT_CONFIG", "main", "parse_args"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """--config and the section.key=value overrides. A Megatron-LM flag (`--train-iters 50`) exits 2 with one
    line naming the override that replaces it (config/megatron_flags.py, docs/megatron_flags.md); so does a
    second --config (config/cli.py)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="YAML config, given once (default: configs/gpt_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.train_iters=50")
    args, unknown = parser.parse_known_args(argv)
    try:
        if unknown:
            raise ConfigError(unknown_option_message(unknown, argv))
        args.config = one_config_file(args.config, DEFAULT_CONFIG)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_INPUT_ERROR) from None
    return args


def unknown_option_message(unknown: list[str], argv: list[str]) -> str:
    """One line for the first option argparse did not know, with the override a Megatron-LM flag maps to."""
    flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0])
    position = argv.index(flag) + 1 if flag in argv else len(argv)  # argparse took its value as an override
    following = argv[position] if position < len(argv) else None
    value = following if following is not None and not following.startswith("-") else None
    override = megatron_hint(flag, value)
    if override is None:
        return f"unknown option {flag}: the trainer takes --config FILE and section.key=value overrides"
    return (
        f"{flag.split('=', 1)[0]} is a Megatron-LM flag: write the override {override} "
        f"(docs/megatron_flags.md maps every flag to its key)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; returns the exit code (0 done, 2 bad input, 3 stopped by a signal, 4 diverged, 5 a hang:
    see operations/guards.py)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_config(args.config, args.overrides)
        layout = layout_from_config(config, world_size)  # every layout rule, before any work
        use_cuda = check_devices(config.train, os.environ)
        check_cpu_requests(config.train.num_threads, config.data.num_workers, os.environ, usable_cores())
        check_wandb_importable(config.logging)
        check_sample_corpus_fits(config)  # a config error, named before the memory estimate that follows from it
        check_fits(config, layout, use_cuda, os.environ)  # sizes against the memory here, before any allocation
        extra_evaluation = zero_shot_tasks(config)  # eval.*: its files are read here, before any work
        fault = fault_from_env(world_size, config.train.train_iters)  # PTDP_INJECT_FAULT, operations/faults.py
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    created_dir = not os.path.exists(config.run.dir)
    lock = RunLock(config.run.dir)
    with PreemptionHandler() as preemption:  # from here on a signal stops at an iteration boundary
        try:
            env = init_distributed(use_cuda, config.train.num_threads, timeout_s=config.parallel.init_timeout_s)
        except GroupCreationTimeout as err:  # a rank missing at the rendezvous: the start-up's first timeout
            print(f"error: {err}", file=sys.stderr)
            return EXIT_HUNG
        try:
            error = take_run_lock(lock, env.rank, env.world_size, env.device, env.comm)
            if error is not None:
                if error:
                    print(f"error: {error}", file=sys.stderr)
                return EXIT_INPUT_ERROR
            warning = lock.stale_warning()
            if warning is not None:
                print(warning, file=sys.stderr)
            return run_training(config, env, layout, preemption, extra_evaluation, fault)
        except Interrupted as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            lock.release()
            if created_dir and env.rank == 0 and os.path.isdir(config.run.dir) and not os.listdir(config.run.dir):
                os.rmdir(config.run.dir)  # a start that failed before writing anything leaves no folder
            if dist.is_initialized():
                dist.destroy_process_group()


def exit_with(code: int) -> None:
    """Exit the process with `code`. After a hang (exit 5) the interpreter's teardown is skipped: gloo's
    destructors can wait for a receive that timed out while its peer still lives, and the rank would be killed
    by torchrun instead of exiting with its code."""
    if code == EXIT_HUNG:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_with(main())
