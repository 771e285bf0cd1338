"""What each test costs in CPU seconds, and why: a pytest plugin and its summary (docs/testing.md).

Wall time on a shared machine says little (other jobs take the cores), so this records CPU seconds per test:
the pytest process's own (`RUSAGE_SELF`), the processes it started and waited for (`RUSAGE_CHILDREN`: the
subprocesses, torchrun and its ranks, forked ranks), and what the persistent rank pool spent on the test
(tests/rank_pool.py reports it). It also counts the processes a test started, by kind, and the time the
pytest process spent building data (corpus, tokenizer, .bin/.idx), so that the summary can group costs by
cause. Turned on by PTDP_TEST_COSTS=<file> (one JSON line per test, appended; xdist workers share the file):

    PTDP_TEST_COSTS=/tmp/costs.jsonl python -m pytest -q tests
    python -m tests.cpu_costs /tmp/costs.jsonl
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest

# CPU seconds one `python -c "import torch, pretrain_gpt"` costs on this machine (measured by `startup_cost`
# when the summary is printed): the unit for "process start-up".
_STARTUP_PROBE = "import torch, pretrain_gpt"


@dataclass
class TestCost:
    """One test's figures (setup + call + teardown together)."""

    nodeid: str
    wall: float = 0.0
    cpu_self: float = 0.0
    cpu_children: float = 0.0
    cpu_pool: float = 0.0
    fixtures: Counter = field(default_factory=Counter)  # CPU s of each fixture set up for this test
    launches: Counter = field(default_factory=Counter)  # processes started: "python", "torchrun", "other"

    def cpu(self) -> float:
        return self.cpu_self + self.cpu_children + self.cpu_pool


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _launch_kind(args) -> str:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    joined = " ".join(argv)
    if "torch.distributed.run" in joined or os.path.basename(argv[0]) == "torchrun":
        return "torchrun"
    if "python" in os.path.basename(argv[0]) or argv[0] == sys.executable:
        return "python"
    return "other"


class CostRecorder:
    """The plugin: one TestCost per test, written as a JSON line when the test ends."""

    def __init__(self, path: str):
        self.path = path
        self.current: TestCost | None = None
        self._wrap_popen()

    def _wrap_popen(self) -> None:
        original = subprocess.Popen.__init__
        recorder = self

        def counting_init(popen, args, *rest, **kwargs):
            if recorder.current is not None:
                recorder.current.launches[_launch_kind(args)] += 1
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = counting_init  # type: ignore[method-assign]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        """CPU of each fixture's setup, by fixture name (a session fixture counts for the test that built it)."""
        began = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
        yield
        if self.current is not None:
            spent = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - began
            if spent > 0.01:
                self.current.fixtures[fixturedef.argname] += spent

    def add_pool_cpu(self, seconds: float) -> None:
        if self.current is not None:
            self.current.cpu_pool += seconds

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = TestCost(item.nodeid)
        began = (time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))
        yield
        cost, self.current = self.current, None
        cost.wall = time.perf_counter() - began[0]
        cost.cpu_self = _cpu(resource.RUSAGE_SELF) - began[1]
        cost.cpu_children = _cpu(resource.RUSAGE_CHILDREN) - began[2]
        record = {**cost.__dict__, "launches": dict(cost.launches), "fixtures": dict(cost.fixtures)}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def recorder_for(config) -> CostRecorder | None:
    """A recorder where PTDP_TEST_COSTS asks for one: in the pytest process the user started and in its xdist
    workers, not in a pytest that a test starts (scripts/gpu_check.sh's kernel stage): its tests are already
    in the CPU seconds of the test that started it."""
    path = os.environ.get("PTDP_TEST_COSTS")
    if not path:
        return None
    owner = os.environ.setdefault("PTDP_TEST_COSTS_OWNER", str(os.getpid()))
    if owner != str(os.getpid()) and not hasattr(config, "workerinput"):
        return None
    return CostRecorder(path)


def startup_cost() -> float:
    """CPU seconds of one python start that imports torch and the trainer (best of three)."""
    costs = []
    for _ in range(3):
        before = _cpu(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", _STARTUP_PROBE], check=True)
        costs.append(_cpu(resource.RUSAGE_CHILDREN) - before)
    return min(costs)


# A fixture's cause by its name: data it builds, a reference it computes once, or other shared set-up.
_DATA_WORDS = ("corpus", "tokenizer", "dataset", "prefix", "vocab", "jsonl", "indexed", "data")
_REFERENCE_WORDS = ("reference", "single", "one_process", "baseline", "expected")


def fixture_cause(name: str) -> str:
    """'data preparation', 'references' or 'shared set-up' for a fixture name."""
    lowered = name.lower()
    if any(word in lowered for word in _DATA_WORDS):
        return "data preparation"
    if any(word in lowered for word in _REFERENCE_WORDS):
        return "references"
    return "shared set-up"


def causes_of(record: dict, startup_unit: float) -> dict[str, float]:
    """One test's CPU seconds split by cause: process start-up is estimated as the number of python processes
    it started times the cost of one (a torchrun counts as its agent and two ranks), fixtures by their names."""
    launches = record["launches"]
    starts = launches.get("python", 0) + 3 * launches.get("torchrun", 0)
    total = record["cpu_self"] + record["cpu_children"] + record["cpu_pool"]
    causes: Counter = Counter()
    for name, seconds in record["fixtures"].items():
        causes[fixture_cause(name)] += seconds
    causes["process start-up"] = min(starts * startup_unit, max(total - sum(causes.values()), 0.0))
    causes["work"] = max(total - sum(causes.values()), 0.0)
    return dict(causes)


def summarize(path: str, top: int = 30) -> str:
    """Totals by cause and by file, of a PTDP_TEST_COSTS file."""
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    unit = startup_cost()
    totals: Counter = Counter()
    by_file: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        file_name = record["nodeid"].split("::")[0]
        for cause, seconds in causes_of(record, unit).items():
            totals[cause] += seconds
            by_file[file_name][cause] += seconds
        by_file[file_name]["wall"] += record["wall"]
        by_file[file_name]["tests"] += 1
    order = ("process start-up", "data preparation", "references", "shared set-up", "work")
    lines = [f"{len(records)} tests; one python start importing torch + the trainer = {unit:.2f} CPU s"]
    lines += [f"  {cause:18s} {totals[cause]:8.1f} CPU s" for cause in order]
    lines.append(f"  {'total':18s} {sum(totals.values()):8.1f} CPU s")
    lines.append("by file, CPU s: total | start-up | data | references | set-up | work | wall s | tests")
    ranked = sorted(by_file.items(), key=lambda kv: -sum(kv[1][c] for c in order))
    for file_name, causes in ranked[:top]:
        figures = " | ".join(f"{causes[c]:6.1f}" for c in order)
        total = sum(causes[c] for c in order)
        lines.append(f"  {total:7.1f} | {figures} | {causes['wall']:6.1f} | {causes['tests']:3d}  {file_name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
