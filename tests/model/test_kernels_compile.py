"""The fused kernels as torch custom ops: torch.library.opcheck on each (schema, fake tensor, autograd
registration, AOT dispatch), and train.compile's regional compilation of a layer with every kernel on: no
graph break, and the same loss and gradients as eager. On CPU the kernels run in Triton's interpreter (the ops
are custom_ops there); on CUDA (scripts/gpu_check.sh) they are triton_ops and inductor compiles the layer."""

import pytest
import torch

from model.kernels.backend import interpreter_on, triton_installed, triton_runs

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_on() else "cpu"
BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"  # inductor on CPU would compile C++: slow, not the point
pytestmark = [
    pytest.mark.tier("fast"),
    pytest.mark.skipif(
        not (triton_installed() and triton_runs(DEVICE)), reason="needs Triton (CUDA, or the interpreter on CPU)"
    ),
]


def _t(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE).requires_grad_(grad)


def _op_samples():
    """(op, args) pairs covering every custom op, with and without the optional tensors."""
    from model.kernels.registry import register_kernel_ops

    ops = register_kernel_ops()

    x2d, w, b = _t(6, 40), _t(40), _t(40)
    _, mean, rstd = ops.norm_fwd(x2d.detach(), w.detach(), b.detach(), 1e-5, False)
    mask = (torch.rand(3, 2, 45, device=DEVICE) > 0.3).float() / 0.7
    cos, sin = torch.randn(6, 10, device=DEVICE), torch.randn(6, 10, device=DEVICE)
    group_ends = torch.tensor([4, 4, 9], dtype=torch.int32, device=DEVICE)  # 4, 0 and 5 rows
    return [
        (ops.bias_gelu, (_t(3, 2, 37), _t(37))),
        (ops.bias_gelu, (_t(1, 2, 50), None)),
        (ops.bias_gelu_bwd, (_t(3, 37, grad=False), _t(3, 37, grad=False), _t(37, grad=False))),
        (ops.bias_swiglu, (_t(3, 2, 74), _t(74))),
        (ops.bias_swiglu_bwd, (_t(3, 37, grad=False), _t(3, 74, grad=False), None)),
        (ops.bias_dropout_add, (_t(3, 2, 45), _t(45), _t(3, 2, 45), mask)),
        (ops.bias_dropout_add, (_t(3, 2, 45), None, _t(3, 2, 45), None)),
        (ops.mul, (_t(3, 45, grad=False), _t(3, 45, grad=False))),
        (ops.norm_fwd, (x2d, w, b, 1e-5, False)),
        (ops.norm_fwd, (_t(6, 64), _t(64), None, 1e-6, True)),
        (ops.norm_bwd, (_t(6, 40, grad=False), x2d.detach(), w.detach(), mean, rstd, True, False)),
        (ops.norm_bwd, (_t(6, 40, grad=False), x2d.detach(), w.detach(), mean, rstd, False, True)),
        (ops.rotate, (_t(3, 2, 4, 10), cos, sin, False)),
        (ops.grouped_mm, (_t(9, 8), _t(3, 12, 8), group_ends)),
        (ops.grouped_mm, (_t(9, 12, grad=False), _t(3, 12, 8, grad=False).transpose(-2, -1), group_ends)),  # dX
        (ops.grouped_mm_weight_grad, (_t(9, 12, grad=False), _t(9, 8, grad=False), group_ends)),
    ]


def test_opcheck_every_custom_op():
    from model.kernels.registry import register_kernel_ops

    ops = register_kernel_ops()

    samples = _op_samples()
    assert {op for op, _ in samples} == set(ops.custom_ops())
    # the AOT-dispatch check compiles each sample (slow in the interpreter): the compile tests below cover it
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for op, args in samples:
        torch.library.opcheck(op, args, test_utils=checks)


def _model(style: dict, dropout: float = 0.0):
    from model.config import ModelConfig
    from model.gpt import GPTModel

    cfg = ModelConfig(
        num_layers=2,
        hidden_size=24,
        num_attention_heads=2,
        seq_length=5,
        vocab_size=61,
        make_vocab_size_divisible_by=16,
        hidden_dropout=dropout,
        attention_dropout=0.0,
        fused_kernels=True,
        **style,
    )
    torch.manual_seed(0)
    return GPTModel(cfg, cfg.padded_vocab_size()).to(DEVICE)


STYLES = [
    dict(),  # GPT: LayerNorm with bias, bias + GeLU, learned positions
    dict(position_embedding_type="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False),
]


@pytest.mark.parametrize("style", STYLES, ids=["gpt", "llama"])
def test_compiled_layer_has_no_graph_break(style):
    """torch._dynamo.explain on one transformer layer, in training mode with hidden dropout (the fused
    bias-dropout-add draws its mask inside the graph)."""
    from model.gpt import rotary_cos_sin

    model = _model(style, dropout=0.1).train()
    layer = model.transformer_layers()[0][1]
    x = _t(5, 2, 24)
    rotary = None
    if style:
        positions = torch.arange(5, device=DEVICE).expand(2, 5)
        rotary = rotary_cos_sin(positions, model.cfg.head_dim, model.cfg.rotary_base, x.dtype)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(x, rotary, None)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("style", STYLES, ids=["gpt", "llama"])
def test_compiled_model_matches_eager(style):
    """train.compile's path (GPTModel.compile_layers): loss and gradients equal eager within fp32 tolerance,
    and dynamo records no graph break while it compiles the layers."""
    from torch._dynamo.utils import counters

    eager, compiled = _model(style), _model(style)
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_layers(BACKEND)
    ids = torch.randint(0, 61, (2, 5), device=DEVICE)
    positions = torch.arange(5, device=DEVICE).expand(2, 5)
    results = []
    for model in (eager, compiled):
        loss = model(ids, positions, labels=ids.roll(1, 1)).mean()
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for actual, expected in zip(grads_c, grads_e):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)


def test_experts_with_the_grouped_mm_kernel_have_no_graph_break():
    """The kernel finds each program's group on the device, so a compiled MoE experts block holds no graph
    break (the per-expert loop reads the counts on the host: one break per multiply)."""
    from model import kernels
    from model.moe.experts import GroupedExperts

    selection = kernels.KernelSelection.of(True, ["grouped_mm"]).registered()
    experts = GroupedExperts(4, 16, 12, "swiglu", False, use_grouped_mm=False, kernels=selection).to(DEVICE)
    experts.reset_parameters(0.3, 0.2)
    inputs = (_t(11, 16), torch.rand(11, device=DEVICE), torch.tensor([3, 0, 6, 2], device=DEVICE))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(experts)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
