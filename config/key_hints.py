"""The known key an unknown one most likely meant: `train.iters` -> `train.train_iters`.

difflib alone picks `eval_iters` for `train.iters` (the shorter key wins on ratio): users often drop the
section name that many keys repeat (`train_iters`, `tp_size` in `parallel`), or write a Megatron-LM flag's
spelling (`train-iters`, `--train-iters`). Those are tried first.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from config.megatron_flags import MEGATRON_FLAGS


def closest_key(section: str, key: str, known: Sequence[str]) -> str | None:
    """The `section.key` that `key` (unknown in `section`, whose keys are `known`) most likely meant, or None."""
    plain = key.lstrip("-").replace("-", "_")
    for candidate in (plain, f"{section}_{plain}", f"{plain}_{section}"):
        if candidate in known:
            return f"{section}.{candidate}"
    megatron = MEGATRON_FLAGS.get("--" + plain.replace("_", "-"))
    if megatron is not None:  # Megatron's name for it: data_cache_path -> data.cache_dir
        return megatron[0].split("=", 1)[0]
    words = set(plain.split("_"))
    holding = [k for k in known if words <= set(k.split("_"))]
    if len(holding) == 1:  # every word of it in one key only: `layers` -> num_layers, `warmup` -> lr_warmup_iters
        return f"{section}.{holding[0]}"
    # With the section name in front a near miss must be closer: `train.foo` is not `train_iters`.
    close = difflib.get_close_matches(plain, known, n=1) or difflib.get_close_matches(
        f"{section}_{plain}", known, n=1, cutoff=0.8
    )
    return f"{section}.{close[0]}" if close else None
