"""eval.* in the trainer: the zero-shot tasks on the live model chunks, at every eval.interval iterations and
at the last one, their figures logged in the validation record (console, metrics.jsonl, TensorBoard, W&B:
training/logging.py's sinks) as `wikitext_perplexity`, `wikitext_word_perplexity`, `lambada_accuracy`, ...

They run through the run's own forward-only plan (StepContext.eval_plan) at the run's layout, so the
figures at iteration N equal tools/evaluate.py's on the checkpoint of iteration N (tests/evaluation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from checkpoint import TrainingProgress
from config.schema import Config
from evaluation.documents import read_lambada, read_wikitext
from evaluation.scoring import WindowScorer
from evaluation.tasks import Task, lambada_task, trainer_record, wikitext_task
from parallel.pipeline.forward import ForwardOnlyContext


class Run(Protocol):
    """What eval.* reads of the trainer's run (training.run.Run; evaluation/ does not import training/)."""

    @property
    def config(self) -> Config: ...
    @property
    def ctx(self) -> ForwardOnlyContext: ...
    @property
    def progress(self) -> TrainingProgress: ...
    @property
    def logger(self) -> logging.Logger: ...


@dataclass
class ZeroShotEvaluation:
    """The prepared tasks of one run and when they are due."""

    tasks: list[Task]
    scorer: WindowScorer
    interval: int
    last_iteration: int

    def __call__(self, run: Run) -> dict[str, float]:
        """The tasks' figures after this iteration when due (a multiple of eval.interval, or the last), else {}."""
        iteration = run.progress.iteration
        if iteration == 0 or (iteration % self.interval and iteration != self.last_iteration):
            return {}
        record: dict[str, float] = {}
        for task in self.tasks:
            figures = trainer_record(task.run(self.scorer))
            record.update(figures)
            shown = " | ".join(f"{key} {value:.6g}" for key, value in figures.items())
            run.logger.info(f"zero-shot {task.name} at iteration {iteration}: {shown}")
        return record


def _model_source() -> ModuleType:
    """evaluation.model_source, imported when the evaluation is built: it brings the HuggingFace folder reader
    (convert/, ~0.15 CPU s), which every start of the trainer would otherwise pay (pretrain_gpt imports this
    module)."""
    from evaluation import model_source

    return model_source


def zero_shot_tasks(config: Config) -> Callable[[Run], ZeroShotEvaluation] | None:
    """None without eval.interval. Else the files are read now (a missing or malformed one is a one-line
    error before any work) and a builder is returned that the trainer calls once its run exists (the
    tokenizer is the run's, the model its chunks)."""
    eval_cfg = config.eval
    if not eval_cfg.interval:
        return None
    wikitext = read_wikitext(eval_cfg.wikitext_file) if eval_cfg.wikitext_file else None
    lambada = read_lambada(eval_cfg.lambada_file) if eval_cfg.lambada_file else None

    def build(run: Run) -> ZeroShotEvaluation:
        model_source = _model_source()
        tokenizer = model_source.run_tokenizer(
            run.config, exact=False
        )  # the trainer allows model.vocab_size > the tokenizer's
        window = model_source.window_length(run.config)
        tasks = []
        if wikitext is not None:
            tasks.append(wikitext_task(wikitext, tokenizer.encode, tokenizer.eod, window, eval_cfg.overlapping_eval))
        if lambada is not None:
            tasks.append(lambada_task(lambada, tokenizer.encode, tokenizer.eod, window))
        return ZeroShotEvaluation(
            tasks, WindowScorer(run.ctx, tokenizer.eod), eval_cfg.interval, config.train.train_iters
        )

    return build
