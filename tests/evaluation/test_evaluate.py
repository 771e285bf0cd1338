"""tools/evaluate.py and the ptdp adapter on one tiny trained checkpoint and its transformers export, against
lm-evaluation-harness (its HuggingFace backend on the export, same local files), transformers (Megatron's
adjusted perplexity from its definition), the trainer's own validation and eval.* figures, and layouts."""

import json
import math
import os

import pytest
import torch

import tests.tools.test_convert_checkpoint as convert_tests
import tools.evaluate as evaluate_tool
from evaluation.documents import read_lambada
from evaluation.model_source import load_model, run_config, run_tokenizer
from evaluation.scoring import WindowScorer
from evaluation.tasks import lambada_task
from operations.startup import DistEnv
from parallel.layout import layout_from_config
from tests.conftest import read_metrics, run_ranks
from tests.evaluation.conftest import LAMBADA, WHITESPACE_LAMBADA, write_jsonl
from tests.tools.test_convert_checkpoint import tokenizer_files  # noqa: F401  (a module fixture)
from tools.convert_checkpoint import to_hf

pytestmark = pytest.mark.tier("full")  # the lm-evaluation-harness comparisons


def run_tool(capsys, *argv: str) -> dict:
    assert evaluate_tool.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def harness_metric(results: dict, task: str, metric: str) -> float:
    return results["results"][task][f"{metric},none"]


def test_lambada_and_wikitext_match_the_harness(eval_model, eval_files, harness_files, harness_results, capsys):
    hf = harness_results["hf"]
    for source in (("--checkpoint", eval_model["checkpoint"]), ("--hf", eval_model["hf"])):
        lambada = run_tool(capsys, "lambada", "--data", harness_files["lambada"], *source)
        assert lambada["total"] == harness_files["texts"]
        assert lambada["correct"] == round(harness_metric(hf, "local_lambada", "acc") * lambada["total"])
        assert lambada["correct"] >= harness_files["strict"] > 0 and lambada["loose_correct"] > lambada["correct"]
        assert close(lambada["target_perplexity"], harness_metric(hf, "local_lambada", "perplexity"), 1e-4)
        wikitext = run_tool(capsys, "wikitext", "--data", eval_files["wikitext"], *source)
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            assert close(wikitext[metric], harness_metric(hf, "local_wikitext", metric), 1e-4), metric
    # example by example: the strict rule's correct examples are the harness's acc = 1 examples
    config, source = run_config(eval_model["checkpoint"], None, [])
    tokenizer = run_tokenizer(config)
    ctx = load_model(config, source, layout_from_config(config, 1), DistEnv(1, 0, 0, 1, torch.device("cpu")))
    texts = read_lambada(harness_files["lambada"])
    task = lambada_task(texts, tokenizer.encode, tokenizer.eod, 64)
    strict = WindowScorer(ctx, tokenizer.eod).score(task.windows)[: len(texts)]
    samples = sorted(hf["samples"]["local_lambada"], key=lambda s: s["doc_id"])
    assert [s.all_greedy for s in strict] == [bool(sample["acc"]) for sample in samples]
    for ours, sample in zip(strict, samples):
        assert abs(ours.total - sample["perplexity"]) <= 1e-4  # the per-example target log-likelihood
    # the ptdp adapter inside lm_eval gives the HuggingFace backend's figures
    for task_name, metric in (
        ("local_lambada", "acc"),
        ("local_lambada", "perplexity"),
        ("local_wikitext", "word_perplexity"),
    ):
        ptdp = harness_metric(harness_results["ptdp"], task_name, metric)
        assert close(ptdp, harness_metric(hf, task_name, metric), 1e-4) or ptdp == harness_metric(hf, task_name, metric)


