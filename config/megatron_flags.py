"""Megatron-LM's command-line flags and the config keys that replace them: one table, read by the
trainer's error for a Megatron flag (`--train-iters 50` -> `train.train_iters=50`) and written out as
docs/megatron_flags.md (`python -m config.megatron_flags > docs/megatron_flags.md`; a test keeps the two equal).

Each entry: flag -> (override, note). The override is `section.key={}` for a flag that takes a value (the
value goes in the braces), or a complete `section.key=value` for a switch such as `--bf16`.
"""

from __future__ import annotations

MEGATRON_FLAGS: dict[str, tuple[str, str]] = {
    # model
    "--num-layers": ("model.num_layers={}", ""),
    "--hidden-size": ("model.hidden_size={}", ""),
    "--num-attention-heads": ("model.num_attention_heads={}", ""),
    "--num-query-groups": ("model.num_query_groups={}", "with --group-query-attention"),
    "--ffn-hidden-size": ("model.ffn_hidden_size={}", ""),
    "--seq-length": ("model.seq_length={}", ""),
    "--max-position-embeddings": ("model.max_position_embeddings={}", ""),
    "--make-vocab-size-divisible-by": ("model.make_vocab_size_divisible_by={}", ""),
    "--position-embedding-type": ("model.position_embedding_type={}", "learned_absolute is `learned`"),
    "--rotary-base": ("model.rotary_base={}", ""),
    "--normalization": ("model.normalization={}", "LayerNorm / RMSNorm: `layernorm` / `rmsnorm`"),
    "--norm-epsilon": ("model.norm_epsilon={}", ""),
    "--swiglu": ("model.activation=swiglu", ""),
    "--untie-embeddings-and-output-weights": ("model.tie_embeddings=false", ""),
    "--disable-bias-linear": ("model.add_bias_linear=false", ""),
    "--hidden-dropout": ("model.hidden_dropout={}", ""),
    "--attention-dropout": ("model.attention_dropout={}", ""),
    "--init-method-std": ("model.init_std={}", ""),
    # mixture of experts
    "--num-experts": ("model.num_experts={}", "unset or 0: dense"),
    "--moe-router-topk": ("model.moe_router_topk={}", ""),
    "--moe-ffn-hidden-size": ("model.moe_ffn_hidden_size={}", ""),
    "--moe-shared-expert-intermediate-size": ("model.moe_shared_expert_ffn_hidden_size={}", ""),
    "--moe-layer-freq": ("model.moe_layer_freq={}", "an int, or the list itself ([0,1,1,1]), not a Python expression"),
    "--moe-router-score-function": ("model.moe_router_score_function={}", "softmax / sigmoid"),
    "--moe-router-pre-softmax": ("model.moe_router_pre_softmax=true", ""),
    "--moe-router-topk-scaling-factor": ("model.moe_router_topk_scaling_factor={}", ""),
    "--moe-router-load-balancing-type": ("model.moe_router_load_balancing_type={}", "aux_loss / seq_aux_loss / none"),
    "--moe-aux-loss-coeff": ("model.moe_aux_loss_coeff={}", ""),
    "--moe-z-loss-coeff": ("model.moe_z_loss_coeff={}", ""),
    "--moe-router-enable-expert-bias": ("model.moe_router_enable_expert_bias=true", ""),
    "--moe-router-bias-update-rate": ("model.moe_router_bias_update_rate={}", ""),
    "--moe-expert-capacity-factor": ("model.moe_expert_capacity_factor={}", "unset: dropless"),
    "--moe-token-drop-policy": ("model.moe_token_drop_policy={}", "probs / position"),
    "--moe-pad-expert-input-to-capacity": ("model.moe_pad_expert_input_to_capacity=true", ""),
    # parallel
    "--tensor-model-parallel-size": ("parallel.tp_size={}", ""),
    "--pipeline-model-parallel-size": ("parallel.pp_size={}", ""),
    "--virtual-pipeline-model-parallel-size": ("parallel.vp_size={}", "implies parallel.schedule=interleaved"),
    "--num-layers-per-virtual-pipeline-stage": (
        "parallel.vp_size={}",
        "give vp = num_layers / (pp * this) instead",
    ),
    "--expert-model-parallel-size": (
        "parallel.ep_size={}",
        "divides dp x cp; experts are not split over tp (--expert-tensor-parallel-size 1)",
    ),
    "--sequence-parallel": ("parallel.sequence_parallel=true", ""),
    "--use-distributed-optimizer": ("parallel.distributed_optimizer=true", ""),
    "--use-torch-fsdp2": ("parallel.fsdp=true", "ZeRO-3 over dp x cp, with pp = 1"),
    "--overlap-p2p-communication": ("parallel.overlap_p2p_comm=true", "on by default here"),
    "--no-scatter-gather-tensors-in-pipeline": ("parallel.scatter_gather=false", ""),
    "--distributed-timeout-minutes": (
        "parallel.train_timeout_s=SECONDS",
        "in seconds (minutes x 60); start-up and checkpoint saves: parallel.init_timeout_s",
    ),
    # train
    "--micro-batch-size": ("train.micro_batch_size={}", ""),
    "--global-batch-size": ("train.global_batch_size={}", ""),
    "--train-iters": ("train.train_iters={}", ""),
    "--seed": ("train.seed={}", ""),
    "--bf16": ("train.precision=bf16", ""),
    "--fp16": ("train.precision=fp16", ""),
    "--recompute-granularity": ("train.recompute={}", "selective / full"),
    "--recompute-activations": ("train.recompute=selective", ""),
    "--recompute-method": ("train.recompute_method={}", "uniform / block"),
    "--recompute-num-layers": ("train.recompute_num_layers={}", ""),
    "--eval-interval": ("train.eval_interval={}", ""),
    "--eval-iters": ("train.eval_iters={}", ""),
    "--exit-interval": ("train.exit_interval={}", ""),
    "--exit-duration-in-mins": ("train.exit_duration_mins={}", ""),
    "--clip-grad": ("train.clip_grad={}", ""),
    # optim
    "--lr": ("optim.lr={}", ""),
    "--min-lr": ("optim.min_lr={}", ""),
    "--weight-decay": ("optim.weight_decay={}", ""),
    "--adam-beta1": ("optim.adam_beta1={}", ""),
    "--adam-beta2": ("optim.adam_beta2={}", ""),
    "--adam-eps": ("optim.adam_eps={}", ""),
    "--lr-warmup-iters": ("optim.lr_warmup_iters={}", ""),
    "--lr-decay-iters": ("optim.lr_decay_iters={}", ""),
    "--lr-decay-style": ("optim.lr_decay_style={}", "cosine / linear / constant"),
    "--initial-loss-scale": ("optim.initial_loss_scale={}", ""),
    "--min-loss-scale": ("optim.min_loss_scale={}", ""),
    "--loss-scale-window": ("optim.loss_scale_window={}", ""),
    "--hysteresis": ("optim.hysteresis={}", ""),
    "--override-opt_param-scheduler": ("optim.override_lr_schedule=true", ""),
    # data
    "--data-path": ("data.data_path=[{}]", "a YAML list: `[prefix]` or `[w1, prefix1, w2, prefix2]`"),
    "--train-data-path": ("data.train_data_path=[{}]", "a YAML list, as data.data_path"),
    "--valid-data-path": ("data.valid_data_path=[{}]", "a YAML list, as data.data_path"),
    "--test-data-path": ("data.test_data_path=[{}]", "a YAML list, as data.data_path"),
    "--split": ("data.split={}", ""),
    "--tokenizer-type": (
        "data.tokenizer_type={}",
        "GPT2BPETokenizer / SentencePieceTokenizer / HuggingFaceTokenizer / NullTokenizer (model.vocab_size = --vocab-size + 1)",
    ),
    "--vocab-file": ("data.vocab_file={}", ""),
    "--merge-file": ("data.merge_file={}", ""),
    "--tokenizer-model": ("data.tokenizer_model={}", "a .model file, or a tokenizer.json (or its folder)"),
    "--data-cache-path": ("data.cache_dir={}", "default: index-cache/ beside the first data prefix"),
    "--num-workers": ("data.num_workers={}", ""),
    "--eod-mask-loss": ("data.eod_mask_loss=true", ""),
    "--reset-position-ids": ("data.reset_position_ids=true", ""),
    "--reset-attention-mask": ("data.reset_attention_mask=true", ""),
    "--mock-data": ("data.use_sample_corpus=true", "the bundled sample corpus (real text) instead of mock data"),
    # checkpoint, logging, run
    "--save": ("run.dir={}", "checkpoints go to run.dir/checkpoints"),
    "--load": ("checkpoint.load={}", "a checkpoints folder or one iter_XXXXXXX; true = run.dir's"),
    "--save-interval": ("checkpoint.save_interval={}", ""),
    "--finetune": ("checkpoint.finetune=true", "with checkpoint.load"),
    "--no-load-optim": ("checkpoint.load_optimizer=false", ""),
    "--async-save": ("checkpoint.async_save=true", ""),
    "--log-interval": ("logging.log_interval={}", ""),
    "--log-straggler": ("logging.straggler_interval=100", "on by default (every 100 iterations; 0 = off)"),
    "--straggler-minmax-count": (
        "logging.straggler_interval=100",
        "the slowest and the fastest rank are logged; logging.straggler_threshold sets the warning",
    ),
    "--tensorboard-dir": ("logging.tensorboard=true", "written to run.dir/tensorboard"),
}


def megatron_hint(flag: str, value: str | None) -> str | None:
    """The override that replaces Megatron's `flag` (given `value` where it takes one), or None."""
    entry = MEGATRON_FLAGS.get(flag.split("=", 1)[0])
    if entry is None:
        return None
    override = entry[0]
    if "{}" in override:
        inline = flag.split("=", 1)[1] if "=" in flag else None
        override = override.format(inline or value or "VALUE")
    return override


def markdown_table() -> str:
    """docs/megatron_flags.md: the table above as Markdown."""
    lines = [
        "# Megatron-LM flags and their config keys",
        "",
        "The trainer takes `--config FILE` and `section.key=value` overrides only; a Megatron-LM flag is refused",
        "with the override that replaces it. Generated from `config/megatron_flags.py`",
        "(`python -m config.megatron_flags > docs/megatron_flags.md`).",
        "",
        "| Megatron-LM flag | override here | note |",
        "|---|---|---|",
    ]
    for flag, (override, note) in MEGATRON_FLAGS.items():
        lines.append(f"| `{flag}` | `{override.replace('{}', 'VALUE')}` | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
