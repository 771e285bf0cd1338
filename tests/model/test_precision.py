"""Precision names -> torch dtypes: one table (model/precision.py) for the trainer, the tools and the converter."""

import pytest
import torch

from config.schema import PRECISIONS
from evaluation.model_source import DTYPES as EVAL_PRECISIONS
from model.precision import PRECISION_DTYPES, precision_dtype

pytestmark = pytest.mark.tier("fast")


def test_every_configurable_precision_has_its_dtype():
    assert tuple(PRECISION_DTYPES) == PRECISIONS  # train.precision's choices are exactly the table's names
    assert [precision_dtype(name) for name in PRECISIONS] == [torch.float32, torch.bfloat16, torch.float16]
    assert set(EVAL_PRECISIONS) <= set(PRECISIONS)


def test_an_unknown_precision_is_named():
    with pytest.raises(ValueError, match="precision 'fp8' is not one of fp32, bf16, fp16"):
        precision_dtype("fp8")
