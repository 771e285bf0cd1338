"""scripts/slurm/pretrain_gpt.sbatch on a real one-node SLURM (Debian's slurm-wlm), the way users run it.

A system test: it runs only with PTDP_SYSTEM_TESTS=1 (.ci/run sets it). The fixture installs slurm-wlm with apt
when it is missing and the test runs as root, writes a small slurm.conf (auth/none, its own ports and folders),
starts slurmctld + slurmd, and skips with the reason when any of that cannot be done here. The job is a 2-rank CPU
run submitted with --export=NONE (and no --gpus-per-node: a plain sbatch on a CPU cluster) from a checkout without
an active venv; USR1 goes to the batch shell as `--signal=B:USR1@...` would send it; the job must save, requeue
itself, resume by itself and end with the same losses as an uninterrupted 2-rank run, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

import pretrain_gpt
from tests.conftest import REPO_ROOT, free_port, read_metrics, run_ranks, tiny_train_args
from tests.e2e.netns import SYSTEM_TEST

pytestmark = [pytest.mark.tier("full"), SYSTEM_TEST]  # the launch path: SLURM daemons (system test)

# What every test cluster here shares: no munge (auth/none), no cgroups (linuxproc), root as SlurmUser.
SLURM_COMMON = """AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
SlurmUser=root
StateSaveLocation={root}/state
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/slurmctld.log
ReturnToService=2
"""
SLURM_CONF = (
    """ClusterName=ci
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
TaskPlugin=task/none
SlurmdSpoolDir={root}/spool
SlurmdPidFile={root}/slurmd.pid
SlurmdLogFile={root}/slurmd.log
NodeName=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
    + SLURM_COMMON
)


def install_slurm() -> str | None:
    """None when slurmctld/slurmd/sbatch are on PATH (installing them with apt if possible), else why not."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm is not installed and cannot be installed here (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode:
            return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-300:]}"
    return None


def _as_is(command: list[str]) -> list[str]:
    return command


def wait_idle(env: dict, seconds: float, wrap: Callable[[list[str]], list[str]] = _as_is) -> bool:
    """Whether every node of the cluster became idle within `seconds`; `wrap` runs sinfo where the
    controller can be reached (a network namespace for the two-node cluster)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = subprocess.run(wrap(["sinfo", "-h", "-o", "%t"]), capture_output=True, text=True, env=env).stdout
        if state.strip() == "idle":
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running one-node cluster; skips with the reason if there is none."""
    if os.geteuid() != 0:
        pytest.skip("slurmd needs root to run a one-node cluster here")
    reason = install_slurm()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, ctld_port=free_port(), slurmd_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        for cmd in (["slurmctld", "-i"], ["slurmd", "-N", "localhost"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
            if proc.returncode:
                pytest.skip(f"{cmd[0]} cannot run here: {proc.stderr.strip()[-300:]}")
        daemons = [root / "slurmctld.pid", root / "slurmd.pid"]
        if not wait_idle(env, 30):
            log = (root / "slurmd.log").read_text(errors="replace")[-500:] if (root / "slurmd.log").exists() else ""
            pytest.skip(f"the SLURM node did not become idle within 30 s: {log}")
        yield env
    finally:
        for pid_file in daemons:  # stop exactly the daemons this fixture started
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


def make_checkout(root, env_lines: str = "") -> str:
    """A checkout to submit from: the repository's files linked in, plus scripts/slurm/env.sh that puts this
    interpreter on PATH (what a user's env.sh does with `module load` or a venv), then `env_lines`."""
    checkout = root / "checkout"
    checkout.mkdir()
    for name in os.listdir(REPO_ROOT):
        if name not in ("scripts", ".git"):
            os.symlink(os.path.join(REPO_ROOT, name), checkout / name)
    (checkout / "scripts" / "slurm").mkdir(parents=True)
    os.symlink(
        os.path.join(REPO_ROOT, "scripts", "slurm", "pretrain_gpt.sbatch"),
        checkout / "scripts" / "slurm" / "pretrain_gpt.sbatch",
    )
    (checkout / "scripts" / "slurm" / "env.sh").write_text(
        f'export PATH="{os.path.dirname(sys.executable)}:$PATH"\n{env_lines}'
    )
    return str(checkout)


def job_state(env: dict, job_id: str, wrap: Callable[[list[str]], list[str]] = _as_is) -> str:
    out = subprocess.run(wrap(["scontrol", "show", "job", job_id]), capture_output=True, text=True, env=env).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return f"{fields.get('JobState', '?')} restarts={fields.get('Restarts', '?')}"


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.3)


