"""Start-up pieces of a run: torch.distributed, the device, the data, the model chunks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from config.data_config import DataConfig
from config.schema import Config, TrainConfig
from data.blended_dataset import BlendedDataset
from data.builder import SPLIT_NAMES, BuildOptions, build_split_datasets, build_train_valid_test_datasets
from data.gpt_dataset import GPTDataset
from data.loader import build_data_iterator
from data.microbatch import Microbatch
from data.sample_corpus import VOCAB_SIZE as SAMPLE_VOCAB_SIZE
from data.sample_corpus import ensure_sample_corpus
from model.kernels.attention_backend import sdpa_backend
from operations.loader_workers import MicrobatchStream
from operations.preemption import ignore_stop_signals, stop_at_once
from operations.threads import ThreadPlan, log_thread_plan, set_threads
from parallel.comm import Collectives
from parallel.comm_recorder import CommRecorder
from parallel.group_setup import creating_group

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "gpt_tiny.yaml")  # the trainer's config without --config

Dataset = GPTDataset | BlendedDataset
DatasetSplits = tuple[Dataset | None, Dataset | None, Dataset | None]  # train, valid, test


@dataclass
class DistEnv:
    """This process in the world torchrun / srun started: ranks, device, thread plan, and the world's door.

    `comm` issues the collectives made before a ParallelState exists (the run lock, the start-up barriers) on
    the world group; `init_distributed` gives it a recorder, which the trainer's ParallelState then shares
    (training/run.py `build_state`), so those calls are in the rank's records and its hang report."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device
    threads: ThreadPlan | None = None  # the intra-op thread choice init_distributed applied (None: not chosen here)
    comm: Collectives = field(default_factory=Collectives)  # the world's door (parallel/comm.py)


def _gpus_allocated(environ) -> str | None:
    """Why this process is expected to have GPUs (the variable that says so), or None."""
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE"):
        value = environ.get(key, "").strip()
        allocated = (
            (value.isdigit() and int(value) > 0)
            if key == "SLURM_GPUS_ON_NODE"
            else value not in ("", "-1", "NoDevFiles")
        )
        if allocated:
            return f"{key}={value}"
    return None


def check_devices(train: TrainConfig, environ) -> bool:
    """Whether to run on CUDA (train.device), refusing a silent fallback: CPU where GPUs were allocated or
    asked for, and more local ranks than visible GPUs (unless train.allow_gpu_sharing). Raises ValueError."""
    if train.device == "cpu":
        return False
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        expected = "train.device=cuda" if train.device == "cuda" else _gpus_allocated(environ)
        if expected:
            raise ValueError(
                f"GPUs were expected ({expected}) but torch sees no CUDA device (torch "
                f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}): fix the driver or "
                f"the torch build, or set train.device=cpu to train on the CPU"
            )
        return False
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1")))
    if local_ranks > visible and not train.allow_gpu_sharing:
        raise ValueError(
            f"{local_ranks} ranks on this node but {visible} visible GPU(s): ranks would share "
            f"GPUs; start {visible} ranks per node, or set train.allow_gpu_sharing=true"
        )
    return True


