"""Scoring token windows (evaluation/windows.py) with this project's model at any layout.

The windows run through the pipeline executor's forward-only plan, the one validation runs
(`StepContext.eval_plan`), with tensor, context and data parallelism: each step hands every dp rank
`num_microbatches` micro-batches of `micro_batch_size` windows, right-padded to the step's longest window
(causal attention: padding after a token never changes its prediction). On the last virtual stage the
head turns the (vocabulary-parallel) logits into, per position, the target's log-probability (in fp32),
whether the target is the argmax (the lowest id among equal maxima, as torch.argmax) and the argmax itself,
with the training loss's log-softmax (parallel/tp_layers.vocab_parallel_softmax).
The results go from the last stage to every stage (broadcast over pp) and to every dp rank (all-gather), so
every rank returns every window's scores and computes the same figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from data.microbatch import Microbatch
from evaluation.windows import Window
from model.gpt import GPTModel
from parallel.context_parallel import chunk_indices, cut_microbatch
from parallel.layout import Layout
from parallel.pipeline.executor import execute_schedule
from parallel.pipeline.forward import ForwardOnlyContext
from parallel.pipeline.plan import PipelinePlan
from parallel.state import ParallelState
from parallel.tensor_parallel import tp_comm
from parallel.tp_layers import vocab_parallel_softmax
from parallel.tp_mappings import all_reduce

Progress = Callable[[int, int], None]  # (windows scored so far, total)
_FIELDS = 3  # per position: target log-probability, target is the argmax (0/1), the argmax id


@dataclass
class EvalContext:
    """What forward-only passes need (parallel.pipeline.forward.ForwardOnlyContext): the trainer's StepContext has
    it; a model loaded for evaluation gets one without gradient buffers or optimizer state."""

    chunks: list[GPTModel]
    state: ParallelState
    layout: Layout
    eval_plan: PipelinePlan
    activation_shape: tuple[int, int, int]  # [s(/cp, /tp with sequence parallelism), b, h] of a training sample
    activation_dtype: torch.dtype
    device: torch.device
    scatter_gather: bool
    overlap_p2p_comm: bool

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches


@dataclass(frozen=True)
class WindowScore:
    """The scored predictions of one window, in order."""

    logprobs: np.ndarray  # [scored] float64: log-probability of each target
    greedy: np.ndarray  # [scored] bool: the target was the most likely token
    argmax: np.ndarray  # [scored] int64: the most likely token

    @property
    def total(self) -> float:
        """Summed log-likelihood of the scored targets, summed in fp32 by torch as lm-evaluation-harness sums a
        window's (`float(logits.sum())`): a long request's total then differs from the harness's by the
        per-token differences only, not by fp32's rounding of the sum (~1e-4 over a few hundred tokens)."""
        return float(torch.from_numpy(self.logprobs.astype(np.float32)).sum())

    @property
    def all_greedy(self) -> bool:
        """Every scored target was the argmax (the harness's is_greedy, LAMBADA's correct)."""
        return bool(self.greedy.all())


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group, state: ParallelState) -> torch.Tensor:
    state.comm.all_reduce(tensor, group, op=op)  # through the door: recorded, bounded by the groups' timeouts
    return tensor


