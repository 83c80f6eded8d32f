"""The Triton GDN output norm and the grouped-norm dispatch (interpreted on CPU) against the eager references."""

import pytest

pytest.importorskip("triton")

import torch
from conftest import on_device

import qwen4exp.ops as ops
from qwen4exp.ops import norm
from qwen4exp.ops.norm_triton import gated_rms_norm

gated_rms_norm = on_device(gated_rms_norm)


def _tolerance(dtype):
    # bf16: an ulp of the normalised value where rstd differs in its last fp32 bits (sums of squares reduced in
    # another order, the GPU's approximate rsqrt against eager's) grows to at most two ulps of the output through
    # the weight and gate products (seen once in 672 values on the H200); the interpreter truncates its casts
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_gated_norm_matches_reference_on_strided_gates(dtype, activation, tokens):
    """x [T, heads, D] and the gate as a strided view of a wider projection (as GDN's z); rows past a program's
    block masked."""
    heads, D = 6, 32
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, heads, D, generator=g) * 3).to(dtype)
    proj = (torch.randn(tokens, heads * D + 40, generator=g) * 2).to(dtype)
    gate = proj[:, 8: 8 + heads * D].reshape(tokens, heads, D)
    weight = (torch.rand(D, generator=g) + 0.5).to(dtype)
    out = gated_rms_norm(x, gate, weight, 1e-6, activation)
    ref = norm.gated_rms_norm.eager(x, gate, weight, 1e-6, activation)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), **_tolerance(dtype))
    # rounded where the reference rounds: a differing bf16 value is a rare ulp of rstd, not a rounding step
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 1e-2
    other = norm.gated_rms_norm.eager(x, gate, weight, 1e-6, "silu" if activation == "sigmoid" else "sigmoid")
    assert not torch.allclose(out.float(), other.float(), **_tolerance(dtype)), "the activation must matter"


def test_gated_norm_of_flat_rows():
    g = torch.Generator().manual_seed(5)
    x, gate = torch.randn(2, 70, 16, generator=g)
    weight = torch.rand(16, generator=g)
    torch.testing.assert_close(gated_rms_norm(x, gate, weight, 1e-6, "sigmoid"),
                               norm.gated_rms_norm.eager(x, gate, weight, 1e-6, "sigmoid"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatchers_take_the_kernels_from_the_token_threshold(dtype, monkeypatch):
    """With the fast path on (the CPU runs the kernels in the interpreter), steps at the threshold go through the
    Triton passes and agree with the references; the grouped norm normalises each group on its own."""
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    monkeypatch.setattr(ops.tuning, "TRITON_NORM_MIN_TOKENS", 8)
    calls = []
    from qwen4exp.ops import hyper_connection_triton, norm_triton

    for module, name in ((hyper_connection_triton, "hc_prenorm"), (norm_triton, "gated_rms_norm")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    # the dispatchers take tensors where the kernels run (the GPU when there is one, else the interpreter)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(9)
    groups, size = 4, 32
    for tokens in (7, 8):
        x = (torch.randn(tokens, groups * size, generator=g) * torch.tensor([1.0, 4, 0.5, 9]).repeat_interleave(size)
             ).to(dev, dtype)
        w = (torch.randn(groups * size, generator=g) * 0.1).to(dev, dtype)
        torch.testing.assert_close(norm.rms_norm_op(x, w, 1e-6, size).float(),
                                   norm.rms_norm.eager(x, w, 1e-6, size).float(), **_tolerance(dtype))
        xg, gate = (torch.randn(tokens, 3, size, generator=g).to(dev, dtype) for _ in range(2))
        wg = torch.rand(size, generator=g).to(dev, dtype)
        torch.testing.assert_close(norm.gated_rms_norm_op(xg, gate, wg, 1e-6, "silu").float(),
                                   norm.gated_rms_norm.eager(xg, gate, wg, 1e-6, "silu").float(), **_tolerance(dtype))
    assert calls == ["hc_prenorm", "gated_rms_norm"], calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,D,rot", [(1, 24, 64, 16), (37, 3, 32, 32), (5, 2, 128, 32), (20, 4, 16, 8)])
def test_norm_rope_matches_norm_then_rope(dtype, tokens, heads, D, rot):
    """The per-head norm and the partial NeoX rotation in one pass, on the query's layout (a [T, heads, D] view of a
    projection that packs another D per head): in fp32 as the two references; in bf16 equal to the norm's rounded
    output rotated in fp32 and rounded once (what the compiled rotation computes) up to an ulp where the rstd's last
    bits differ, and within the eager reference's bf16 rounding."""
    from qwen4exp.ops.rotary import apply_rope, rope_cos_sin
    from qwen4exp.ops.rotary_triton import rms_norm_rope

    g = torch.Generator().manual_seed(tokens * heads + D)
    packed = (torch.randn(tokens, heads, 2 * D, generator=g) * 3).to(dtype)
    x = packed[..., :D]  # strided, as q is after the chunk of q_proj's [q | gate] heads
    w = (torch.randn(D, generator=g) * 0.2).to(dtype)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    cos, sin = rope_cos_sin.eager(torch.arange(7, 7 + tokens), inv_freq, dtype)
    got = on_device(rms_norm_rope)(x, w, 1e-6, cos, sin)
    normed = norm.rms_norm.eager(x, w, 1e-6)
    want = apply_rope.eager(normed, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    # the eager rotation rounds both products to bf16 too: where they nearly cancel, that is an ulp of the products
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-7)
    c, s = cos[:, None].float(), sin[:, None].float()
    n = normed.float()
    rotated = torch.cat((-n[..., rot // 2: rot], n[..., : rot // 2]), dim=-1)
    once = torch.cat((n[..., :rot] * c + rotated * s, n[..., rot:]), dim=-1).to(dtype)
    assert (got == once).float().mean() > 0.97
    torch.testing.assert_close(got, once, rtol=2**-7, atol=1e-6)


def test_norm_rope_dispatch_keeps_the_reference_off_the_gpu():
    """ops.rotary.norm_rope on CPU tensors is the two references (the model's CPU path)."""
    from qwen4exp.ops.rotary import apply_rope, norm_rope

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 2, 32, generator=g), torch.randn(32, generator=g)
    cos, sin = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    assert torch.equal(norm_rope(x, w, 1e-6, cos, sin), apply_rope(norm.rms_norm(x, w, 1e-6), cos, sin))
