"""Evaluation beside training: zero-shot WikiText and LAMBADA as Megatron-LM and lm-evaluation-harness score
them, the loss over a .bin/.idx split as validation computes it, and the lm_eval model "ptdp".

documents (the files) -> windows (each convention's token windows) -> scoring (the windows through the
forward-only pipeline plan at any layout) -> tasks / dataset_loss (the figures); model_source loads a checkpoint
or a transformers folder; harness is the lm_eval adapter; in_training runs the tasks for the trainer (eval.*).
tools/evaluate.py is the command line; docs/evaluation.md the conventions.
"""
