"""Generate text from a checkpoint (any layout) or a transformers folder, with a KV cache.

examples:
  python tools/generate.py --checkpoint runs/gpt_tiny/checkpoints --prompt "def main(" --max-new-tokens 200
  echo "import os" | python tools/generate.py --checkpoint runs/gpt_tiny/checkpoints --greedy
  python tools/generate.py --checkpoint hf/gpt_tiny --top-k 40 --temperature 0.7 --seed 3
  torchrun --nproc-per-node 2 tools/generate.py --checkpoint runs/gpt_tiny/checkpoints   # tensor parallel

Without --prompt, a prompt piped on stdin is used; with neither, generation starts from the end-of-document
token (an unconditional sample). The text streams to stdout as it is produced (after the prompt); the
speed goes to stderr at the end. Generation stops at the end-of-document token or after --max-new-tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from operations.openmp_wait import passive_wait_default

# Before torch is imported: libgomp reads its wait policy once, when torch loads it (operations/openmp_wait.py).
os.environ.update(passive_wait_default(os.environ, sys.modules))

import torch
import torch.distributed as dist

from checkpoint import CheckpointError
from config.cli import numbers_as_values
from config.schema import PRECISIONS, ConfigError
from convert.hf_folder import HFFolderError
from convert.hf_mapping import UnsupportedModelError
from convert.open_model import ModelSource, open_config, open_model, run_tokenizer
from model.config import ModelConfig
from model.generation import SamplingConfig, generate_tokens
from model.precision import precision_dtype
from operations.guards import EXIT_HUNG, weights_are_finite
from operations.startup import init_distributed
from parallel.group_setup import GroupCreationTimeout
from parallel.layout import check_tensor_parallel
from parallel.state import ParallelState
from parallel.tensor_parallel import tp_comm
from parallel.tp_mappings import gather_from_tp_region

INPUT_ERRORS = (ValueError, OSError, CheckpointError, HFFolderError, UnsupportedModelError, ConfigError)


class StreamDecoder:
    """Turns a growing list of token ids into newly printable text (holding back split UTF-8 bytes)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            return ""
        new, self.printed = text[self.printed :], len(text)
        return new


def make_logits_fn(model, cfg: ModelConfig, state):
    """logits_fn(tokens, positions, cache) -> [b, s, vocab] (the vocabulary shards gathered over tp, through
    the state's door as the trainer's output layer gathers them: parallel/tp_mappings.py)."""
    output_comm = tp_comm(state, scope="output")

    def logits_fn(tokens, positions, cache):
        logits = model(tokens, positions, kv_cache=cache)  # [b, s, V/tp]
        return gather_from_tp_region(logits, output_comm)[..., : cfg.vocab_size]  # [b, s, V] (tp = 1: as is)

    return logits_fn


def read_prompt(args: argparse.Namespace, rank: int) -> str:
    if args.prompt is not None:
        return args.prompt
    if rank == 0 and not sys.stdin.isatty():
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"the prompt piped to stdin is not UTF-8 text (byte {err.start} of {len(data)}): pipe text, "
                f"or give --prompt"
            ) from None
    return ""


NUMBER_OPTIONS = ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--repetition-penalty", "--seed")


def shared_prompt(args: argparse.Namespace, env, tokenizer) -> tuple[str, list[int]]:
    """(prompt text, its ids) on every rank: stdin is read on rank 0 and its ids (or why it could not be read,
    raised on every rank, so no rank waits for a broadcast that never comes) sent to the others."""
    try:
        prompt, problem = read_prompt(args, env.rank), None
    except ValueError as err:
        prompt, problem = "", str(err)
    prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eod]
    if env.world_size > 1:  # every rank runs the same prompt
        holder: list[object] = [prompt_ids, problem]
        env.comm.broadcast_object_list(holder, src=0)
        prompt_ids, sent = holder
        problem = None if sent is None else str(sent)  # rank 0's reason (a str), or None
    if problem is not None:
        raise ValueError(problem)
    return prompt, prompt_ids


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoints folder, iter_XXXXXXX folder, or transformers model folder"
    )
    parser.add_argument("--prompt", default=None, help="prompt text (default: stdin if piped, else none)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=PRECISIONS, default="fp32")
    return parser.parse_args(numbers_as_values(argv, NUMBER_OPTIONS))  # `--temperature -1e-3`: refused in one line


def prepare(args: argparse.Namespace, env):
    """Model (tensor parallel over every rank under torchrun), tokenizer, sampling config, prompt ids."""
    sampling = SamplingConfig(args.greedy, args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    sampling.validate()
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    source = ModelSource.at(args.checkpoint)
    config = open_config(source)
    cfg = config.model
    check_tensor_parallel(cfg, env.world_size, sequence_parallel=False)
    # tp over every rank; its collectives (the logits' gather) recorded as the prompt's broadcast is (env.comm)
    state = (
        ParallelState.create(env.world_size, 1, recorder=env.comm.recorder)
        if env.world_size > 1
        else ParallelState.single()
    )
    # the weights before the tokenizer, as from-hf reads them: a config.json that disagrees with its weights
    # is named as such, not as a tokenizer of another vocabulary
    model = open_model(config, source, state, env.device, precision_dtype(args.dtype))[0]  # pp=1: the whole model
    # checked on every rank at once: NaN weights would fail deep inside sampling, or on one tp rank only
    if not weights_are_finite([model], state, env.device):
        raise ValueError(source.broken_weights())
    tokenizer = run_tokenizer(config)
    if env.rank == 0:
        print(f"loaded {source.describe()}", file=sys.stderr)  # which weights generate, when a run saves many
    return model, cfg, state, tokenizer, sampling


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        env = init_distributed(announce_threads=False)  # stdout is the generated text
    except GroupCreationTimeout as err:  # a rank that never joined: one line per rank, as the trainer says it
        print(f"error: {err}", file=sys.stderr)
        return EXIT_HUNG
    try:
        try:
            if not 0 <= args.seed < 2**64:  # torch.Generator's range (else "Overflow when unpacking long long")
                raise ValueError(f"--seed={args.seed} must be in [0, 2**64 - 1]")
            model, cfg, state, tokenizer, sampling = prepare(args, env)
            prompt, prompt_ids = shared_prompt(args, env, tokenizer)
            generator = torch.Generator().manual_seed(args.seed)
            tokens = generate_tokens(
                make_logits_fn(model, cfg, state),
                prompt_ids,
                args.max_new_tokens,
                sampling,
                tokenizer.eod,
                env.device,
                generator,
                max_length=cfg.max_positions,
            )
            stream(tokens, tokenizer, prompt, env.rank == 0)
        except INPUT_ERRORS as err:
            if env.rank == 0:
                print(f"error: {err}", file=sys.stderr)
            return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def stream(tokens, tokenizer, prompt: str, printing: bool) -> None:
    """Print the prompt, then each new piece of text as its token arrives; tokens/s to stderr."""
    decoder = StreamDecoder(tokenizer)
    if printing:
        print(prompt, end="", flush=True)
    started, count = time.perf_counter(), 0
    for token in tokens:
        count += 1
        text = decoder.add(token)
        if printing and text:
            print(text, end="", flush=True)
    elapsed = time.perf_counter() - started
    if printing:
        print(flush=True)
        print(
            f"[{count} tokens in {elapsed:.2f} s: {count / max(elapsed, 1e-9):.1f} tokens/s, "
            f"{1000 * elapsed / max(count, 1):.1f} ms/token]",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
