"""The heavy torch.distributed packages, imported on first use: the one place that imports them.

torch.distributed.checkpoint (DCP) and torch.distributed.fsdp both import torch.distributed.tensor, whose
operator strategies and sympy cost ~1.3 CPU s per process (tests/test_start_up_imports.py): a run that
neither saves nor loads a checkpoint and uses no FSDP, a config error or --help never needs them, and every
torchrun rank would pay them at `import pretrain_gpt`. Callers ask these functions for the module at the
moment they use it (`dcp().save(...)`), so a test that patches an attribute of the module is still seen.
"""

from __future__ import annotations

from types import ModuleType


def dcp() -> ModuleType:
    """torch.distributed.checkpoint (its `metadata`, `planner` and `filesystem` submodules are loaded with it)."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def dtensor() -> ModuleType:
    """torch.distributed.tensor (DTensor, Shard, Replicate)."""
    import torch.distributed.tensor

    return torch.distributed.tensor


def fsdp() -> ModuleType:
    """torch.distributed.fsdp (fully_shard, MixedPrecisionPolicy)."""
    import torch.distributed.fsdp

    return torch.distributed.fsdp