def init_distributed(
    use_cuda: bool | None = None, num_threads: int = 0, announce_threads: bool = True, timeout_s: float | None = None
) -> DistEnv:
    """Join the process group torchrun / srun described in the environment (NCCL on GPUs, gloo on CPU).

    A plain `python pretrain_gpt.py` (no WORLD_SIZE) runs as one process without torch.distributed.
    `use_cuda` (from `check_devices`) defaults to whether CUDA is available; `num_threads` is
    train.num_threads (0: OMP_NUM_THREADS, else this rank's share of the usable cores, operations/threads.py);
    `announce_threads=False` keeps the thread count off stdout (tools whose stdout is their output);
    `timeout_s` bounds the world group's creation and collectives (parallel.init_timeout_s; None: torch's
    default); a creation that times out raises GroupCreationTimeout (parallel/group_setup.py), naming it.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available() if use_cuda is None else use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    plan = set_threads(num_threads, local_world_size)
    if announce_threads:
        log_thread_plan(plan, rank, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        with creating_group(f"the world process group ({world_size} ranks, {backend})", rank, timeout_s):
            if device.type == "cuda":  # binds the NCCL communicator to this rank's GPU at once
                dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device, timeout=timeout)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return DistEnv(world_size, rank, local_rank, local_world_size, device, plan, Collectives(CommRecorder()))


def barrier(env: DistEnv, comm: Collectives | None = None) -> None:
    """Every rank meets, through `comm` (None: the world's door, `env.comm`): recorded, and a timeout is a
    CollectiveError."""
    if env.world_size > 1:
        (comm if comm is not None else env.comm).barrier()


def check_sample_corpus_fits(config: Config) -> None:
    """With no data path the run trains on the bundled sample corpus, a byte-level corpus for the tiny configs.
    A config that fixes model.vocab_size to another size (GPT-2's 50257) was written for a corpus of its own:
    training it on the sample corpus would be silently wrong (and its index huge), so it is refused unless
    data.use_sample_corpus=true says it is meant (throughput measurements)."""
    vocab_size = config.model.vocab_size
    data = config.data
    if not data.has_data and not data.use_sample_corpus and vocab_size not in (None, SAMPLE_VOCAB_SIZE):
        raise ValueError(
            f"data.data_path is empty, so the run would train on the bundled sample corpus ({SAMPLE_VOCAB_SIZE} "
            f"byte-level tokens, for the tiny configs), but model.vocab_size={vocab_size} expects a tokenizer of "
            f"its own: set data.data_path (and the tokenizer keys) to your preprocessed corpus, or "
            f"data.use_sample_corpus=true to measure speed on the sample corpus"
        )


def resolve_sample_data(config: Config, env: DistEnv, logger, comm: Collectives | None = None) -> None:
    """With no data path, use the bundled sample corpus (built on first use by local rank 0; the others wait in
    a barrier through `comm`, when given)."""
    data = config.data
    if data.has_data:
        return
    check_sample_corpus_fits(config)
    root = os.path.join(REPO_ROOT, "sample_data")
    with stop_at_once("building the sample corpus"):
        if env.local_rank == 0:
            info = ensure_sample_corpus(root, progress=env.rank == 0)
        barrier(env, comm)
        if env.local_rank != 0:
            info = ensure_sample_corpus(root, progress=False)
    data.data_path = [info["data_prefix"]]
    data.tokenizer_type = info["tokenizer_type"]
    data.vocab_file, data.merge_file = info["vocab_file"], info["merge_file"]
    logger.info(f"data: sample corpus {info['data_prefix']}")


def build_options(data: DataConfig) -> BuildOptions:
    """The data section's Megatron GPTDatasetConfig options, as data/builder.py takes them."""
    return BuildOptions(
        extra_token=data.add_extra_token_to_sequence,
        drop_last_partial_validation=data.drop_last_partial_validation_sequence,
        mid_level_surplus=data.mid_level_dataset_surplus,
    )


def build_datasets(config: Config, env: DistEnv, gbs: int, comm: Collectives | None = None) -> DatasetSplits:
    """Train / valid / test datasets; rank 0 writes the index caches first, the others then map them.

    The test split is not built: the trainer never evaluates on it. A split with fewer samples than the
    run reads (an unweighted blend holds one epoch) is a one-line error. A stop signal while the indices are
    built ends the run at once (SetupInterrupted, exit 130).
    """
    train, data = config.train, config.data
    num_samples = (train.train_iters * gbs, train.eval_iters * gbs, 0)
    options = build_options(data)
    seq_length, split_paths = config.model.seq_length, tuple(getattr(data, key) for key in data.SPLIT_KEYS)

    def build():
        if data.data_path:
            return build_train_valid_test_datasets(
                data.data_path, data.split, seq_length, train.seed, num_samples, data.cache_dir, options
            )
        return build_split_datasets(split_paths, seq_length, train.seed, num_samples, data.cache_dir, options)

    with stop_at_once("building the data indices"):
        datasets: tuple | None = build() if env.rank == 0 else None
        barrier(env, comm)  # a start-up timeout here: rank 0's index building took longer than init_timeout_s
        datasets = datasets if datasets is not None else build()
    for k, (dataset, needed) in enumerate(zip(datasets, num_samples)):
        if needed and (dataset is None or len(dataset) < needed):
            raise ValueError(_short_split_message(data, k, 0 if dataset is None else len(dataset), needed))
    return datasets


def _short_split_message(data, k: int, have: int, needed: int) -> str:
    """One line for split k holding fewer samples than the run reads, naming the key to change."""
    blend = "an unweighted blend holds one epoch: give weights"
    if data.data_path:
        return (
            f"data.data_path: the {SPLIT_NAMES[k]} split gives {have} samples, the run reads {needed} "
            f"(data.split={data.split!r}; {blend})"
        )
    key = data.SPLIT_KEYS[k]
    if not getattr(data, key):
        return (
            f"data.{key} is not set but the run reads {needed} {SPLIT_NAMES[k]} samples: set it, or train.eval_iters=0"
        )
    return f"data.{key} gives {have} samples, the run reads {needed} ({blend})"


def check_vocab_size(model_vocab_size: int, tokenizer_vocab_size: int, data) -> None:
    """model.vocab_size below the tokenizer's would index past the embedding table: one-line error."""
    if model_vocab_size < tokenizer_vocab_size:
        source = data.vocab_file or data.tokenizer_model or data.tokenizer_type
        raise ValueError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab_size} entries in {source})"
        )


def data_iterator(
    config: Config,
    dataset,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
    eod_id: int,
    num_workers: int | None = None,
) -> MicrobatchStream:
    """This dp rank's micro-batches from `consumed_samples` on (data.num_workers loader processes unless
    `num_workers` says otherwise); a stream with workers is closed on every way out (operations/loader_workers.py)."""
    data = config.data

    def start() -> Iterator[Microbatch]:
        return build_data_iterator(
            dataset,
            consumed_samples,
            config.train.micro_batch_size,
            dp_rank,
            dp_size,
            data.num_workers if num_workers is None else num_workers,
            eod_id,
            data.eod_mask_loss,
            data.reset_position_ids,
            data.reset_attention_mask,
            data.add_extra_token_to_sequence,
            worker_init_fn=ignore_stop_signals,
        )

    return MicrobatchStream(start)


def log_kernel_choices(
    chunks: list, model_cfg, micro_batch_size: int, tp_size: int, device: torch.device, dtype: torch.dtype, logger
) -> None:
    """Log once which fused kernels run on which path (model/kernels) and which SDPA backend attention uses."""
    selection = chunks[0].kernels if chunks else model_cfg.kernel_selection()
    logger.info(
        f"{selection.describe(device)}; attention: scaled_dot_product_attention, backend "
        f"{sdpa_backend(model_cfg, micro_batch_size, tp_size, device, dtype)}"
    )
