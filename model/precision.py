"""The torch dtype each precision name stands for: train.precision and the tools' --dtype (tools/generate.py,
tools/evaluate.py, tools/convert_checkpoint.py) all turn a name into a dtype here.

The names themselves are config/schema.py's PRECISIONS, the choices of train.precision, kept there so that
reading a config imports no torch; tests/model/test_precision.py holds the two equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

PRECISION_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
)


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype of `precision` (fp32, bf16 or fp16); a ValueError naming it otherwise."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISION_DTYPES)}")
    return PRECISION_DTYPES[precision]
