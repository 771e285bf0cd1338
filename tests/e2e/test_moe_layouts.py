"""A Mixture-of-Experts model trains the same at every layout as one process, through the real trainer.

The MoE settings are configs/moe_tiny.yaml's (8 experts, top-2, one shared expert, the Switch loss and the
z-loss on, dropless) on the tiny test model of tests/e2e/test_layouts.py (its `train` and `assert_matches`:
10 iterations, fp32, dropout 0, lm_loss and grad_norm within 1e-5 relative of one process). The experts and
the router are replicated over tp (model/gpt.build_moe_layer), so these layouts check that their gradients
are reduced as other replicated parameters' are, and that the auxiliary losses reach the gradients as in one
process's sum over micro-batches (with sequence or context parallelism, a micro-batch's tokens are spread
over ranks and the router's losses count over all of them). One cheap case is in the fast tier.
"""

from __future__ import annotations

import os

import pytest
import yaml

from tests import tiers
from tests.conftest import REPO_ROOT
from tests.e2e.test_layouts import FAST, INTERLEAVED, assert_matches, train

pytestmark = pytest.mark.tier("fast")


def moe_tiny_overrides() -> tuple[str, ...]:
    """configs/moe_tiny.yaml's MoE keys as overrides, the experts' widths scaled to the tiny test model
    (hidden 32: experts and the shared expert 64 wide, twice the hidden size as in moe_tiny)."""
    with open(os.path.join(REPO_ROOT, "configs", "moe_tiny.yaml")) as handle:
        model = yaml.safe_load(handle)["model"]
    widths = {"moe_ffn_hidden_size": 64, "moe_shared_expert_ffn_hidden_size": 64}
    keys = [key for key in model if key == "num_experts" or key.startswith("moe_")]
    return tuple(f"model.{key}={'null' if model[key] is None else widths.get(key, model[key])}" for key in keys)


MOE = moe_tiny_overrides()
# Aux-loss-free balancing: sigmoid scores and the expert bias, stepped after each optimizer step from the
# selections counted over the global batch.
EXPERT_BIAS = ("model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true")
SEQ_AUX = ("model.moe_router_load_balancing_type=seq_aux_loss",)
TP2_SP = ("parallel.tp_size=2", "parallel.sequence_parallel=true")


@pytest.fixture(scope="module")
def moe_reference(tiny_corpus, tmp_path_factory):
    """moe_reference(*model_overrides) -> the single-process metrics of the MoE model, computed once each."""
    cache: dict[tuple, list[dict]] = {}

    def get(*model_overrides: str) -> list[dict]:
        if model_overrides not in cache:
            run_dir = str(tmp_path_factory.mktemp("moe_reference"))
            cache[model_overrides] = train(tiny_corpus, run_dir, 1, *FAST, *MOE, *model_overrides)
        return cache[model_overrides]

    return get


# (id, world size, model overrides shared with the reference, parallel overrides)
LAYOUTS = [
    ("tp2-sp", 2, (), TP2_SP),
    ("tp2", 2, (), ("parallel.tp_size=2",)),
    ("pp2-1f1b", 2, (), ("parallel.pp_size=2", "parallel.schedule=1f1b")),
    ("pp2-vp2", 2, (), ("parallel.pp_size=2", *INTERLEAVED)),
    ("pp2-zb-v", 2, (), ("parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v")),
    ("cp2", 2, (), ("parallel.cp_size=2",)),
    ("cp2-seq_aux_loss", 2, SEQ_AUX, ("parallel.cp_size=2",)),
    ("tp2-sp-seq_aux_loss", 2, SEQ_AUX, TP2_SP),
    ("dp2-distopt", 2, (), ("parallel.distributed_optimizer=true",)),
    ("dp2-expert_bias", 2, EXPERT_BIAS, ()),
    ("tp2-sp-expert_bias", 2, EXPERT_BIAS, TP2_SP),
    ("fsdp-dp2", 2, (), ("parallel.fsdp=true",)),
    (
        "tp2-pp2-dp2-sp-distopt",
        8,
        (),
        ("parallel.tp_size=2", "parallel.pp_size=2", *TP2_SP[1:], "parallel.distributed_optimizer=true"),
    ),
]


@pytest.mark.parametrize(
    "world_size,model_overrides,parallel_overrides",
    [tiers.layout_case(case[0], *case[1:], fast={"tp2-sp"}) for case in LAYOUTS],
)
def test_moe_layout_matches_single_process(
    tiny_corpus, tmp_path, moe_reference, world_size, model_overrides, parallel_overrides
):
    records = train(tiny_corpus, str(tmp_path / "run"), world_size, *FAST, *MOE, *model_overrides, *parallel_overrides)
    reference = moe_reference(*model_overrides)
    assert_matches(records, reference)
    # the routing metrics are the global batch's at every layout too (the mean over dp, the parts of a
    # micro-batch summed over its token group)
    assert_matches(records, reference, keys=("moe_load_balancing_loss", "moe_z_loss", "moe_max_load"))


def test_moe_run_logs_its_routing_metrics(tiny_corpus, tmp_path, moe_reference):
    """One process: the losses are on, nothing is dropped (dropless), and the busiest expert's load is at
    least the mean (a ratio >= 1) in every iteration's metrics.jsonl line."""
    records = moe_reference()
    for record in records:
        assert record["moe_load_balancing_loss"] > 0 and record["moe_z_loss"] > 0
        assert record["moe_dropped_fraction"] == 0.0 and record["moe_max_load"] >= 1.0
