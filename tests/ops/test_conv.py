"""Triton causal conv1d update (interpreted on CPU) against its torch reference and the prefill reference."""



import pytest

pytest.importorskip("triton")

import torch
from conftest import on_device
from kernel_references import causal_conv1d_update_ref

from qwen4exp.ops.conv import causal_conv1d_ref as causal_conv1d
from qwen4exp.ops.conv_triton import causal_conv1d_update, causal_conv1d_varlen

causal_conv1d_update = on_device(causal_conv1d_update)
causal_conv1d_varlen = on_device(causal_conv1d_varlen)

NUM_SLOTS = 9


def _local(qsl) -> torch.Tensor:
    """Each row's index in its request (the step metadata's token_local)."""
    qsl = [int(q) for q in qsl]
    return torch.cat([torch.arange(b - a) for a, b in zip(qsl, qsl[1:])])


def _batch():
    """Shuffled distinct slots, a fresh request whose slot holds NaNs, and two padding rows on the null slot 0."""
    slots = torch.tensor([5, 2, 7, 0, 3, 0], dtype=torch.int64)
    has_init = torch.tensor([True, False, True, True, True, False])
    real = torch.tensor([True, True, True, False, True, False])
    return slots, has_init, real


@pytest.mark.parametrize(
    "channels,kernel,dilation,dtype,state_dtype,activation",
    [
        (40, 4, 1, torch.float32, torch.float32, "silu"),
        (40, 4, 3, torch.float32, torch.float32, "silu"),
        (300, 4, 1, torch.float32, torch.float32, None),  # several channel tiles, ragged last tile
        (24, 2, 1, torch.float32, torch.float32, "silu"),
        (40, 4, 1, torch.bfloat16, torch.bfloat16, "silu"),
        (24, 4, 3, torch.bfloat16, torch.bfloat16, None),
        (24, 4, 3, torch.float32, torch.bfloat16, "silu"),  # inputs are rounded to the state's dtype
    ],
)
def test_matches_reference(channels, kernel, dilation, dtype, state_dtype, activation):
    slots, has_init, real = _batch()
    B, state_len = slots.numel(), (kernel - 1) * dilation
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, channels, generator=gen).to(state_dtype).to(dtype)
    # ^ inputs representable in the state's dtype: the interpreter rounds fp32 -> bf16 toward zero where the GPU
    # (and torch) round to nearest even, so only exactly representable values can be compared bit for bit.
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    state = torch.randn(NUM_SLOTS, channels, state_len, generator=gen).to(state_dtype)
    state[slots[1]] = float("nan")  # a fresh request must not read its slot
    fast_state, ref_state = state.clone(), state.clone()

    out = causal_conv1d_update(x, weight, fast_state, slots, has_init, dilation, activation)
    ref = causal_conv1d_update_ref(x, weight, ref_state, slots, has_init, dilation, activation)

    assert out.dtype == dtype and out.shape == x.shape
    exact = dtype == torch.float32 and state_dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if exact else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[real], ref[real], **tol)
    # the state only moves values around: exact in any dtype
    touched = slots[real]
    assert torch.equal(fast_state[touched], ref_state[touched])
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(fast_state[untouched], state[untouched])


@pytest.mark.parametrize("dilation", [1, 3])
def test_token_by_token_matches_prefill_reference(dilation):
    """Requests fed one token per step (fast kernel and existing reference) agree with one prefill of each request."""
    channels, kernel, n = 20, 4, 7
    slots = [4, 1, 6]
    has_init = [True, False, True]
    B, state_len = len(slots), (kernel - 1) * dilation
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, n, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(NUM_SLOTS, channels, state_len, generator=gen)
    init = state.clone()
    step_state = state.clone()  # the existing reference, one token per request per step

    slots_t = torch.tensor(slots, dtype=torch.int64)
    outs, step_outs = [], []
    for t in range(n):
        step_init = has_init if t == 0 else [True] * B
        outs.append(causal_conv1d_update(x[:, t], weight, state, slots_t, torch.tensor(step_init), dilation))
        step_outs.append(causal_conv1d(x[:, t], weight, step_state, list(range(B + 1)), slots, step_init, dilation))
    out, step_out = torch.stack(outs, 1), torch.stack(step_outs, 1)

    prefill_state = init.clone()
    prefill = causal_conv1d(x.flatten(0, 1), weight, prefill_state, [b * n for b in range(B + 1)], slots, has_init,
                            dilation).reshape(B, n, channels)
    torch.testing.assert_close(out, step_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, prefill, rtol=1e-5, atol=1e-6)
    assert torch.equal(state, step_state) and torch.equal(state, prefill_state)


