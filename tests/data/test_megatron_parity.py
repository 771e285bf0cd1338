"""Parity with Megatron-LM's own code, where megatron-core is importable (it is not a dependency).

    pip install --no-deps --target /tmp/mcore megatron-core
    PYTHONPATH=/tmp/mcore python -m pytest tests/data/test_megatron_parity.py

Checked with megatron-core 0.16.1: every sample of single and blended datasets, one epoch and several
(separate final epoch included), and .bin/.idx files read both ways.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from data.builder import build_train_valid_test_datasets
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.conftest import free_port

mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets import indexed_dataset as megatron_indexed  # noqa: E402


class _Tokenizer:
    """The fields Megatron's GPTDatasetConfig reads from a tokenizer."""
    eod, pad, bos, vocab_size = 0, -1, None, 60000
    unique_identifiers = {"class": "test tokenizer"}


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    rng = np.random.RandomState(0)
    out = []
    for name, n_docs in (("a", 1000), ("b", 400)):
        builder = IndexedDatasetBuilder(str(tmp / f"{name}.bin"), np.uint16)
        for _ in range(n_docs):
            builder.add_document(rng.randint(1, 60000, size=rng.randint(1, 200)))
        builder.finalize(str(tmp / f"{name}.idx"))
        out.append(str(tmp / name))
    if not dist.is_initialized():  # Megatron's blended dataset asks for the rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield out
    dist.destroy_process_group()


CASES = [("single", "969,30,1", 16, [2000, 50, 10]), ("single", "98,2,0", 64, [5000, 300, 0]),
         ("blend", "90,10,0", 32, [700, 50, 0]), ("blend", "1", 128, [2500, 0, 0])]


@pytest.mark.parametrize("kind,split,seq_length,num_samples", CASES)
def test_same_samples_as_megatron(prefixes, tmp_path, kind, split, seq_length, num_samples):
    a, b = prefixes
    data_path = [a] if kind == "single" else [0.7, a, 0.3, b]
    blend = ([a], None) if kind == "single" else ([a, b], [0.7, 0.3])
    config = mcore.GPTDatasetConfig(
        random_seed=1234, sequence_length=seq_length, blend=blend, split=split,
        path_to_cache=str(tmp_path / "megatron"), tokenizer=_Tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, mmap_bin_files=True)
    theirs = BlendedMegatronDatasetBuilder(mcore.GPTDataset, num_samples, lambda: True, config).build()
    ours = build_train_valid_test_datasets(data_path, split, seq_length, 1234, tuple(num_samples),
                                           str(tmp_path / "ours"))
    for t, o, n in zip(theirs, ours, num_samples):
        if n == 0 or o is None:
            continue  # we return None for num_samples 0; Megatron builds one epoch anyway
        assert len(t) == len(o)
        for i in range(len(o)):
            item = t[i]
            text = o[i]["text"]
            assert np.array_equal(text[:-1], item["tokens"].numpy()) and np.array_equal(
                text[1:], item["labels"].numpy()), i


def test_files_read_both_ways(prefixes, tmp_path):
    theirs, ours = megatron_indexed.IndexedDataset(prefixes[0]), IndexedDataset(prefixes[0])
    assert len(theirs) == len(ours)
    assert all(np.array_equal(theirs[i], ours[i]) for i in range(len(ours)))
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    rng = np.random.RandomState(1)
    seqs = [rng.randint(0, 100000, size=rng.randint(0, 50)) for _ in range(100)]
    for seq in seqs:
        builder.add_document(torch.tensor(seq), [len(seq)])
    builder.finalize(str(tmp_path / "m.idx"))
    read = IndexedDataset(str(tmp_path / "m"))
    assert all(np.array_equal(read[i], seq) for i, seq in enumerate(seqs))
