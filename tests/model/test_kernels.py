"""Every fused kernel against its plain-torch reference: forward, input and weight gradients, over odd shapes
(hidden not a power of two, sequence 1, vocabulary not a multiple of the block). On CPU the kernels run in
Triton's interpreter (fp32, tiny shapes: it is slow); on CUDA (scripts/gpu_check.sh) compiled, fp32 and bf16.
"""

import pytest
import torch
from torch import nn

from model.kernels import reference
from model.kernels.backend import interpreter_on, triton_installed, triton_runs
from model.kernels.cross_entropy import chunked_linear_cross_entropy

# tests/conftest.py turns the interpreter on before anything imports Triton (scripts/gpu_check.sh turns it off)
DEVICES = (["cpu"] if interpreter_on() else []) + (["cuda"] if torch.cuda.is_available() else [])
CASES = [(device, torch.float32) for device in DEVICES] + [("cuda", torch.bfloat16)] * torch.cuda.is_available()
pytestmark = [pytest.mark.tier("fast"), pytest.mark.skipif(not triton_installed(), reason="triton is not installed")]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Max-abs error within 1e-5 of the reference's max-abs (fp32), or a few bf16 ulps (bf16)."""
    rel = 1e-5 if dtype == torch.float32 else 2**-7
    scale = expected.float().abs().max().clamp_min(1e-12)
    error = (actual.float() - expected.float()).abs().max()
    assert error <= rel * scale, f"max error {error:.3g} > {rel:g} x {scale:.3g}"


