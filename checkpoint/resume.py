"""What to load when a run starts, decided before anything is written: where from, whether it fits this
run's config, and then loading it into the built run.

    checkpoint.load=true      the latest complete checkpoint under run.dir/checkpoints (none: start fresh)
    checkpoint.load=PATH      a checkpoints folder (its latest complete one) or one iter_XXXXXXX inside it
    checkpoint.finetune=true  weights only; iteration 0, fresh optimizer, LR schedule and data order
                              (checkpoint.finetune=PATH: the same from PATH, one override)
    checkpoint.load_optimizer=false   weights and counters; fresh optimizer state (Megatron's --no-load-optim)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from checkpoint import dcp_modules, files
from checkpoint.files import CheckpointError
from checkpoint.legacy import load_legacy
from checkpoint.loader import load_model_weights, load_optimizer_state, load_rng, verify_share
from checkpoint.parts import CheckpointParts
from checkpoint.train_state import TrainingProgress, TrainState, read_train_state
from config.schema import Config
from model.config import ModelConfig, checkpoint_keys
from optim.lr_schedule import LRSchedule
from parallel.comm import Collectives
from parallel.random import RNGTracker

# Model settings that change the tensors (names or shapes): they must match the checkpoint; and those that
# change what a resumed run computes from the same tensors (a fine-tune may change them). Marked on ModelConfig.
STRUCTURAL = checkpoint_keys("structural")
RESUME_ONLY = checkpoint_keys("resume_only")
IGNORED_SECTIONS = ("run", "checkpoint")


@dataclass
class ResumePlan:
    """The checkpoint a run starts from and how."""

    iter_dir: str
    train_state: TrainState  # its meta.json (format 1: read from its main file)
    legacy: bool
    weights_only: bool  # finetune or load_optimizer=false or a weights-only checkpoint
    reset_progress: bool  # finetune: iteration 0, fresh data order and LR schedule


def _model_value(model: dict, key: str) -> object:
    known = {k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}
    return getattr(ModelConfig(**known), key)


def model_differences(saved: dict, current: dict, keys: tuple[str, ...]) -> list[str]:
    """'model.KEY=checkpoint value vs this run's value' for every differing key."""
    out = []
    for key in keys:
        before, after = _model_value(saved["model"], key), _model_value(current["model"], key)
        if before != after:
            name = {
                "query_groups": "num_query_groups",
                "ffn_size": "ffn_hidden_size",
                "max_positions": "max_position_embeddings",
            }.get(key, key)
            out.append(f"model.{name}={before!r} in the checkpoint, {after!r} in this run")
    return out


def other_differences(saved: dict, current: dict) -> list[str]:
    """Every other differing config key (logged, allowed)."""
    out = []
    for section, values in current.items():
        if section in IGNORED_SECTIONS or not isinstance(values, dict):
            continue
        for key, value in values.items():
            before = saved.get(section, {}).get(key, "<absent>")
            if (before != value and section != "model") or (
                section == "model" and before != value and key not in STRUCTURAL + RESUME_ONLY
            ):
                out.append(f"{section}.{key}: {before!r} -> {value!r}")
    return out


def _source(config: Config, run_root: str) -> str | None:
    load = config.checkpoint.source()
    if load is False or load is None:
        return None
    if load is True:
        if not files.list_iterations(run_root) and files.read_tracker(run_root) is None:
            return None  # nothing saved yet: start fresh
        return run_root
    return str(load)


