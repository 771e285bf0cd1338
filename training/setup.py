"""Start-up pieces of a run: torch.distributed, the device, the data, the model chunks."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from data.blended_dataset import BlendedDataset
from data.builder import build_train_valid_test_datasets
from data.gpt_dataset import GPTDataset
from data.loader import build_data_iterator
from data.sample_corpus import ensure_sample_corpus
from training.config import Config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Dataset = Union[GPTDataset, BlendedDataset]
DatasetSplits = tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]  # train, valid, test


@dataclass
class DistEnv:
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device


def init_distributed() -> DistEnv:
    """Join the process group torchrun / srun described in the environment (NCCL on GPUs, gloo on CPU).

    A plain `python pretrain_gpt.py` (no WORLD_SIZE) runs as one process without torch.distributed.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Ranks on one CPU share its cores: give each an equal slice instead of every rank taking them all.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world_size, 1)))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return DistEnv(world_size, rank, local_rank, local_world_size, device)


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def resolve_sample_data(config: Config, env: DistEnv, logger) -> None:
    """With no data.data_path, use the bundled sample corpus (built on first use by local rank 0)."""
    data = config.data
    if data.data_path:
        return
    root = os.path.join(REPO_ROOT, "sample_data")
    if env.local_rank == 0:
        info = ensure_sample_corpus(root, progress=env.rank == 0)
    barrier(env)
    if env.local_rank != 0:
        info = ensure_sample_corpus(root, progress=False)
    data.data_path = [info["data_prefix"]]
    data.tokenizer_type = info["tokenizer_type"]
    data.vocab_file, data.merge_file = info["vocab_file"], info["merge_file"]
    logger.info(f"data: sample corpus {info['data_prefix']}")


def build_datasets(config: Config, env: DistEnv, gbs: int) -> DatasetSplits:
    """Train / valid / test datasets; rank 0 writes the index caches first, the others then map them."""
    train = config.train
    num_samples = (train.train_iters * gbs, max(train.eval_iters, 1) * gbs, max(train.eval_iters, 1) * gbs)

    def build():
        return build_train_valid_test_datasets(
            config.data.data_path, config.data.split, config.model.seq_length, train.seed, num_samples,
            config.data.cache_dir)

    datasets: Optional[tuple] = build() if env.rank == 0 else None
    barrier(env)
    return datasets if datasets is not None else build()


def data_iterator(config: Config, dataset, consumed_samples: int, dp_rank: int, dp_size: int,
                  eod_id: int, num_workers: Optional[int] = None):
    data = config.data
    return build_data_iterator(
        dataset, consumed_samples, config.train.micro_batch_size, dp_rank, dp_size,
        data.num_workers if num_workers is None else num_workers, eod_id, data.eod_mask_loss,
        data.reset_position_ids, data.reset_attention_mask)


def param_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def log_kernel_choices(chunks: list, model_cfg, micro_batch_size: int, tp_size: int, device: torch.device,
                       dtype: torch.dtype, logger) -> None:
    """Log once which fused kernels run on which path (model/kernels) and which SDPA backend attention uses."""
    from model.kernels import KernelSelection
    from model.kernels.attention_backend import sdpa_backend
    selection = chunks[0].kernels if chunks else KernelSelection.from_model_config(model_cfg)
    logger.info(f"{selection.describe(device)}; attention: scaled_dot_product_attention, backend "
                f"{sdpa_backend(model_cfg, micro_batch_size, tp_size, device, dtype)}")