@pytest.mark.parametrize(
    "channels,kernel,dilation,dtype,state_dtype,activation",
    [
        (40, 4, 1, torch.float32, torch.float32, "silu"),
        (300, 4, 3, torch.float32, torch.float32, None),  # several channel tiles; requests shorter than the state
        (24, 2, 1, torch.float32, torch.float32, "silu"),
        (40, 4, 1, torch.bfloat16, torch.bfloat16, "silu"),
        (24, 4, 3, torch.float32, torch.bfloat16, "silu"),  # inputs are rounded to the state's dtype
    ],
)
def test_varlen_prefill_matches_reference(channels, kernel, dilation, dtype, state_dtype, activation):
    """A flat batch of requests of lengths 1 .. 45 (decodes first, as the runner orders them), one with a fresh slot
    holding NaNs, one empty: outputs and every slot equal the per-request reference."""
    lengths = [1, 1, 5, 2, 45, 0, 33]
    slots = [3, 7, 1, 8, 2, 6, 5]
    has_init = [True, True, False, True, True, False, True]
    state_len = (kernel - 1) * dilation
    gen = torch.Generator().manual_seed(6)
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    x = torch.randn(qsl[-1], channels, generator=gen).to(state_dtype).to(dtype)  # see test_matches_reference
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    state = torch.randn(NUM_SLOTS, channels, state_len, generator=gen).to(state_dtype)
    state[slots[2]] = float("nan")
    fast_state, ref_state = state.clone(), state.clone()

    out = causal_conv1d_varlen(x, weight, fast_state, torch.tensor(qsl, dtype=torch.int32), _local(qsl),
                               torch.tensor(slots), torch.tensor(has_init), dilation, activation)
    ref = causal_conv1d(x, weight, ref_state, qsl, slots, has_init, dilation, activation)

    exact = dtype == torch.float32 and state_dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if exact else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(fast_state, ref_state, rtol=0, atol=0, equal_nan=True)  # values only move


@pytest.mark.parametrize("split,block_c", [((32, 32, 64), 32), ((16, 48, 64), 32)])
def test_varlen_split_output_equals_split_of_the_full_output(split, block_c):
    """GDN asks for q, k, v as separate tensors: they come back contiguous (fla would otherwise copy each), also
    where a channel tile straddles two parts, with the values of the unsplit output."""
    channels, kernel = sum(split), 4
    slots, has_init = [2, 5, 3], [True, False, True]  # requests of 1, 6 and 40 tokens
    gen = torch.Generator().manual_seed(8)
    qsl = torch.tensor([0, 1, 7, 47], dtype=torch.int32)
    x = torch.randn(int(qsl[-1]), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(NUM_SLOTS, channels, kernel - 1, generator=gen)
    args = (qsl, _local(qsl), torch.tensor(slots), torch.tensor(has_init))
    full_state, split_state = state.clone(), state.clone()
    full = causal_conv1d_varlen(x, weight, full_state, *args, block_c=block_c)
    parts = causal_conv1d_varlen(x, weight, split_state, *args, block_c=block_c, split=split)
    assert [p.shape[1] for p in parts] == list(split)
    assert all(p.is_contiguous() for p in parts)
    for got, want in zip(parts, full.split(list(split), -1)):
        assert torch.equal(got, want)
    assert torch.equal(split_state, full_state)


@pytest.mark.parametrize("dilation,state_dtype", [(1, torch.float32), (3, torch.float32), (3, torch.bfloat16)])
def test_verified_rows_store_the_state_after_each_row(dilation, state_dtype):
    """Speculative verification: for a request whose first row has a token slot, each of its rows but the last
    with a slot stores the state after it, which is what single-token steps up to that row leave in the request's
    slot; the reference and the varlen kernels agree (a fresh request holds NaNs in its slot, a request shorter than
    the state, a row without a token slot, a prefill that stores nothing, and a request whose first row has none)."""
    channels, kernel = 24, 4
    state_len = (kernel - 1) * dilation
    lengths, slots, has_init = [3, 2, 4, 5, 3], [5, 2, 7, 3, 1], [True, False, True, True, True]
    qsl = [0, 3, 5, 9, 14, 17]
    # the prefill's rows hold no slot; the last request's first row has none, so its later slot stores nothing
    token_slots = [10, 11, -1, 12, -1, 13, -1, 14, -1] + [-1] * 5 + [-1, 15, -1]
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(qsl[-1], channels, generator=gen).to(state_dtype)  # the model's dtype, as its states
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(16, channels, state_len, generator=gen).to(state_dtype)
    state[2] = float("nan")
    ref = state.clone()
    out = causal_conv1d(x, weight, ref, qsl, slots, has_init, dilation, "silu", token_slots)
    plain = state.clone()
    torch.testing.assert_close(out, causal_conv1d(x, weight, plain, qsl, slots, has_init, dilation), rtol=0, atol=0)
    for r, (slot, n) in enumerate(zip(slots, lengths)):
        single = state.clone()
        for j in range(n):
            t = qsl[r] + j
            causal_conv1d(x[t:t + 1], weight, single, [0, 1], [slot], [has_init[r] or j > 0], dilation)
            if token_slots[t] >= 0 and r < 4:
                assert torch.equal(ref[token_slots[t]], single[slot]), (r, j)
        assert torch.equal(ref[slot], single[slot])
    written = [10, 11, 12, 13, 14]
    stored = torch.zeros(16, dtype=torch.bool)
    stored[written] = True
    stored[slots] = True
    assert torch.equal(ref[~stored].nan_to_num(7.0), state[~stored].nan_to_num(7.0))

    fast = state.clone()
    got = causal_conv1d_varlen(x, weight, fast, torch.tensor(qsl), _local(qsl), torch.tensor(slots),
                               torch.tensor(has_init), dilation, "silu", token_slots=torch.tensor(token_slots))
    tol = dict(rtol=1e-5, atol=1e-6) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, out, **tol)  # fp32 sums in another order, rounded to x's dtype
    assert torch.equal(fast[stored], ref[stored])  # values only move
    untouched = ~stored
    assert torch.equal(fast[untouched].nan_to_num(7.0), state[untouched].nan_to_num(7.0))
