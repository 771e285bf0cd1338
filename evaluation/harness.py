"""lm-evaluation-harness adapter: this project's model as the lm_eval model "ptdp", so that any harness task
runs on a checkpoint without converting it (and on a transformers folder through our model).

    python -m evaluation.harness --model ptdp --model_args checkpoint=runs/x/checkpoints --tasks lambada_openai
    torchrun --nproc-per-node 4 -m evaluation.harness --model ptdp \\
        --model_args checkpoint=runs/x/checkpoints,parallel.tp_size=2,parallel.pp_size=2 --tasks wikitext

`python -m evaluation.harness` is lm_eval's own command line (every option, task and output the same) with
"ptdp" registered first: lm_eval 0.4.13 finds models only in its registry, which nothing outside lm_eval fills
before its command line parses `--model` (no entry-point discovery). Later lm_eval versions read the
`lm_eval.models` entry point pyproject.toml declares, and plain `lm_eval --model ptdp` works there. From
Python, importing this module registers it: `lm_eval.simple_evaluate(model="ptdp", model_args="checkpoint=...")`.

model_args: `checkpoint=DIR` or `hf=DIR`, `dtype=fp32|bf16`, `max_length=N` (default: eval.seq_length, else
the model's positions), `max_gen_toks=N` (256), and any `section.key=value` override of the run config
(parallel.* choose the layout under torchrun). --batch_size is the windows per micro-batch. Under torchrun
every rank serves every request (the layout splits the model and, over dp, the windows), so lm_eval sees
one worker and its LOCAL_RANK 0 reports.

Requests are scored exactly as the harness's HuggingFace backend scores them (lm_eval/models/huggingface.py):
TemplateLM's (context, continuation) split, windows cut from the left to max_length + 1 tokens, rolling
windows after the end-of-document token; generation is greedy until a stop sequence, the end of document or
max_gen_toks.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from compat.optional import lm_eval_cli, lm_eval_evaluate_config, lm_eval_evaluator
from config.schema import ParallelConfig
from evaluation.model_source import DTYPES, INPUT_ERRORS, load_model, run_config, run_tokenizer, window_length
from evaluation.scoring import WindowScorer
from evaluation.windows import Window, continuation_window, rolling_windows
from model.precision import precision_dtype
from operations.guards import EXIT_HUNG
from operations.startup import check_devices, init_distributed
from parallel.group_setup import GroupCreationTimeout
from parallel.layout import layout_from_config

NAME = "ptdp"


def _overrides(model_args: dict[str, Any], batch_size: int, world_size: int) -> list[str]:
    """`section.key=value` overrides from the model_args that name config keys, plus the batching:
    --batch_size windows per micro-batch, one micro-batch per pipeline stage per step."""
    overrides = [f"{key}={value}" for key, value in model_args.items() if "." in key]
    given = {item.split("=", 1)[0] for item in overrides}
    if "train.micro_batch_size" not in given:
        overrides.append(f"train.micro_batch_size={batch_size}")
    if "train.global_batch_size" not in given:
        default = ParallelConfig()  # the sizes the config gives when model_args do not
        pp = int(model_args.get("parallel.pp_size", default.pp_size))
        tp = int(model_args.get("parallel.tp_size", default.tp_size))
        model_ranks = tp * pp * int(model_args.get("parallel.cp_size", default.cp_size))
        overrides.append(f"train.global_batch_size={batch_size * pp * max(world_size // model_ranks, 1)}")
    return overrides


@register_model(NAME)
class PTDPLM(TemplateLM):
    """A checkpoint of this trainer (any layout) or a transformers folder, served to lm_eval."""

    def __init__(
        self,
        checkpoint: str | None = None,
        hf: str | None = None,
        dtype: str = "fp32",
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,  # lm_eval passes its --device; the layout and train.device decide here
        max_batch_size: int | None = None,
        **model_args: Any,
    ):
        super().__init__()
        try:
            self._max_gen_toks = _whole_tokens("max_gen_toks", max_gen_toks)
            self._build(checkpoint, hf, dtype, batch_size, max_length, model_args)
        except INPUT_ERRORS as err:
            raise ModelInputError(str(err)) from None

    def _build(
        self,
        checkpoint: str | None,
        hf: str | None,
        dtype: str,
        batch_size: int | str,
        max_length: int | str | None,
        model_args: dict,
    ) -> None:
        unknown = [key for key in model_args if "." not in key]
        if unknown:
            raise ValueError(
                f"unknown ptdp model_args {', '.join(unknown)}: use checkpoint, hf, dtype, max_length, "
                f"max_gen_toks or section.key=value overrides"
            )
        # checked here, where it is named as the user gave it (the config would name eval.seq_length)
        length = None if max_length is None else _window_argument(max_length)
        if length is not None:
            model_args["eval.seq_length"] = length
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype} is not one of {', '.join(DTYPES)}")
        batch = int(batch_size) if str(batch_size).isdigit() else 1  # "auto": one window per micro-batch
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        config, source = run_config(checkpoint, hf, _overrides(model_args, batch, world_size), "hf=DIR")
        layout = layout_from_config(config, world_size)
        self.tokenizer = run_tokenizer(config)
        if length is not None and length > config.model.max_positions:
            raise ValueError(
                f"ptdp model_args max_length={length} is longer than the model's {config.model.max_positions} "
                f"positions (model.max_position_embeddings)"
            )
        self._max_length = window_length(config)
        env = init_distributed(
            check_devices(config.train, os.environ), config.train.num_threads, announce_threads=False
        )
        self.scorer = WindowScorer(load_model(config, source, layout, env, precision_dtype(dtype)), self.tokenizer.eod)
        self.source = source.describe()

    # ---- what TemplateLM asks of a model --------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each ((context, continuation), context ids, continuation ids)."""
        windows = [continuation_window(context, continuation, self.max_length) for _, context, continuation in requests]
        answers = [(score.total, score.all_greedy) for score in self.scorer.score(windows)]
        for (strings, _, _), answer in zip(requests, answers):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of each whole text, over the harness's rolling windows."""
        per_request = [
            rolling_windows(self.tok_encode(string), self.prefix_token_id, self.max_length)
            for (string,) in (request.args for request in requests)
        ]
        scores = iter(self.scorer.score([w for windows in per_request for w in windows]))
        totals = [sum(next(scores).total for _ in windows) for windows in per_request]
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (the end-of-document text among them)."""
        eos = self.tok_decode([self.eot_token_id])
        results = []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("the ptdp model generates greedily: do_sample=True is not supported")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = int(kwargs.pop("max_gen_toks"))
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks={budget} leaves no context in a window of {self.max_length} tokens")
            tokens = self.tok_encode(context)[-(self.max_length - budget) :] or [self.eot_token_id]
            text = self.tok_decode(self._greedy(tokens, budget, until))
            results.append(postprocess_generated_text(text, until, None))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), results[-1])
        return results

    def _greedy(self, context: list[int], budget: int, until: list[str]) -> list[int]:
        """Up to `budget` greedy tokens after `context` (a full forward per token, at any layout)."""
        generated: list[int] = []
        while len(generated) < budget:
            window = Window((*context, *generated, self.eot_token_id), 1)
            token = int(self.scorer.score([window])[0].argmax[0])
            if token == self.eot_token_id:
                break
            generated.append(token)
            if any(stop and stop in self.tok_decode(generated) for stop in until):
                break
        return generated


def _window_argument(max_length: int | float | str) -> int:
    """model_args max_length as tokens per window: a whole number >= 1, else a one-line error naming it."""
    try:
        length = int(max_length)
        whole = float(max_length) == length
    except (ValueError, OverflowError):  # text, nan; inf
        whole = False
    if not whole:
        raise ValueError(f"ptdp model_args max_length={max_length!r} is not a whole number of tokens")
    if length < 1:
        raise ValueError(
            f"ptdp model_args max_length={length} must be >= 1 (tokens per window; without it: eval.seq_length, "
            f"else the model's positions)"
        )
    return length


def _whole_tokens(name: str, value: int | float | str) -> int:
    """A model_args token count (`name`) as a whole number >= 1, else a one-line error naming it."""
    try:
        count = int(value)
        whole = float(value) == count
    except (ValueError, OverflowError):  # text, nan; inf
        whole = False
    if not whole or count < 1:
        raise ValueError(f"ptdp model_args {name}={value!r} must be a whole number of tokens >= 1")
    return count


class ModelInputError(ValueError):
    """The ptdp model could not be built from its model_args (a bad checkpoint, tokenizer, layout, ...)."""


def refused_by_lm_eval(err: Exception) -> bool:
    """Whether lm_eval's checks of its own command line raised `err` (its option checks in
    lm_eval/config/evaluate_config.py: an unknown task, conflicting options; simple_evaluate's checks before
    any model is built: no task). Raised anywhere else, a ValueError is a fault and keeps its traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return False
    raised_in = frames[-1]
    return raised_in.filename == lm_eval_evaluate_config().__file__ or (
        raised_in.filename == lm_eval_evaluator().__file__ and raised_in.name == "simple_evaluate"
    )


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line with the "ptdp" model registered; a bad model input or a command line lm_eval
    refuses (no task, an unknown task): one line, exit 2."""
    saved_argv = sys.argv
    if argv is not None:  # lm_eval's parser reads sys.argv
        sys.argv = [saved_argv[0], *argv]
    try:
        lm_eval_cli().cli_evaluate()
    except ModelInputError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr)
        return 2
    except GroupCreationTimeout as err:  # a rank that never joined: one line per rank, as the trainer says it
        print(f"error: {err}", file=sys.stderr)
        return EXIT_HUNG
    except ValueError as err:
        if not refused_by_lm_eval(err):
            raise
        if os.environ.get("RANK", "0") == "0":
            hint = " (--tasks NAME[,NAME...]; `python -m evaluation.harness ls tasks` lists them)"
            message = " ".join(str(err).split())  # lm_eval's message on one line
            print(f"error: {message}{hint if 'task' in message.lower() else ''}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved_argv
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
