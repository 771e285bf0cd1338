"""Micro-batches for one data-parallel rank: Megatron's pretraining sampler + masks + a DataLoader.

The sampler walks global sample indices from consumed_samples in chunks of micro_batch_size * dp_size;
rank r takes slice [r * mbs, (r + 1) * mbs) of each chunk. A resumed run that restores consumed_samples
therefore continues the same stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
import torch

from data.gpt_dataset import PAD_ID
from data.microbatch import Microbatch


def sample_index(
    first_sample: int, microbatch: int, row: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> int:
    """The global sample index that `row` of micro-batch `microbatch` on dp rank `dp_rank` reads, counting
    micro-batches from the one that starts at `first_sample` (the samples consumed before it). The sampler
    below walks exactly these; the id checks and evaluation ask this function to name a sample."""
    return first_sample + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size + row


class PretrainingSampler:
    """Yields this rank's lists of sample indices (Megatron's MegatronPretrainingSampler, drop_last=True)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return max(0, (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size))

    def __iter__(self) -> Iterator[list[int]]:
        mbs, rank, size = self.micro_batch_size, self.dp_rank, self.dp_size
        for microbatch in range(len(self)):
            first = sample_index(self.consumed_samples, microbatch, 0, mbs, rank, size)
            yield list(range(first, first + mbs))


def get_batch_masks(
    tokens: torch.Tensor, eod_id: int, eod_mask_loss: bool, reset_position_ids: bool, reset_attention_mask: bool
):
    """(loss_mask float32 [b, s], position_ids int64 [b, s], attention_mask bool [b, 1, s, s] or None).

    As Megatron's get_ltor_masks_and_position_ids: with eod_mask_loss, EOD positions get loss weight 0;
    with reset_position_ids, positions restart after each EOD; with reset_attention_mask, tokens after an
    EOD may not attend to tokens before it. attention_mask True = may attend (causal, block-diagonal).
    """
    b, s = tokens.shape
    loss_mask = torch.ones((b, s), dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_id] = 0.0
    position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).clone()
    attention_mask = None
    if reset_position_ids or reset_attention_mask:
        # Document number of each position: EODs seen strictly before it (an EOD ends its own document).
        is_eod = (tokens == eod_id).to(torch.int64)
        doc = torch.cumsum(is_eod, dim=1) - is_eod
        if reset_position_ids:
            starts = torch.zeros((b, s), dtype=torch.int64)
            starts[:, 1:] = torch.where(is_eod[:, :-1].bool(), torch.arange(1, s).expand(b, s - 1), 0)
            position_ids = position_ids - torch.cummax(starts, dim=1).values
        if reset_attention_mask:
            causal = torch.ones((s, s), dtype=torch.bool).tril()
            same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)  # [b, s, s]
            attention_mask = (causal & same_doc).unsqueeze(1)
    return loss_mask, position_ids, attention_mask


def collate_samples(
    samples: list[dict],
    eod_id: int,
    eod_mask_loss: bool,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    extra_token: bool,
) -> Microbatch:
    """Stack samples into tokens/labels [b, s] and their masks, as Megatron's GPTDataset.__getitem__.

    With the extra token a sample holds s + 1 tokens (tokens = x[:-1], labels = x[1:]); without it s
    tokens, labels shifted by one and the last label is padding. Padding (the tail of a kept partial sample
    after its "length" tokens, and that last label) gets loss weight 0 and is fed to the model as token 0.
    """
    text = torch.from_numpy(np.stack([np.asarray(x["text"], dtype=np.int64) for x in samples]))
    # Padding is where a sample's tokens ran out (its "length"), whatever the value there: a negative id
    # in the data itself stays as it is, so the per-step id check (operations.guards) stops the run on it.
    lengths = torch.tensor([int(x.get("length", text.shape[1])) for x in samples]).unsqueeze(1)
    is_pad = torch.arange(text.shape[1]).unsqueeze(0) >= lengths  # [b, s + extra]
    if extra_token:
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    else:
        tokens = text
        labels = torch.cat((text[:, 1:], torch.full_like(text[:, :1], PAD_ID)), dim=1)
    loss_mask, position_ids, attention_mask = get_batch_masks(
        tokens, eod_id, eod_mask_loss, reset_position_ids, reset_attention_mask
    )
    if extra_token:
        token_pad, label_pad = is_pad[:, :-1], is_pad[:, 1:]
    else:  # the last label is always padding: no sample holds the token after it
        token_pad, label_pad = is_pad, torch.cat((is_pad[:, 1:], torch.ones_like(is_pad[:, :1])), dim=1)
    loss_mask[label_pad] = 0.0
    tokens, labels = tokens.masked_fill(token_pad, 0), labels.masked_fill(label_pad, 0)
    return Microbatch.of(tokens, labels, loss_mask, position_ids, attention_mask)


def build_data_iterator(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    eod_id: int,
    eod_mask_loss: bool,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    extra_token: bool,
    worker_init_fn=None,
) -> Iterator[Microbatch]:
    """Iterator over this dp rank's micro-batches from consumed_samples on; stops when the data runs out.
    `worker_init_fn` runs first in each worker process (the trainer makes workers ignore stop signals)."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    collate = partial(
        collate_samples,
        eod_id=eod_id,
        eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        extra_token=extra_token,
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=False,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        worker_init_fn=worker_init_fn,
        # Its own generator: a DataLoader iterator otherwise draws its worker seed from the global RNG, which
        # would shift the dropout stream whenever an iterator is created (every evaluation, every resume).
        generator=torch.Generator().manual_seed(0),
    )
    return iter(loader)
