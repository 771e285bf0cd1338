"""Compatibility with the torch versions the project runs on (2.11 on the GPU machines, 2.13 here).

`torch_private.py` is the one place that names private torch attributes; every package may import it (it
imports torch only, never torch.distributed), and tests/test_torch_private.py pins each name to the installed
torch.
"""
