"""The optimizers and what steps them: AdamW on flat fp32 shards with the distributed optimizer (optimizer.py),
the same AdamW on FSDP's shards (sharded_optimizer.py), the fp16 loss scaler (loss_scaler.py) and the learning
rate schedule (lr_schedule.py). Imported by the trainer and by checkpoint/ (what a checkpoint saves and loads);
imports config/, model/ and parallel/, never training/. Import the modules themselves: this file re-exports
nothing, so `import optim.lr_schedule` does not import FSDP through sharded_optimizer.py."""
