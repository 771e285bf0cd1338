"""Fixtures of the converter tests (tools/convert_checkpoint.py): the small GPT-2 BPE of test_convert_checkpoint.py
and the tiny checkpoint every converter reads, in our format and exported to transformers and Megatron-LM."""

import pytest

from tests.tools import test_convert_checkpoint
from tests.tools.converter_inputs import make_sources

tokenizer_files = test_convert_checkpoint.tokenizer_files  # its module-scoped 300-entry BPE, for every module


@pytest.fixture(scope="module")
def converter_sources(tokenizer_files, tmp_path_factory) -> dict[str, str]:
    """{"ours", "hf", "megatron"}: see converter_inputs.make_sources; tests copy the one they damage."""
    return make_sources(tmp_path_factory.mktemp("sources"), tokenizer_files)
