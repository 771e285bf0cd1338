"""tools/model_stats.py: the paper's Table 1 totals, per-stage counts, FLOPs and errors, on the meta device."""

import os
import sys

import pytest

from config.schema import load_config
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT
from tools.model_stats import count, meta_chunks, report, total_parameters

pytestmark = pytest.mark.tier("fast")

TABLE_1 = {
    "1.7b": 1.7,
    "3.6b": 3.6,
    "7.5b": 7.5,
    "18.4b": 18.4,
    "39.1b": 39.1,
    "76.1b": 76.1,
    "145.6b": 145.6,
    "310.1b": 310.1,
    "529.6b": 529.6,
    "1t": 1008.0,
}


@pytest.mark.parametrize("name", sorted(TABLE_1))
def test_paper_totals_match_table_1(name):
    config = load_config(os.path.join(REPO_ROOT, "configs", "paper", f"gpt_{name}.yaml"))
    assert round(total_parameters(config) / 1e9, 1) == TABLE_1[name]
    assert config.model.seq_length == 2048 and config.model.padded_vocab_size(config.parallel.tp_size) == 51200


def test_stages_and_tp_shards_add_up():
    config = load_config(os.path.join(REPO_ROOT, "configs", "paper", "gpt_39.1b.yaml"))  # tp 8, pp 2
    h, vocab_local = config.model.hidden_size, 51200 // 8
    # Per tp rank: column/row weights and column biases split 8 ways; row biases and norms replicated.
    per_layer = (12 * h * h + 7 * h) // 8 + 2 * h + 4 * h
    first = count(meta_chunks(config, tp_rank=3, pp_rank=0, dp_size=32))
    last = count(meta_chunks(config, tp_rank=3, pp_rank=1, dp_size=32))
    assert first == 24 * per_layer + vocab_local * h + 2048 * h
    assert last == 24 * per_layer + 2 * h + vocab_local * h  # final norm + its copy of the tied embedding
    assert any("stage 1: 24 layers" in line for line in report(config, dp_size=32))


def test_report_prints_the_papers_flops():
    # 96 B s l h^2 (1 + s/6h + V/16lh) with full recomputation (the paper's equation 3); the formula against
    # every paper config: tests/model/test_shape.py
    config = load_config(os.path.join(REPO_ROOT, "configs", "paper", "gpt_76.1b.yaml"))
    m, b = config.model, config.train.global_batch_size
    s, l, h, v = m.seq_length, m.num_layers, m.hidden_size, 51200  # noqa: E741 (the paper's l)
    expected = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    line = next(line for line in report(config, dp_size=1) if line.startswith("training FLOPs"))
    assert f"{expected:.4e} with recompute full" in line


def test_cli_prints_and_rejects_bad_input():
    ok = run_cli([sys.executable, "tools/model_stats.py", "--config", "configs/paper/gpt_1t.yaml"], cwd=REPO_ROOT)
    assert ok.returncode == 0 and "(1008.0 B)" in ok.stdout and "stage 63" in ok.stdout
    bad = run_cli([sys.executable, "tools/model_stats.py", "--config", "configs/gpt_tiny.yaml"], cwd=REPO_ROOT)
    assert bad.returncode == 2 and "model.vocab_size" in bad.stderr