def test_lambada_on_code_and_prose_gives_the_harness_perplexity(
    eval_model, harness_files, harness_results, tmp_path, capsys
):
    """Passages with newlines and tabs next to the last word (WHITESPACE_LAMBADA among them): the target
    perplexity and accuracy of source code and of prose, each scored apart, are the harness's (HuggingFace
    backend, same examples) within 0.1 %."""
    samples = harness_results["hf"]["samples"]["local_lambada"]
    prose = {LAMBADA[0], LAMBADA[2], *WHITESPACE_LAMBADA[-2:]}
    groups = {
        "prose": [s for s in samples if s["doc"]["text"] in prose],
        "code": [s for s in samples if s["doc"]["text"] not in prose],
    }
    assert len(groups["prose"]) == len(prose) and any("\n" in s["doc"]["text"] for s in groups["code"])
    for name, group in groups.items():
        data = write_jsonl(tmp_path / f"{name}.jsonl", [sample["doc"]["text"] for sample in group])
        ours = run_tool(capsys, "lambada", "--data", data, "--checkpoint", eval_model["checkpoint"])
        theirs = math.exp(-sum(sample["perplexity"] for sample in group) / len(group))
        assert close(ours["target_perplexity"], theirs, 1e-3), (name, ours["target_perplexity"], theirs)
        assert ours["correct"] == sum(sample["acc"] for sample in group), name


def requests(kind: str, arguments: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=k) for k, args in enumerate(arguments)]


LOGLIKELIHOOD_CASES = [
    ("import os\nimport", " sys"),
    ("def main(self, ", "value):\n    return value"),
    ("the end of the context with spaces   ", "word"),
    ("", "starts from the end-of-document token"),
    ("a long context " * 40, " and a continuation"),  # cut from the left to the window
    ("x = 1\n", "\n\ny = 2"),
]


def test_adapter_loglikelihoods_equal_the_hf_backend(eval_model, harness_results):
    from lm_eval.models.huggingface import HFLM

    from evaluation.harness import PTDPLM
    from tests.evaluation.conftest import WIKITEXT

    ours = PTDPLM(checkpoint=eval_model["checkpoint"], batch_size=3)
    theirs = HFLM(pretrained=eval_model["hf"], dtype="float32", batch_size=3, device="cpu")
    assert ours.max_length == theirs.max_length == 64 and ours.prefix_token_id == theirs.prefix_token_id
    asked = requests("loglikelihood", LOGLIKELIHOOD_CASES)
    for (ll_ours, greedy_ours), (ll_theirs, greedy_theirs) in zip(
        ours.loglikelihood(asked), theirs.loglikelihood(asked)
    ):
        assert abs(ll_ours - ll_theirs) <= 1e-4 and greedy_ours == greedy_theirs
    texts = [(WIKITEXT,), ("short",), ("def f(x):\n    return x * 2\n" * 9,)]
    rolling = requests("loglikelihood_rolling", texts)
    for a, b in zip(ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)):
        assert abs(a - b) <= 1e-4
    until = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    prompts = requests("generate_until", [("import os\nimport", until), ("def main(", until)])
    assert ours.generate_until(prompts) == theirs.generate_until(prompts)


