"""Convert checkpoints: ours <-> HuggingFace transformers, ours <-> Megatron-LM, any layout -> one file.

A CHECKPOINT is a checkpoints folder (its latest complete iteration) or one iter_XXXXXXX folder in it.

examples:
  python tools/convert_checkpoint.py to-hf runs/gpt_tiny/checkpoints hf/gpt_tiny --dtype bf16
  python tools/convert_checkpoint.py from-hf hf/llama ckpt/llama --tp 2 --pp 2
  python tools/convert_checkpoint.py from-megatron /data/megatron/gpt_345m/checkpoints ckpt/gpt_345m
  python tools/convert_checkpoint.py to-megatron runs/gpt_tiny/checkpoints megatron/gpt_tiny --tp 2 --pp 2
  python tools/convert_checkpoint.py consolidate runs/gpt_tiny/checkpoints gpt_tiny.pt

to-hf writes GPT-2 style models as GPT2LMHeadModel, Llama style ones as LlamaForCausalLM and Llama style MoE
models as MixtralForCausalLM, Qwen2MoeForCausalLM (a gated shared expert) or OlmoeForCausalLM (q/k norm), with the run's
tokenizer (AutoTokenizer.from_pretrained(OUT_DIR) works). from-hf and from-megatron write a weights-only
checkpoint and OUT_CHECKPOINT/config.yaml (model, tokenizer and layout sections; the tokenizer files are
copied into OUT_CHECKPOINT/tokenizer/ and named relative to it, so the folder can be moved) for fine-tuning:
  python pretrain_gpt.py --config ckpt/llama/config.yaml checkpoint.finetune=ckpt/llama \
      data.data_path=[data/my_text_document]
to-megatron writes Megatron-LM's legacy torch format (weights, args; docs/conversion.md says what each
direction carries). Bad input is one line on stderr and exit status 2; nothing is left half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys

import torch
import yaml

from checkpoint import TRACKER, CheckpointError
from config.schema import PRECISIONS, Config, ConfigError, DataConfig, config_from_dict
from convert.hf_folder import (
    HFFolderError,
    check_tokenizer_files,
    hf_model_config,
    hf_tokenizer_json,
    parse_size,
    sentencepiece_normalizer,
    write_tokenizer,
    write_weights,
)
from convert.hf_mapping import (
    UnsupportedModelError,
    hf_config,
    to_hf_state_dict,
)
from convert.megatron import load_megatron_checkpoint
from convert.megatron_export import megatron_files
from convert.model_weights import check_finite, check_layout, save_global_state
from convert.open_model import ModelSource, global_state
from convert.staging import Stopped, check_output_free, staged_file, staged_folder
from model.config import ModelConfig
from model.precision import precision_dtype

TOKENIZER_DIR = "tokenizer"  # OUT/tokenizer/: the copied tokenizer files of from-hf / from-megatron
INPUT_ERRORS = (ValueError, OSError, CheckpointError, HFFolderError, UnsupportedModelError, ConfigError)


def model_config_of(config: dict) -> ModelConfig:
    """The model section of a saved run config."""
    return config_from_dict(config).model


def refuse_experts(cfg: ModelConfig, command: str) -> None:
    """Refuse a Mixture-of-Experts model where `command` writes a format its mapping holds no experts for (it
    would drop every MoE layer's weights and write a model that is not this one): Megatron-LM's, for now."""
    if cfg.num_experts:
        raise UnsupportedModelError(
            f"model.num_experts={cfg.num_experts}: {command} maps dense models only (no MoE layers yet); "
            "`consolidate` writes this checkpoint as one file"
        )


# ---- to-hf -----------------------------------------------------------------------------------------
def to_hf(checkpoint: str, out_dir: str, dtype: str = "fp32", max_shard_size: str = "5GB") -> list[str]:
    """Export a checkpoint of any layout to a transformers folder; returns the files written."""
    max_bytes = parse_size(max_shard_size)
    check_output_free(out_dir)
    source = ModelSource.checkpoint(checkpoint)
    config, tensors = global_state(source)
    print(f"loaded {source.describe()}")
    cfg = model_config_of(config)  # an MoE model the transformers families cannot express: hf_architecture refuses
    warn_about_normalization(config["data"])
    torch_dtype = precision_dtype(dtype)
    hf_tensors = {k: v.to(torch_dtype) for k, v in to_hf_state_dict(cfg, tensors).items()}
    with staged_folder(out_dir) as tmp:
        ids = export_tokenizer(tmp, config["data"], cfg)
        files = write_weights(tmp, hf_tensors, max_bytes)
        hf = {**hf_config(cfg, ids["bos"], ids["eos"]), "dtype": str(torch_dtype).removeprefix("torch.")}
        _write_json(os.path.join(tmp, "config.json"), hf)
        _write_json(
            os.path.join(tmp, "generation_config.json"), {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}
        )
    return files


def export_tokenizer(folder: str, data: dict, cfg: ModelConfig) -> dict:
    """The run's tokenizer into the transformers folder; {bos, eos} ids. A run without tokenizer files (a
    Megatron NullTokenizer, a tokenizer this project does not read) exports weights and config only."""
    kind = data.get("tokenizer_type")
    if kind == "NullTokenizer":
        print(
            "warning: the checkpoint's tokenizer is NullTokenizer (text = ids, no files): writing weights and "
            "config.json without a tokenizer",
            file=sys.stderr,
        )
        return {"bos": None, "eos": None}
    files = ("vocab_file", "merge_file") if kind == "GPT2BPETokenizer" else ("tokenizer_model",)
    if not all(data.get(key) for key in files):
        print(
            f"warning: the checkpoint names no tokenizer files ({data.get('tokenizer_type')} without "
            f"{' / '.join(files)}): writing weights and config.json without a tokenizer",
            file=sys.stderr,
        )
        return {"bos": None, "eos": None}
    return write_tokenizer(folder, data, cfg.vocab_size, cfg.max_positions)


def warn_about_normalization(data: dict) -> None:
    """transformers' LlamaTokenizer applies no SentencePiece normalization: say so when the model has one."""
    if data.get("tokenizer_type") == "SentencePieceTokenizer":
        rule = sentencepiece_normalizer(data["tokenizer_model"])
        if rule != "identity":
            print(
                f"warning: {data['tokenizer_model']} normalizes text ({rule!r}); transformers' LlamaTokenizer "
                "does not, so its ids can differ on such text (e.g. runs of whitespace)",
                file=sys.stderr,
            )


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2)


