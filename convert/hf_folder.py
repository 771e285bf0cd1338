"""transformers model folders on disk: config.json, safetensors weights (sharded with an index above a size),
tokenizer files. Writing goes to a folder beside OUT_DIR, renamed into place at the end, so a failure
leaves no partial OUT_DIR. Reading accepts model.safetensors, a sharded safetensors index or
pytorch_model.bin (read with weights_only=True).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from data.atomic_files import honour_umask
from data.tokenizers import EOD_TOKEN
from training.checkpoint.files import CheckpointError
from training.checkpoint.safe_reader import load_weights_file

Tensors = dict[str, torch.Tensor]
SAFE_INDEX = "model.safetensors.index.json"
HF_TOKENIZER = "tokenizer.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class HFFolderError(ValueError):
    """A folder that is not a usable transformers model; the message names the file."""


def parse_size(text: str) -> int:
    """'5GB', '500MB', '10KiB' or a byte count -> bytes (transformers' convention: GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"--max-shard-size={text!r} is not a size like 5GB, 500MB or 1000000")
    number, unit = float(match.group(1)), match.group(2) or "B"
    powers = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(number * powers[unit])


def shard_tensors(tensors: Tensors, max_shard_bytes: int) -> list[Tensors]:
    """Split tensors (in name order) into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[Tensors] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def write_weights(folder: str, tensors: Tensors, max_shard_bytes: int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        honour_umask(os.path.join(folder, name))  # safetensors creates its files 0600 whatever the umask
        weight_map.update({key: name for key in shard})
    if len(shards) == 1:
        return names
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, SAFE_INDEX), "w", encoding="utf-8") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, handle, indent=2)
    return names + [SAFE_INDEX]


def hf_tokenizer_json(path: str | None) -> str | None:
    """The tokenizer.json a HuggingFace tokenizer path names (the file, or inside the folder), or None."""
    if path and os.path.isdir(path):
        path = os.path.join(path, HF_TOKENIZER)
    return path if path and os.path.isfile(path) else None


def write_tokenizer(folder: str, data: dict[str, Any], vocab_size: int | None, max_length: int) -> dict[str, int]:
    """Copy the run's tokenizer files with a tokenizer_config.json for AutoTokenizer; returns bos/eos ids.
    Refuses (ValueError) a tokenizer whose vocabulary size differs from the model's."""
    from data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(
        data["tokenizer_type"],
        vocab_file=data.get("vocab_file"),
        merge_file=data.get("merge_file"),
        tokenizer_model=data.get("tokenizer_model"),
        vocab_size=vocab_size,
    )
    if tokenizer.vocab_size != vocab_size:
        source = data.get("vocab_file") or data.get("tokenizer_model")
        raise ValueError(
            f"tokenizer {source} has {tokenizer.vocab_size} entries but the model's vocabulary is "
            f"model.vocab_size={vocab_size}"
        )
    if data["tokenizer_type"] == "GPT2BPETokenizer":
        shutil.copyfile(data["vocab_file"], os.path.join(folder, "vocab.json"))
        shutil.copyfile(data["merge_file"], os.path.join(folder, "merges.txt"))
        special = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}
        config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, **special}
        ids = {"bos": tokenizer.eod, "eos": tokenizer.eod}
    elif data["tokenizer_type"] == "HuggingFaceTokenizer":
        return _write_hf_tokenizer(folder, tokenizer, max_length)
    else:
        shutil.copyfile(data["tokenizer_model"], os.path.join(folder, "tokenizer.model"))
        sp = tokenizer.sp
        special = {"eos_token": sp.id_to_piece(sp.eos_id())}
        if sp.bos_id() >= 0:
            special["bos_token"] = sp.id_to_piece(sp.bos_id())
        if sp.unk_id() >= 0:
            special["unk_token"] = sp.id_to_piece(sp.unk_id())
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            **special,
        }
        ids = {"bos": sp.bos_id() if sp.bos_id() >= 0 else sp.eos_id(), "eos": sp.eos_id()}
    config["model_max_length"] = max_length
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as handle:
        json.dump(special, handle, indent=2)
    return ids


