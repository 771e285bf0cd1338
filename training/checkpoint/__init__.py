"""Layout-free checkpoints; the public API is training/checkpointing.py."""
