"""Sampler resume, dp slicing, batch masks against a loop reference, DataLoader with workers."""

import numpy as np
import pytest
import torch

from data.loader import PretrainingSampler, build_data_iterator, get_batch_masks, sample_index

pytestmark = pytest.mark.tier("fast")


class CountingDataset:
    """Sample i = [i, i+1, ..., i+s]: makes the order of samples visible in the batches."""

    def __init__(self, n, s):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": np.arange(i, i + self.s + 1, dtype=np.int64)}


def _stream(dataset, consumed, mbs, dp_rank, dp_size, workers=0):
    it = build_data_iterator(
        dataset,
        consumed,
        mbs,
        dp_rank,
        dp_size,
        workers,
        eod_id=-1,
        eod_mask_loss=False,
        reset_position_ids=False,
        reset_attention_mask=False,
        extra_token=True,
    )
    return [b.tokens[:, 0].tolist() for b in it]


def test_sampler_slices_chunks_per_rank():
    s0 = list(PretrainingSampler(20, 0, 2, 0, 3))
    s2 = list(PretrainingSampler(20, 0, 2, 2, 3))
    assert s0 == [[0, 1], [6, 7], [12, 13]] and s2 == [[4, 5], [10, 11], [16, 17]]


def test_sample_index_names_what_the_sampler_yields():
    for consumed, mbs, dp_size in [(0, 2, 3), (12, 3, 2), (5, 1, 4)]:
        for dp_rank in range(dp_size):
            batches = list(PretrainingSampler(40, consumed, mbs, dp_rank, dp_size))
            named = [
                [sample_index(consumed, k, row, mbs, dp_rank, dp_size) for row in range(mbs)]
                for k in range(len(batches))
            ]
            assert batches == named


def test_resume_continues_the_same_stream():
    ds = CountingDataset(50, 4)
    full = _stream(ds, 0, 2, 1, 2)
    resumed = _stream(ds, 12, 2, 1, 2)  # 3 global batches of 4 consumed
    assert resumed == full[3:]


def test_workers_give_the_same_batches_as_in_process():
    ds = CountingDataset(40, 8)
    assert _stream(ds, 4, 3, 0, 2, workers=2) == _stream(ds, 4, 3, 0, 2, workers=0)


def test_batch_fields_shapes_and_types():
    ds = CountingDataset(10, 6)
    batch = next(
        build_data_iterator(
            ds,
            0,
            2,
            0,
            1,
            0,
            eod_id=3,
            eod_mask_loss=True,
            reset_position_ids=True,
            reset_attention_mask=True,
            extra_token=True,
        )
    )
    assert batch.tokens.dtype == torch.int64 and batch.tokens.shape == (2, 6)
    assert torch.equal(batch.labels, batch.tokens + 1)
    assert batch.loss_mask.dtype == torch.float32
    assert batch.attention_mask is not None
    assert batch.attention_mask.dtype == torch.bool and batch.attention_mask.shape == (2, 1, 6, 6)
    assert batch.position_ids.dtype == torch.int64 and float(batch.loss_tokens) == float(batch.loss_mask.sum())
    plain = next(build_data_iterator(ds, 0, 2, 0, 1, 0, 3, False, False, False, True))
    assert plain.attention_mask is None


def reference_masks(tokens, eod, eod_mask_loss, reset_pos, reset_attn):
    """Megatron's get_ltor_masks_and_position_ids as loops; attention True = may attend."""
    b, s = tokens.shape
    attn = torch.tril(torch.ones((b, 1, s, s))) > 0.5
    loss = torch.ones((b, s))
    if eod_mask_loss:
        loss[tokens == eod] = 0.0
    pos = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for row in range(b):
        prev = 0
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            if reset_attn:
                attn[row, 0, i + 1 :, : i + 1] = False
            if reset_pos:
                pos[row, i + 1 :] -= i + 1 - prev
                prev = i + 1
    return loss, pos, attn


def test_masks_equal_megatron_loops():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (3, 24), generator=gen)
    tokens[0, -1] = 0  # EOD at the end
    tokens[1, 0] = 0  # EOD at the start
    for flags in [(False, False, False), (True, True, True), (True, False, True), (False, True, False)]:
        loss, pos, attn = get_batch_masks(tokens, 0, *flags)
        ref_loss, ref_pos, ref_attn = reference_masks(tokens, 0, *flags)
        assert torch.equal(loss, ref_loss) and torch.equal(pos, ref_pos)
        if flags[2]:
            assert torch.equal(attn, ref_attn)
        else:
            assert attn is None
