"""tools/generate.py: greedy output equals transformers' generate(do_sample=False) on the exported model for 50
new tokens (GPT-2 and Llama style), the same under tensor parallelism (tp2), and the CLI streams the text."""

import argparse
import sys

import pytest
import torch

from checkpoint import save_model_weights
from model.generation import generate_tokens
from operations.startup import DistEnv
from parallel.state import ParallelState
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT, run_ranks
from tests.tools.test_convert_checkpoint import GPT, LLAMA, reference_model, run_config, tokenizer_files  # noqa: F401
from tools.convert_checkpoint import to_hf
from tools.generate import make_logits_fn, prepare

pytestmark = pytest.mark.tier("fast")

PROMPT = "def walk(top, topdown=True):\n    "


def make_checkpoint(style: dict, tokenizer: dict, root: str) -> None:
    config = run_config({**style, "max_position_embeddings": 128}, tokenizer)
    save_model_weights(root, 3, [reference_model(config)], ParallelState.single(), config)


def greedy_tokens(checkpoint: str, env: DistEnv, max_new_tokens: int = 50) -> list[int]:
    args = argparse.Namespace(
        checkpoint=checkpoint,
        greedy=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        max_new_tokens=max_new_tokens,
        dtype="fp32",
    )
    model, cfg, state, tokenizer, sampling = prepare(args, env)
    return list(
        generate_tokens(
            make_logits_fn(model, cfg, state),
            tokenizer.encode(PROMPT),
            max_new_tokens,
            sampling,
            tokenizer.eod,
            env.device,
            max_length=cfg.max_positions,
        )
    )


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_greedy_equals_transformers_generate(style, tokenizer_files, tmp_path):  # noqa: F811
    import transformers

    make_checkpoint(GPT if style == "gpt" else LLAMA, tokenizer_files, str(tmp_path / "ckpt"))
    to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = hf_model.generate(prompt, do_sample=False, max_new_tokens=50, min_new_tokens=50)[0, prompt.shape[1] :]
    env = DistEnv(1, 0, 0, 1, torch.device("cpu"))
    ours = greedy_tokens(str(tmp_path / "ckpt"), env)
    assert len(ours) == 50 and ours == theirs.tolist()  # (no end-of-document token among them here)
    assert greedy_tokens(str(tmp_path / "hf"), env) == ours  # a transformers folder loads through from-hf


def _tp_greedy(rank, world_size, checkpoint, out_file):
    tokens = greedy_tokens(checkpoint, DistEnv(world_size, rank, rank, world_size, torch.device("cpu")), 20)
    if rank == 0:
        torch.save(tokens, out_file)


def test_tensor_parallel_generation_and_the_cli(tokenizer_files, tmp_path):  # noqa: F811
    make_checkpoint(LLAMA, tokenizer_files, str(tmp_path / "ckpt"))
    single = greedy_tokens(str(tmp_path / "ckpt"), DistEnv(1, 0, 0, 1, torch.device("cpu")), 20)
    run_ranks(2, _tp_greedy, str(tmp_path / "ckpt"), str(tmp_path / "tokens.pt"))
    assert torch.load(tmp_path / "tokens.pt") == single
    result = run_cli(
        [
            sys.executable,
            "tools/generate.py",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--greedy",
            "--max-new-tokens",
            "20",
        ],
        input=PROMPT,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    from data.tokenizers import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(tokenizer_files["vocab_file"], tokenizer_files["merge_file"])
    assert result.stdout == PROMPT + tokenizer.decode(single) + "\n"
    assert (
        "tokens/s" in result.stderr and f"loaded iteration 3 of {tmp_path / 'ckpt' / 'iter_0000003'}" in result.stderr
    )
    bad = run_cli(  # stdin: /dev/null
        [sys.executable, "tools/generate.py", "--checkpoint", str(tmp_path / "ckpt"), "--top-p", "0"], cwd=REPO_ROOT
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --top-p=0.0 must be in (0, 1]"]


# A Mixture-of-Experts model (model/moe/): 4 experts, top-2, a shared expert.
MOE = dict(GPT, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_shared_expert_ffn_hidden_size=64)


def test_moe_generation_with_the_kv_cache_equals_recomputing_the_sequence(tokenizer_files, tmp_path):  # noqa: F811
    """A saved MoE model generates through tools/generate.py (router in eval mode: no auxiliary losses): with
    the KV cache each new token is routed alone, and the tokens equal greedy decoding that re-runs the whole
    sequence every step; under tp2 the same tokens come out."""
    make_checkpoint(MOE, tokenizer_files, str(tmp_path / "ckpt"))
    env = DistEnv(1, 0, 0, 1, torch.device("cpu"))
    cached = greedy_tokens(str(tmp_path / "ckpt"), env, 20)
    config = run_config({**MOE, "max_position_embeddings": 128}, tokenizer_files)
    model = reference_model(config)
    from data.tokenizers import GPT2BPETokenizer

    tokens = GPT2BPETokenizer(tokenizer_files["vocab_file"], tokenizer_files["merge_file"]).encode(PROMPT)
    recomputed = []
    with torch.no_grad():
        for _ in range(20):
            ids = torch.tensor([tokens + recomputed])
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
            recomputed.append(int(logits[0, -1, :300].argmax()))
    assert cached == recomputed
    assert all(moe.router.last_losses == {} for _, moe in model.moe_layers())
    run_ranks(2, _tp_greedy, str(tmp_path / "ckpt"), str(tmp_path / "tokens.pt"))
    assert torch.load(tmp_path / "tokens.pt") == cached
