"""Where Triton can run: CUDA tensors when triton is installed, CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, read by Triton when the kernels are defined, so set it before the first use)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for tensors on `device`."""
    device_type = torch.device(device).type
    if not triton_installed():
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and interpreter_on()


def triton_kernels() -> ModuleType:
    """model.kernels.triton_kernels, imported on first use (importing it compiles nothing)."""
    return importlib.import_module("model.kernels.triton_kernels")


def backend_name(device: torch.device | str) -> str:
    """'triton' (compiled), 'triton-interpreter' or 'torch' (the reference / chunked torch path)."""
    if not triton_runs(device):
        return "torch"
    return "triton" if torch.device(device).type == "cuda" else "triton-interpreter"
