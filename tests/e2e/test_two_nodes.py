"""Two "nodes" on this machine: two network namespaces joined by a veth pair, one torchrun in each with
--nnodes 2 and a c10d rendezvous on the first's address, the way a two-node job launches.

The layout is tp 2 x pp 2 x dp 2 (4 ranks per node) with checkpoints. SIGUSR1 goes to the second node's
torchrun, which dies of it (torchrun has no handler for USR1): its ranks find their launcher gone, every rank
of both nodes agrees to stop after the same iteration, saves it and exits 3. A relaunch of both nodes resumes
and finishes, and the losses equal one process's on the same global batch (fp32, dropout 0).

A system test (it creates network interfaces as root): it runs only with PTDP_SYSTEM_TESTS=1 (.ci/run sets
it). Without permission for `ip netns` it skips with the reason, except under CI=true, where it fails. All
traffic stays on 10.213.77.0/30, which exists only inside the two namespaces the test creates and deletes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import checkpoint
from tests.conftest import REPO_ROOT, read_metrics, tiny_train_args
from tests.e2e.netns import INTERFACE, SYSTEM_TEST, in_namespace, namespace_pids, tp2_pp2, two_nodes

ADDRESSES = ("10.213.77.1", "10.213.77.2")  # a private /30 that lives only inside the test's namespaces
PORT = 29400  # free by construction: the namespaces are new
ITERS = 10
LAYOUT = tp2_pp2(ITERS, "checkpoint.save_interval=4")

pytestmark = [pytest.mark.tier("full"), SYSTEM_TEST]  # the launch path: two network-namespace nodes (system test)


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    """Node 0 and node 1 (tests/e2e/netns.py)."""
    hosts = str(tmp_path_factory.mktemp("netns") / "hosts")
    with two_nodes(f"ptdp{os.getpid() % 100000}", ADDRESSES, hosts) as nodes:
        yield nodes, hosts


def launch(namespaces, corpus: dict, run_dir: str, *extra: str) -> list[subprocess.Popen]:
    """One torchrun per namespace, 4 ranks each, c10d rendezvous on node 0's address."""
    nodes, hosts = namespaces
    # gloo binds to the address of the named interface (the machine's host name resolves to no address there).
    env = {**os.environ, "GLOO_SOCKET_IFNAME": INTERFACE, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    procs = []
    for index, node in enumerate(nodes):
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}", "--rdzv-id", "two-nodes"),
            *("--local-addr", node.address),
            # Node 0 hosts the rendezvous store: torchrun cannot tell by itself, the endpoint's address is not
            # one its host name resolves to.
            *("--rdzv-conf", f"is_host={int(index == 0)},join_timeout=300"),
            os.path.join(REPO_ROOT, "pretrain_gpt.py"),
            *tiny_train_args(corpus, run_dir, *LAYOUT, *extra),
        ]
        procs.append(
            subprocess.Popen(
                in_namespace(node, hosts, cmd),
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], seconds: float) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=seconds)[0])
        finally:
            proc.kill()
    return outputs


def wait_for_iteration(run_dir: str, iteration: int, procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    path = os.path.join(run_dir, "metrics.jsonl")
    while time.monotonic() < deadline:
        if os.path.exists(path) and any(r["iteration"] >= iteration for r in read_metrics(run_dir)):
            return
        if any(proc.poll() is not None for proc in procs):
            raise AssertionError("a node ended early:\n" + "\n".join(o[-2000:] for o in finish(procs, 60)))
        time.sleep(0.3)
    raise AssertionError(f"no iteration {iteration} within {seconds} s:\n" + "\n".join(finish(procs, 5)))


def test_two_nodes_signal_one_and_resume(namespaces, tiny_corpus, tmp_path):
    run_dir = str(tmp_path / "run")
    procs = launch(namespaces, tiny_corpus, run_dir)
    wait_for_iteration(run_dir, 2, procs, 420)
    # Node 1's torchrun (exec'd by nsenter/unshare/sh, so it has the Popen's pid) dies of it; its ranks notice.
    procs[1].send_signal(signal.SIGUSR1)
    outputs = finish(procs, 240)
    text = "\n".join(outputs)
    saved = checkpoint.read_tracker(os.path.join(run_dir, "checkpoints"))
    assert saved is not None and 2 <= saved < ITERS, text[-4000:]
    assert procs[1].returncode == -signal.SIGUSR1
    assert "which started this rank, is gone" in outputs[1], outputs[1][-3000:]
    assert f"stopped by SIGTERM after iteration {saved}" in text, text[-4000:]
    assert "exitcode  : 3" in outputs[0], outputs[0][-3000:]  # node 0's ranks stopped with the checkpoint too
    assert not namespace_pids(namespaces[0][1]), "node 1's ranks outlived the run"

    resumed = launch(namespaces, tiny_corpus, run_dir, "checkpoint.load=true")
    outputs = finish(resumed, 420)
    assert [p.returncode for p in resumed] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert f"resumed from iteration {saved}" in "\n".join(outputs)
    losses = [r["lm_loss"] for r in read_metrics(run_dir)]
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, ITERS + 1))

    reference = str(tmp_path / "reference")
    one = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *tiny_train_args(tiny_corpus, reference, *LAYOUT[2:])],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    expected = [r["lm_loss"] for r in read_metrics(reference)]
    assert losses == pytest.approx(expected, rel=1e-5)
