"""The optional or heavy libraries some runs need, imported on first use: the one place that imports them.

Each function imports its library when called and returns the module (or class), so a caller names what it
uses where it uses it, and `import pretrain_gpt` (every torchrun rank, every --help or config error) does
not pay for a library the run does not use. Measured on the 2-core CPU machine, CPU seconds of the first
import after torch: wandb 0.72 (only with logging.wandb_project), torch.utils.tensorboard 0.28 (only with
TensorBoard on), lm_eval.evaluator 1.66, lm_eval.config 0.50 and lm_eval.__main__ 0.48 (only
tools/evaluate_harness.py), safetensors.torch ~0.01 (optional for the trainer: only the converters read and
write safetensors). A missing library raises ImportError from the call, where the caller can name the key
that needs it. Returning the module, not a name in it, keeps a test's monkeypatch of that name visible.
torch.distributed's heavy packages have theirs in parallel/lazy_torch.py (compat/ never imports
torch.distributed), the tokenizer libraries in data/tokenizer_libraries.py, matplotlib in planner/pyplot.py.
"""

from __future__ import annotations

from types import ModuleType


def wandb() -> ModuleType:
    """The wandb package (Weights & Biases)."""
    import wandb

    return wandb


def tensorboard_writer() -> type:
    """torch.utils.tensorboard.SummaryWriter (needs the tensorboard package)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def safetensors_torch() -> ModuleType:
    """safetensors.torch (load_file, save_file)."""
    import safetensors.torch

    return safetensors.torch


def lm_eval_evaluator() -> ModuleType:
    """lm_eval.evaluator (simple_evaluate)."""
    import lm_eval.evaluator

    return lm_eval.evaluator


def lm_eval_evaluate_config() -> ModuleType:
    """lm_eval.config.evaluate_config (lm_eval's checks of its command line's options)."""
    import lm_eval.config.evaluate_config

    return lm_eval.config.evaluate_config


def lm_eval_cli() -> ModuleType:
    """lm_eval.__main__ (cli_evaluate: lm_eval's command line)."""
    import lm_eval.__main__

    return lm_eval.__main__