def test_megatron_adjusted_perplexity_from_its_definition(eval_model, tmp_path, capsys):
    import transformers
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer as detokenize

    text = (
        " = Hand Made = \n \n The first line , with a comma . \n The second line @-@ with a dash ; and more words . \n"
    )
    path = tmp_path / "hand.tokens"
    path.write_text(text, encoding="utf-8")
    seq, overlap = 16, 5
    ours = run_tool(
        capsys,
        "wikitext",
        "--data",
        str(path),
        "--hf",
        eval_model["hf"],
        f"eval.seq_length={seq}",
        f"eval.overlapping_eval={overlap}",
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(eval_model["hf"])
    model = transformers.AutoModelForCausalLM.from_pretrained(eval_model["hf"]).eval()
    tokens = tokenizer.encode(detokenize({"page": text}))
    total = 0.0
    for t in range(1, len(tokens)):  # token t read after the window it is scored in: start 0, or k * overlap
        start = 0 if t <= seq else math.ceil((t - seq) / overlap) * overlap
        with torch.no_grad():
            logits = model(torch.tensor([tokens[start:t]])).logits[0, -1].double()
        total -= float(torch.log_softmax(logits, -1)[tokens[t]])
    loss = total / (len(tokens) - 1)
    words = len(text.strip().split(" "))
    assert ours["tokens"] == len(tokens) > seq + 2 * overlap and ours["original_tokens"] == words
    assert close(ours["loss"], loss, 1e-5) and close(ours["perplexity"], math.exp(min(20, loss)), 1e-5)
    assert close(ours["adjusted_perplexity"], math.exp(loss * (len(tokens) - 1) / (words - 1)), 1e-4)


def test_loss_equals_the_trainer_validation_and_the_trainer_figures_the_tool(eval_model, eval_files, capsys):
    run_dir, checkpoint = eval_model["run_dir"], eval_model["checkpoint"]
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    last_val = [r for r in records if "val_loss" in r][-1]
    assert last_val["iteration"] == 8 and read_metrics(run_dir)[-1]["iteration"] == 8
    loss = run_tool(
        capsys,
        "loss",
        "--data",
        eval_model["corpus"]["data_prefix"],
        "--checkpoint",
        checkpoint,
        "--split",
        "valid",
        "--batches",
        "2",
    )
    assert close(loss["loss"], last_val["val_loss"], 1e-6) and loss["samples"] == 16
    assert [r["iteration"] for r in records if "wikitext_word_perplexity" in r] == [4, 8]
    for task in ("wikitext", "lambada"):
        figures = run_tool(capsys, task, "--data", eval_files[task], "--checkpoint", checkpoint)
        for key, value in last_val.items():
            if key.startswith(task + "_"):
                assert close(value, figures[key.removeprefix(task + "_")], 1e-6), key


LAYOUTS = {
    "tp2-pp2": ["parallel.tp_size=2", "parallel.pp_size=2"],
    "pp2-vp2-dp2": ["parallel.pp_size=2", "parallel.vp_size=2", "parallel.schedule=interleaved"],
    "cp2-tp2-sp": ["parallel.cp_size=2", "parallel.tp_size=2", "parallel.sequence_parallel=true"],
}


def _evaluate_on_ranks(rank, world_size, runs, out_file):
    records = []
    for argv in runs:
        records.append(evaluate_tool.evaluate(evaluate_tool.parse_args(argv), []))
    if rank == 0:
        with open(out_file, "w", encoding="utf-8") as handle:
            json.dump(records, handle)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_give_the_figures_of_one_process(layout, eval_model, eval_files, tmp_path, capsys):
    checkpoint = ["--checkpoint", eval_model["checkpoint"]]
    runs = [
        ["wikitext", "--data", eval_files["wikitext"], *checkpoint],
        ["lambada", "--data", eval_files["lambada"], *checkpoint],
        ["loss", "--data", eval_model["corpus"]["data_prefix"], "--batches", "2", *checkpoint],
    ]
    single = [run_tool(capsys, *argv) for argv in runs]
    run_ranks(4, _evaluate_on_ranks, [argv + LAYOUTS[layout] for argv in runs], str(tmp_path / "out.json"))
    with open(tmp_path / "out.json", encoding="utf-8") as handle:
        parallel = json.load(handle)
    for one, many in zip(single, parallel):
        assert one["layout"] != many["layout"]
        for key, value in one.items():
            if isinstance(value, float):
                assert close(many[key], value, 1e-5), (one["task"], key)
            elif key not in ("layout", "convention"):
                assert many[key] == value, (one["task"], key)


def test_a_checkpoint_saved_at_tp2_pp2_evaluates_on_one_process(tokenizer_files, eval_files, tmp_path, capsys):  # noqa: F811
    """The layout a checkpoint was trained at is not imposed on its evaluation, and its figures are its
    transformers export's."""
    config = convert_tests.run_config(convert_tests.GPT, tokenizer_files, tp=2, pp=2)
    run_ranks(4, convert_tests._save_at_layout, config, str(tmp_path / "ckpt"))
    to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    capsys.readouterr()
    ours = run_tool(capsys, "wikitext", "--data", eval_files["wikitext"], "--checkpoint", str(tmp_path / "ckpt"))
    theirs = run_tool(capsys, "wikitext", "--data", eval_files["wikitext"], "--hf", str(tmp_path / "hf"))
    assert ours["layout"].startswith("world 1 = tp 1") and ours["iteration"] == 3 and theirs["iteration"] is None
    for key, value in ours.items():
        if isinstance(value, float):
            assert close(theirs[key], value, 1e-5), key
