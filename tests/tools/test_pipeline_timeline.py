"""tools/pipeline_timeline.py as users run it (forked by run_cli as a new python would run it): the bubble line and a PNG."""

import os
import sys

import pytest

from tests.cli_runner import run_cli

pytestmark = pytest.mark.tier("fast")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "pipeline_timeline.py")


def run_tool(*args):
    return run_cli([sys.executable, TOOL, *args], cwd=REPO, timeout=120)


@pytest.mark.parametrize(
    "schedule,p,m,v,costs,expected",
    [
        ("interleaved", 4, 8, 2, ("1", "2"), 3 / 16),
        ("1f1b", 4, 8, 1, ("1.5", "2.5"), 3 / 8),
        ("gpipe", 3, 5, 1, ("2", "1"), 2 / 5),
    ],
)
def test_prints_bubble_and_writes_png(tmp_path, schedule, p, m, v, costs, expected):
    output = tmp_path / "timeline.png"
    result = run_tool(
        "--pp",
        str(p),
        "--microbatches",
        str(m),
        "--vp",
        str(v),
        "--schedule",
        schedule,
        "--forward-cost",
        costs[0],
        "--backward-cost",
        costs[1],
        "--output",
        str(output),
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("bubble fraction: "))
    assert abs(float(line.split(": ")[1]) - expected) < 1e-9
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 1000


def test_exact_bubble_line():
    result = run_tool(
        "--pp", "4", "--microbatches", "8", "--vp", "2", "--schedule", "interleaved", "--output", os.devnull
    )
    assert "bubble fraction: 0.1875\n" in result.stdout


@pytest.mark.parametrize(
    "args,words",
    [
        (("--pp", "4", "--microbatches", "6", "--vp", "2", "--schedule", "interleaved"), "multiple of"),
        (("--pp", "4", "--microbatches", "8", "--schedule", "zigzag"), "unknown"),
        (("--pp", "4", "--microbatches", "8", "--vp", "2", "--schedule", "gpipe"), "interleaved"),
        (("--pp", "1", "--microbatches", "8", "--vp", "2", "--schedule", "interleaved"), "pp_size > 1"),
    ],
)
def test_invalid_input_exits_2_with_one_line(tmp_path, args, words):
    result = run_tool(*args, "--output", str(tmp_path / "x.png"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_overlap_shortens_the_printed_makespan(tmp_path):
    common = ("--pp", "4", "--microbatches", "8", "--vp", "2", "--schedule", "interleaved", "--comm-cost", "0.1")
    spans = []
    for extra in ((), ("--overlap",)):
        result = run_tool(*common, *extra, "--output", str(tmp_path / "t.png"))
        assert result.returncode == 0, result.stderr
        spans.append(float(next(x for x in result.stdout.splitlines() if x.startswith("makespan: ")).split()[1]))
    assert spans[1] < spans[0]


def test_default_output_goes_under_runs_and_a_missing_folder_is_created(tmp_path):
    args = ("--pp", "2", "--microbatches", "2")
    result = run_cli([sys.executable, TOOL, *args], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == ["runs"]  # nothing at the top of the working directory
    assert (tmp_path / "runs" / "timeline" / "1f1b_p2_m2_v1.png").stat().st_size > 1000
    result = run_tool(*args, "--output", str(tmp_path / "missing" / "t.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "missing" / "t.png").stat().st_size > 1000
    (tmp_path / "a_file").write_text("x")
    result = run_tool(*args, "--output", str(tmp_path / "a_file" / "t.png"))  # a folder that cannot be made
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: cannot write {tmp_path / 'a_file' / 't.png'}")


def test_xmax_puts_two_schedules_on_one_scale(tmp_path):
    from PIL import Image

    widths = []
    for extra in (("--schedule", "1f1b"), ("--schedule", "interleaved", "--vp", "2")):
        output = tmp_path / f"{extra[1]}.png"
        result = run_tool("--pp", "4", "--microbatches", "8", *extra, "--xmax", "33", "--output", str(output))
        assert result.returncode == 0, result.stderr
        widths.append(Image.open(output).size[0])
    assert widths[0] == widths[1]
