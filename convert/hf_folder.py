"""transformers model folders on disk: config.json, safetensors weights (sharded with an index above a size),
tokenizer files. Writing goes to a staging folder beside OUT_DIR (convert/staging.py), so a failure leaves no
partial OUT_DIR. Reading accepts model.safetensors, a sharded safetensors index or
pytorch_model.bin (read with weights_only=True).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from typing import Any

import torch

from checkpoint import load_weights_file
from compat.optional import safetensors_torch
from convert.hf_mapping import (
    UnsupportedModelError,
    from_hf_state_dict,
    global_names,
    hf_architecture,
    model_config_from_hf,
    to_hf_state_dict,
)
from convert.model_weights import check_dtypes, check_finite, meta_state
from convert.safe_pickle import first_line
from data.atomic_files import honour_umask
from data.bpe import check_vocab_and_merges, load_vocab_and_merges
from data.tokenizer_libraries import sentencepiece_model_pb2
from data.tokenizers import EOD_TOKEN, HuggingFaceTokenizer, build_tokenizer
from model.config import ModelConfig

Tensors = dict[str, torch.Tensor]
SAFE_INDEX = "model.safetensors.index.json"
HF_TOKENIZER = "tokenizer.json"


class HFFolderError(ValueError):
    """A folder that is not a usable transformers model; the message names the file."""


def parse_size(text: str) -> int:
    """'5GB', '500MB', '10KiB' or a byte count -> bytes (transformers' convention: GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"--max-shard-size={text!r} is not a size like 5GB, 500MB or 1000000")
    number, unit = float(match.group(1)), match.group(2) or "B"
    if number <= 0:
        raise ValueError(f"--max-shard-size={text!r} must be above 0 (e.g. 5GB)")
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
    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        safetensors_torch().save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
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


def check_tokenizer_files(data: dict[str, Any], vocab_size: int, exact: bool = False) -> Any:
    """The tokenizer `data` names (our data-section keys), built after its files are checked against each
    other (GPT-2: vocab.json against merges.txt; tokenizer.json: the tokenizer_config.json beside it) and its
    entries against the model's vocabulary: more entries than the model has rows are refused (their ids would
    index past the embedding), fewer refused when `exact` (to-hf writes one vocab_size for both), else a
    one-line warning (a padded vocabulary is legal). ValueError naming the file otherwise."""
    kind = data["tokenizer_type"]
    if kind == "GPT2BPETokenizer" and data.get("vocab_file") and data.get("merge_file"):
        check_gpt2_files(data["vocab_file"], data["merge_file"])
    path = hf_tokenizer_json(data.get("tokenizer_model")) if kind == "HuggingFaceTokenizer" else None
    if path and os.path.isfile(os.path.join(os.path.dirname(path), "tokenizer_config.json")):
        read_json_object(os.path.join(os.path.dirname(path), "tokenizer_config.json"))  # its eos_token is read
    tokenizer = build_tokenizer(
        kind,
        vocab_file=data.get("vocab_file"),
        merge_file=data.get("merge_file"),
        tokenizer_model=data.get("tokenizer_model"),
        vocab_size=vocab_size,
    )
    source = data.get("vocab_file") or data.get("tokenizer_model")
    if tokenizer.vocab_size > vocab_size or (exact and tokenizer.vocab_size != vocab_size):
        raise ValueError(
            f"tokenizer {source} has {tokenizer.vocab_size} entries but the model's vocabulary is "
            f"model.vocab_size={vocab_size}"
        )
    if tokenizer.vocab_size < vocab_size:
        print(
            f"warning: tokenizer {source} has {tokenizer.vocab_size} entries, fewer than the model's "
            f"{vocab_size}: the rows above are never produced (fine for a padded vocabulary; otherwise this is "
            "not the model's tokenizer)",
            file=sys.stderr,
        )
    return tokenizer


def check_gpt2_files(vocab_file: str, merge_file: str) -> None:
    """vocab.json and merges.txt that belong together (data.bpe.check_vocab_and_merges); its warning printed."""
    vocab, merges = load_vocab_and_merges(vocab_file, merge_file)
    warning = check_vocab_and_merges(vocab, merges, vocab_file, merge_file, {EOD_TOKEN})
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def write_tokenizer(folder: str, data: dict[str, Any], vocab_size: int | None, max_length: int) -> dict[str, int]:
    """Copy the run's tokenizer files with a tokenizer_config.json for AutoTokenizer; returns bos/eos ids.
    Refuses (ValueError) tokenizer files that do not belong together or to the model (check_tokenizer_files)."""
    if vocab_size is None:
        raise ValueError("the checkpoint's model.vocab_size is unknown: the tokenizer cannot be checked against it")
    tokenizer = check_tokenizer_files(data, vocab_size, exact=True)
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


def _write_hf_tokenizer(folder: str, tokenizer: HuggingFaceTokenizer, max_length: int) -> dict[str, int]:
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


# ---- reading ---------------------------------------------------------------------------------------
def read_json_object(path: str) -> dict[str, object]:
    """A JSON file that must hold an object ({...}); HFFolderError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise HFFolderError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(value, dict):
        raise HFFolderError(f"{path} holds {type(value).__name__ if value is not None else 'null'}, not a JSON object")
    return value


def read_config(folder: str) -> dict[str, object]:
    """config.json of a transformers folder (a JSON object)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFFolderError(f"{folder} is not a transformers model folder: no config.json")
    return read_json_object(path)


def weight_files(folder: str) -> list[str]:
    """The weight files of a transformers folder: model.safetensors, the shards its index names (plain file
    names inside the folder), or pytorch_model.bin."""
    single, index = os.path.join(folder, "model.safetensors"), os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise HFFolderError(f"{index} has no weight_map (tensor name -> shard file): re-save the model")
        shards = sorted(set(weight_map.values()))
        for name in shards:
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise HFFolderError(f"{index} names shard {name!r}, which is not a file name inside {folder}")
            if not os.path.isfile(os.path.join(folder, name)):
                raise HFFolderError(f"{index} names shard {name}, which {folder} lacks: re-download the model")
        return [os.path.join(folder, name) for name in shards]
    legacy = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return [legacy]
    raise HFFolderError(f"{folder} holds no weights (model.safetensors, {SAFE_INDEX} or pytorch_model.bin)")


def read_weights(folder: str) -> Tensors:
    """Every tensor of a transformers folder (safetensors, sharded safetensors or pytorch_model.bin)."""
    tensors: Tensors = {}
    for path in weight_files(folder):
        if path.endswith(".bin"):
            loaded = load_weights_file(path)  # weights only; a refusal names the file and the global
        else:
            try:
                loaded = safetensors_torch().load_file(path)
            except Exception as err:  # safetensors errors have many types; name the file
                raise HFFolderError(
                    f"{path} cannot be read: {first_line(err)}; re-download or re-save the model"
                ) from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise HFFolderError(f"{path} holds no state dict of tensors: re-save the model")
        tensors.update(loaded)
    return tensors


def check_hf_shapes(cfg: ModelConfig, hf: Tensors, source: str) -> None:
    """HFFolderError naming `source` (the config.json) when a transformers tensor's shape is not the one
    the config gives: config and weights of different models. Without it a vocab_size above the embedding's
    rows would be padded with invented rows, and other sizes would fail deep in the mapping."""
    expected = to_hf_state_dict(cfg, meta_state(cfg))
    embedding = global_names(hf_architecture(cfg))["embedding.word_embeddings.weight"]
    for name in [embedding, *sorted(set(expected) - {embedding})]:  # the vocabulary first: the likeliest cause
        if name not in hf or tuple(hf[name].shape) == tuple(expected[name].shape):
            continue
        got, want = list(hf[name].shape), list(expected[name].shape)
        if name == embedding and got[1:] == want[1:]:
            raise HFFolderError(
                f"{source} says vocab_size={cfg.vocab_size} but the embedding {name} has {got[0]} rows: the config "
                f"and the weights disagree; use the config.json saved with these weights (vocab_size={got[0]})"
            )
        raise HFFolderError(
            f"{source} and the weights disagree: tensor {name} is {got} in the weights but {want} by the config "
            "(hidden size, heads, layers, vocab_size); use the config.json saved with these weights"
        )


def hf_model_config(folder: str) -> ModelConfig:
    """Our model section for the config.json of a transformers folder, checked (one line naming the file)."""
    return model_config_from_hf(read_config(folder), os.path.join(folder, "config.json"))


def read_hf_weights(folder: str, cfg: ModelConfig) -> Tensors:
    """Our global state dict from the weights of a transformers folder, checked before and after the mapping:
    dtypes, shapes against config.json (hf_model_config's `cfg`), finite values. One line naming the file."""
    weights = read_weights(folder)
    check_dtypes(weights, folder)
    check_hf_shapes(cfg, weights, os.path.join(folder, "config.json"))
    try:
        tensors = from_hf_state_dict(cfg, weights)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{folder}: {err}") from None
    check_finite(tensors, folder)  # NaN weights convert into a checkpoint that only looks fine
    return tensors


def tokenizer_section(folder: str) -> dict[str, str | None] | None:
    """Our data-section tokenizer keys for the tokenizer files of a transformers folder (vocab.json +
    merges.txt, else tokenizer.model, else tokenizer.json: Llama-3 and most current models), or None."""
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    keys: dict[str, str | None] = {"vocab_file": None, "merge_file": None, "tokenizer_model": None}
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return {"tokenizer_type": "GPT2BPETokenizer", **keys, "vocab_file": vocab, "merge_file": merges}
    for name, kind in (("tokenizer.model", "SentencePieceTokenizer"), (HF_TOKENIZER, "HuggingFaceTokenizer")):
        if os.path.isfile(os.path.join(folder, name)):
            return {"tokenizer_type": kind, **keys, "tokenizer_model": os.path.join(folder, name)}
    return None


def sentencepiece_normalizer(model_file: str) -> str:
    """The normalization rule a SentencePiece model applies ('identity', 'nmt_nfkc', ...)."""
    proto = sentencepiece_model_pb2().ModelProto()  # a generated protobuf class
    with open(model_file, "rb") as handle:
        proto.ParseFromString(handle.read())
    return proto.normalizer_spec.name
