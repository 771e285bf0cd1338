"""tools/convert_checkpoint.py: export of checkpoints saved at tp2 x pp2 and pp2 x vp2 to transformers (same
logits, no missing/unexpected keys, AutoTokenizer works), sharding and dtypes, HF -> ours -> HF bitwise,
consolidate, and bad input (one line, exit 2, no OUT_DIR left)."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

from checkpoint import save_model_weights
from config.schema import Config, DataConfig, ParallelConfig
from convert.model_weights import load_global_state
from model.config import ModelConfig
from parallel.model_builder import build_model_chunks
from parallel.state import ParallelState
from tests.cli_runner import run_cli
from tests.conftest import REPO_ROOT, run_ranks
from tests.tiny_models import STYLES, tiny_config, tiny_hf_config
from tools.convert_checkpoint import consolidate, from_hf, to_hf, to_megatron

pytestmark = pytest.mark.tier("fast")

# The converters' models, as overrides of tests/tiny_models.py's tiny GPT (run_config builds them from it)
GPT = dict(num_layers=4, hidden_size=64, seq_length=32, init_std=0.1)
LLAMA = dict(GPT, **STYLES["llama"], rotary_base=500.0)
SEED = 5


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A 300-entry byte-level BPE (padded to 384 rows by the model) trained on a few stdlib files."""
    from data.tokenizer_training import train_gpt2_bpe

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(stdlib, name), encoding="utf-8").read() for name in ("os.py", "abc.py", "glob.py")]
    vocab, merges = train_gpt2_bpe(texts, 300, str(tmp_path_factory.mktemp("tokenizer")))
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}


def run_config(style: dict, tokenizer: dict, tp=1, pp=1, vp=1, vocab_size=300) -> dict:
    return Config(
        model=tiny_config(vocab_size=vocab_size, **style),
        parallel=ParallelConfig(tp_size=tp, pp_size=pp, vp_size=vp),
        data=DataConfig(**tokenizer),
    ).to_dict()


def _save_at_layout(rank, world_size, config, root):
    par = config["parallel"]
    state = ParallelState.create(par["tp_size"], par["pp_size"], par["vp_size"])
    chunks = build_model_chunks(ModelConfig(**config["model"]), state, SEED, torch.device("cpu"), torch.float32)
    save_model_weights(root, 3, chunks, state, config)


def reference_model(config: dict):
    """The single-process model every layout builds (init is layout-independent)."""
    return build_model_chunks(
        ModelConfig(**config["model"]), ParallelState.single(), SEED, torch.device("cpu"), torch.float32
    )[0].eval()


