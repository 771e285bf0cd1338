"""Mixture of Experts, the model side (one process): the router's arithmetic (routing.py, as megatron-core
0.16.1's moe_utils computes it), token permute / unpermute and the experts' grouped matrix multiply
(experts.py), and the layer that puts them in place of the dense MLP (layer.py). Expert parallelism is applied
from parallel/, as every other split is.
"""
