"""Model weights in and out of other formats, all through one global state dict.

The global state dict is what a single-process GPTModel holds (`layers.5.mlp.fc1.weight`, vocabulary rows
padded to ModelConfig.padded_vocab_size(1)). How each tensor is split over tp and which of its rows are real
comes from one record per parameter (model/param_info.Sharding, per global name from
parallel/tensor_parallel.param_shardings), so that trimming, padding and merging agree with the trainer.

    open_model.py     the one door to open a model (checkpoint or transformers folder): config, tokenizer,
                      weights placed at a layout (generation, evaluation and the converters use it)
    model_weights.py  our checkpoints of any layout <-> the global state dict; chunks at a layout filled from it
    hf_mapping.py     the global state dict <-> transformers' GPT-2 / Llama (names, QKV and SwiGLU layouts)
    hf_folder.py      transformers folders on disk (config.json, safetensors shards, tokenizer files)
    megatron.py       Megatron-LM checkpoints -> the global state dict (legacy "torch": tp / pp / vp shards merged)
    megatron_checks.py a Megatron-LM checkpoint checked against its args (rank folders, sizes, shard shapes)
    megatron_dist.py  Megatron-LM "torch_dist" folders read with torch.distributed.checkpoint (stacked layers)
    megatron_export.py the global state dict -> Megatron-LM's legacy "torch" format at a chosen tp / pp / vp
    safe_pickle.py    the allow-lists Megatron-LM's pickles are read with (no code runs on load)
    staging.py        outputs written whole or not at all (Ctrl-C, SIGTERM, a stale staging folder removed)

Used by tools/convert_checkpoint.py, tools/generate.py and evaluation/; nothing in the trainer imports this
package.
"""
