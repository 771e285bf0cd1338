"""The experts of a Mixture-of-Experts layer: token permute / unpermute (megatron-core's moe_utils.permute and
unpermute, without token padding) and the routed experts' MLPs computed as one grouped matrix multiply over
the experts' token groups, with a per-expert loop as its reference.

Shapes: T tokens, E experts, h hidden, f the expert FFN width (2f rows of fc1 with SwiGLU: [gate; up]),
P = sum over experts of their token counts (T x k when nothing is dropped).
"""

from __future__ import annotations

import torch
from torch import nn

from compat import torch_private
from model import kernels
from model.kernels import KernelSelection, reference

# The per-expert loop, one torch.mm per group: the reference of both grouped multiplies (torch's, the kernel's)
loop_mm = reference.grouped_mm

# torch._grouped_mm's CUTLASS kernels need 16-byte aligned row strides (compat/torch_private.GROUPED_MM).
_GROUPED_MM_ALIGNMENT_BYTES = 16


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the tokens by expert: (permuted tokens [P, h], their routing weights [P], the token index of each
    row [P], tokens per expert [E]). Expert 0's tokens come first, each group in token order (a token routed to
    k experts appears k times). tokens [T, h], routing_map [T, E] bool, probs [T, E]."""
    num_tokens = tokens.shape[0]
    expert_major_map = routing_map.T.contiguous()  # [E, T]
    token_indices = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand_as(expert_major_map)
    sorted_indices = token_indices.masked_select(expert_major_map)  # [P]
    permuted_probs = probs.T.contiguous().masked_select(expert_major_map)  # [P]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices, expert_major_map.sum(dim=1)


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each token's rows back into token order: permuted [P, h] -> [T, h] (tokens no expert took: zeros)."""
    output = torch.zeros(num_tokens, permuted.shape[-1], dtype=permuted.dtype, device=permuted.device)
    return output.index_add_(0, sorted_indices, permuted)


