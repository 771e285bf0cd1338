"""The model to evaluate, at the layout of this torchrun world: a checkpoint of this trainer (read at any tp /
pp / vp through the layout-free loader, as a resumed run reads it) or a transformers folder (mapped into our
model by convert/, so its numbers come from the same forward as a checkpoint's), opened through
convert/open_model.py, the door generation and the converters open models through too.

`run_config` makes the run config first (the checkpoint's saved config, or the transformers config and
tokenizer files, plus `section.key=value` overrides such as parallel.tp_size=2): every check of the input
(config, layout, tokenizer against the model's vocabulary) runs on it before torch.distributed starts or a
weight is read. `load_model` then opens this rank's chunks, checks them finite on every rank and returns the
forward-only context that evaluation/scoring.py and parallel.pipeline.forward.evaluate run. ModelSource,
TextTokenizer and run_tokenizer are the door's, named here for evaluation's callers.
"""

from __future__ import annotations

import torch

from checkpoint import CheckpointError
from config.schema import Config
from convert.open_model import ModelSource, TextTokenizer, open_config, open_model, run_tokenizer
from evaluation.documents import EvalInputError
from evaluation.scoring import EvalContext
from operations.guards import weights_are_finite
from operations.startup import DistEnv
from parallel.layout import Layout
from parallel.model_builder import rank_spec
from parallel.pipeline.plan import build_plan
from parallel.run_shape import RunShape
from parallel.state import ParallelState

__all__ = [
    "DTYPES",
    "INPUT_ERRORS",
    "ModelSource",
    "TextTokenizer",
    "load_model",
    "run_config",
    "run_tokenizer",
    "window_length",
]

DTYPES = ("fp32", "bf16")  # the precisions evaluation runs in (model.precision gives their torch dtypes)
# What bad input raises (config, layout, tokenizer, files, checkpoint): one line, exit 2.
INPUT_ERRORS = (ValueError, OSError, CheckpointError)


def run_config(
    checkpoint: str | None, hf: str | None, overrides: list[str], hf_option: str = "--hf DIR"
) -> tuple[Config, ModelSource]:
    """The run config to evaluate with and the weights' source (convert/open_model.py opens both): a
    checkpoint brings its saved config without the sections of the run that trained it (the overrides choose
    the layout here), a transformers folder its model and tokenizer; dropout is off. A transformers folder
    given as the checkpoint is refused with `hf_option`, how the caller's user names a transformers folder."""
    source = ModelSource.given(checkpoint, hf, hf_option)
    return open_config(source, overrides), source


def load_model(
    config: Config, source: ModelSource, layout: Layout, env: DistEnv, dtype: torch.dtype = torch.float32
) -> EvalContext:
    """This rank's chunks of the model in `source`, at `layout`, in eval mode (collective under torchrun; the
    state's collectives recorded by the world door's recorder, `env.comm`)."""
    state = ParallelState.from_layout(layout, env.comm.recorder)
    chunks = open_model(
        config, source, state, env.device, dtype, rank_spec(config.model, state, layout.sequence_parallel)
    )
    if not weights_are_finite(chunks, state, env.device):
        raise EvalInputError(source.broken_weights())
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
