"""How large a dataset's index arrays will be, checked against free disk and memory before any is built.

A run that reads far more samples than its corpus holds (a 124M-parameter config on a small corpus) asks
for thousands of epochs: the indices then take gigabytes of memory and of cache, and minutes to build.
The size is known from counts alone, so the refusal comes first, in one line with the size.
"""

from __future__ import annotations

import os
import shutil

# The index may take at most this share of the free disk (its cache) and of the available memory (it is
# built in memory): the rest stays for checkpoints, other runs and the model itself.
MAX_SHARE = 0.5


def index_nbytes(document_entries: int, total_samples: int) -> int:
    """Bytes of the three GPT index arrays: int32 document index, [n + 1, 2] int64 sample index and the
    shuffle index (uint32 below 2^32 samples, else int64), as data/gpt_dataset.py builds them."""
    shuffle_itemsize = 4 if total_samples < 2**32 - 2 else 8
    return document_entries * 4 + (total_samples + 1) * 16 + total_samples * shuffle_itemsize


def human_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def free_disk_bytes(folder: str) -> int | None:
    """Free bytes on the file system `folder` is (or will be created) on; None when unknown."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_index_fits(nbytes: int, cache_dir: str | None, what: str, detail: str) -> None:
    """Raise ValueError (one line: the size, what it is, the limit and what to change) when an index of
    `nbytes` would take more than MAX_SHARE of the free disk under `cache_dir` or of the available memory."""
    limits = [("memory available", available_memory_bytes())]
    if cache_dir is not None:
        limits.append((f"free on the disk of {cache_dir}", free_disk_bytes(cache_dir)))
    for name, available in limits:
        if available is not None and nbytes > MAX_SHARE * available:
            raise ValueError(
                f"{what}: its index would take {human_bytes(nbytes)} ({detail}), more than half of the "
                f"{human_bytes(available)} {name}: give data.data_path a larger corpus, read fewer samples "
                f"(train.train_iters, train.global_batch_size, train.eval_iters) or set data.cache_dir to a "
                f"larger disk"
            )