def target_scores(logits_local: torch.Tensor, labels: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[b, s, 3] float64 (log-probability of labels, label is the argmax, argmax) from this tp rank's logits
    [b, s, V/tp] (padding columns already -inf): the loss's log-softmax over the whole vocabulary
    (parallel/tp_layers.vocab_parallel_softmax: its log-probability is minus the training loss, bit for bit)
    and one more all-reduce over tp for the argmax."""
    comm = tp_comm(state, scope="eval")  # through the state's door: recorded, bounded by the groups' timeouts
    softmax = vocab_parallel_softmax(logits_local, labels, comm)
    # [b, s]; the first index among equal values. In the logits' own dtype: fp32 holds each value exactly
    # and orders them alike, so no fp32 copy of [b, s, V/tp] is made for this.
    local_max, local_arg = logits_local.max(dim=-1)
    vocab_start = state.tp_rank * logits_local.shape[-1]
    lowest = torch.full_like(local_arg, torch.iinfo(torch.int64).max)
    # the lowest id at the global max, as torch.argmax over the whole vocabulary
    at_max = torch.where(local_max.float() == softmax.global_max, local_arg + vocab_start, lowest)
    argmax = all_reduce(at_max, comm, "forward", op=dist.ReduceOp.MIN)
    logprob = softmax.log_prob()
    return torch.stack([logprob.double(), (argmax == labels).double(), argmax.double()], dim=-1)


class WindowScorer:
    """Scores window lists through `ctx`'s chunks (collective: every rank of the layout calls `score` with
    the same windows, in the same order)."""

    def __init__(self, ctx: ForwardOnlyContext, pad_id: int, progress: Progress | None = None):
        self.ctx, self.pad_id, self.progress = ctx, pad_id, progress
        self.micro_batch_size = ctx.activation_shape[1]
        self.max_positions = ctx.chunks[0].cfg.max_positions
        state, layout = ctx.state, ctx.layout
        self.cp_size, self.cp_rank = state.cp_size, state.cp_rank
        # The sequence is cut into 2 * cp chunks and, with sequence parallelism, over tp: pad it to both.
        self.length_multiple = (2 * state.cp_size if state.cp_size > 1 else 1) * (
            state.tp_size if layout.sequence_parallel else 1
        )

    def score(self, windows: Sequence[Window]) -> list[WindowScore]:
        """One WindowScore per window, in the given order (longest windows are batched together first)."""
        ctx = self.ctx
        order = sorted(range(len(windows)), key=lambda k: -len(windows[k].tokens))
        per_step = ctx.state.dp_size * ctx.num_microbatches * self.micro_batch_size
        scores: dict[int, WindowScore] = {}
        modes = [chunk.training for chunk in ctx.chunks]
        for chunk in ctx.chunks:
            chunk.eval()
        try:
            for start in range(0, len(order), per_step):
                step = order[start : start + per_step]
                scores.update(zip(step, self._score_step([windows[k] for k in step])))
                if self.progress is not None:
                    self.progress(min(start + per_step, len(order)), len(order))
        finally:
            for chunk, training in zip(ctx.chunks, modes):
                chunk.train(training)
        return [scores[k] for k in range(len(windows))]

    def _score_step(self, windows: list[Window]) -> list[WindowScore]:
        """Scores of up to dp * m * b windows, run as one forward-only pass of the pipeline."""
        ctx, state = self.ctx, self.ctx.state
        length = max(len(w.tokens) - 1 for w in windows)
        length = -(-length // self.length_multiple) * self.length_multiple
        m, b = ctx.num_microbatches, self.micro_batch_size
        mine = windows[state.dp_rank * m * b : (state.dp_rank + 1) * m * b]
        microbatches = [self._microbatch(mine[k * b : (k + 1) * b], length) for k in range(m)]
        local = self._run(microbatches, length)  # [m, b, length, 3]
        gathered = self._share(local)  # [dp * m * b, length, 3]
        return [self._window_score(w, gathered[k]) for k, w in enumerate(windows)]

    def _microbatch(self, windows: list[Window], length: int) -> Microbatch:
        b = self.micro_batch_size
        tokens = torch.full((b, length + 1), self.pad_id, dtype=torch.long)
        for row, window in enumerate(windows):
            tokens[row, : len(window.tokens)] = torch.tensor(window.tokens, dtype=torch.long)
        mb = Microbatch.of(
            tokens=tokens[:, :-1].contiguous(),
            labels=tokens[:, 1:].contiguous(),
            loss_mask=torch.ones(b, length),
            # padding past the model's positions (the length rounded up for cp / sp) reads the last position
            position_ids=torch.arange(length).clamp(max=self.max_positions - 1).expand(b, length).contiguous(),
        )
        if self.cp_size > 1:
            mb = cut_microbatch(mb, self.cp_rank, self.cp_size)
        return mb.to(self.ctx.device)

    def _run(self, microbatches: list[Microbatch], length: int) -> torch.Tensor:
        ctx, state = self.ctx, self.ctx.state
        hidden = ctx.activation_shape[2]
        local_length = length // state.cp_size // (state.tp_size if ctx.layout.sequence_parallel else 1)

        def forward_fn(chunk_index: int, chunk: torch.nn.Module, input_tensor, mb: Microbatch, /) -> torch.Tensor:
            output = chunk(
                input_ids=mb.tokens if chunk.pre_process else None,
                position_ids=mb.position_ids,
                hidden_states=input_tensor,
            )
            if not chunk.post_process:
                return output
            return self._gather_cp(target_scores(output, mb.labels, state), length)

        result = execute_schedule(
            ctx.eval_plan,
            ctx.chunks,
            microbatches,
            forward_fn,
            state,
            (local_length, self.micro_batch_size, hidden),
            ctx.activation_dtype,
            scatter_gather=ctx.scatter_gather,
            overlap_p2p_comm=ctx.overlap_p2p_comm,
        )
        if result.losses:
            return torch.stack(result.losses)
        return torch.zeros(
            len(microbatches), self.micro_batch_size, length, _FIELDS, dtype=torch.float64, device=ctx.device
        )

    def _gather_cp(self, local: torch.Tensor, length: int) -> torch.Tensor:
        """[b, s/cp, 3] of this cp rank's positions -> [b, s, 3] on every cp rank."""
        if self.cp_size == 1:
            return local
        full = local.new_zeros(local.shape[0], length, _FIELDS)
        full[:, chunk_indices(length, self.cp_size, self.cp_rank).to(local.device)] = local
        return _all_reduce(full, dist.ReduceOp.SUM, self.ctx.state.cp_group, self.ctx.state)

    def _share(self, local: torch.Tensor) -> np.ndarray:
        """The last stage's results on every rank: broadcast over pp, all-gathered over dp."""
        state = self.ctx.state
        if state.pp_size > 1:  # the last virtual stage: on the last rank, on the first in zb-v's V
            holder = state.pp_ranks[state.stages.head_pp_rank]
            state.comm.broadcast(local, holder, state.pp_group)
        if state.dp_size > 1:
            parts = [torch.empty_like(local) for _ in range(state.dp_size)]
            state.comm.all_gather(parts, local, state.dp_group)
            local = torch.cat(parts)
        return local.reshape(-1, *local.shape[-2:]).cpu().numpy()

    @staticmethod
    def _window_score(window: Window, rows: np.ndarray) -> WindowScore:
        end = len(window.tokens) - 1
        picked = rows[end - window.scored : end]
        return WindowScore(picked[:, 0].copy(), picked[:, 1] > 0.5, picked[:, 2].astype(np.int64))
