"""tools/compare_runs.py: pass within rtol, fail past it naming the iteration, exit 2 on bad input."""

import io
import json
import os
import sys

import pytest

from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT
from tools import compare_runs

pytestmark = pytest.mark.tier("fast")


def write_run(path, losses, grad_norms=None, val=None, extra_lines=()):
    os.makedirs(path, exist_ok=True)
    lines = []
    for i, loss in enumerate(losses, start=1):
        lines.append(json.dumps({"iteration": i, "lm_loss": loss, "grad_norm": (grad_norms or losses)[i - 1]}))
    for iteration, value in (val or {}).items():
        lines.append(json.dumps({"iteration": iteration, "val_loss": value, "val_ppl": 2.0}))
    lines.extend(extra_lines)
    with open(os.path.join(path, "metrics.jsonl"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return str(path)


def run(*argv):
    out = io.StringIO()
    code = compare_runs.main([str(a) for a in argv], out=out)
    return code, out.getvalue()


def test_identical_and_within_rtol_pass(tmp_path):
    a = write_run(tmp_path / "a", [6.0, 5.5, 5.0], val={0: 6.1, 3: 5.1})
    b = write_run(tmp_path / "b", [6.0, 5.5 * (1 + 5e-6), 5.0], val={0: 6.1, 3: 5.1})
    code, out = run(a, b)
    assert code == 0 and "OK" in out and "val_loss" in out
    assert out.count("\n") >= 3 + 2  # one table row per iteration


def test_difference_past_rtol_fails_naming_first_iteration(tmp_path):
    a = write_run(tmp_path / "a", [6.0, 5.5, 5.0, 4.5])
    b = write_run(tmp_path / "b", [6.0, 5.5, 5.01, 4.6])
    code, out = run(a, b)
    assert code == 1
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("FAIL") and "iteration 3" in verdict and "5.0" in verdict and "5.01" in verdict
    assert run(a, b, "--rtol", "0.05")[0] == 0


def test_repeatable_key_and_val_loss_are_compared(tmp_path):
    a = write_run(tmp_path / "a", [6.0, 5.5], grad_norms=[1.0, 0.9], val={2: 5.4})
    b = write_run(tmp_path / "b", [6.0, 5.5], grad_norms=[1.0, 0.8], val={2: 5.4})
    assert run(a, b)[0] == 0  # lm_loss only by default
    code, out = run(a, b, "--key", "lm_loss", "--key", "grad_norm")
    assert code == 1 and "grad_norm differs first at iteration 2" in out
    c = write_run(tmp_path / "c", [6.0, 5.5], val={2: 5.3})
    code, out = run(a, c)
    assert code == 1 and "val_loss differs first at iteration 2" in out


@pytest.mark.parametrize("case", ["missing_dir", "missing_file", "malformed", "no_common", "unknown_key"])
def test_bad_input_exits_2(tmp_path, capsys, case):
    a = write_run(tmp_path / "a", [6.0, 5.5])
    b = tmp_path / "b"
    fragment = {
        "missing_dir": "does not exist",
        "missing_file": "no metrics file",
        "malformed": "metrics.jsonl:3",
        "no_common": "no common",
        "unknown_key": "no common",
    }[case]
    if case == "missing_file":
        os.makedirs(b)
    elif case == "malformed":
        write_run(b, [6.0, 5.5], extra_lines=['{"iteration": 3, "lm_loss": 5.'])
    elif case == "no_common":
        with open(os.path.join(write_run(b, []), "metrics.jsonl"), "w") as handle:
            handle.write(json.dumps({"iteration": 7, "lm_loss": 1.0}) + "\n")
    elif case == "unknown_key":
        write_run(b, [6.0, 5.5])
    argv = [a, b] + (["--key", "nope"] if case == "unknown_key" else [])
    assert run(*argv)[0] == 2
    assert fragment in capsys.readouterr().err


def test_command_line(tmp_path):
    """Run as users do: `python tools/compare_runs.py A B` from any directory."""
    a = write_run(tmp_path / "a", [6.0, 5.5])
    b = write_run(tmp_path / "b", [6.0, 5.6])
    script = os.path.join(REPO_ROOT, "tools", "compare_runs.py")
    ok = run_cli([sys.executable, script, a, a], cwd=tmp_path)
    bad = run_cli([sys.executable, script, a, b], cwd=tmp_path)
    assert ok.returncode == 0 and "OK" in ok.stdout
    assert bad.returncode == 1 and "iteration 2" in bad.stdout


def test_drift_tolerance_after_the_strict_iterations(tmp_path):
    """Rounding differences grow during training: late iterations get --drift-rtol, early ones --rtol."""
    losses = [5.0 - 0.01 * i for i in range(40)]
    drifted = list(losses)
    drifted[29] *= 1 + 3e-3  # iteration 30: beyond the strict window, inside 1e-2
    a, b = write_run(tmp_path / "a", losses), write_run(tmp_path / "b", drifted)
    code, out = run(a, b)
    assert code == 0 and "up to iteration 20" in out
    assert run(a, b, "--strict-iters", "-1")[0] == 1
    assert run(a, b, "--strict-iters", "30")[0] == 1
    early = list(losses)
    early[9] *= 1 + 3e-3  # iteration 10: inside the strict window
    assert run(a, write_run(tmp_path / "c", early))[0] == 1
    late = list(losses)
    late[34] *= 1 + 5e-2  # past even the drift tolerance
    code, out = run(a, write_run(tmp_path / "d", late))
    assert code == 1 and "iteration 35" in out.strip().splitlines()[-1]
