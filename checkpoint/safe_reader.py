"""Reading torch.distributed.checkpoint's `.metadata` without running anything in it: the one reader of DCP
metadata for our checkpoints and Megatron-LM's torch_dist folders alike.

`.metadata` is a pickle, and torch's `FileSystemReader.read_metadata` reads it with a plain `pickle.load`: a
crafted file runs its code the moment a checkpoint is opened (checksums.json does not help, whoever crafted
the file can write it too). `MetadataUnpickler` resolves only the classes such a file is made of (DCP's
metadata dataclasses and enums, torch.Size, dtypes and layouts, paths) and refuses any other global by name,
before it is called. `SafeFileSystemReader` (checkpoint/dcp_reader.py) is the FileSystemReader every
load goes through: its `read_metadata` uses the unpickler, checks the result's shape (an index of tensors
whose data lie in files of the folder itself) and returns the same object every time, so `dcp.load` plans
with exactly what the caller checked (and DCP's `torch.load(weights_only=False)` of byte entries is never
reached for a key the caller saw as a tensor). `load_weights_file` is the one torch.load of the other pickled
files a user hands us (our rng/*.pt and format-1 files, a transformers pytorch_model.bin): weights only,
refusals named in one line.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from typing import IO, TYPE_CHECKING, Any

import torch

from checkpoint.files import CheckpointError
from compat.torch_private import PICKLED_LAYOUT, dcp_metadata_classes
from parallel.lazy_torch import dcp

if TYPE_CHECKING:  # torch.distributed.checkpoint costs ~1.3 CPU s to import: imported where a file is read
    from torch.distributed.checkpoint.metadata import Metadata

ALLOWED = "torch.distributed.checkpoint metadata classes, torch.Size, dtypes"
# Every global a DCP metadata file pickles (ours: metadata, filesystem; Megatron's torch_dist adds its save
# plan's planner classes), by module. Classes only: dataclasses and enums that hold values and run nothing.
# The private ones (_MEM_FORMAT_ENCODING, _StorageInfo, ...) are named in compat/torch_private.py.
_PUBLIC_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
    ),
    "torch.distributed.checkpoint.planner": (
        "SavePlan",
        "LoadPlan",
        "WriteItem",
        "ReadItem",
        "TensorWriteData",
        "WriteItemType",
        "LoadItemType",
    ),
    "torch": ("Size",),
    "collections": ("OrderedDict",),
    # StorageMeta.checkpoint_id is the folder it was saved to: a path object in our checkpoints
    "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),
    "pathlib._local": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),  # Python 3.13's home
}
DCP_CLASSES = {
    module: _PUBLIC_DCP_CLASSES.get(module, ()) + dcp_metadata_classes().get(module, ())
    for module in _PUBLIC_DCP_CLASSES.keys() | dcp_metadata_classes().keys()
}


class MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata`: its own dataclasses and enums, torch.Size, dtypes, layouts."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """Resolve only the classes a DCP metadata file is made of; refuse anything else by name."""
        target = None
        if name in DCP_CLASSES.get(module, ()):
            candidate = super().find_class(module, name)
            target = candidate if isinstance(candidate, type) else None
        elif (module, name) == (PICKLED_LAYOUT.module, PICKLED_LAYOUT.path):  # a layout by its name (torch.strided)
            target = super().find_class(module, name)
        elif module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # no lazy import by name
            target = vars(torch)[name]
        if target is None:
            raise CheckpointError(f"{self.path} pickles {module}.{name}, which is not on the allow-list ({ALLOWED})")
        return target


def _is_shape(value: object, ndim: int | None = None) -> bool:
    return isinstance(value, tuple) and all(type(n) is int for n in value) and ndim in (None, len(value))


def _is_tensor_entry(entry: object) -> bool:
    """A TensorStorageMetadata with a shape, a dtype and chunks of that rank (what every reader relies on)."""
    size, chunks = getattr(entry, "size", None), getattr(entry, "chunks", None)
    if (
        not isinstance(size, tuple)
        or not isinstance(chunks, list)
        or not isinstance(entry, dcp().metadata.TensorStorageMetadata)
    ):
        return False
    ndim = len(size)
    return (
        _is_shape(size)
        and isinstance(getattr(getattr(entry, "properties", None), "dtype", None), torch.dtype)
        and all(
            _is_shape(getattr(c, "offsets", None), ndim) and _is_shape(getattr(c, "sizes", None), ndim) for c in chunks
        )
    )


def _is_data_file(info: object) -> bool:
    """A _StorageInfo naming a file of the folder itself (no path: a crafted one could read any file)."""
    name = getattr(info, "relative_path", None)
    return (
        isinstance(name, str)
        and os.path.basename(name) == name
        and name not in ("", ".", "..")
        and type(getattr(info, "offset", None)) is int
        and type(getattr(info, "length", None)) is int
    )


def _check_shape(metadata: object, path: str) -> Metadata:
    """The unpickled object, if it is an index of tensors stored in files of the folder itself."""
    metadata_classes = dcp().metadata
    if not isinstance(metadata, metadata_classes.Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not all(
        isinstance(key, str) and (isinstance(entry, metadata_classes.BytesStorageMetadata) or _is_tensor_entry(entry))
        for key, entry in entries.items()
    ):
        raise CheckpointError(f"{path} is not checkpoint metadata (its index of tensors is malformed)")
    if storage is not None and not (
        isinstance(storage, dict)
        and all(isinstance(getattr(index, "fqn", None), str) and _is_data_file(info) for index, info in storage.items())
    ):
        raise CheckpointError(f"{path} is not checkpoint metadata (its index of data files is malformed)")
    return metadata


def read_metadata_file(path: str) -> Metadata:
    """A DCP `.metadata` file unpickled with the allow-list; CheckpointError (one line naming the file) for a
    file that pickles anything else, cannot be read or is not checkpoint metadata."""
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror or type(err).__name__}") from None
    except Exception as err:  # unpickling errors have many types; name the file either way
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{path} cannot be read: {reason}") from None
    return _check_shape(metadata, path)


# torch's weights-only unpickler names a refused global as "GLOBAL module.name" (the wording varies by version)
REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_weights_file(path: str) -> Any:
    """torch.load(path, weights_only=True): tensors, numbers, strings and plain containers, nothing that runs.
    CheckpointError (one line naming the file, and the refused global if that is why) otherwise."""
    return _load_weights_only(path, path)


def load_weights_bytes(data: bytes, source: str) -> Any:
    """torch.load of one torch.save record held in memory (a record of a DCP data file), weights_only=True as
    `load_weights_file`; errors name `source` (the file and the record)."""
    return _load_weights_only(io.BytesIO(data), source)


def _load_weights_only(file: str | IO[bytes], source: str) -> Any:
    try:
        with warnings.catch_warnings():  # torch warns about a pickle protocol before refusing: one line is ours
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling and zip errors have many types; name the file either way
        text = str(err)
        refused = REFUSED_GLOBAL.search(text)
        if refused:
            raise CheckpointError(
                f"{source} pickles {refused.group(1)}, which is not on the allow-list (tensors, numbers, strings "
                "and plain containers: torch.load weights_only=True)"
            ) from None
        if text.startswith("Weights only load failed"):  # never pass on torch's advice to load it unsafely
            reason = "it holds objects other than tensors, numbers, strings and plain containers"
        else:
            reason = (text.strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{source} cannot be read: {reason}") from None
