"""`SafeFileSystemReader`, and `read_dcp_metadata` through it: the torch.distributed.checkpoint FileSystemReader every load goes through, its
`.metadata` read by checkpoint/safe_reader.py's allow-list unpickler. In a module of its own because
subclassing FileSystemReader imports DCP (~1.3 CPU s: DTensor's operator strategies and sympy), which a run
that neither saves nor loads, a config error or --help never needs: this module is imported where a
checkpoint is read.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from checkpoint.files import DCP_METADATA
from checkpoint.safe_reader import read_metadata_file


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` goes through `read_metadata_file` (never pickle.load), read once:
    `metadata`, when given, is the object the caller already read and checked."""

    def __init__(self, path: str, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.checked_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's index (also when DCP asks for a rank's own: only the folder's `.metadata` is read)."""
        if self.checked_metadata is None:
            self.checked_metadata = read_metadata_file(os.path.join(str(self.path), DCP_METADATA))
        metadata = self.checked_metadata
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def read_dcp_metadata(iter_dir: str) -> Metadata:
    """The `.metadata` of the DCP folder iter_dir, read safely (CheckpointError naming the file otherwise)."""
    return SafeFileSystemReader(iter_dir).read_metadata()
