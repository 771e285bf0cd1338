"""What a checkpoint holds, and whether every byte of it is intact.

    python tools/checkpoint_info.py PATH [--verify] [--tensors]

PATH is a checkpoints folder (its latest complete checkpoint) or one iter_XXXXXXX folder. Prints the
iteration, the layout it was saved at (it loads at any layout), the model config, whether optimizer state is
present, the size on disk and (with --tensors, or always for up to 40 tensors) every tensor's global shape and
dtype. --verify reads every byte and checks each file's size and CRC-32 against checksums.json and every
tensor's stored extent against the DCP metadata, and every weight of the saved model config as a tensor of its
shape (the check the loaders make before reading): a torn, truncated or corrupted file is named. For a
checkpoints folder every iter_* folder newer than the one loaded is checked too (a resume passes over a broken
newest save): --verify fails naming it. Exit status: 0 fine, 1 verification failed, 2 not a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint import (
    ITER_RE,
    META,
    CheckpointError,
    check_model_entries,
    check_storage_extents,
    dir_size,
    dp_rank_file,
    is_legacy,
    iter_name,
    list_iterations,
    rank_dir,
    read_checksums,
    read_dcp_metadata,
    read_train_state,
    resolve_checkpoint,
    verify_files,
)
from config.schema import ConfigError, config_from_dict


def describe(iter_dir: str, show_tensors: bool) -> list[str]:
    """Human-readable lines about the checkpoint in iter_dir."""
    if is_legacy(iter_dir):
        if not os.path.isfile(os.path.join(rank_dir(iter_dir, 0, 0), dp_rank_file(0))):  # format 1 writes it
            raise CheckpointError(
                f"{iter_dir} is not a checkpoint of this project: mp_rank folders without dp_rank files are "
                "Megatron-LM's; convert it with tools/convert_checkpoint.py from-megatron"
            )
        return [f"checkpoint {iter_dir}: per-rank format of earlier versions (loads only at its own layout)"]
    saved = read_train_state(iter_dir)
    metadata = read_dcp_metadata(iter_dir)
    stored = metadata.state_dict_metadata
    model = saved.config.get("model", {})
    lines = [
        f"checkpoint {iter_dir}",
        f"  iteration {saved.iteration}, {saved.progress.consumed_samples} samples consumed, "
        f"format {saved.format_version}",
        f"  saved at {saved.layout.describe()}",
        "  model: " + ", ".join(f"{k}={v}" for k, v in model.items()),
        f"  optimizer state: {'present' if saved.has_optimizer else 'absent (weights only)'}",
        f"  size on disk: {dir_size(iter_dir) / 2**20:.1f} MiB in {len(read_checksums(iter_dir))} files",
        f"  tensors: {len(stored)}",
    ]
    if show_tensors or len(stored) <= 40:
        for key in sorted(stored):
            entry = stored[key]
            if not isinstance(entry, TensorStorageMetadata):
                lines.append(f"    {key}  (bytes)")
                continue
            lines.append(f"    {key}  {list(entry.size)}  {str(entry.properties.dtype).replace('torch.', '')}")
    return lines


def verify(iter_dir: str) -> None:
    """Every file's size and CRC-32, and every stored tensor extent inside its file."""
    if is_legacy(iter_dir):
        raise CheckpointError(f"{iter_dir} is in the per-rank format of earlier versions: it has no checksums")
    verify_files(iter_dir)
    metadata = read_dcp_metadata(iter_dir)
    check_storage_extents(iter_dir, metadata)
    try:
        model = config_from_dict(read_train_state(iter_dir).config).model
    except ConfigError as err:
        raise CheckpointError(f"checkpoint {iter_dir}: its saved config is not a valid run config: {err}") from None
    check_model_entries(iter_dir, metadata, model)


def newer_failures(path: str, iter_dir: str) -> list[str]:
    """For a checkpoints folder: why each iter_* folder newer than the one chosen (`iter_dir`) was passed
    over (a save torn by a crash, a corrupted file); empty for an iter_* path or when none is newer."""
    root = os.path.abspath(path)
    if os.path.dirname(iter_dir) != root:
        return []
    chosen = int(ITER_RE.match(os.path.basename(iter_dir)).group(1))  # type: ignore[union-attr]
    problems = []
    for iteration in list_iterations(root):
        if iteration <= chosen:
            continue
        directory = os.path.join(root, iter_name(iteration))
        try:
            if not os.path.exists(os.path.join(directory, META)):
                raise CheckpointError(f"checkpoint {directory} has no {META} (a save that did not finish)")
            verify(directory)
        except CheckpointError as err:
            problems.append(f"the newest checkpoint {directory} is not usable: {err}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a checkpoints folder or one iter_XXXXXXX folder")
    parser.add_argument("--verify", action="store_true", help="read every byte and check it")
    parser.add_argument("--tensors", action="store_true", help="list every tensor even when there are many")
    args = parser.parse_args(argv)
    try:
        iter_dir = resolve_checkpoint(args.path)
        print("\n".join(describe(iter_dir, args.tensors)))
        passed_over = newer_failures(args.path, iter_dir)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    fallback = f"; a resume loads {os.path.basename(iter_dir)} (shown above)"
    if args.verify:
        try:
            verify(iter_dir)
        except CheckpointError as err:
            print(f"verify: FAILED: {err}", file=sys.stderr)
            return 1
        for problem in passed_over:  # the folder as a whole is not OK when its newest save is broken
            print(f"verify: FAILED: {problem}{fallback}", file=sys.stderr)
        if passed_over:
            return 1
        print("verify: OK (every file's size and CRC-32, every tensor's extent, every weight's shape)")
    for problem in passed_over:
        print(f"warning: {problem}{fallback}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