def plan_resume(
    config: Config, run_root: str, log: Callable[[str], None], is_rank0: bool, comm: Collectives
) -> ResumePlan | None:
    """Resolve checkpoint.load, check the checkpoint against this run's config (model.vocab_size already
    known) and verify its files: every size, and the CRC-32 of all but the data files, whose CRC-32
    `load_into_run` takes from the bytes it loads (each read once). Raises CheckpointError before anything of
    the run is written; None = start fresh. Collective when distributed (the verification, through `comm`)."""
    if is_rank0:
        files.remove_stale_tmp(run_root, log)
    source = _source(config, run_root)
    if source is None:
        _refuse_overwrite(config, run_root, from_root=False, start=0)
        if config.checkpoint.source() is True:
            log(f"checkpoint.load=true but no checkpoint under {run_root}: starting fresh")
        return None
    if (
        files.read_tracker(source) is None
        and not files.ITER_RE.match(os.path.basename(os.path.abspath(source)))
        and files.list_iterations(source)
    ):
        log(f"no tracker under {source}: loading the newest checkpoint that verifies")
    iter_dir = files.resolve_checkpoint(source)
    legacy = files.is_legacy(iter_dir)
    saved = read_train_state(iter_dir)
    ckpt = config.checkpoint
    plan = ResumePlan(
        iter_dir,
        saved,
        legacy,
        # checkpoint.finetune is true or a path (the source, resolved by _source): either means fine-tune
        weights_only=bool(ckpt.finetune) or not ckpt.load_optimizer or not saved.has_optimizer,
        reset_progress=bool(ckpt.finetune),
    )
    if not plan.weights_only and not plan.reset_progress and not saved.has_optimizer:
        raise CheckpointError(
            f"checkpoint {iter_dir} holds weights only: load it with checkpoint.finetune=true "
            f"or checkpoint.load_optimizer=false"
        )
    _check_config(plan, config, log)
    if not legacy:
        verify_share(iter_dir, comm, data_crc=False)  # the files dealt over the ranks (collective)
    from_root = os.path.abspath(os.path.dirname(iter_dir)) == os.path.abspath(run_root)
    start = 0 if plan.reset_progress else saved.iteration
    _refuse_overwrite(config, run_root, from_root and not plan.reset_progress, start)
    return plan


def _check_config(plan: ResumePlan, config: Config, log: Callable[[str], None]) -> None:
    saved, current = plan.train_state.config, config.to_dict()
    keys = STRUCTURAL if plan.reset_progress else STRUCTURAL + RESUME_ONLY
    differences = model_differences(saved, current, keys)
    if differences:
        raise CheckpointError(f"checkpoint {plan.iter_dir} does not fit this run: " + "; ".join(differences))
    for line in other_differences(saved, current):
        log(f"config differs from the checkpoint's: {line}")
    iteration = plan.train_state.iteration
    if not plan.reset_progress and config.train.train_iters < iteration:
        raise CheckpointError(
            f"train.train_iters={config.train.train_iters} is below the iteration of checkpoint "
            f"{plan.iter_dir} ({iteration}): raise it, or fine-tune with checkpoint.finetune=true"
        )


def _refuse_overwrite(config: Config, run_root: str, from_root: bool, start: int) -> None:
    """A run that did not resume from run_root must not write over the checkpoints it holds."""
    if not config.checkpoint.save:
        return
    existing = [i for i in files.list_iterations(run_root) if i > start or not from_root]
    if not existing:
        return
    newest, ckpt = os.path.join(run_root, files.iter_name(existing[-1])), config.checkpoint
    load = ckpt.source()
    # The advice depends on what was asked: never "checkpoint.load=true" to a run that gave it.
    if load is False:
        advice = "resume them with checkpoint.load=true, or choose another run.dir"
    elif ckpt.finetune:
        advice = "a fine-tune starts at iteration 0: give it another run.dir"
    elif load is True:
        advice = (
            f"checkpoint.load=true loads iteration {start}, as {newest} does not verify (python "
            f"tools/checkpoint_info.py {newest} --verify says why): move it aside, or choose another run.dir"
        )
    else:
        advice = f"checkpoint.load={load} starts at iteration {start}: choose another run.dir"
    raise CheckpointError(
        f"{run_root} already holds checkpoints ({os.path.basename(newest)}) that this run would write over: {advice}"
    )


def derived_seed(seed: int, iteration: int) -> int:
    """The seed dropout streams restart from after a layout change: a function of (seed, iteration) only."""
    return int(hashlib.md5(f"rng/{seed}/{iteration}".encode()).hexdigest()[:8], 16)


