"""What `import pretrain_gpt` costs every process that starts the trainer (each torchrun rank and agent, each
entry-point test, a user's --help or config error): libraries that only some runs need stay unimported until
those runs need them. torch.distributed.checkpoint and torch.distributed.fsdp import torch.distributed.tensor
(its operator strategies and sympy, ~1.3 CPU s), numba ~0.4 CPU s, torch._dynamo ~0.5-1 CPU s; a run that
neither saves nor loads a checkpoint, uses no FSDP, no dataset blend and no torch.compile needs none of them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

# imported where used: checkpoint saves and loads (training/checkpoint/dcp_reader.py, saver.py, loader.py),
# FSDP (parallel/fsdp.py), the blending index (data/blend_index.py), torch.compile (model/kernels)
LAZY_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "sympy",
    "numba",
    "torch._dynamo",
)


def test_import_pretrain_gpt_leaves_lazy_libraries_unimported():
    """A new interpreter (this one has imported everything the other tests needed)."""
    probe = f"import sys, pretrain_gpt; print(','.join(m for m in {LAZY_MODULES!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"`import pretrain_gpt` imported {result.stdout.strip()}"
