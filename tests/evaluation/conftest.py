"""Session fixtures of the evaluation tests: one tiny trained checkpoint (with the trainer's eval.* tasks on),
its transformers export, small files in the standard formats, and lm-evaluation-harness's own results on them.

The model: the tests' tiny GPT (4 layers, hidden 32, the tiny corpus's 512-entry BPE with merges), trained 8
iterations from init_std 0.2 at a small LR so that its greedy predictions vary (a model that predicts one token
everywhere would make every argmax check trivial); max_position_embeddings 64 against seq_length 32, so the
window (the model's positions, as the harness takes it) differs from the training sequence.
"""

import json
import os
import re
import sysconfig

import pytest
import torch

import pretrain_gpt
from tests.conftest import tiny_train_args
from tools.convert_checkpoint import to_hf

# wiki.test.tokens' format: every line " <text> \n", blank lines " \n", articles start at " = Title = ".
WIKITEXT_LINES = [
    "",
    "= Robert Boulter =",
    "",
    "Robert Boulter is an English film , television and theatre actor . He had a guest @-@ starring role on the "
    "television series The Bill in 2000 . This was followed by a starring role in the play Herons written by Simon "
    "Stephens , which was performed in 2001 at the Royal Court Theatre .",
    "",
    "= = Career = =",
    "",
    "In 2006 , Boulter starred alongside Whishaw in the play Citizenship written by Mark Ravenhill . It was 1 @,@ "
    '200 km ( 750 mi ) long and 3 @.@ 5 m deep ; " A Moment " was its name , and the actors \' names were kept .',
    "",
    "= Du Fu =",
    "",
    "Du Fu ( Wade – Giles : Tu Fu ; Chinese : 杜甫 ; 712 – 770 ) was a prominent Chinese poet of the Tang dynasty . "
    "Along with Li Bai ( Li Po ) , he is frequently called the greatest of the Chinese poets .",
    "",
    "= = = Early life = = =",
    "",
    "Most of what is known of Du Fu 's life comes from his poems . His grandfather was Du Shenyan , a noted "
    "politician and poet during the reign of Empress Wu .",
    "",
]
WIKITEXT = "".join(f" {line} \n" if line else " \n" for line in WIKITEXT_LINES)

# Model-independent LAMBADA texts (the trainer's eval.lambada_file); the harness comparison adds texts built
# from the model's own greedy predictions (greedy_texts).
LAMBADA = [
    "He looked at the door and then back at the window , and finally he opened the door",
    "import os\nimport sys\n\ndef main():\n    return sys",
    "She gave him the book , the pen and the small red notebook",
    "for index in range(10):\n    print(index)",
    "single",
]

# LAMBADA-format passages with a newline or tab next to the last word, where `text.split(' ')` (the harness)
# and `text.split()` with stripping (Megatron's strict rule) take different targets; the last two are prose.
WHITESPACE_LAMBADA = [
    "import os, sys\nsys",
    "for index in range(10):\n\tprint(index)\n\treturn",
    "def main():\n\treturn value \n\tvalue",
    "if name:\n    raise KeyError(name)\nname",
    "with open(path) as handle:\treturn handle\n",
    "value = 3\t\nvalue",
    "She opened the door and looked out .\nNothing",
    "He gave her the key , the map and\tthe letter",
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({key: text}) + "\n" for text in texts)
    return str(path)


@pytest.fixture(scope="session")
def eval_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_files")
    (root / "wiki.test.tokens").write_text(WIKITEXT, encoding="utf-8")
    return {"wikitext": str(root / "wiki.test.tokens"), "lambada": write_jsonl(root / "lambada.jsonl", LAMBADA)}


@pytest.fixture(scope="session")
def eval_model(tiny_corpus, eval_files, tmp_path_factory):
    """{run_dir, checkpoint (the checkpoints folder), hf (its export)}: trained with eval.* on, so that
    metrics.jsonl holds the trainer's zero-shot figures at iterations 4 and 8."""
    run_dir = str(tmp_path_factory.mktemp("eval_run") / "run")
    args = tiny_train_args(
        tiny_corpus,
        run_dir,
        "train.train_iters=8",
        "model.init_std=0.2",
        "model.max_position_embeddings=64",
        "optim.lr=1e-4",
        "optim.min_lr=1e-5",
        "eval.interval=4",
        f"eval.wikitext_file={eval_files['wikitext']}",
        f"eval.lambada_file={eval_files['lambada']}",
    )
    assert pretrain_gpt.main(["--config", pretrain_gpt.DEFAULT_CONFIG, *args]) == 0
    hf_dir = str(tmp_path_factory.mktemp("eval_hf") / "hf")
    to_hf(os.path.join(run_dir, "checkpoints"), hf_dir)
    return {"run_dir": run_dir, "checkpoint": os.path.join(run_dir, "checkpoints"), "hf": hf_dir, "corpus": tiny_corpus}


