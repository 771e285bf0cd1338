"""Creating a process group that times out is one error naming parallel.init_timeout_s (issue 40); other errors
of the creation pass through unchanged."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from parallel.comm import CollectiveError
from parallel.group_setup import GroupCreationTimeout, creating_group, is_timeout
from parallel.state import ParallelState
from tests.conftest import run_forked_ranks

pytestmark = pytest.mark.tier("fast")

WORLD = "the world process group (2 ranks, gloo)"
# torch 2.13's texts, as the ranks of `torchrun ... parallel.init_timeout_s=0.01` printed them
STORE_TIMEOUT = "wait timeout after 10ms, keys: /default_pg/0//cpu//0/1"
GLOO_TIMEOUT = (
    "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:42417$1"
)


@pytest.mark.parametrize("error", [dist.DistStoreError(STORE_TIMEOUT), RuntimeError(GLOO_TIMEOUT)])
def test_a_store_or_gloo_timeout_names_the_key_and_its_value(error):
    with pytest.raises(GroupCreationTimeout) as raised, creating_group(WORLD, 1, 0.5):
        raise error
    message = str(raised.value)
    assert message.startswith("rank 1: creating the world process group (2 ranks, gloo) timed out after ")
    assert "(parallel.init_timeout_s=0.5)" in message and str(error).splitlines()[0] in message
    assert "\n" not in message and isinstance(raised.value, CollectiveError)  # reported as a start-up collective
    assert raised.value.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] SO_ERROR: Connection refused"),
        dist.DistStoreError("LibUV TCPStore implementation missing"),
        ValueError("Invalid rank -1"),
        RuntimeError("TimeoutError-free text naming a Timeouts table"),  # "timeout" only as a whole word counts
    ],
    ids=["refused", "store-not-a-timeout", "value-error", "word-inside-a-word"],
)
def test_other_errors_pass_through_unchanged(error):
    assert not is_timeout(error)
    with pytest.raises(type(error)) as raised, creating_group(WORLD, 0, 300.0):
        raise error
    assert raised.value is error


def test_without_a_timeout_of_ours_the_message_says_torchs_default():
    expected = r"\(torch's default timeout\): not every rank joined within it; look"
    with pytest.raises(GroupCreationTimeout, match=expected), creating_group(WORLD, 0, None):
        raise dist.DistStoreError(STORE_TIMEOUT)


def _rank_one_stays_away(rank: int, world_size: int) -> None:
    """Rank 0 builds the parallel groups on a 1 s timeout; rank 1 never joins them: it goes on to the world
    group's barrier (run_forked_ranks'), where rank 0 meets it after its error."""
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(GroupCreationTimeout) as raised:
            ParallelState.create(tp_size=2, pp_size=1, timeout_s=1.0)
        message = str(raised.value)
        assert message.startswith("rank 0: creating the process group of ranks [0, 1] timed out after "), message
        assert "(parallel.init_timeout_s=1)" in message, message
        assert time.monotonic() - started < 30.0  # the 1 s bound held (torch's default would be 30 minutes)


def test_a_parallel_group_that_a_rank_never_joins_is_named():
    run_forked_ranks(2, _rank_one_stays_away, timeout=120.0)
