"""Crafted files for the security tests, in one place: each holds a pickle that creates a file (`marker`) the
moment anything unpickles it unsafely, so a test proves nothing ran by the marker's absence.

    arm_dcp_metadata(iter_dir, marker)      a DCP `.metadata` (ours or Megatron's torch_dist) with the payload
    arm_torch_file(path, marker)            a torch.save file (rng/*.pt, pytorch_model.bin, Megatron's .pt)
    match_checksums(iter_dir)               checksums.json rewritten to match, as whoever crafted the file can
    assert_refused(code, err, bad, marker)  exit 2, one line on stderr naming the file, nothing ran
"""

from __future__ import annotations

import os
import pickle
import shlex
from typing import Any

import torch

from checkpoint import files
from checkpoint.safe_reader import read_metadata_file


class CreatesFile:
    """Unpickling this runs `touch marker` (a shell command: what an attacker would run)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


# The name the refusal gives the payload's callable (os.system lives in the posix module).
PAYLOAD_GLOBAL = f"{os.system.__module__}.system"


def assert_payload_is_live(marker: str) -> None:
    """The payload really creates its file when unpickled unsafely (so its absence elsewhere means something)."""
    pickle.loads(pickle.dumps(CreatesFile(marker)))
    assert os.path.exists(marker)
    os.remove(marker)


def arm_dcp_metadata(iter_dir: str, marker: str) -> str:
    """Put the payload into iter_dir/.metadata (the real index, with the payload as its planner_data, so the
    file is still a working checkpoint's metadata for an unsafe reader); returns the file's path."""
    path = os.path.join(iter_dir, files.DCP_METADATA)
    metadata = read_metadata_file(path)
    metadata.planner_data = CreatesFile(marker)
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)
    return path


def arm_torch_file(path: str, marker: str) -> str:
    """Add the payload to a torch.save file (a dict), or write one holding only it; returns path."""
    content = torch.load(path, weights_only=True) if os.path.exists(path) else {}
    torch.save({**content, "payload": CreatesFile(marker)}, path)
    return path


def match_checksums(iter_dir: str) -> None:
    """Rewrite checksums.json for the files as they are now: checksums are no defence against a crafted file."""
    names = sorted(files.read_checksums(iter_dir))
    files.write_json({"files": files.checksum_files(iter_dir, names)}, os.path.join(iter_dir, files.CHECKSUMS))


def assert_refused(code: int, stderr: str, bad_file: str, marker: str) -> None:
    """Exit status 2 and one line on stderr naming the file; the payload did not run."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert len(lines) == 1 and bad_file in lines[0], stderr
    assert not os.path.exists(marker), "the payload ran"
