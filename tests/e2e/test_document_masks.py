"""Per-document attention masking (data.reset_attention_mask + reset_position_ids + eod_mask_loss) trains the
same model in every tp / pp / sp layout as in one process, on a corpus whose samples cross many documents."""

import json
import os

import pytest

from data.preprocess import preprocess_jsonl
from tests.e2e.test_layouts import FAST, LLAMA, assert_matches, train

pytestmark = pytest.mark.tier("full")  # parity combinations beyond the fast tier's one per feature

RESET = ("data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true")


@pytest.fixture(scope="module")
def short_documents(tiny_corpus, tmp_path_factory):
    """The tiny corpus's tokenizer over documents of 3 source lines: a 32-token sample spans several."""
    root = tmp_path_factory.mktemp("short_docs")
    with open(os.path.join(os.path.dirname(tiny_corpus["data_prefix"]), "corpus.jsonl"), encoding="utf-8") as f:
        lines = [line for record in map(json.loads, f) for line in record["text"].splitlines() if line.strip()]
    jsonl = str(root / "short.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": "\n".join(lines[i : i + 3])}) + "\n" for i in range(0, 6000, 3))
    preprocess_jsonl(
        jsonl,
        str(root / "short"),
        "GPT2BPETokenizer",
        vocab_file=tiny_corpus["vocab_file"],
        merge_file=tiny_corpus["merge_file"],
        append_eod=True,
        log=lambda msg: None,
    )
    return dict(tiny_corpus, data_prefix=str(root / "short_text_document"))


@pytest.fixture(scope="module")
def references(short_documents, tmp_path_factory):
    cache = {}

    def get(*overrides):
        if overrides not in cache:
            cache[overrides] = train(short_documents, str(tmp_path_factory.mktemp("ref")), 1, *FAST, *overrides)
        return cache[overrides]

    return get


def test_masks_change_training(references):
    """Guards the layout cases below: with many EODs per sample, the masks must change the losses."""
    masked, plain = references(*RESET), references()
    assert all(abs(a["lm_loss"] - b["lm_loss"]) > 1e-4 for a, b in zip(masked[1:], plain[1:]))


@pytest.mark.parametrize(
    "world_size,model,parallel",
    [
        pytest.param(4, (), ("parallel.tp_size=2", "parallel.pp_size=2"), id="tp2-pp2"),
        pytest.param(2, LLAMA, ("parallel.tp_size=2", "parallel.sequence_parallel=true"), id="tp2-sp-rope"),
    ],
)
def test_reset_masks_match_single_process(short_documents, references, tmp_path, world_size, model, parallel):
    records = train(short_documents, str(tmp_path / "run"), world_size, *FAST, *RESET, *model, *parallel)
    assert_matches(records, references(*RESET, *model))
