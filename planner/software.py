"""What the training software does that the config does not say (this trainer, or Megatron-LM and DeepSpeed as the
paper ran them: planner/published.py), as the planner's time model and collective listing read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Software:
    """How a training program reduces gradients, exchanges pipeline messages and steps its optimizer.

    grad_reduce_bytes   bytes per gradient element it reduces over dp (this trainer: fp32 main grads)
    bucketed_grads      reduce in buckets of parallel.grad_bucket_size_mb (this trainer, PyTorch DDP); False:
                        one flattened all-reduce of the rank's gradients after the pipeline flush
    overlap_grad_reduce the buckets' reduction overlaps the last backward of each chunk
    planned_p2p         pipeline messages in this trainer's executor plan (p2p.plan_steps: batches posted
                        jointly, computing while one is in flight with parallel.overlap_p2p_comm); False: each
                        message sent synchronously by its producer and received just when needed (Megatron-LM
                        2021's schedules, whose batches pair a send with the next action's receive)
    step_bytes          HBM bytes its optimizer step moves per element of the rank's optimizer shard (this
                        trainer's AdamW reads grad, master, moments and writes master, moments)
    copy_bytes          HBM bytes per local parameter outside the shard (the grad-norm read, the 16-bit copy-back)

    Sharded data parallelism (ZeRO-3 / FSDP, parallel.fsdp; planner/sharded.py):
    gather_bytes        bytes per parameter element its all-gathers carry (0: the compute dtype's, as FSDP2's
                        MixedPrecisionPolicy(param_dtype) casts the fp32 shards before gathering)
    prefetch_params     parameters whose gather may run ahead of the compute that needs them: a layer's gather
                        hides behind the previous layer's compute up to this many of its parameters (FSDP2's
                        explicit prefetch: the whole next layer)
    gather_per_param    one collective per parameter (DeepSpeed 2021) instead of one per layer (FSDP2's units)
    sharded_bandwidth   the fraction of the cost model's collective bandwidth its sharded collectives reach (1:
                        NCCL's ring as planner/costs.py prices it)
    """

    grad_reduce_bytes: float = 4.0
    bucketed_grads: bool = True
    overlap_grad_reduce: bool = True
    planned_p2p: bool = True
    step_bytes: float = 28.0
    copy_bytes: float = 6.0
    gather_bytes: float = 0.0
    prefetch_params: float = float("inf")
    gather_per_param: bool = False
    sharded_bandwidth: float = 1.0


TRAINER = Software()