def _leaf(*shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()


def check_fn(fused, ref, inputs, dtype):
    """Forward and the gradient of every input that requires one, fused vs reference."""
    outs_f, outs_r = fused(*inputs), ref(*inputs)
    outs_f = outs_f if isinstance(outs_f, tuple) else (outs_f,)
    outs_r = outs_r if isinstance(outs_r, tuple) else (outs_r,)
    weights = [torch.randn_like(out, dtype=torch.float32).to(out.dtype) for out in outs_r]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads_f = torch.autograd.grad(sum((o.float() * w.float()).sum() for o, w in zip(outs_f, weights)), leaves)
    grads_r = torch.autograd.grad(sum((o.float() * w.float()).sum() for o, w in zip(outs_r, weights)), leaves)
    for actual, expected in zip(outs_f + grads_f, outs_r + grads_r):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert_close(actual, expected, dtype)


def test_triton_runs_where_expected():
    assert triton_runs("cpu") == interpreter_on()
    assert triton_runs("cuda")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape,bias", [((3, 2, 37), True), ((1, 2, 50), False)])
def test_bias_gelu(device, dtype, shape, bias):
    from model.kernels.registry import register_kernel_ops

    ops = register_kernel_ops()

    y = _leaf(*shape, device=device, dtype=dtype)
    b = _leaf(shape[-1], device=device, dtype=dtype) if bias else None
    check_fn(ops.bias_gelu, reference.bias_gelu, (y, b), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape,bias", [((3, 2, 2 * 37), True), ((1, 1, 2 * 24), False)])
def test_bias_swiglu(device, dtype, shape, bias):
    from model.kernels.registry import register_kernel_ops

    ops = register_kernel_ops()

    y = _leaf(*shape, device=device, dtype=dtype)
    b = _leaf(shape[-1], device=device, dtype=dtype) if bias else None
    check_fn(ops.bias_swiglu, reference.bias_swiglu, (y, b), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("p,bias", [(0.0, True), (0.3, True), (0.3, False)])
def test_bias_dropout_add(device, dtype, p, bias):
    """The fused op draws its mask through the same dropout module from the same generator state: with one
    seed both give the same result (the mask itself, not only its statistics)."""
    from model import kernels

    y = _leaf(3, 1, 45, device=device, dtype=dtype)
    residual = _leaf(3, 1, 45, device=device, dtype=dtype)
    b = _leaf(45, device=device, dtype=dtype) if bias else None
    dropout = nn.Dropout(p)
    selection = kernels.KernelSelection(frozenset({"bias_dropout_add"})).registered()

    def fused(y, b, residual):
        torch.manual_seed(7)
        return kernels.bias_dropout_add(y, b, residual, dropout, p, True, selection)

    def ref(y, b, residual):
        torch.manual_seed(7)
        return reference.bias_dropout_add(y, b, residual, dropout)

    check_fn(fused, ref, (y, b, residual), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize(
    "kind,shape",
    [
        ("layernorm", (5, 2, 97)),
        ("layernorm_nobias", (1, 3, 40)),
        ("rmsnorm", (5, 2, 97)),
        ("rmsnorm", (1, 1, 64)),
        ("layernorm", (300, 2, 97)),
    ],
)  # 600 rows: several row blocks
def test_norms(device, dtype, kind, shape):
    from model.kernels.registry import register_kernel_ops

    ops = register_kernel_ops()

    hidden = shape[-1]
    x = _leaf(*shape, device=device, dtype=dtype, scale=3.0)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()
    if kind == "rmsnorm":
        check_fn(
            lambda x, w: ops.norm(x, w, None, 1e-5, True), lambda x, w: reference.rms_norm(x, w, 1e-5), (x, w), dtype
        )
        return
    b = _leaf(hidden, device=device, dtype=dtype, scale=0.1) if kind == "layernorm" else None
    check_fn(
        lambda x, w, b: ops.norm(x, w, b, 1e-5, False),
        lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
        (x, w, b),
        dtype,
    )


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("s,b,nq,nkv,d", [(3, 2, 4, 2, 10), (1, 2, 3, 3, 6)])
def test_rotary(device, dtype, s, b, nq, nkv, d):
    from model.gpt import rotary_cos_sin
    from model.kernels.registry import register_kernel_ops

    ops = register_kernel_ops()

    q = _leaf(s, b, nq, d, device=device, dtype=dtype)
    k = _leaf(s, b, nkv, d, device=device, dtype=dtype)
    positions = torch.randint(0, 50, (b, s), device=device)
    cos, sin = rotary_cos_sin(positions, d, 10000.0, dtype)
    check_fn(
        lambda q, k: ops.rotary_qk(q, k, cos, sin),
        lambda q, k: (reference.apply_rotary(q, cos, sin), reference.apply_rotary(k, cos, sin)),
        (q, k),
        dtype,
    )


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("s,b,h,vocab,num_valid,chunk", [(7, 2, 24, 300, 290, 4), (1, 3, 20, 77, 77, None)])
def test_chunked_linear_cross_entropy(device, dtype, use_triton, s, b, h, vocab, num_valid, chunk):
    hidden = _leaf(s, b, h, device=device, dtype=dtype)
    weight = _leaf(vocab, h, device=device, dtype=dtype, scale=0.5)
    labels = torch.randint(0, num_valid, (s, b), device=device)
    check_fn(
        lambda hd, w: chunked_linear_cross_entropy(
            hd, w, labels, 0, num_valid, chunk_tokens=chunk, use_triton=use_triton
        ),
        lambda hd, w: reference.linear_cross_entropy(hd, w, labels, num_valid),
        (hidden, weight),
        dtype,
    )


# bf16 runs on CPU too: the kernel multiplies in fp32 in the interpreter, and torch's CPU bf16 matmul accumulates
# in fp32, so both round each output once to bf16 (assert_close's bf16 bound: 2^-7 of the reference's max-abs)
GROUPED_MM_CASES = [(device, dtype) for device in DEVICES for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("device,dtype", GROUPED_MM_CASES)
@pytest.mark.parametrize(
    "tokens_per_expert,k,n",
    [
        ((5, 0, 40, 1, 0, 17), 24, 70),  # uneven, empty groups inside; a group and N over one tile (32 x 64)
        ((0, 9, 0), 37, 16),  # empty first and last groups, K not a multiple of anything
    ],
)
def test_grouped_mm(device, dtype, tokens_per_expert, k, n):
    """The experts' grouped multiply against the per-expert loop: output, and the gradients of the tokens (the
    same kernel on the transposed weights) and of each expert's weights (zero for an expert without tokens)."""
    from model import kernels

    selection = kernels.KernelSelection(frozenset({"grouped_mm"})).registered()
    counts = torch.tensor(tokens_per_expert, device=device)
    x = _leaf(int(counts.sum()), k, device=device, dtype=dtype)
    weights = _leaf(len(tokens_per_expert), n, k, device=device, dtype=dtype)
    check_fn(
        lambda x, w: kernels.fused_grouped_mm(x, w, counts, selection),
        lambda x, w: reference.grouped_mm(x, w, counts),
        (x, weights),
        dtype,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm_without_tokens(device):
    """No token for any expert (an expert-parallel rank can receive none): an empty output, zero gradients."""
    from model import kernels

    selection = kernels.KernelSelection(frozenset({"grouped_mm"})).registered()
    x = _leaf(0, 8, device=device, dtype=torch.float32)
    weights = _leaf(3, 16, 8, device=device, dtype=torch.float32)
    out = kernels.fused_grouped_mm(x, weights, torch.zeros(3, dtype=torch.int64, device=device), selection)
    assert out.shape == (0, 16)
    grad_x, grad_w = torch.autograd.grad(out.sum(), (x, weights))
    assert grad_x.shape == (0, 8) and torch.equal(grad_w, torch.zeros_like(weights))
    with pytest.raises(ValueError, match=r"grouped_mm: x is torch.float32 but the weights are torch.bfloat16"):
        kernels.fused_grouped_mm(x, weights.bfloat16(), torch.zeros(3, dtype=torch.int64), selection)


@pytest.mark.skipif(not interpreter_on(), reason="CPU experts test needs the interpreter")
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)])
def test_experts_take_the_kernel_when_selected(activation, bias, monkeypatch):
    """GroupedExperts with grouped_mm selected (model.fused_kernels) runs the kernel for fc1 and fc2, and equals
    the experts computed with the per-expert loop: output and every parameter's gradient."""
    from model import kernels
    from model.moe.experts import GroupedExperts

    selection = kernels.KernelSelection.of(True, ["grouped_mm"]).registered()
    torch.manual_seed(0)
    fused = GroupedExperts(4, 16, 12, activation, bias, use_grouped_mm=False, kernels=selection)
    fused.reset_parameters(0.3, 0.2)
    plain = GroupedExperts(4, 16, 12, activation, bias, use_grouped_mm=False)
    plain.load_state_dict(fused.state_dict())
    counts = torch.tensor([3, 0, 6, 2])
    permuted, probs = torch.randn(11, 16), torch.rand(11)
    launched = []
    kernel = kernels.fused_grouped_mm

    def counted(x, weights, tokens_per_expert, selection):
        launched.append(weights.shape)
        return kernel(x, weights, tokens_per_expert, selection)

    monkeypatch.setattr(kernels, "fused_grouped_mm", counted)
    outputs = [module(permuted, probs, counts) for module in (fused, plain)]
    assert launched == [fused.fc1_weight.shape, fused.fc2_weight.shape]
    assert_close(outputs[0], outputs[1], torch.float32)
    grads = [torch.autograd.grad(out.square().sum(), list(m.parameters())) for out, m in zip(outputs, (fused, plain))]
    for actual, expected in zip(*grads):
        assert_close(actual, expected, torch.float32)


@pytest.mark.skipif(not interpreter_on(), reason="CPU model test needs the interpreter")
def test_model_with_every_kernel_matches_reference():
    """A whole Llama-style and GPT-style model: fused kernels on (interpreter) vs off, loss and gradients."""
    from model.config import ModelConfig
    from model.gpt import GPTModel

    for style in (
        dict(),
        dict(
            position_embedding_type="rope",
            normalization="rmsnorm",
            activation="swiglu",
            add_bias_linear=False,
            num_query_groups=1,
        ),
    ):
        cfg = ModelConfig(
            num_layers=1,
            hidden_size=24,
            num_attention_heads=2,
            seq_length=5,
            vocab_size=61,
            make_vocab_size_divisible_by=16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **style,
        )
        fused_cfg = ModelConfig(**{**cfg.__dict__, "fused_kernels": True})
        torch.manual_seed(0)
        plain = GPTModel(cfg, cfg.padded_vocab_size())
        fused = GPTModel(fused_cfg, cfg.padded_vocab_size())
        fused.load_state_dict(plain.state_dict())
        ids = torch.randint(0, 61, (2, 5))
        positions = torch.arange(5).expand(2, 5)
        losses = [model(ids, positions, labels=ids.roll(1, 1)) for model in (plain, fused)]
        assert_close(losses[1], losses[0], torch.float32)
        grads = [
            torch.autograd.grad(loss.mean(), list(model.parameters())) for loss, model in zip(losses, (plain, fused))
        ]
        for actual, expected in zip(grads[1], grads[0]):
            assert_close(actual, expected, torch.float32)


def test_kernel_selection_from_config_and_errors():
    from model.config import ModelConfig
    from model.kernels import KERNEL_NAMES, KernelSelection

    assert ModelConfig().kernel_selection().names == frozenset()
    assert ModelConfig(fused_kernels=True).kernel_selection().names == frozenset(KERNEL_NAMES)
    subset = ModelConfig(fused_kernels=True, fused_kernel_names=["norm", "rotary"])
    subset.validate()
    assert subset.kernel_selection().names == {"norm", "rotary"}
    assert subset.kernel_selection() == KernelSelection.of(True, ["rotary", "norm"])
    with pytest.raises(ValueError, match=r"model\.fused_kernel_names: 'normm' is not one of norm, bias_gelu"):
        ModelConfig(fused_kernels=True, fused_kernel_names=["normm"]).validate()
    with pytest.raises(ValueError, match=r"model\.fused_kernel_names=\['norm'\] needs model\.fused_kernels=true"):
        ModelConfig(fused_kernel_names=["norm"]).validate()


def test_ops_are_registered_by_the_build_not_on_import():
    """Importing the model registers no op; building a model with fused kernels registers them all, once: a
    second build (or call) looks them up; a selection never registered says how to get its ops."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    code = (
        "import torch, model.gpt, model.kernels, model.kernels.ops, model.kernels.registry as r\n"
        "ns = torch.ops.gpt_kernels\n"
        "assert not any(hasattr(ns, name) for name in r.OP_TABLE)\n"
        "from model.config import ModelConfig\n"
        "cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=50, fused_kernels=True)\n"
        "with torch.device('meta'):\n"
        "    first, second = model.gpt.GPTModel(cfg, 64), model.gpt.GPTModel(cfg, 64)\n"
        "assert all(hasattr(ns, name) for name in r.OP_TABLE)\n"
        "assert first.kernels.fused_ops() == second.kernels.fused_ops() == r.register_kernel_ops()\n"
        "assert first.layers['0'].mlp.kernels is first.kernels\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
    from model.kernels import KernelSelection

    with pytest.raises(RuntimeError, match=r"never registered: build the model from a RankSpec"):
        KernelSelection(frozenset({"norm"})).fused_ops()


def test_cpu_without_interpreter_runs_the_torch_path(monkeypatch):
    """fused_kernels=true on a CPU without TRITON_INTERPRET: references and the chunked torch loss, and the
    log line says so."""
    from model.config import ModelConfig
    from model.gpt import GPTModel

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=4,
        vocab_size=50,
        make_vocab_size_divisible_by=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fused_cfg = ModelConfig(**{**cfg.__dict__, "fused_kernels": True})
    assert "on the torch path" in fused_cfg.kernel_selection().describe("cpu")
    torch.manual_seed(0)
    plain, fused = GPTModel(cfg, 64), GPTModel(fused_cfg, 64)
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 50, (2, 4))
    positions = torch.arange(4).expand(2, 4)
    assert_close(fused(ids, positions, labels=ids), plain(ids, positions, labels=ids), torch.float32)