# ---- from-hf / from-megatron -----------------------------------------------------------------------
def layout_section(cfg: ModelConfig, tp: int, pp: int, vp: int) -> dict:
    """The parallel section for the asked layout, checked against the model by the trainer's rules (one line
    naming both values when it cannot split the model)."""
    return Config(model=cfg, parallel=check_layout(cfg, tp, pp, vp)).to_dict()["parallel"]


def write_our_checkpoint(out: str, cfg: ModelConfig, tensors: dict, data: dict | None, parallel: dict) -> str:
    """Weights-only checkpoint (iteration 0) plus out/config.yaml, written aside then renamed."""
    with staged_folder(out) as tmp:
        sections = Config(model=cfg).to_dict()
        sections["parallel"] = parallel
        if data is not None:
            sections["data"] = {**DataConfig().__dict__, **copy_tokenizer_files(data, tmp)}
        save_global_state(tmp, 0, sections, tensors)
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as handle:
            yaml.safe_dump(
                {k: sections[k] for k in ("model", "parallel", "data") if k in sections}, handle, sort_keys=False
            )
    return out


def copy_tokenizer_files(data: dict, root: str) -> dict:
    """The tokenizer keys with each file copied into root/tokenizer/ and named relative to root
    ("tokenizer/vocab.json"), so the checkpoint folder can be moved: its readers resolve them against the
    checkpoint root (convert/model_weights.py) and load_config against config.yaml's folder. A HuggingFace
    tokenizer.json takes its tokenizer_config.json (the end of document) along."""
    data = dict(data)
    hf = data.get("tokenizer_type") == "HuggingFaceTokenizer"
    for key in DataConfig.FILE_KEYS:
        path = hf_tokenizer_json(data.get(key)) if hf else data.get(key)
        if not path:
            continue
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        os.makedirs(os.path.join(root, TOKENIZER_DIR), exist_ok=True)
        for source in [path, config] if hf and os.path.isfile(config) else [path]:
            shutil.copyfile(source, os.path.join(root, TOKENIZER_DIR, os.path.basename(source)))
        data[key] = os.path.join(TOKENIZER_DIR, os.path.basename(path))
    return data


def from_hf(hf_dir: str, out: str, tp: int = 1, pp: int = 1, vp: int = 1) -> str:
    """A transformers GPT-2, Llama, Mixtral, Qwen2-MoE or OLMoE folder -> our checkpoint (and config.yaml) at
    the asked layout. The config, the weights and the tokenizer files are checked against each other before
    anything is written."""
    check_output_free(out)  # before reading the weights
    cfg = hf_model_config(hf_dir)
    parallel = layout_section(cfg, tp, pp, vp)  # before reading the weights too
    config, tensors = global_state(ModelSource(hf_dir=hf_dir), cfg)
    data = config["data"]
    if data is not None:
        check_tokenizer_files(data, cfg.vocab_size or 0)
    return write_our_checkpoint(out, cfg, tensors, data, parallel)


