"""Unpickling Megatron-LM's files without running their code: an explicit allow-list of constructors.

Megatron-LM's training loop pickles more than tensors: `args` (argparse.Namespace holding Megatron's enums),
`rng_state` (numpy's RandomState tuple: an ndarray and a dtype), Transformer Engine's `_extra_state` (an
io.BytesIO in older versions). torch.load(weights_only=True) refuses all of these; we allow exactly the
constructors that build them (arrays, dtypes, byte buffers, a namespace) and nothing else. Megatron's own
classes become inert placeholders. torch_dist's `.metadata` is read by checkpoint/safe_reader.py,
the one reader of DCP metadata (ours and Megatron's).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
from typing import Any

import numpy as np
import torch

ALLOWED = "argparse.Namespace, numpy arrays and dtypes, io.BytesIO, megatron.* as inert placeholders"
# numpy globals an array or RandomState state pickles, by the name the pickle gives (numpy 1.x: numpy.core).
NUMPY_GLOBALS = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
)


def _numpy_global(name: str) -> Any:
    """The numpy object behind an allowed name, from whichever of numpy.core / numpy._core this numpy has."""
    if name in ("numpy.ndarray", "numpy.dtype"):
        return getattr(np, name.removeprefix("numpy."))
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    return getattr(multiarray, name.rsplit(".", 1)[1])


class MegatronObject:
    """Inert stand-in for an object of Megatron's own classes found in a checkpoint (an enum in args)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _allowed_global(name: str) -> Any:
    """The object a pickled global `name` may resolve to, or None when it is not on the allow-list."""
    if name == "argparse.Namespace":
        return argparse.Namespace
    if name in ("io.BytesIO", "_io.BytesIO"):
        return (io.BytesIO, name)
    if name in NUMPY_GLOBALS:
        return (_numpy_global(name), name)
    if name.startswith("numpy.dtypes."):  # numpy 2's dtype classes (UInt32DType, ...): dtypes, nothing else
        cls = getattr(np.dtypes, name.removeprefix("numpy.dtypes."), None)
        return (cls, name) if isinstance(cls, type) and issubclass(cls, np.dtype) else None
    if name.startswith("megatron."):
        return (MegatronObject, name)
    return None


def numpy_dtype_classes() -> list[type]:
    """numpy 2's dtype classes (numpy.dtypes.*DType): each builds a dtype and nothing else."""
    dtypes = getattr(np, "dtypes", None)
    classes = (getattr(dtypes, name) for name in dir(dtypes)) if dtypes else ()
    return [cls for cls in classes if isinstance(cls, type) and issubclass(cls, np.dtype)]


def first_line(err: BaseException) -> str:
    """An exception as one line for an error message: its message's first line, or its type when it has none
    (a bare EOFError), cut to its first sentence when long."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line.split(". ")[0] if len(line) > 120 else line  # torch's long advice after the first sentence


def load_megatron_file(path: str) -> dict:
    """torch.load(weights_only=True) with the allow-list above; any other global is refused by name. A file
    that is not a whole torch.save (empty, truncated, missing) is one line naming it; so is one holding no dict."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: the checkpoint is incomplete; copy it again")
    allowed: list[Any] = []
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # a missing, empty or truncated file: OSError, RuntimeError, ValueError, ...
        raise ValueError(
            f"{path} cannot be read ({first_line(err)}): not a whole torch.save file; copy it again"
        ) from None
    for name in unsafe:
        target = _allowed_global(name)
        if target is None:
            raise ValueError(f"{path} pickles {name}, which is not on the allow-list ({ALLOWED})")
        allowed.append(target)
        if name == "numpy.dtype":  # a dtype's state names its class (numpy 2: numpy.dtypes.UInt32DType, ...)
            allowed.extend(numpy_dtype_classes())
    with torch.serialization.safe_globals(allowed):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # unpickling errors have many types; name the file either way
            raise ValueError(f"{path} cannot be read: {first_line(err)}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path} holds a {type(payload).__name__}, not a Megatron checkpoint's dict")
    return payload
