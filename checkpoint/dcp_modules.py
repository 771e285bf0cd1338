"""The checkpoint modules that subclass torch.distributed.checkpoint's classes, imported on first use.

checkpoint/dcp_planners.py, checkpoint/dcp_reader.py and checkpoint/crc_writer.py import DCP at their top (their
classes subclass its planners, its FileSystemReader and its FileSystemWriter), and DCP costs ~1.3 CPU s per process (DTensor's operator strategies and
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


def crc_writer() -> ModuleType:
    """checkpoint.crc_writer: ChecksummingWriter (DCP's writer, taking each file's size and CRC-32 as it writes)."""
    from checkpoint import crc_writer

    return crc_writer
