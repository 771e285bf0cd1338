"""scripts/slurm/pretrain_gpt.sbatch's multi-node path on a real two-node SLURM cluster on this machine.

Two network namespaces joined by a veth pair (tests/e2e/netns.py) are the nodes: slurmctld and node0's slurmd
run in the first, node1's slurmd in the second, each seeing the other only at its /30 address. TaskPlugin is
task/affinity, so srun's `--cpus-per-task` / `--cpu-bind=cores` really bind each node's torchrun (the log's
cpu-bind lines show the mask). The job is `sbatch --nodes=2` of a tp 2 x pp 2 run (2 CPU ranks per node,
torchrun's static rendezvous on the first node's name); USR1 to the batch shell makes every rank of both nodes
save the same iteration, the job requeues itself, resumes and completes with the losses of one process.

A system test: it runs only with PTDP_SYSTEM_TESTS=1 (.ci/run sets it); without slurm-wlm or permission for
network namespaces it skips with the reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from functools import partial

import pytest

from tests.conftest import REPO_ROOT, read_metrics, tiny_train_args
from tests.e2e.netns import INTERFACE, SYSTEM_TEST, in_namespace, tp2_pp2, two_nodes, unavailable
from tests.e2e.test_slurm import SLURM_COMMON, install_slurm, make_checkout, submit_signal_and_finish, wait_idle

ADDRESSES = ("10.213.77.5", "10.213.77.6")  # a private /30 that lives only inside the test's namespaces
SLURM_CONF = (
    """ClusterName=two
SlurmctldHost={controller}({address})
TaskPlugin=task/affinity
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    + SLURM_COMMON
)
ITERS = 60
LAYOUT = tp2_pp2(ITERS, "optim.lr_decay_iters=100")

pytestmark = [pytest.mark.tier("full"), SYSTEM_TEST]  # the launch path: SLURM on two nodes (system test)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(environment, wrap): SLURM_CONF of a running two-node cluster, and how to run a client command (in the
    first node's namespace)."""
    reason = install_slurm()
    if reason:
        unavailable(reason)
    root = tmp_path_factory.mktemp("slurm2")
    hosts = str(root / "hosts")
    with two_nodes(f"ptdps{os.getpid() % 10000}", ADDRESSES, hosts) as nodes:
        for sub in ("state", "spool", f"spool/{nodes[0].hostname}", f"spool/{nodes[1].hostname}"):
            (root / sub).mkdir()
        node_lines = "\n".join(f"NodeName={n.hostname} NodeAddr={n.address} CPUs={os.cpu_count()}" for n in nodes)
        # slurmctld accepts only its own host name as SlurmctldHost; the address is the first namespace's.
        controller = os.uname().nodename.split(".")[0]
        conf = root / "slurm.conf"
        conf.write_text(SLURM_CONF.format(controller=controller, address=nodes[0].address, root=root, nodes=node_lines))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        daemons = [
            (nodes[0], ["slurmctld", "-i"], root / "slurmctld.pid"),
            *[(n, ["slurmd", "-N", n.hostname], root / f"slurmd-{n.hostname}.pid") for n in nodes],
        ]
        try:
            for node, cmd, _ in daemons:
                proc = subprocess.run(
                    in_namespace(node, hosts, cmd), capture_output=True, text=True, env=env, timeout=60
                )
                if proc.returncode:
                    unavailable(f"{cmd[0]} cannot run in a network namespace here: {proc.stderr.strip()[-300:]}")
            wrap = partial(in_namespace, nodes[0], hosts)
            if not wait_idle(env, 60, wrap):
                logs = [p.read_text(errors="replace")[-400:] for p in sorted(root.glob("slurm*.log"))]
                unavailable("the two SLURM nodes did not become idle within 60 s: " + " | ".join(logs))
            yield env, wrap
        finally:
            for _, _, pid_file in daemons:  # stop exactly the daemons this fixture started
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


def test_two_node_job_saves_requeues_and_resumes(cluster, tiny_corpus, tmp_path):
    env, wrap = cluster
    checkout = make_checkout(tmp_path, f"export GLOO_SOCKET_IFNAME={INTERFACE} CPU_RANKS_PER_NODE=2\n")
    run_dir = str(tmp_path / "run")
    args = tiny_train_args(tiny_corpus, run_dir, *LAYOUT)
    text = submit_signal_and_finish(env, checkout, run_dir, ["--nodes=2"], args, wrap)
    assert "2 node(s)" in text, text[-3000:]
    cpus = os.cpu_count() or 1
    for node in (0, 1):  # each node's torchrun bound to all of that node's allocated CPUs
        assert f"{node}: cpu-bind=MASK - node{node}, task  {node}  0" in text, text[-3000:]
    assert f"mask {hex((1 << cpus) - 1)} set" in text, text[-3000:]
    losses = [r["lm_loss"] for r in read_metrics(run_dir)]
    assert len(losses) == ITERS

    reference = str(tmp_path / "reference")
    one = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *tiny_train_args(tiny_corpus, reference, *LAYOUT[2:])],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert losses == pytest.approx([r["lm_loss"] for r in read_metrics(reference)], rel=1e-5)
