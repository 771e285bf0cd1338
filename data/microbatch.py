"""One micro-batch, as the data loader yields it and the model's forward and loss read it: a frozen record.

The loader (data/loader.py `collate_samples`) and evaluation's token windows make them; the training step moves
them to the device (`to`); context parallelism keeps one cp rank's positions of the sequence
(parallel/context_parallel.py `cut_microbatch`, through `cut_sequence`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Microbatch:
    """b samples of s tokens.

    Attributes:
        tokens: int64 [b, s], the model's input ids.
        labels: int64 [b, s], the token after each position.
        loss_mask: float32 [b, s], each position's weight in the loss (0: padding, or an EOD with
            data.eod_mask_loss).
        position_ids: int64 [b, s] (restarting after each EOD with data.reset_position_ids).
        attention_mask: bool [b, 1, s_q, s], True where a query may attend to a key, when documents are kept
            apart (data.reset_attention_mask); None: causal attention over the whole sample.
        loss_tokens: float32 [], the loss's denominator: the micro-batch's loss-mask sum. After `cut_sequence`
            (a cp rank's part of each sample) it is still the whole micro-batch's, so the cp parts add up.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    loss_tokens: torch.Tensor

    @classmethod
    def of(
        cls,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> Microbatch:
        """A whole micro-batch: its loss denominator is its loss-mask sum."""
        return cls(tokens, labels, loss_mask, position_ids, attention_mask, loss_mask.sum())

    def to(self, device: torch.device, non_blocking: bool = False) -> Microbatch:
        """The same micro-batch with every tensor on `device`."""

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device, non_blocking=non_blocking)

        mask = None if self.attention_mask is None else move(self.attention_mask)
        return Microbatch(
            move(self.tokens),
            move(self.labels),
            move(self.loss_mask),
            move(self.position_ids),
            mask,
            move(self.loss_tokens),
        )

    def cut_sequence(self, positions: torch.Tensor, key_positions: torch.Tensor | None) -> Microbatch:
        """The micro-batch at sequence `positions` only ([b, s] -> [b, len(positions)]; each token keeps its
        position id). An attention mask keeps those query rows and every key column, reordered as
        `key_positions` lists them (needed only when there is a mask). The loss denominator is unchanged."""
        mask = self.attention_mask
        if mask is not None:
            if key_positions is None:
                raise ValueError("cut_sequence: an attention mask needs key_positions")
            mask = mask.index_select(2, positions).index_select(3, key_positions)
        return dataclasses.replace(
            self,
            tokens=self.tokens.index_select(1, positions),
            labels=self.labels.index_select(1, positions),
            loss_mask=self.loss_mask.index_select(1, positions),
            position_ids=self.position_ids.index_select(1, positions),
            attention_mask=mask,
        )
