"""What `import pretrain_gpt` costs every process that starts the trainer (each torchrun rank and agent, each
entry-point test, a user's --help or config error): libraries that only some runs need stay unimported until
those runs need them. torch.distributed.checkpoint and torch.distributed.fsdp import torch.distributed.tensor
(its operator strategies and sympy, ~1.3 CPU s), numba ~0.4 CPU s, torch._dynamo ~0.5-1 CPU s; a run that
neither saves nor loads a checkpoint, uses no FSDP, no dataset blend and no torch.compile needs none of them.
Nor does building and training the model: torch._dynamo, Triton and sympy stay out of a plain run (an embedding's
default init on the meta device imported the first two, ~1.4 CPU s per rank; torch.autograd.backward's shape check
sympy, ~0.5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.conftest import REPO_ROOT, tiny_train_args

pytestmark = pytest.mark.tier("fast")

# imported where used: checkpoint saves and loads (checkpoint/dcp_reader.py, saver.py, loader.py),
# FSDP (parallel/fsdp.py), the blending index (data/blend_index.py), torch.compile (model/kernels), the HuggingFace
# folder reader (~0.15 CPU s: the converters, evaluation in training once it builds its tasks)
LAZY_MODULES = (
    "convert.hf_folder",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "sympy",
    "numba",
    "torch._dynamo",
)
# not needed by a plain run of the trainer either: torch.compile and the fused kernels import dynamo and Triton,
# checkpoints sympy (torch.distributed.checkpoint), torch.autograd.backward with a gradient sympy (its shape check)
TRAINING_LAZY_MODULES = ("torch._dynamo", "triton", "sympy")

# a new interpreter: argv[1] holds the module lists and the trainer's arguments (JSON)
PROBE = """
import json, sys
import pretrain_gpt
request = json.loads(sys.argv[1])
after_import = [m for m in request["lazy"] if m in sys.modules]
code = pretrain_gpt.main(request["argv"])
after_run = [m for m in request["training_lazy"] if m in sys.modules]
print(json.dumps({"after_import": after_import, "code": code, "after_run": after_run}))
"""


@pytest.fixture(scope="module")
def probe(tiny_corpus, tmp_path_factory) -> dict:
    """One new interpreter (this one has imported everything the other tests needed) imports the trainer, then
    trains the tiny model 2 iterations on one process without saving; which lazy modules each step imported."""
    run_dir = str(tmp_path_factory.mktemp("probe_run"))
    argv = [
        "--config",
        pretrain_gpt.DEFAULT_CONFIG,
        *tiny_train_args(tiny_corpus, run_dir, "train.train_iters=2", "checkpoint.save=false"),
    ]
    request = {"lazy": LAZY_MODULES, "training_lazy": TRAINING_LAZY_MODULES, "argv": argv}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(request)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_pretrain_gpt_leaves_lazy_libraries_unimported(probe):
    assert probe["after_import"] == [], f"`import pretrain_gpt` imported {probe['after_import']}"


def test_a_plain_training_run_leaves_dynamo_triton_and_sympy_unimported(probe):
    assert probe["code"] == 0
    assert probe["after_run"] == [], f"building and training the model imported {probe['after_run']}"
