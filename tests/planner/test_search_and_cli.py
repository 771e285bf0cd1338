"""--search picks the config's layout or a faster one that fits; the CLI's outputs and errors; calibration."""

import json
import os
import sys

import pytest
import yaml

from config.schema import load_config
from model.rank_spec import Recompute
from model.shape import iteration_flops
from planner import calibrate
from planner.cluster import load_cluster
from planner.predict import predict
from planner.search import conservative_seconds, outside_domain, search, why_best_wins
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT
from tools.plan import main as plan_main

pytestmark = pytest.mark.tier("fast")

A100 = os.path.join(REPO_ROOT, "configs", "clusters", "dgx_a100_80gb.yaml")


def plan(*args):
    """tools/plan.py as users run it (forked as a new process would be: tests/cli_runner.py)."""
    return run_cli([sys.executable, "tools/plan.py", "--cluster", A100, *args], cwd=REPO_ROOT)


def plan_here(capsys, *args, cluster=A100):
    """tools/plan.py's main in this process (no second torch import): (exit code, stdout, stderr)."""
    code = plan_main(["--cluster", cluster, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_beats_or_equals_the_paper_layout_and_always_fits():
    config = load_config(os.path.join(REPO_ROOT, "configs", "paper", "gpt_7.5b.yaml"))
    cluster = load_cluster(A100)
    result = search(config, cluster, 128)
    reference = predict(config, cluster, 128)
    # ranked by the conservative estimate: the prediction plus its error bar, wider outside the fit's domain
    assert conservative_seconds(result.best) <= conservative_seconds(reference) + 1e-9
    assert all(p.fits and p.memory_gib <= 80 for p in result.ranked)
    costs = [conservative_seconds(p) for p in result.ranked]
    assert costs == sorted(costs)
    assert outside_domain(reference) == [] and conservative_seconds(reference) > reference.iteration_seconds
    for p in result.ranked:
        margin = conservative_seconds(p) / p.iteration_seconds - 1
        assert margin == pytest.approx(0.08 + 0.15 * len(outside_domain(p)))  # each unseen dimension widens it
    reason = why_best_wins(result)
    assert result.best.describe_layout() in reason and "GiB" in reason


def test_search_never_picks_a_layout_that_does_not_fit():
    # 145.6B on 64 GPUs of 80 GiB: little room, so most layouts are rejected by the memory model
    config = load_config(os.path.join(REPO_ROOT, "configs", "paper", "gpt_145.6b.yaml"), ["train.global_batch_size=64"])
    result = search(config, load_cluster(A100), 64)
    assert result.fitting < result.considered
    assert result.ranked and all(p.fits for p in result.ranked)


def test_cli_json_has_the_promised_keys():
    out = plan("--config", "configs/paper/gpt_18.4b.yaml", "--gpus", "256", "train.global_batch_size=512", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in ("tflops_per_gpu", "iteration_seconds", "memory_gib_per_gpu", "breakdown_seconds"):
        assert key in result
    assert set(result["breakdown_seconds"]) == {
        "compute",
        "bubble",
        "tp_comm",
        "ep_comm",
        "pp_comm",
        "dp_comm",
        "optimizer",
    }
    assert result["layout"]["dp"] == 32 and result["layout"]["num_microbatches"] == 16


def test_cli_errors_name_the_value(tmp_path, capsys):
    config = os.path.join(REPO_ROOT, "configs", "paper", "gpt_18.4b.yaml")
    code, _, err = plan_here(capsys, "--config", config, "--gpus", "100")
    assert code == 2 and "world size 100" in err
    code, _, err = plan_here(capsys, "--config", config, "--gpus", "256", "parallel.tp_sise=4")
    assert code == 2 and "parallel.tp_size" in err
    cluster = tmp_path / "c.yaml"
    cluster.write_text(open(A100).read().replace("hbm_gbs:", "hbm_gb:"))
    code, _, err = plan_here(capsys, "--config", config, "--gpus", "256", cluster=str(cluster))
    assert code == 2 and "unknown key gpu.hbm_gb" in err


def test_cli_plots_three_pngs(tmp_path, capsys):
    code, _, err = plan_here(
        capsys,
        "--config",
        os.path.join(REPO_ROOT, "configs", "paper", "gpt_3.6b.yaml"),
        "--gpus",
        "16",
        "parallel.tp_size=2",
        "parallel.pp_size=2",
        "train.global_batch_size=64",
        "--plot",
        str(tmp_path),
    )
    assert code == 0, err
    for name in ("tp_vs_pp.png", "microbatch.png", "interleaving.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def write_run(run_dir, config, world, seconds, logs_world_size=True):
    """A run folder as pretrain_gpt.py writes it: config.yaml and metrics.jsonl with ms_per_iter and world_size;
    `logs_world_size=False`: as a trainer wrote it before it logged world_size (the planner then recovers the
    world size from tflops_per_device)."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.yaml"), "w") as handle:
        yaml.safe_dump(config.to_dict(), handle)
    m, train = config.model, config.train
    recompute = Recompute(train.recompute, train.recompute_method, train.recompute_num_layers)
    vocab = m.padded_vocab_size(config.parallel.tp_size)
    flops = iteration_flops(m, vocab, train.global_batch_size, recompute).with_recompute
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as handle:
        for i, scale in enumerate((3.0, 1.0, 1.01, 0.99)):  # the first interval holds the warm-up
            ms = 1000 * seconds * scale
            handle.write(
                json.dumps(
                    {
                        "iteration": 10 * (i + 1),
                        "ms_per_iter": ms,
                        "lm_loss": 5.0,
                        "tflops_per_device": flops / (ms / 1000) / world / 1e12,
                        **({"world_size": world} if logs_world_size else {}),
                    }
                )
                + "\n"
            )
        handle.write(json.dumps({"iteration": 40, "val_loss": 4.0}) + "\n")


def two_runs(tmp_path, truth) -> list[str]:
    """Two run folders whose times are `truth`'s predictions (1.7B on 8 GPUs, 3.6B at pp 2 on 16)."""
    runs = []
    for i, (name, world, overrides) in enumerate(
        [("gpt_1.7b.yaml", 8, []), ("gpt_3.6b.yaml", 16, ["parallel.pp_size=2"])]
    ):
        config = load_config(
            os.path.join(REPO_ROOT, "configs", "paper", name), overrides + ["train.global_batch_size=64"]
        )
        run_dir = str(tmp_path / f"run{i}")
        write_run(run_dir, config, world, predict(config, truth, world).iteration_seconds, logs_world_size=i == 1)
        runs.append(run_dir)
    return runs


def test_calibration_recovers_the_constants_of_a_run(tmp_path, capsys):
    cluster = load_cluster(A100)
    runs = two_runs(tmp_path, cluster.with_efficiency(gemm_max=0.5, hbm=0.4))
    observations = [calibrate.load_run(r) for r in runs]
    assert [o.world_size for o in observations] == [8, 16]
    before = calibrate.error_table(cluster, observations)
    fitted = calibrate.fit(cluster, observations, keys=("gemm_max", "hbm"))
    after = calibrate.error_table(fitted, observations)
    assert max(abs(r[3]) for r in before) > 0.2 and max(abs(r[3]) for r in after) < 0.01
    code, out, err = plan_here(capsys, "--calibrate", runs[0], "--output", str(tmp_path / "fitted.yaml"))
    assert code == 0, err
    assert "model error after the fit: at most" in out
    assert load_cluster(str(tmp_path / "fitted.yaml")).efficiency.gemm_max < cluster.efficiency.gemm_max


def test_a_prior_holds_a_constant_near_its_start(tmp_path):
    # calibrate.fit's MAP prior: a tight prior keeps hbm near where the fit starts, and gemm_max takes up what
    # it can of the difference; without the prior hbm goes to the truth
    cluster = load_cluster(A100)
    observations = [calibrate.load_run(r) for r in two_runs(tmp_path, cluster.with_efficiency(gemm_max=0.5, hbm=0.4))]
    free = calibrate.fit(cluster, observations, keys=("gemm_max", "hbm"))
    held = calibrate.fit(cluster, observations, keys=("gemm_max", "hbm"), prior_sigma={"hbm": 0.01})
    assert free.efficiency.hbm == pytest.approx(0.4, rel=0.02)
    assert held.efficiency.hbm == pytest.approx(cluster.efficiency.hbm, rel=0.05)
    assert held.efficiency.gemm_max < cluster.efficiency.gemm_max


def test_calibrate_rejects_a_folder_without_metrics(tmp_path, capsys):
    code, _, err = plan_here(capsys, "--calibrate", str(tmp_path))
    assert code == 2 and "config.yaml does not exist" in err


def test_cli_marks_extrapolations_and_prints_the_training_time(capsys):
    args = ["--config", "configs/paper/gpt_1.7b.yaml", "--gpus", "16"]  # 32 sequences per rank
    code, out, _ = plan_here(
        capsys, *args, "train.recompute=selective", "train.micro_batch_size=32", "--tokens", "300e9"
    )
    assert code == 0
    assert "outside the calibrated domain (micro-batch 32, recompute selective)" in out
    assert "equation (4)" in out and "planner:" in out and "days" in out
    code, out, _ = plan_here(capsys, *args)
    assert code == 0 and "outside the calibrated domain" not in out
