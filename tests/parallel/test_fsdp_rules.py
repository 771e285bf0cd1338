"""The FSDP keys' rules: one line naming the keys for every combination that cannot run, decided before any
process group exists; and what a layout with FSDP says about itself."""

import os
import re

import pytest

from config.schema import ConfigError, load_config
from parallel.layout import LayoutError, layout_from_config
from tests.conftest import REPO_ROOT, assert_entry_points_refuse

pytestmark = pytest.mark.tier("fast")

TINY = os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.fsdp=true", "parallel.distributed_optimizer=true"], "set parallel.distributed_optimizer=false"),
        (["parallel.fsdp_replicate=2"], "parallel.fsdp_replicate=2 needs parallel.fsdp=true"),
        (["parallel.fsdp_reshard_after_forward=false"], "needs parallel.fsdp=true"),
        (["parallel.fsdp=true", "parallel.fsdp_replicate=0"], "parallel.fsdp_replicate=0 must be >= 1"),
        (["parallel.fsdp=true", "train.compile=true"], "set train.compile=false"),
    ],
)
def test_config_refuses_fsdp_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel.fsdp=true", "parallel.pp_size=2"], 4, "parallel.fsdp=true runs with parallel.pp_size=1 (got 2)"),
        (["parallel.fsdp=true", "parallel.fsdp_replicate=3"], 4, "is not divisible by parallel.fsdp_replicate=3"),
    ],
)
def test_layout_refuses_fsdp_with_pipeline_and_uneven_replicas(overrides, world_size, message):
    config = load_config(TINY, ["train.global_batch_size=48", *overrides])
    with pytest.raises(LayoutError, match=re.escape(message)):
        layout_from_config(config, world_size)


def test_fsdp_layout_describes_its_shards():
    config = load_config(TINY, ["parallel.fsdp=true", "parallel.fsdp_replicate=2", "parallel.cp_size=2"])
    layout = layout_from_config(config, 8)
    assert layout.fsdp and layout.fsdp_shard_size == 4  # dp 4 x cp 2 in 2 replicas
    assert "FSDP over 4 ranks in 2 replicas (HSDP)" in layout.describe()
    one = layout_from_config(load_config(TINY, ["parallel.fsdp=true", "parallel.tp_size=2"]), 2)
    assert not one.fsdp  # one data-parallel rank: nothing to shard, the trainer runs it plain (and says so)


def test_entry_points_refuse_fsdp_with_pipeline_parallelism(tmp_path):
    assert_entry_points_refuse(
        ["parallel.fsdp=true", "parallel.pp_size=2"],
        2,
        "parallel.fsdp=true runs with parallel.pp_size=1 (got 2): shard over dp with tp, cp and HSDP, or use "
        "parallel.distributed_optimizer=true with pipeline parallelism",
        str(tmp_path / "run"),
    )
