"""Optional Weights & Biases logging, next to metrics.jsonl and TensorBoard (logging.wandb_project).

wandb is imported only when the key is set (`check_wandb_importable` refuses the key in one line at the
trainer's start-up when wandb is not installed or cannot be imported). Only the
logging rank opens a W&B run; it gets the same records as metrics.jsonl, plotted against `iteration`. The run's id is kept in run.dir/wandb_run_id, so a resumed run (checkpoint.load=true) continues
the same W&B run. Offline (`WANDB_MODE=offline`, no network needed) the run is written under run.dir/wandb/
for a later `wandb sync`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import uuid
from collections.abc import Mapping
from typing import Any

from compat.optional import wandb
from config.schema import Config, LoggingConfig

RUN_ID_FILE = "wandb_run_id"


class WandbSink:
    """One open W&B run: `log` sends a metrics record, `close` finishes the run."""

    def __init__(self, run: Any) -> None:  # a wandb Run; Any keeps wandb out of imports when unused
        self._run = run
        # Plot everything against the trainer's iteration, not W&B's own step counter: a resumed run logs
        # iterations again from its checkpoint, which W&B's monotonic step would drop.
        run.define_metric("iteration")
        run.define_metric("*", step_metric="iteration")

    def log(self, record: Mapping[str, object]) -> None:
        """Send one record's numbers (the same record metrics.jsonl gets)."""
        numbers = {key: value for key, value in record.items() if isinstance(value, (int, float))}
        if numbers:
            self._run.log(numbers)

    def close(self) -> None:
        """Finish the run and stop wandb's background service: finish() alone returns before the service has
        written the run's last records, and offline files must be complete when the trainer exits."""
        self._run.finish()
        wandb().teardown()


def run_id(run_dir: str) -> str:
    """The W&B run id of this run.dir: read from run.dir/wandb_run_id, or made and written there once."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            existing = handle.read().strip()
        if existing:
            return existing
    new_id = uuid.uuid4().hex[:12]
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(new_id + "\n")
    return new_id


def check_wandb_importable(logging_config: LoggingConfig) -> None:
    """With logging.wandb_project set, import wandb now: a broken install (find_spec sees the package, the
    import fails on a missing dependency) is then one line naming the key before any work, not a traceback
    after the run folder is made."""
    if not logging_config.wandb_project:
        return
    # Checked here, at the trainer's start, not in LoggingConfig.validate: a checkpoint's saved config is
    # validated too, and converting or generating from a run that logged to W&B must not need wandb.
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"logging.wandb_project={logging_config.wandb_project} needs the wandb package: pip install wandb "
            "(or drop the key)"
        )
    try:
        wandb()
    except Exception as err:  # whatever a broken package raises while importing
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
        raise ValueError(
            f"logging.wandb_project={logging_config.wandb_project} needs wandb, which cannot be imported "
            f"({reason}): repair it (pip install --force-reinstall wandb) or drop the key"
        ) from None


def open_wandb(config: Config, enabled: bool) -> WandbSink | None:
    """A W&B run for the logging rank when logging.wandb_project is set, else None."""
    project = config.logging.wandb_project
    if not enabled or not project:
        return None
    run = wandb().init(  # wandb imported only here: the trainer does not need it unless the key is set
        project=project,
        entity=config.logging.wandb_entity,
        name=os.path.basename(os.path.normpath(config.run.dir)),
        dir=config.run.dir,
        id=run_id(config.run.dir),
        resume="allow",
        config=dataclasses.asdict(config),
    )
    return WandbSink(run)
