"""convert/open_model.py, the one door to open a model: a checkpoint and its transformers export open into the
same shards at a tp2 x pp2 layout (the layout-free loader and place_global_weights agree on every stored row),
generation and evaluation refuse a transformers folder without a tokenizer with the door's one line, and
place_global_weights names what does not fit."""

import os
import re

import pytest
import torch

from convert.model_weights import build_model_from_state
from convert.open_model import ModelSource, global_state, open_config, open_model
from model.param_info import param_info
from parallel.state import ParallelState
from tests.conftest import REPO_ROOT, run_ranks
from tests.tools.converter_inputs import copy

pytestmark = pytest.mark.tier("fast")

NO_TOKENIZER = "holds no tokenizer this project reads (vocab.json + merges.txt, tokenizer.model or tokenizer.json)"


def stored_rows(param: torch.Tensor, tp_rank: int = 0) -> torch.Tensor:
    """The rows of a parameter (or its tp shard) that checkpoints and exports hold: a vocabulary table without
    its padding rows (which neither stores: what they hold after opening is no part of the model)."""
    valid = param_info(param).sharding.valid_rows
    if valid is None:
        return param.detach()
    return param.detach()[: max(0, valid - tp_rank * param.shape[0])]  # tables are split along their rows


def _open_on_ranks(rank, world_size, paths, out_file):
    state = ParallelState.create(2, 2)
    shards = []
    for path in paths:
        source = ModelSource.at(path)
        chunks = open_model(open_config(source), source, state, torch.device("cpu"))
        shards.append(
            {name: stored_rows(p, state.tp_rank).clone() for chunk in chunks for name, p in chunk.named_parameters()}
        )
        shards[-1]["rows of the embedding"] = torch.tensor(
            [
                p.shape[0]
                for chunk in chunks
                for n, p in chunk.named_parameters()
                if n.endswith("word_embeddings.weight")
            ]
        )
    torch.save(shards, f"{out_file}.{rank}")


def test_a_checkpoint_and_its_export_open_into_the_same_shards(converter_sources, tmp_path):
    ours, hf = converter_sources["ours"], converter_sources["hf"]
    cfg = open_config(ModelSource.at(ours)).model
    model = build_model_from_state(cfg, global_state(ModelSource.checkpoint(ours))[1])
    hf_config, hf_tensors = global_state(ModelSource.at(hf))
    assert hf_config["model"]["num_layers"] == cfg.num_layers == 4
    for name, param in model.named_parameters():  # the fp32 export holds the same bits
        assert torch.equal(stored_rows(param), hf_tensors[name][: stored_rows(param).shape[0]]), name

    rows = cfg.padded_vocab_size(2) // 2  # of the embedding, per tp rank
    # padded at tp2: the second tp rank's shard ends in padding rows
    assert cfg.vocab_size is not None and rows * 2 > cfg.vocab_size
    run_ranks(4, _open_on_ranks, [ours, hf], str(tmp_path / "shards"))
    for rank in range(4):
        from_checkpoint, from_hf = torch.load(f"{tmp_path / 'shards'}.{rank}")
        assert from_checkpoint.keys() == from_hf.keys() and len(from_checkpoint) > 1
        for name, shard in from_checkpoint.items():
            assert torch.equal(shard, from_hf[name]), (rank, name)
        assert from_hf["rows of the embedding"].tolist() in ([], [rows])  # the first stage holds it


def test_a_transformers_folder_without_a_tokenizer_is_refused_in_one_line(converter_sources, tmp_path, capsys):
    from tools import evaluate, generate

    hf = copy(converter_sources["hf"], tmp_path)
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer.model"):
        if os.path.exists(os.path.join(hf, name)):
            os.remove(os.path.join(hf, name))
    for tool, argv in (
        (generate, ["--checkpoint", hf, "--prompt", "x", "--max-new-tokens", "1"]),
        (evaluate, ["lambada", "--data", str(tmp_path / "lambada.jsonl"), "--hf", hf]),
    ):
        assert tool.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"error: {hf} {NO_TOKENIZER}"], tool.__name__
    # the converter carries the weights without one (from-hf writes no tokenizer section then)
    config, tensors = global_state(ModelSource(hf_dir=hf))
    assert config["data"] is None and len(tensors) > 0


def test_the_refusal_text_is_written_once():
    """Opening a model is written in one place: its refusal text appears in one file outside tests/."""
    holders = []
    for folder, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if d not in ("tests", ".git", "__pycache__") and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                if "holds no tokenizer" in open(path, encoding="utf-8").read():
                    holders.append(os.path.relpath(path, REPO_ROOT))
    assert holders == [os.path.join("convert", "open_model.py")]


def test_a_checkpoint_source_names_the_transformers_option(converter_sources):
    hf = converter_sources["hf"]
    with pytest.raises(ValueError, match=f"^{re.escape(hf)} is a transformers folder .* give it as hf=DIR$"):
        ModelSource.checkpoint(hf, "hf=DIR")
    with pytest.raises(ValueError, match="^give one model: --checkpoint DIR or --hf DIR$"):
        ModelSource.given(None, None)
    source = ModelSource.at(converter_sources["ours"])
    assert source.iteration == 3 and source.describe() == f"iteration 3 of {source.iter_dir}"


def test_place_global_weights_names_what_does_not_fit(converter_sources):
    tensors = global_state(ModelSource.checkpoint(converter_sources["ours"]))[1]
    cfg = open_config(ModelSource.checkpoint(converter_sources["ours"])).model
    name = "layers.0.mlp.fc1.weight"
    cases = [
        ({k: v for k, v in tensors.items() if k != name}, f"the state dict lacks {name}"),
        ({**tensors, "layers.9.extra": torch.zeros(1)}, "the state dict holds layers.9.extra, which the model"),
        ({**tensors, name: tensors[name][:-1]}, f"{name} is {tuple(tensors[name][:-1].shape)}, the model's"),
    ]
    for damaged, message in cases:
        with pytest.raises(ValueError, match=f"^the weights do not fit the model config: {re.escape(message)}"):
            build_model_from_state(cfg, damaged)
    model = build_model_from_state(cfg, tensors)
    for name, param in model.named_parameters():
        assert torch.equal(stored_rows(param), tensors[name][: len(stored_rows(param))]), name
