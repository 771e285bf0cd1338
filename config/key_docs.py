"""What each config section and key does, in one place: docs/configuration.md is generated from these texts
and the dataclasses of config/schema.py (types, defaults) by tools/config_reference.py, and a test fails when a
key of the schema has no text here or the committed page differs from a fresh one.

A key added to a section needs its line here; say what the trainer does with the value, its choices, and what
the default means when it is derived (None).
"""

from __future__ import annotations

SECTION_DOCS: dict[str, str] = {
    "model": "The GPT itself (model/config.py): its shape, GPT-2 or Llama style, dropout, init and fused kernels.",
    "parallel": "How the ranks split the work: tp, cp, pp, vp, dp (the rest of the world), schedules, FSDP, timeouts.",
    "train": "The training loop: batch sizes, iterations, precision, recomputation, evaluation, stopping, device.",
    "optim": "AdamW, its learning-rate schedule and fp16's dynamic loss scaler (training/optimizer.py).",
    "data": "Where tokens come from (Megatron's .bin/.idx, or the bundled sample corpus), tokenizers, samples.",
    "checkpoint": "Saving and resuming (training/checkpoint/): layout-free checkpoints under run.dir/checkpoints.",
    "logging": "The console line, metrics.jsonl, TensorBoard, Weights & Biases and the straggler report.",
    "eval": "Zero-shot tasks (WikiText perplexity, LAMBADA accuracy): tools/evaluate.py and the trainer read them.",
    "run": "Where a run writes.",
}