TOKENS = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(
    "style,layout",
    [("gpt", (2, 2, 1)), ("llama", (2, 2, 1)), ("llama", (1, 2, 2))],
    ids=["gpt-tp2pp2", "llama-tp2pp2", "llama-pp2vp2"],
)
def test_export_of_a_parallel_checkpoint_gives_our_logits_in_transformers(style, layout, tokenizer_files, tmp_path):
    import transformers

    tp, pp, vp = layout
    config = run_config(GPT if style == "gpt" else LLAMA, tokenizer_files, tp, pp, vp)
    run_ranks(tp * pp, _save_at_layout, config, str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    to_hf(str(tmp_path / "ckpt"), str(out))
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(hf_model).__name__ == ("GPT2LMHeadModel" if style == "gpt" else "LlamaForCausalLM")
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        theirs = hf_model.eval()(TOKENS).logits
        ours = reference_model(config)(TOKENS, torch.arange(20).expand(2, 20))[..., :300]
    assert theirs.shape[-1] == 300  # padding rows dropped
    assert (ours - theirs).abs().max().item() <= 1e-4 * (theirs.max() - theirs.min()).item()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    from data.tokenizers import GPT2BPETokenizer

    text = open(os.path.join(sysconfig.get_paths()["stdlib"], "glob.py"), encoding="utf-8").read()[:2000]
    assert tokenizer.encode(text) == GPT2BPETokenizer(
        tokenizer_files["vocab_file"], tokenizer_files["merge_file"]
    ).encode(text)


def save_single(config: dict, root: str) -> None:
    save_model_weights(root, 3, [reference_model(config)], ParallelState.single(), config)


def test_sharded_bf16_export_and_round_trips(tokenizer_files, tmp_path):
    import transformers
    from safetensors.torch import load_file

    config = run_config(LLAMA, tokenizer_files)
    save_single(config, str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    result = run_tool("to-hf", str(tmp_path / "ckpt"), str(out), "--dtype", "bf16", "--max-shard-size", "100KB")
    assert result.returncode == 0, result.stderr
    assert f"loaded iteration 3 of {tmp_path / 'ckpt' / 'iter_0000003'}" in result.stdout
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    loaded = [load_file(out / name) for name in shards]
    assert len(shards) > 3 and all(
        len(shard) == 1 or sum(t.nbytes for t in shard.values()) <= 100_000 for shard in loaded
    )  # a tensor larger than the limit goes alone
    exported = {k: v for shard in loaded for k, v in shard.items()}
    assert all(v.dtype == torch.bfloat16 for v in exported.values())
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16
    # HF -> ours -> HF through the files: bitwise
    from_hf(str(out), str(tmp_path / "back"), tp=2, pp=2)
    to_hf(str(tmp_path / "back"), str(tmp_path / "hf2"), dtype="bf16")
    again = load_file(tmp_path / "hf2" / "model.safetensors")
    assert set(again) == set(exported) and all(torch.equal(again[k], exported[k]) for k in again)
    # to-megatron carries the GPT-2 BPE files in Megatron's args; from-megatron reads them back
    to_megatron(str(tmp_path / "back"), str(tmp_path / "megatron"), tp=2, pp=2)
    from convert.megatron import load_megatron_checkpoint

    _, megatron_tensors, data = load_megatron_checkpoint(str(tmp_path / "megatron"))
    assert data["tokenizer_type"] == "GPT2BPETokenizer" and os.path.isfile(data["vocab_file"])
    _, back_tensors = load_global_state(str(tmp_path / "back"))
    assert torch.equal(
        megatron_tensors["embedding.word_embeddings.weight"][:300],
        back_tensors["embedding.word_embeddings.weight"][:300],
    )
    # consolidate: the full model under global names
    consolidate(str(tmp_path / "back"), str(tmp_path / "model.pt"))
    whole = torch.load(tmp_path / "model.pt", weights_only=True)
    assert whole["config"]["parallel"]["tp_size"] == 2
    assert torch.equal(
        whole["model"]["layers.3.mlp.fc2.weight"],
        reference_model(config).state_dict()["layers.3.mlp.fc2.weight"].to(torch.bfloat16).float(),
    )


def test_from_hf_of_a_transformers_save_round_trips_bitwise(tmp_path):
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = tiny_hf_config("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), tp=2)
    assert "tp_size: 2" in (tmp_path / "ours" / "config.yaml").read_text()
    original = load_file(tmp_path / "hf" / "model.safetensors")
    # no tokenizer in that folder: to-hf needs one, so compare the global state instead
    _, ours = load_global_state(str(tmp_path / "ours"))
    from convert.hf_mapping import model_config_from_hf, to_hf_state_dict

    back = to_hf_state_dict(model_config_from_hf(config.to_dict()), ours)
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in back)


def test_gpt2_gelu_new_converts_with_transformers_logits_and_exports_back(tmp_path):
    """GPT-2's default activation (gelu_new, the tanh GeLU) -> model.activation=gelu_tanh: same logits, it
    trains, and to-hf (no tokenizer files here: weights and config with a warning) keeps gelu_new, bitwise."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = tiny_hf_config("gpt2")
    assert config.activation_function == "gelu_new"
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), tp=2)
    saved, tensors = load_global_state(str(tmp_path / "ours"))
    assert saved["model"]["activation"] == "gelu_tanh"
    from config.schema import config_from_dict
    from convert.model_weights import build_model_from_state

    model = build_model_from_state(config_from_dict(saved).model, tensors)
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
        ours = model(TOKENS, torch.arange(20).expand(2, 20))[..., :300]
    assert (ours - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())
    model.train()
    model(TOKENS, torch.arange(20).expand(2, 20)).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    result = run_tool("to-hf", str(tmp_path / "ours"), str(tmp_path / "back"))
    assert result.returncode == 0 and result.stderr.startswith("warning: the checkpoint names no tokenizer files")
    assert json.load(open(tmp_path / "back" / "config.json"))["activation_function"] == "gelu_new"
    original, back = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert all(torch.equal(back[k], original[k]) for k in back) and set(original) - set(back) <= {"lm_head.weight"}


def test_from_hf_refuses_non_finite_weights(tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"][3, 5] = float("nan")
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    out = str(tmp_path / "out")
    assert_refused(
        run_tool("from-hf", str(tmp_path / "hf"), out),
        f"{tmp_path / 'hf'}: tensor layers.0.mlp.fc1.weight holds non-finite values (NaN or inf): these weights "
        "are broken (a diverged run or a bad export); use another checkpoint or model",
        out,
    )


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return run_cli([sys.executable, "tools/convert_checkpoint.py", *args], cwd=REPO_ROOT)


def assert_refused(result: subprocess.CompletedProcess, message: str, out) -> None:
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {message}"]
    assert not os.path.exists(out) and not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tokenizer_files, tmp_path):
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "out")
    assert_refused(
        run_tool("from-hf", str(tmp_path / "empty"), out),
        f"{tmp_path / 'empty'} is not a transformers model folder: no config.json",
        out,
    )
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert_refused(
        run_tool("from-hf", str(tmp_path / "bert"), out),
        "model_type='bert' (architectures ['BertModel']) is not supported: only gpt2, llama, mixtral, qwen2_moe, olmoe",
        out,
    )
    assert_refused(
        run_tool("to-hf", str(tmp_path / "empty"), out),
        f"{tmp_path / 'empty'} holds no complete checkpoint (no tracker, no verifying iter_* folder)",
        out,
    )
    config = run_config(GPT, tokenizer_files)
    save_single(config, str(tmp_path / "ckpt"))
    config["model"]["vocab_size"] = 320  # the model claims more entries than its tokenizer has
    save_single(config, str(tmp_path / "ckpt320"))
    assert_refused(
        run_tool("to-hf", str(tmp_path / "ckpt320"), out),
        f"tokenizer {tokenizer_files['vocab_file']} has 300 entries but the model's vocabulary is model.vocab_size=320",
        out,
    )
    assert_refused(
        run_tool("from-hf", str(tmp_path / "bert"), out, "--tp", "3"),
        "model_type='bert' (architectures ['BertModel']) is not supported: only gpt2, llama, mixtral, qwen2_moe, olmoe",
        out,
    )


def test_sentencepiece_tokenizer_exports_for_autotokenizer(tmp_path):
    import sentencepiece
    import transformers

    from data.tokenizers import SentencePieceTokenizer

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(stdlib, name), encoding="utf-8").read() for name in ("os.py", "abc.py", "glob.py")]
    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(  # Llama's settings: no normalization, byte fallback
        sentence_iterator=iter([line for text in texts for line in text.splitlines() if line]),
        model_prefix=prefix,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    tokenizer = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": prefix + ".model"}
    config = run_config(LLAMA, tokenizer, vocab_size=400)
    save_single(config, str(tmp_path / "ckpt"))
    result = run_tool("to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = texts[2][:3000] + "\n\n   héllo 世界"
    ours = SentencePieceTokenizer(prefix + ".model")
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf_tokenizer.eos_token_id == ours.eod == 2


def test_moe_checkpoints_no_export_expresses_are_refused_and_consolidate_whole(tokenizer_files, tmp_path):
    """A GPT-style MoE checkpoint: to-hf refuses it (transformers' MoE families are Llama style;
    tests/tools/test_convert_moe_hf.py converts those) and to-megatron maps no experts yet, each with one line
    naming the key and nothing written (they would drop every MoE layer); consolidate keeps the stacked
    experts [E, f, h]."""
    from convert.hf_mapping import UnsupportedModelError

    config = run_config(dict(GPT, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64), tokenizer_files)
    save_model_weights(str(tmp_path / "ckpt"), 3, [reference_model(config)], ParallelState.single(), config)
    refusals = (
        (to_hf, tmp_path / "hf", r"^model.num_experts=4 with position_embedding_type=learned, "),
        (to_megatron, tmp_path / "megatron", r"^model.num_experts=4: to-megatron maps dense"),
    )
    for export, out, message in refusals:
        with pytest.raises(UnsupportedModelError, match=message) as error:
            export(str(tmp_path / "ckpt"), str(out))
        assert "\n" not in str(error.value) and not out.exists()
    whole = torch.load(consolidate(str(tmp_path / "ckpt"), str(tmp_path / "model.pt")), weights_only=False)
    assert whole["model"]["layers.0.mlp.experts.fc1_weight"].shape == (4, 64, 64)