def load_into_run(
    plan: ResumePlan, config: Config, parts: CheckpointParts, log: Callable[[str], None]
) -> TrainingProgress:
    """Load the planned checkpoint into the built run; returns the counters to continue from. Collective.
    The data files are verified as they are read: a bad one raises CheckpointError (naming it) with the model
    and optimizer partly filled, so a caller that catches it must not train on them (the trainer exits 2)."""
    if plan.legacy:
        return _load_legacy(plan, config, parts, log)
    state, chunks, optimizer = parts.state, parts.chunks, parts.optimizer
    saved = plan.train_state  # plan_resume verified every size and the files other than the data files
    if plan.weights_only:
        load_model_weights(plan.iter_dir, chunks, state, verify=False)
        optimizer.reset_from_params()
    else:
        metadata = dcp_modules.reader().read_dcp_metadata(plan.iter_dir)
        if saved.optimizer is None:
            raise CheckpointError(f"checkpoint {plan.iter_dir}: meta.json has no optimizer scalars")
        load_optimizer_state(plan.iter_dir, chunks, optimizer, state, metadata, saved.optimizer)
    if plan.reset_progress:
        log(f"fine-tuning from {plan.iter_dir}: weights loaded; iteration 0, fresh optimizer and data order")
        return TrainingProgress()
    apply_lr_schedule(saved.lr_schedule, parts.lr_schedule, config.optim.override_lr_schedule, log)
    restore_rng(plan, config, parts, log)
    what = (
        "weights (checkpoint.load_optimizer=false: fresh optimizer state)"
        if plan.weights_only
        else "weights and optimizer state"
    )
    log(f"loaded {what} of iteration {saved.iteration} from {plan.iter_dir} (saved at {saved.layout.describe()})")
    return dataclasses.replace(saved.progress)  # the loop advances it


def apply_lr_schedule(
    saved: Mapping[str, object] | None, lr_schedule: LRSchedule, override: bool, log: Callable[[str], None]
) -> None:
    """Megatron's rule: the checkpoint's LR schedule wins unless optim.override_lr_schedule=true; every
    difference is logged either way."""
    if not saved:
        return
    current = lr_schedule.state_dict()
    changed = [key for key in current if key in saved and saved[key] != current[key]]
    if override:
        for key in changed:
            log(
                f"LR schedule: {key}={current[key]!r} from this run's config (checkpoint had {saved[key]!r}; "
                f"optim.override_lr_schedule=true)"
            )
        return
    lr_schedule.load_state_dict(saved)
    for key in changed:
        log(
            f"LR schedule: {key}={saved[key]!r} from the checkpoint, not this run's {current[key]!r} "
            f"(set optim.override_lr_schedule=true to use the config's)"
        )


def restore_rng(plan: ResumePlan, config: Config, parts: CheckpointParts, log: Callable[[str], None]) -> None:
    """Same sizes (tp, cp, pp, vp, dp): each rank continues its own saved streams (bitwise resume). Another
    layout: the streams are tied to (tp rank, pp rank), so they restart from a seed derived from (train.seed,
    iteration)."""
    state, rng_tracker, saved_layout = parts.state, parts.rng_tracker, plan.train_state.layout
    saved = load_rng(plan.iter_dir, state.rank) if saved_layout.same_sizes(parts.layout) else None
    if saved is not None:
        rng_tracker.load_state_dict(saved)
        return
    seed = derived_seed(config.train.seed, plan.train_state.iteration)
    fresh = RNGTracker.seeded(seed, state.tp_rank, state.pp_rank, rng_tracker.device_type)
    rng_tracker.set_states(fresh.get_states())
    log(
        f"layout changed ({saved_layout.describe()} -> {parts.layout.describe()}): dropout RNG streams "
        f"restarted from seed {seed} (derived from train.seed and iteration {plan.train_state.iteration})"
    )


def _load_legacy(
    plan: ResumePlan, config: Config, parts: CheckpointParts, log: Callable[[str], None]
) -> TrainingProgress:
    state, chunks, optimizer = parts.state, parts.chunks, parts.optimizer
    _, per_rank = load_legacy(
        plan.iter_dir, state, chunks, None if plan.weights_only else optimizer, config.parallel.distributed_optimizer
    )
    if plan.weights_only:
        optimizer.reset_from_params()
    log(
        f"loaded {plan.iter_dir}, a checkpoint in the per-rank format of earlier versions (loads only at its "
        f"own layout); the next save writes the layout-free format"
    )
    if plan.reset_progress:
        return TrainingProgress()
    apply_lr_schedule(plan.train_state.lr_schedule, parts.lr_schedule, config.optim.override_lr_schedule, log)
    parts.rng_tracker.load_state_dict(per_rank["rng"])
    return dataclasses.replace(plan.train_state.progress)