KEY_DOCS: dict[str, dict[str, str]] = {
    "model": {
        "num_layers": "Transformer layers; must divide by parallel.pp_size x parallel.vp_size.",
        "hidden_size": "Width h of the residual stream; must divide by model.num_attention_heads.",
        "num_attention_heads": "Attention heads; must divide by parallel.tp_size.",
        "num_query_groups": "Grouped-query attention: key/value heads shared by groups of query heads. null: one "
        "group per head (multi-head attention).",
        "ffn_hidden_size": "Width of the MLP. null: 4h for gelu, Llama's 2/3 x 4h rounded up to a multiple of 64 "
        "for swiglu.",
        "seq_length": "Tokens per training sample.",
        "max_position_embeddings": "Positions the model has (learned embeddings' rows, the rotary table). null: "
        "model.seq_length.",
        "vocab_size": "Rows of the embedding before padding. null: the tokenizer's vocabulary size (a larger value "
        "is allowed; a smaller one is refused).",
        "make_vocab_size_divisible_by": "The embedding is padded to a multiple of this times parallel.tp_size "
        "(Megatron's rule); the padded rows are dropped on export.",
        "position_embedding_type": "learned (GPT-2: an embedding table) or rope (Llama: rotary embeddings).",
        "rotary_base": "Base of the rotary frequencies (with position_embedding_type=rope).",
        "normalization": "layernorm (GPT-2) or rmsnorm (Llama).",
        "norm_epsilon": "Epsilon of every LayerNorm / RMSNorm.",
        "activation": "MLP activation: gelu, gelu_tanh (GPT-2's gelu_new) or swiglu (Llama; fc1 holds gate and up).",
        "tie_embeddings": "The output layer shares the input embedding's weight (under pp the first and last stage "
        "each hold a copy, summed after backward).",
        "add_bias_linear": "Biases in the attention and MLP linears (false: Llama style).",
        "hidden_dropout": "Dropout after attention and MLP (before the residual add), and on the embeddings.",
        "attention_dropout": "Dropout on the attention probabilities (must be 0 with parallel.cp_size > 1).",
        "init_std": "Standard deviation of the normal init; the output projections of each layer use "
        "init_std / sqrt(2 x num_layers).",
        "fused_kernels": "Run the fused kernels of model/kernels/ (Triton on CUDA or with TRITON_INTERPRET=1, "
        "else their torch paths); docs/kernels.md.",
        "fused_kernel_names": "With fused_kernels: only these (norm, bias_gelu, swiglu, bias_dropout_add, rotary, "
        "linear_cross_entropy). null: all.",
    },
    "parallel": {
        "tp_size": "Tensor-parallel size: each layer's GEMMs split over tp ranks (Megatron's column/row split).",
        "pp_size": "Pipeline-parallel size: the layers cut into pp stages.",
        "vp_size": "Virtual pipeline stages (model chunks) per pipeline rank: 2 or more for the interleaved "
        "schedule, 2 for zb-v.",
        "cp_size": "Context-parallel size: each sequence cut into 2 x cp chunks over cp ranks, attention as a ring "
        "(model.seq_length must divide by 2 x cp).",
        "cp_attention_backend": "Block attention of the ring: torch (matmul + log-sum-exp). sdpa returns no "
        "log-sum-exp and is refused with cp_size > 1.",
        "sequence_parallel": "With tp > 1: norms, dropout and residuals work on 1/tp of the sequence; all-gather / "
        "reduce-scatter replace the all-reduces.",
        "distributed_optimizer": "ZeRO-1: the fp32 master weights and Adam moments sharded over dp (x cp); "
        "gradients reduce-scattered, parameters all-gathered.",
        "overlap_param_gather": "With the distributed optimizer: all-gather updated parameters in the background, "
        "each bucket waited for by the next forward (same numbers).",
        "schedule": "Pipeline schedule: gpipe, 1f1b, interleaved (vp_size > 1), zb-h1 or zb-v (vp_size=2, "
        "zero bubble). Rules: parallel/layout.py.",
        "scatter_gather": "The paper's section 4.1: with tp > 1 and no sequence parallelism, each tp rank sends 1/tp "
        "of an activation between stages and the receiver all-gathers it.",
        "overlap_p2p_comm": "Compute while a step's pipeline messages are in flight, unless the action needs them "
        "(same numbers).",
        "grad_bucket_size_mb": "Size in MiB of the gradient buckets whose dp all-reduce (or reduce-scatter) starts "
        "while backward runs.",
        "fsdp": "Sharded data parallelism (ZeRO-3) with torch's FSDP2 over the dp (x cp) ranks, one unit per "
        "layer; pp must be 1, instead of distributed_optimizer.",
        "fsdp_reshard_after_forward": "With fsdp: free each layer's gathered parameters after forward and gather "
        "again in backward (false: keep them, ZeRO-2 like).",
        "fsdp_replicate": "With fsdp: HSDP replicas of the sharded model (dp = fsdp_replicate x the shard group); "
        "1: plain FSDP.",
        "init_timeout_s": "Seconds a collective may wait during start-up (process groups, data indices, loading a "
        "checkpoint, the first iteration) and every checkpoint save; then the rank dumps diagnostics and exits 5. "
        "At least 1 s.",
        "train_timeout_s": "Seconds a collective may wait after the first iteration; a rank that makes no progress "
        "for this + 5 s is stopped by its watchdog (exit 5); docs/operations.md.",
    },
    "train": {
        "micro_batch_size": "Samples per micro-batch on each dp rank.",
        "global_batch_size": "Samples per iteration; must equal micro_batch_size x micro-batches x dp.",
        "train_iters": "Iterations to train (the run ends with a checkpoint of the last).",
        "seed": "Seed of the weights, dropout streams and the data order (0 to 2^32 - 1); every layout draws the "
        "same model from it.",
        "precision": "Parameter and compute dtype: fp32, bf16 or fp16 (with dynamic loss scaling); 16-bit keeps "
        "fp32 master weights and gradients.",
        "recompute": "Activation recomputation: none, selective (core attention) or full (whole layers).",
        "recompute_method": "With recompute=full: uniform (every layer) or block (the first recompute_num_layers "
        "of each model chunk).",
        "recompute_num_layers": "With recompute_method=block: layers recomputed per model chunk.",
        "eval_interval": "Validation every this many iterations, and at the end.",
        "eval_iters": "Validation batches per evaluation (0: no validation).",
        "exit_interval": "Stop (with a checkpoint) after an iteration that is a multiple of this; 0 = off.",
        "exit_duration_mins": "Stop (with a checkpoint) once the job has run this many minutes (from "
        "SLURM_JOB_START_TIME, else the process start); 0 = off.",
        "clip_grad": "Clip the global gradient norm to this (0: no clipping).",
        "max_nonfinite_iters": "This many iterations in a row with a non-finite loss or gradient norm (their "
        "updates skipped) stop the run with exit 4.",
        "device": "auto (CUDA if visible; refused where GPUs were allocated but none is visible), cuda or cpu.",
        "allow_gpu_sharing": "Allow more local ranks than visible GPUs (else an error).",
        "compile": "torch.compile each transformer layer (regional compilation).",
        "compile_backend": "torch.compile backend: inductor, aot_eager (tracing without code generation), eager "
        "or cudagraphs.",
        "num_threads": "Intra-op threads per rank; 0: OMP_NUM_THREADS, else the usable cores (affinity mask) / local "
        "ranks, never the machine's load (training/threads.py).",
    },
    "optim": {
        "lr": "Peak learning rate (after warm-up).",
        "min_lr": "Learning rate at the end of the decay (0 <= min_lr <= lr).",
        "weight_decay": "AdamW's decoupled weight decay (not applied to biases and norms).",
        "adam_beta1": "Adam's beta1.",
        "adam_beta2": "Adam's beta2.",
        "adam_eps": "Adam's epsilon.",
        "lr_warmup_iters": "Iterations of linear warm-up from 0 to lr.",
        "lr_decay_iters": "Iterations over which lr decays to min_lr (then it stays there). null: train.train_iters.",
        "lr_decay_style": "Decay shape: cosine, linear or constant (training/lr_schedule.py).",
        "initial_loss_scale": "fp16: the loss scale the run starts with.",
        "min_loss_scale": "fp16: the loss scale never goes below this; a scale stuck there counts as divergence.",
        "loss_scale_window": "fp16: after this many steps in a row without inf/NaN the loss scale doubles.",
        "hysteresis": "fp16: overflowing steps (counted since the scale last grew) before the loss scale is halved; "
        "each one after that halves it again.",
        "override_lr_schedule": "On resume, use this config's LR schedule instead of the checkpoint's (differences "
        "are logged either way).",
    },
    "data": {
        "data_path": "A blend of .bin/.idx prefixes: [prefix], [w1, prefix1, w2, prefix2] or [prefix1, prefix2] "
        "(by size); split by data.split. Empty: the bundled sample corpus.",
        "split": "Train, validation and test shares of data_path's documents, e.g. 969,30,1 (Megatron's order).",
        "train_data_path": "Megatron's separate splits: a blend list as data_path, all of its documents for "
        "training (instead of data_path and split).",
        "valid_data_path": "With train_data_path: the validation blend (no prefix of the training one).",
        "test_data_path": "With train_data_path: the test blend (no prefix of the training one).",
        "tokenizer_type": "GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer (a tokenizer.json) or "
        "NullTokenizer (the text is already ids; the vocabulary is model.vocab_size).",
        "vocab_file": "GPT-2 BPE vocab.json (relative: from the working directory, else the config file's folder).",
        "merge_file": "GPT-2 BPE merges.txt (relative paths as vocab_file).",
        "tokenizer_model": "SentencePiece .model, or a tokenizer.json (or its folder) for HuggingFaceTokenizer.",
        "use_sample_corpus": "With no data path: train on the sample corpus even where model.vocab_size is set for "
        "another tokenizer (speed measurements at that size); false refuses that.",
        "cache_dir": "Folder of the sample-index caches (Megatron's --data-cache-path). null: index-cache/ beside "
        "the first prefix.",
        "num_workers": "Data loader processes per rank (0: load in the training process).",
        "eod_mask_loss": "Give end-of-document tokens loss weight 0.",
        "reset_position_ids": "Restart position ids after each end-of-document token.",
        "reset_attention_mask": "Tokens after an end-of-document token do not attend to those before it.",
        "add_extra_token_to_sequence": "Megatron's: samples of seq_length + 1 tokens (inputs and shifted labels); "
        "false: exactly seq_length.",
        "drop_last_partial_validation_sequence": "Megatron's: drop the validation split's last partial sample.",
        "mid_level_dataset_surplus": "Megatron's: margin of extra samples each weighted blend component is built with.",
    },
    "checkpoint": {
        "save_interval": "Save every this many iterations (0: only at the end, at exit_interval and on a stop signal).",
        "load": "true: resume from the latest checkpoint under run.dir/checkpoints; a path: a checkpoints folder "
        "(its latest complete one) or one iter_XXXXXXX folder.",
        "save": "Write checkpoints (false: none, not even at the end).",
        "load_optimizer": "With load: restore the optimizer state (false: weights and counters, fresh optimizer).",
        "finetune": "Load weights only: iteration 0, fresh optimizer, LR schedule and data order; true with load, "
        "or a path to load that way.",
        "async_save": "Write checkpoints in a background thread; the loop waits only for a memory copy.",
        "keep_last": "Keep only the newest N checkpoints, older ones deleted after a newer one is complete "
        "(0: keep all).",
    },
    "logging": {
        "log_interval": "A console line and a metrics.jsonl record every this many iterations.",
        "tensorboard": "Also write the records to run.dir/tensorboard.",
        "peak_tflops": "Dense 16-bit peak TFLOP/s per GPU for MFU. null: the known peak of the CUDA device "
        "(A100, H100, H200, ...); none on CPU or for fp32.",
        "wandb_project": "Also log to this Weights & Biases project (needs `pip install wandb`); null: off.",
        "wandb_entity": "The W&B team or user; null: wandb's default.",
        "straggler_interval": "Every N iterations the slowest and fastest ranks' compute and wait times are "
        "logged (training/straggler.py); 0 = off.",
        "straggler_threshold": "Warn when a rank's compute is above its pipeline stage's median by more than this "
        "fraction in two reports in a row.",
    },
    "eval": {
        "interval": "The trainer runs the zero-shot tasks of the files given every this many iterations and at "
        "the end; 0 = never.",
        "wikitext_file": "A WikiText file (e.g. WikiText-103's wiki.test.tokens) for perplexity; docs/evaluation.md. "
        "Needs eval.interval.",
        "lambada_file": "lambada_test.jsonl of the GPT-2 release, for last-word accuracy. Needs eval.interval.",
        "seq_length": "Tokens per evaluation window. null: model.max_position_embeddings.",
        "overlapping_eval": "Megatron's WikiText windows: each window after the first scores its last N tokens.",
    },
    "run": {
        "dir": "Everything a run writes goes under it: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, "
        "diagnostics/, run.lock.",
    },
}