def _two_rank_reference(rank: int, world_size: int, argv: list[str]) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # the threads per rank torchrun's ranks get
    assert pretrain_gpt.main(argv) == 0


def submit_signal_and_finish(
    env: dict,
    checkout: str,
    run_dir: str,
    sbatch_args: list[str],
    train_args: list[str],
    wrap: Callable[[list[str]], list[str]] = _as_is,
) -> str:
    """Submit the sbatch, send USR1 to its batch shell at iteration 2 (what `--signal=B:USR1@120` does before
    the time limit), let the requeued job start at once and wait until it completes; returns its log."""
    submit = subprocess.run(
        wrap(["sbatch", "--parsable", "--export=NONE", *sbatch_args, "scripts/slurm/pretrain_gpt.sbatch", *train_args]),
        cwd=checkout,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    log = os.path.join(checkout, f"slurm-{job_id}.out")
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def trained(at_least: int) -> bool:
        return os.path.exists(metrics) and any(r["iteration"] >= at_least for r in read_metrics(run_dir))

    wait_for(lambda: trained(2), 300, "iteration 2 of the first attempt")
    subprocess.run(wrap(["scancel", "--batch", "--signal=USR1", job_id]), env=env, check=True, timeout=30)
    wait_for(lambda: "requeued" in open(log).read(), 240, "the job to requeue itself")
    # SLURM holds a requeued job back for a while (BeginTime); let it start now so the test stays short.
    wait_for(lambda: job_state(env, job_id, wrap).startswith("PENDING"), 60, "the requeued job to be pending")
    # Not in the second the old attempt's credential was revoked, or slurmd refuses the new one as revoked.
    time.sleep(3)
    subprocess.run(wrap(["scontrol", "update", f"JobId={job_id}", "StartTime=now"]), env=env, timeout=30)
    wait_for(
        lambda: job_state(env, job_id, wrap).startswith("COMPLETED"),
        420,
        f"the requeued job to complete ({job_state(env, job_id, wrap)})",
    )
    text = open(log).read()
    assert "attempt 1" in text and "attempt 2" in text and "requeued" in text, text[-3000:]
    assert "stopped by SIGUSR1 after iteration" in text and "resumed from iteration" in text, text[-3000:]
    return text


# Long enough that USR1 lands mid-run: the tiny model trains an iteration in ~13 ms on an idle machine, and the
# signal takes the poll (0.3 s), scancel, the batch shell's trap and its scancel to the ranks (~2 s); at 120
# iterations an idle machine finished the run first and the job never requeued.
USR1_ITERS = 600
USR1_RUN = (
    f"train.train_iters={USR1_ITERS}",
    "optim.lr_decay_iters=500",
    "train.eval_interval=500",
    "train.eval_iters=1",
)


def test_usr1_saves_requeues_and_resumes_bitwise(slurm, tiny_corpus, tmp_path):
    checkout = make_checkout(tmp_path)
    run_dir = str(tmp_path / "run")
    args = tiny_train_args(
        tiny_corpus,
        run_dir,
        *USR1_RUN,
    )
    submit_signal_and_finish(slurm, checkout, run_dir, [], args)
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["iteration"] for r in lines if "lm_loss" in r] == list(range(1, USR1_ITERS + 1))  # none twice

    reference = str(tmp_path / "reference")
    run_ranks(
        2,
        _two_rank_reference,
        [
            "--config",
            pretrain_gpt.DEFAULT_CONFIG,
            *tiny_train_args(
                tiny_corpus,
                reference,
                *USR1_RUN,
            ),
        ],
        timeout=300,
    )
    assert [r["lm_loss"] for r in read_metrics(run_dir)] == [r["lm_loss"] for r in read_metrics(reference)]
