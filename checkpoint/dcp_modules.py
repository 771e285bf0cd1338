"""The checkpoint modules that subclass torch.distributed.checkpoint's classes, imported on first use.

checkpoint/dcp_planners.py and checkpoint/dcp_reader.py import DCP at their top (their classes subclass its
planners and its FileSystemReader), and DCP costs ~1.3 CPU s per process (DTensor's operator strategies and
sympy; tests/test_start_up_imports.py): the modules of the package that save or load ask these functions for
them when a save or a load starts, so a run that does neither, a config error or --help never imports DCP.
Code outside checkpoint/ gets the same names from the package's face (checkpoint/__init__.py, on first use).
"""

from __future__ import annotations

from types import ModuleType


def planners() -> ModuleType:
    """checkpoint.dcp_planners: GlobalPieces, PiecesSavePlanner, PiecesLoadPlanner."""
    from checkpoint import dcp_planners

    return dcp_planners


def reader() -> ModuleType:
    """checkpoint.dcp_reader: SafeFileSystemReader, read_dcp_metadata."""
    from checkpoint import dcp_reader

    return dcp_reader
