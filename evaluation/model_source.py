"""The model to evaluate, at the layout of this torchrun world: a checkpoint of this trainer (read at any tp /
pp / vp through the layout-free loader, as a resumed run reads it) or a transformers folder (mapped into our
model by convert/, so its numbers come from the same forward as a checkpoint's).

`run_config` makes the run config first (the checkpoint's saved config, or the transformers config and
tokenizer files, plus `section.key=value` overrides such as parallel.tp_size=2): every check of the input
(config, layout, tokenizer against the model's vocabulary) runs on it before torch.distributed starts or a
weight is read. `load_model` then builds this rank's chunks, fills them and returns the forward-only context
that evaluation/scoring.py and parallel.pipeline.forward.evaluate run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from checkpoint import CheckpointError, load_model_weights
from config.schema import Config, apply_overrides, config_from_dict
from convert.hf_folder import HFFolderError, hf_model_config, read_hf_weights, tokenizer_section
from convert.model_weights import checkpoint_iteration, read_run_config
from data.tokenizers import build_tokenizer_of
from evaluation.documents import EvalInputError
from evaluation.scoring import EvalContext
from model.param_info import full_shape, param_info
from operations.guards import weights_are_finite
from operations.startup import DistEnv
from parallel.layout import Layout
from parallel.model_builder import build_model_chunks, rank_spec
from parallel.pipeline.plan import build_plan
from parallel.run_shape import RunShape
from parallel.state import ParallelState

DTYPES = ("fp32", "bf16")  # the precisions evaluation runs in (model.precision gives their torch dtypes)
# What bad input raises (config, layout, tokenizer, files, checkpoint): one line, exit 2.
INPUT_ERRORS = (ValueError, OSError, CheckpointError)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a checkpoint's iteration folder, or a transformers folder."""

    iter_dir: str | None = None
    hf_dir: str | None = None

    def describe(self) -> str:
        if self.iter_dir is not None:
            iteration, _ = checkpoint_iteration(self.iter_dir)
            return f"iteration {iteration} of {self.iter_dir}"
        return f"transformers folder {self.hf_dir}"

    @property
    def iteration(self) -> int | None:
        return None if self.iter_dir is None else checkpoint_iteration(self.iter_dir)[0]


def run_config(
    checkpoint: str | None, hf: str | None, overrides: list[str], hf_option: str = "--hf DIR"
) -> tuple[Config, ModelSource]:
    """The run config to evaluate with and the weights' source. A checkpoint brings its saved config without
    its parallel, logging and eval sections (the layout it trained at, its W&B run and its zero-shot files
    belong to the training run: the overrides choose the layout here); a transformers folder brings its model
    and tokenizer. Overrides apply on top; dropout is off (evaluation runs in eval mode anyway). A transformers
    folder given as the checkpoint is refused with `hf_option`, how the caller's user names a transformers
    folder."""
    if (checkpoint is None) == (hf is None):
        raise EvalInputError("give one model: --checkpoint DIR or --hf DIR")
    if checkpoint is not None:
        try:
            iter_dir = checkpoint_iteration(checkpoint)[1]
        except CheckpointError:
            if os.path.isfile(os.path.join(checkpoint, "config.json")):
                raise EvalInputError(
                    f"{checkpoint} is a transformers folder (config.json), not a checkpoint of this trainer: "
                    f"give it as {hf_option}"
                ) from None
            raise
        raw = read_run_config(iter_dir)
        for section in ("parallel", "logging", "eval"):
            raw.pop(section, None)
        source = ModelSource(iter_dir=iter_dir)
    else:
        assert hf is not None
        model = hf_model_config(hf)
        tokenizer = tokenizer_section(hf)
        if tokenizer is None:
            raise HFFolderError(f"{hf} holds no tokenizer (vocab.json + merges.txt, tokenizer.model or tokenizer.json)")
        raw = {"model": dataclasses.asdict(model), "data": tokenizer}
        source = ModelSource(hf_dir=hf)
    config = config_from_dict(apply_overrides(raw, overrides))
    config.model.hidden_dropout = config.model.attention_dropout = 0.0
    return config, source


