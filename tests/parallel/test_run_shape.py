"""The stage map and the run shape: every quantity derived from (model config, layout) in one place."""

import dataclasses
import os

import pytest

from config.schema import load_config
from model.rank_spec import Recompute
from model.shape import iteration_flops
from parallel.layout import layout_from_config
from parallel.pipeline.stages import StageMap
from parallel.run_shape import TIED_GROUP, TIED_LOCAL, TIED_NONE, RunShape
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.tier("fast")


def tiny(*overrides: str):
    return load_config(os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml"), ["model.vocab_size=1000", *overrides])


def test_stage_map_interleaved_and_v_shaped():
    interleaved = StageMap(2, 2)
    assert [p.layer_ids for p in interleaved.placements(8, 0)] == [(0, 1), (4, 5)]  # Megatron's interleaving
    assert [(p.pre_process, p.post_process) for p in interleaved.placements(8, 1)] == [(False, False), (False, True)]
    assert interleaved.embedding_pp_ranks == (0, 1) and interleaved.head_pp_rank == 1
    v = StageMap(2, 2, v_shape=True)
    assert [(p.virtual_stage, p.layer_ids) for p in v.placements(8, 0)] == [(0, (0, 1)), (3, (6, 7))]
    assert [(p.pre_process, p.post_process) for p in v.placements(8, 0)] == [(True, False), (False, True)]
    assert v.embedding_pp_ranks == (0,) and v.head_pp_rank == 0  # rank 0 holds both ends
    assert StageMap(1).embedding_pp_ranks == (0,)


@pytest.mark.parametrize(
    "overrides, world, roles",
    [
        # (tied tables, reduction) per pipeline rank
        (["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=zb-v"], 2, [(2, TIED_LOCAL), (0, TIED_NONE)]),
        (["parallel.pp_size=2", "parallel.vp_size=2"], 2, [(1, TIED_GROUP), (1, TIED_GROUP)]),
        (["parallel.pp_size=4"], 4, [(1, TIED_GROUP), (0, TIED_NONE), (0, TIED_NONE), (1, TIED_GROUP)]),
        ([], 1, [(1, TIED_NONE)]),  # one stage: the output layer is the embedding
        (["parallel.pp_size=2", "model.tie_embeddings=false"], 2, [(0, TIED_NONE), (0, TIED_NONE)]),
    ],
)
def test_roles_say_who_holds_the_tied_copies(overrides, world, roles):
    config = tiny(*overrides)
    shape = RunShape.of(config, layout_from_config(config, world))
    got = [(r.tied_tables, r.tied_reduction) for r in map(shape.roles, range(shape.layout.pp_size))]
    assert got == roles


def test_sizes_flops_and_recomputation():
    config = tiny(
        "parallel.tp_size=2",
        "parallel.cp_size=2",
        "parallel.sequence_parallel=true",
        "parallel.pp_size=2",
        "train.recompute=full",
        "train.recompute_method=block",
        "train.recompute_num_layers=3",
    )
    layout = layout_from_config(config, 8)
    shape = RunShape.of(config, layout)
    assert shape.padded_vocab == config.model.padded_vocab_size(2) and shape.vocab_local == shape.padded_vocab // 2
    assert shape.local_seq_length == 64 and shape.activation_shape == (32, 4, 128)
    assert shape.recompute == Recompute("full", "block", 3)
    assert shape.flops == iteration_flops(config.model, shape.padded_vocab, 16, Recompute("full", "block", 3), 2)
    assert shape.tokens_per_iteration == 16 * 128
    assert [shape.recomputed_layers(c) for c in shape.chunks(1)] == [(4, 5, 6)]
    uniform = dataclasses.replace(shape, train=dataclasses.replace(config.train, recompute_method="uniform"))
    assert uniform.recomputed_layers(shape.chunks(0)[0]) == (0, 1, 2, 3)


def test_sequence_parallelism_in_effect_and_value_bytes():
    # sequence parallelism splits only where there are tp ranks; the flag alone at tp 1 changes nothing
    alone = tiny("parallel.sequence_parallel=true", "train.precision=fp32")
    single = RunShape.of(alone, layout_from_config(alone, 1))
    assert single.layout.sequence_parallel and not single.sequence_parallel and single.value_bytes == 4
    split = tiny("parallel.tp_size=2", "parallel.sequence_parallel=true", "train.precision=bf16")
    shape = RunShape.of(split, layout_from_config(split, 2))
    assert shape.sequence_parallel and shape.value_bytes == 2
    assert shape.activation_shape == (shape.local_seq_length // 2, 4, 128)


def test_the_planners_activation_shape_reads_the_run_shape():
    from planner.activations import shape_from_config

    config = tiny("parallel.tp_size=2", "parallel.cp_size=2", "parallel.sequence_parallel=true")
    layout = layout_from_config(config, 4)
    run, planned = RunShape.of(config, layout), shape_from_config(config, layout)
    assert (planned.local_seq, planned.micro_batch, planned.hidden) == (run.local_seq_length, *run.activation_shape[1:])
    assert (planned.tp_size, planned.cp_size) == (layout.tp_size, layout.cp_size)
    assert (planned.sequence_parallel, planned.value_bytes) == (run.sequence_parallel, run.value_bytes)
    assert planned.seq_length == config.model.seq_length == 2 * planned.local_seq