def from_megatron(megatron_dir: str, out: str, tp: int = 1, pp: int = 1, vp: int = 1) -> str:
    """A Megatron-LM torch-format GPT checkpoint (legacy or megatron-core names, any tp/pp) -> ours."""
    check_output_free(out)  # before reading the weights
    cfg, tensors, data = load_megatron_checkpoint(megatron_dir)
    check_finite(tensors, megatron_dir)
    parallel = layout_section(cfg, tp, pp, vp)
    if data is not None:
        check_tokenizer_files(data, cfg.vocab_size or 0)
    else:
        print(
            f"warning: {megatron_dir} names no tokenizer this project reads (files on this machine, or "
            f"NullTokenizer with args.vocab_size); only the vocabulary size "
            f"({cfg.vocab_size}) is carried: set data.tokenizer_type and its files before training",
            file=sys.stderr,
        )
    return write_our_checkpoint(out, cfg, tensors, data, parallel)


def to_megatron(checkpoint: str, out: str, tp: int = 1, pp: int = 1, vp: int = 1) -> str:
    """Our checkpoint (any layout) -> Megatron-LM's legacy torch format at (tp, pp, vp), weights only, with
    the iteration it was saved at."""
    check_output_free(out)  # before reading the weights
    source = ModelSource.checkpoint(checkpoint)
    config, tensors = global_state(source)
    iteration = source.iteration
    assert iteration is not None  # a checkpoint's source has one
    print(f"loaded {source.describe()}")
    cfg = model_config_of(config)
    refuse_experts(cfg, "to-megatron")
    files = megatron_files(tensors, cfg, (tp, pp, vp), iteration, config["data"])
    with staged_folder(out) as tmp:
        for relative, payload in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, relative)), exist_ok=True)
            torch.save(payload, os.path.join(tmp, relative))
        with open(os.path.join(tmp, TRACKER), "w", encoding="utf-8") as handle:
            handle.write(f"{iteration}\n")
    return out


# ---- consolidate -----------------------------------------------------------------------------------
def consolidate(checkpoint: str, out_file: str) -> str:
    """One torch file {"config": run config, "model": global state dict} from a checkpoint of any layout."""
    config, tensors = global_state(ModelSource.checkpoint(checkpoint))
    if os.path.isdir(out_file):
        raise ValueError(f"output {out_file} is a folder; give a file name such as model.pt")
    tensors = {name: t.clone() for name, t in tensors.items()}  # the tied output shares no storage then
    with staged_file(out_file) as tmp:
        torch.save({"config": config, "model": tensors}, tmp)
    return out_file


# ---- command line ----------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="our checkpoint -> transformers folder")
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=PRECISIONS, default="fp32")
    p.add_argument("--max-shard-size", default="5GB", help="shard safetensors above this size (default 5GB)")
    for name, source, out, what in (
        ("from-hf", "hf_dir", "out_checkpoint", "transformers folder -> our checkpoint"),
        ("from-megatron", "megatron_dir", "out_checkpoint", "Megatron-LM checkpoint (torch, torch_dist) -> ours"),
        ("to-megatron", "checkpoint", "out_dir", "our checkpoint -> Megatron-LM torch format"),
    ):
        p = sub.add_parser(name, help=f"{what} at the asked layout")
        p.add_argument(source)
        p.add_argument(out)
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--vp", type=int, default=1)
    p = sub.add_parser("consolidate", help="checkpoint of any layout -> one .pt with the full model")
    p.add_argument("checkpoint")
    p.add_argument("out_file")
    return parser.parse_args(argv)


def check_layout_flags(args: argparse.Namespace) -> None:
    """--tp / --pp / --vp below 1 named as the flag the user typed (the trainer's rules check the rest)."""
    for flag in ("tp", "pp", "vp"):
        value = getattr(args, flag, 1)
        if value < 1:
            raise ValueError(f"--{flag} {value}: a parallel size must be >= 1")


def run(args: argparse.Namespace) -> None:
    """The conversion `args.command` names."""
    if args.command == "to-hf":
        to_hf(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size)
        print(f"wrote {args.out_dir}")
    elif args.command == "from-hf":
        print(f"wrote {from_hf(args.hf_dir, args.out_checkpoint, args.tp, args.pp, args.vp)}")
    elif args.command == "from-megatron":
        print(f"wrote {from_megatron(args.megatron_dir, args.out_checkpoint, args.tp, args.pp, args.vp)}")
    elif args.command == "to-megatron":
        print(f"wrote {to_megatron(args.checkpoint, args.out_dir, args.tp, args.pp, args.vp)}")
    else:
        print(f"wrote {consolidate(args.checkpoint, args.out_file)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = getattr(args, "out_dir", None) or getattr(args, "out_checkpoint", None) or args.out_file
    try:
        check_layout_flags(args)
        run(args)
    except INPUT_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as stop:
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        print(
            f"stopped by {signal.Signals(signum).name}: {out} was not written (nothing half-written left)",
            file=sys.stderr,
        )
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