class TextTokenizer(Protocol):
    """What evaluation asks of data/tokenizers.py's tokenizers: text to ids and back, and their sizes."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def run_tokenizer(config: Config, exact: bool = True) -> TextTokenizer:
    """The run's tokenizer; EvalInputError when its vocabulary is not the model's (a tokenizer the model
    was not trained with; exact=False allows a model vocabulary larger than the tokenizer's, as the trainer
    does) or when it cannot turn text into ids (NullTokenizer)."""
    data = config.data
    if data.tokenizer_type == "NullTokenizer":
        raise EvalInputError(
            "the model's tokenizer is NullTokenizer (its text is ids): give the tokenizer it was trained with "
            "(data.tokenizer_type=... and data.vocab_file / data.merge_file / data.tokenizer_model)"
        )
    tokenizer = build_tokenizer_of(data, config.model.vocab_size)
    vocab_size = config.model.vocab_size
    if tokenizer.vocab_size != vocab_size and (exact or vocab_size is None or tokenizer.vocab_size > vocab_size):
        source = data.vocab_file or data.tokenizer_model or data.tokenizer_type
        raise EvalInputError(
            f"tokenizer {source} has {tokenizer.vocab_size} entries but the model's vocabulary is "
            f"model.vocab_size={config.model.vocab_size}: give the tokenizer the model was trained with"
        )
    return tokenizer


@torch.no_grad()
def copy_global_weights(chunks: list, tensors: dict[str, torch.Tensor]) -> None:
    """Fill this rank's chunks from a global state dict (single-process names): each parameter takes its
    tp shard of the tensor stored under its global name, vocabulary tables padded to this layout's rows."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            info = param_info(param)
            full = tensors[info.init_name or name]
            full = info.sharding.padded(full, full_shape(param)[0])
            param.copy_(info.local_shard(full))


def load_model(
    config: Config, source: ModelSource, layout: Layout, env: DistEnv, dtype: torch.dtype = torch.float32
) -> EvalContext:
    """This rank's chunks of the model in `source`, at `layout`, in eval mode (collective under torchrun; the
    state's collectives recorded by the world door's recorder, `env.comm`)."""
    state = ParallelState.from_layout(layout, env.comm.recorder)
    cfg = config.model
    chunks = build_model_chunks(
        cfg,
        state,
        config.train.seed,
        env.device,
        dtype,
        rank_spec(cfg, state, layout.sequence_parallel),
    )
    if source.iter_dir is not None:
        load_model_weights(source.iter_dir, chunks, state)
    else:
        assert source.hf_dir is not None
        copy_global_weights(chunks, read_hf_weights(source.hf_dir, cfg))  # checked against its config.json
    if not weights_are_finite(chunks, state, env.device):
        raise EvalInputError(f"{source.describe()}: the weights hold NaN or inf (a diverged run or a bad export)")
    for chunk in chunks:
        chunk.eval()
    return EvalContext(
        chunks=chunks,
        state=state,
        layout=layout,
        eval_plan=build_plan(
            layout.schedule, layout.pp_size, state.pp_rank, layout.num_microbatches, layout.vp_size, forward_only=True
        ),
        activation_shape=RunShape.of(config, layout).activation_shape,
        activation_dtype=dtype,
        device=env.device,
        scatter_gather=config.parallel.scatter_gather and not layout.sequence_parallel,
        overlap_p2p_comm=config.parallel.overlap_p2p_comm,
    )


def window_length(config: Config) -> int:
    """Tokens per window: eval.seq_length, else the model's positions (max_position_embeddings, else
    seq_length), as lm-evaluation-harness takes a model's max_length from its config."""
    cfg = config.model
    length = config.eval.seq_length or cfg.max_positions
    if length > cfg.max_positions:
        raise EvalInputError(
            f"eval.seq_length={length} is longer than the model's {cfg.max_positions} positions "
            f"(model.max_position_embeddings)"
        )
    if config.eval.overlapping_eval > length:
        raise EvalInputError(f"eval.overlapping_eval={config.eval.overlapping_eval} exceeds the window of {length}")
    return length