def _write_hf_tokenizer(folder: str, tokenizer: Any, max_length: int) -> dict[str, int]:
    """tokenizer.json, and its tokenizer_config.json when it has one (else a minimal one naming the end of
    document as bos and eos, as documents here are separated by eod only); bos/eos ids = the eod."""
    shutil.copyfile(tokenizer.path, os.path.join(folder, HF_TOKENIZER))
    beside = os.path.join(os.path.dirname(tokenizer.path), "tokenizer_config.json")
    if os.path.isfile(beside):
        shutil.copyfile(beside, os.path.join(folder, "tokenizer_config.json"))
    else:
        eod = tokenizer.tokenizer.id_to_token(tokenizer.eod)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod, "eos_token": eod}
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
            json.dump({**config, "model_max_length": max_length}, handle, indent=2)
    return {"bos": tokenizer.eod, "eos": tokenizer.eod}


@contextlib.contextmanager
def staged_folder(out_dir: str) -> Iterator[str]:
    """A folder beside out_dir to write the output into: renamed onto out_dir when the block completes,
    removed when it fails, so out_dir is never half-written (out_dir must be absent or an empty folder)."""
    check_output_free(out_dir)
    tmp = f"{os.path.normpath(out_dir)}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    try:
        yield tmp
        publish_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_folder(tmp: str, out_dir: str) -> None:
    """Rename the finished folder into place (OUT_DIR absent or an empty folder)."""
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)


def check_output_free(out_dir: str) -> None:
    """Refuse to write over an existing non-empty folder or a file (one line, the path)."""
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise ValueError(f"output {out_dir} already exists and is not an empty folder")


# ---- reading ---------------------------------------------------------------------------------------
def read_config(folder: str) -> dict[str, Any]:
    """config.json of a transformers folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFFolderError(f"{folder} is not a transformers model folder: no config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise HFFolderError(f"{path} cannot be read as JSON: {err}") from None


def read_weights(folder: str) -> Tensors:
    """Every tensor of a transformers folder (safetensors, sharded safetensors or pytorch_model.bin)."""
    from safetensors.torch import load_file

    single, index = os.path.join(folder, "model.safetensors"), os.path.join(folder, SAFE_INDEX)
    try:
        if os.path.isfile(single):
            return load_file(single)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
            tensors: Tensors = {}
            for name in files:
                tensors.update(load_file(os.path.join(folder, name)))
            return tensors
        legacy = os.path.join(folder, "pytorch_model.bin")
        if os.path.isfile(legacy):
            return load_weights_file(legacy)  # weights only; a refusal names the file and the global
    except CheckpointError:
        raise
    except Exception as err:  # safetensors errors have many types; name the folder
        raise HFFolderError(f"weights in {folder} cannot be read: {str(err).splitlines()[0]}") from None
    raise HFFolderError(f"{folder} holds no weights (model.safetensors, {SAFE_INDEX} or pytorch_model.bin)")


def tokenizer_section(folder: str) -> dict[str, Any] | None:
    """Our data-section tokenizer keys for the tokenizer files of a transformers folder (vocab.json +
    merges.txt, else tokenizer.model, else tokenizer.json: Llama-3 and most current models), or None."""
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    keys: dict[str, Any] = {"vocab_file": None, "merge_file": None, "tokenizer_model": None}
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return {"tokenizer_type": "GPT2BPETokenizer", **keys, "vocab_file": vocab, "merge_file": merges}
    for name, kind in (("tokenizer.model", "SentencePieceTokenizer"), (HF_TOKENIZER, "HuggingFaceTokenizer")):
        if os.path.isfile(os.path.join(folder, name)):
            return {"tokenizer_type": kind, **keys, "tokenizer_model": os.path.join(folder, name)}
    return None


def sentencepiece_normalizer(model_file: str) -> str:
    """The normalization rule a SentencePiece model applies ('identity', 'nmt_nfkc', ...)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf class
    with open(model_file, "rb") as handle:
        proto.ParseFromString(handle.read())
    return proto.normalizer_spec.name