def grouped_mm_applies(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's grouped matrix multiply takes these operands: it exists in this torch, both row widths
    are 16-byte aligned, and on CUDA the operands are bf16 (the dtype its grouped GEMM is built for; others take
    the loop)."""
    if torch_private.grouped_mm() is None:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    row_bytes = (weights.shape[-1] * x.element_size(), weights.shape[-2] * x.element_size())
    return all(width % _GROUPED_MM_ALIGNMENT_BYTES == 0 for width in row_bytes)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [P, K] in E consecutive groups of tokens_per_expert rows, weights [E, N, K] (nn.Linear's layout per
    expert) -> [P, N]: one grouped matrix multiply where `grouped_mm_applies`, else `loop_mm`."""
    grouped = torch_private.grouped_mm()
    if grouped is None or not grouped_mm_applies(x, weights):
        return loop_mm(x, weights, tokens_per_expert)
    offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)  # each group's end row
    # grouped_mm's backward fails on a zero-stride (expanded) gradient: contiguous() gives it a real one.
    return _ContiguousGradient.apply(grouped(x.contiguous(), weights.transpose(-2, -1), offs=offsets))


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (torch._grouped_mm's backward refuses
    the expanded gradient of a .sum(), for one)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """E expert MLPs (h -> f -> h, GeLU or SwiGLU) stored as stacked weights: fc1_weight [E, f(x2), h],
    fc2_weight [E, h, f] (each expert's slice in nn.Linear's [out, in] layout, transformers' gate_up_proj /
    down_proj), biases fc1_bias [E, f(x2)] and fc2_bias [E, h] when `bias`.

    As megatron-core's experts do, the routing weight multiplies the activation (before fc2) and fc2's bias,
    so the unpermuted sum is the weighted sum of the experts' outputs.

    The grouped multiplies run as the Triton kernel when `kernels` selects grouped_mm (model.fused_kernels /
    model.fused_kernel_names) and Triton runs, else as torch's grouped_mm (`use_grouped_mm`, where it applies)
    or the per-expert loop.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_size: int,
        activation: str,
        bias: bool,
        use_grouped_mm: bool,
        kernels: KernelSelection | None = None,
    ):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.gelu_approximate = "tanh" if activation == "gelu_tanh" else "none"
        self.use_grouped_mm = use_grouped_mm
        self.kernels = kernels if kernels is not None else KernelSelection()  # None: no fused kernel
        stacked = 2 if self.swiglu else 1  # [gate; up]
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, ffn_size * stacked, hidden_size))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.fc1_bias = nn.Parameter(torch.zeros(num_experts, ffn_size * stacked)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    def reset_parameters(self, init_std: float, output_init_std: float) -> None:
        """Megatron's init: normal(0, init_std) for fc1, normal(0, output_init_std) for fc2, zero biases."""
        nn.init.normal_(self.fc1_weight, 0.0, init_std)
        nn.init.normal_(self.fc2_weight, 0.0, output_init_std)
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def matmul(self, x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [P, K] grouped by expert times each group's weights [E, N, K] (transposed) -> [P, N]."""
        if kernels.fuses_grouped_mm(self.kernels, x.device):
            return kernels.fused_grouped_mm(x, weights, tokens_per_expert, self.kernels)
        return (grouped_mm if self.use_grouped_mm else loop_mm)(x, weights, tokens_per_expert)

    def forward(self, permuted: torch.Tensor, probs: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """permuted [P, h] grouped by expert, probs [P], tokens_per_expert [E] -> weighted outputs [P, h]."""
        fc1_out = self.matmul(permuted, self.fc1_weight, tokens_per_expert)  # [P, f(x2)]
        rows_expert = None
        if self.fc1_bias is not None:
            rows_expert = torch.repeat_interleave(
                torch.arange(len(tokens_per_expert), device=permuted.device), tokens_per_expert
            )
            fc1_out = fc1_out + self.fc1_bias[rows_expert]
        if self.swiglu:
            activated = reference.bias_swiglu(fc1_out, None)
        else:
            activated = reference.bias_gelu(fc1_out, None, self.gelu_approximate)
        weighted = (activated * probs.unsqueeze(-1)).to(permuted.dtype)  # [P, f]
        out = self.matmul(weighted, self.fc2_weight, tokens_per_expert)  # [P, h]
        if self.fc2_bias is not None and rows_expert is not None:
            out = out + (self.fc2_bias[rows_expert] * probs.unsqueeze(-1)).to(out.dtype)
        return out


class SharedExperts(nn.Module):
    """The always-on expert(s) as one MLP of width `ffn_size` (megatron-core folds several shared experts into
    one wider MLP): fc1, fc2 as nn.Linear; with `gated`, the output is multiplied by sigmoid(gate_weight . x)
    per token (Qwen2-MoE's shared_expert_gate, gate_weight [1, h], no bias)."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: str, bias: bool, gated: bool):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.gelu_approximate = "tanh" if activation == "gelu_tanh" else "none"
        stacked = 2 if self.swiglu else 1
        self.fc1 = nn.Linear(hidden_size, ffn_size * stacked, bias=bias)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)
        self.gate_weight = nn.Parameter(torch.empty(1, hidden_size)) if gated else None

    def reset_parameters(self, init_std: float, output_init_std: float) -> None:
        """normal(0, init_std) for fc1 and the gate, normal(0, output_init_std) for fc2, zero biases."""
        for weight, std in ((self.fc1.weight, init_std), (self.fc2.weight, output_init_std)):
            nn.init.normal_(weight, 0.0, std)
        for bias in (self.fc1.bias, self.fc2.bias):
            if bias is not None:
                nn.init.zeros_(bias)
        if self.gate_weight is not None:
            nn.init.normal_(self.gate_weight, 0.0, init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T, h] -> [T, h]."""
        fc1_out = self.fc1(tokens)
        if self.swiglu:
            activated = reference.bias_swiglu(fc1_out, None)
        else:
            activated = reference.bias_gelu(fc1_out, None, self.gelu_approximate)
        out = self.fc2(activated)
        if self.gate_weight is not None:
            out = torch.sigmoid(nn.functional.linear(tokens, self.gate_weight)) * out
        return out
