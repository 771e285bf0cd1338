"""Fixtures of the converter tests (tools/convert_checkpoint.py): a small GPT-2 BPE and the tiny checkpoint
every converter reads, in our format and exported to transformers and Megatron-LM."""

import os
import sysconfig

import pytest

from tests.tools.converter_inputs import make_sources


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A 300-entry byte-level BPE (padded to 384 rows by the model) trained on a few stdlib files."""
    from data.tokenizer_training import train_gpt2_bpe

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(stdlib, name), encoding="utf-8").read() for name in ("os.py", "abc.py", "glob.py")]
    vocab, merges = train_gpt2_bpe(texts, 300, str(tmp_path_factory.mktemp("tokenizer")))
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}


@pytest.fixture(scope="module")
def converter_sources(tokenizer_files, tmp_path_factory) -> dict[str, str]:
    """{"ours", "hf", "megatron"}: see converter_inputs.make_sources; tests copy the one they damage."""
    return make_sources(tmp_path_factory.mktemp("sources"), tokenizer_files)