def code_contexts(count: int) -> list[str]:
    """Short lines of the standard library (the kind of text the model saw), without their last word."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lines = []
    for name in ("os.py", "abc.py", "glob.py", "shutil.py"):
        with open(os.path.join(stdlib, name), encoding="utf-8") as handle:
            lines += [line.strip() for line in handle if len(line.split()) >= 4 and len(line) < 60]
    contexts = [" ".join(line.split(" ")[:-1]) for line in lines if re.fullmatch(r"[\w.]+", line.split(" ")[-1])]
    return contexts[::3][:count]


def greedy_texts(hf_dir: str, contexts: list[str]) -> tuple[list[str], int, int]:
    """LAMBADA texts built from transformers' greedy predictions on the exported model: (texts, strict, loose):
    `strict` texts end with a word the model predicts token by token (correct under the strict rule), `loose`
    ones with a word whose first token is not the prediction but whose last one is (correct only loose),
    and the rest (the contexts with a fixed word) are whatever the model makes of them."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()

    def argmax(ids):
        with torch.no_grad():
            return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    def word_of(context_ids, pieces):
        text = tokenizer.decode(pieces)
        ok = text.startswith(" ") and re.fullmatch(r"\S+", text[1:] or " ") and tokenizer.encode(text) == pieces
        return (
            text[1:] if ok and tokenizer.encode(tokenizer.decode(context_ids) + text) == context_ids + pieces else None
        )

    space_tokens = [i for i in range(tokenizer.vocab_size) if re.fullmatch(r" [a-z]+", tokenizer.decode([i]))]
    texts, strict, loose = [], 0, 0
    for k, context in enumerate(contexts):
        ids = tokenizer.encode(context)
        first = argmax(ids)
        word = word_of(ids, [first])
        if word is not None:  # extend by a second greedy token when it continues the word
            longer = word_of(ids, [first, argmax(ids + [first])])
            word, strict = longer or word, strict + 1
            texts.append(f"{context} {word}")
        forced = next(t for t in space_tokens[k % 50 :] if t != first)
        word = word_of(ids, [forced, argmax(ids + [forced])])
        if word is not None:
            texts.append(f"{context} {word}")
            loose += 1
        texts.append(f"{context} value")
    return texts, strict, loose


@pytest.fixture(scope="session")
def harness_files(eval_model, eval_files, tmp_path_factory):
    """The LAMBADA file for the harness comparison and local lm_eval task folders over both files
    (lambada_openai's and wikitext's definitions with dataset_path json; wikitext's pages split by the
    wikitext_document_level rule; the harness's own preprocess_wikitext.py copied beside them)."""
    import shutil

    import lm_eval

    from evaluation.documents import split_articles

    root = tmp_path_factory.mktemp("harness")
    texts, strict, loose = greedy_texts(eval_model["hf"], code_contexts(40))
    lambada = write_jsonl(root / "lambada_test.jsonl", texts + LAMBADA[:3] + WHITESPACE_LAMBADA)
    pages = write_jsonl(root / "pages.jsonl", split_articles(WIKITEXT), key="page")
    tasks = root / "tasks"
    tasks.mkdir()
    utils = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "wikitext", "preprocess_wikitext.py")
    shutil.copy(utils, tasks / "preprocess_wikitext.py")
    cache = root / "datasets_cache"
    for name, body in (
        ("local_lambada", LAMBADA_TASK.format(lambada)),
        ("local_wikitext", WIKITEXT_TASK.format(pages)),
    ):
        (tasks / f"{name}.yaml").write_text(f"task: {name}\n" + body.replace("CACHE", str(cache)), encoding="utf-8")
    return {
        "lambada": lambada,
        "tasks": str(tasks),
        "strict": strict,
        "loose": loose,
        "texts": len(texts) + 3 + len(WHITESPACE_LAMBADA),
    }


LAMBADA_TASK = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {}
  cache_dir: CACHE
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

WIKITEXT_TASK = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {}
  cache_dir: CACHE
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="session")
def harness_results(eval_model, harness_files):
    """lm_eval.simple_evaluate over both local tasks with its HuggingFace backend on the exported folder and
    with the ptdp adapter on the checkpoint: {"hf": results, "ptdp": results} (per-sample logs included)."""
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    import evaluation.harness  # noqa: F401  (registers "ptdp")

    manager = TaskManager(include_path=harness_files["tasks"])
    runs = {"hf": f"pretrained={eval_model['hf']},dtype=float32", "ptdp": f"checkpoint={eval_model['checkpoint']}"}
    with pytest.MonkeyPatch.context() as patch:
        # The results' environment record (torch's collect_env: pip list, lscpu, ... ~1.5 CPU s per call) is
        # metadata no test reads.
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda storage: None)
        return {
            name: lm_eval.simple_evaluate(
                model=name,
                model_args=args,
                tasks=["local_lambada", "local_wikitext"],
                task_manager=manager,
                batch_size=4,
                device="cpu",
                log_samples=True,
            )
            for name, args in runs.items()
        }
