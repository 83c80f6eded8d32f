"""Triton fused recurrent gated delta rule (interpreted on CPU) against its torch reference and the chunked form."""



import pytest

pytest.importorskip("triton")

import torch
from conftest import on_device
from kernel_references import fused_recurrent_gated_delta_rule_ref

from qwen4exp.ops.gated_delta import chunk_gated_delta_rule_ref, gdn_gates
from qwen4exp.ops.gated_delta_triton import fused_recurrent_gated_delta_rule, fused_recurrent_gated_delta_rule_raw

fused_recurrent_gated_delta_rule = on_device(fused_recurrent_gated_delta_rule)
fused_recurrent_gated_delta_rule_raw = on_device(fused_recurrent_gated_delta_rule_raw)

NUM_SLOTS = 9


def _inputs(B, L, hk, hv, dk, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = B * L
    q = torch.randn(n, hk, dk, generator=gen).to(dtype)
    k = torch.randn(n, hk, dk, generator=gen).to(dtype)
    v = torch.randn(n, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(n, hv, generator=gen) * 2  # log-decay <= 0
    beta = torch.rand(n, hv, generator=gen).to(dtype)
    state = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _ranges(B, L):
    """The layout of B requests of L tokens each: one token a request needs none, more take query_start_loc."""
    return {} if L == 1 else {"query_start_loc": torch.arange(B + 1, dtype=torch.int32) * L}


def _batch():
    """Shuffled distinct slots, a fresh request whose slot holds NaNs, and two padding rows on the null slot 0."""
    slots = torch.tensor([5, 2, 7, 0, 3, 0], dtype=torch.int64)
    has_init = torch.tensor([True, False, True, True, True, False])
    real = torch.tensor([True, True, True, False, True, False])
    return slots, has_init, real


@pytest.mark.parametrize(
    "hk,hv,dk,dv,L,dtype,block_v",
    [
        (2, 2, 16, 16, 1, torch.float32, None),
        (1, 3, 16, 32, 1, torch.float32, 16),
        (2, 4, 32, 16, 3, torch.float32, 8),
        (1, 2, 16, 16, 3, torch.bfloat16, 16),
        (2, 6, 16, 16, 1, torch.bfloat16, None),
        (2, 4, 8, 8, 1, torch.float32, None),
        (1, 2, 128, 128, 1, torch.float32, 64),
    ],
)
def test_matches_reference(hk, hv, dk, dv, L, dtype, block_v):
    slots, has_init, real = _batch()
    B = slots.numel()
    q, k, v, g, beta, state = _inputs(B, L, hk, hv, dk, dv, dtype)
    state[slots[1]] = float("nan")  # a fresh request must not read its slot
    fast_state, ref_state = state.clone(), state.clone()

    out = fused_recurrent_gated_delta_rule(q, k, v, g, beta, fast_state, slots, has_init, block_v=block_v,
                                           **_ranges(B, L))
    ref = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, has_init, L)

    assert out.dtype == v.dtype and out.shape == v.shape
    tok_real = real.repeat_interleave(L)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[tok_real].float(), ref[tok_real].float(), **tol)
    # fp32 state arithmetic is identical whatever the input dtype
    touched = slots[real]
    torch.testing.assert_close(fast_state[touched], ref_state[touched], rtol=1e-5, atol=1e-6)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(fast_state[untouched], state[untouched])


def test_strided_inputs_from_a_fused_projection():
    """q, k, v as views into one [T, 2*Hk*Dk + Hv*Dv] projection, as GatedDeltaNet produces them."""
    hk, hv, dk, dv = 1, 2, 16, 16
    slots = torch.tensor([4, 1, 6], dtype=torch.int64)
    has_init = torch.tensor([True, True, False])
    B = slots.numel()
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, 2 * hk * dk + hv * dv, generator=gen)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv)
    g = -torch.rand(B, hv, generator=gen)
    beta = torch.rand(B, hv, generator=gen)
    state = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    fast_state, ref_state = state.clone(), state.clone()
    out = fused_recurrent_gated_delta_rule(q, k, v, g, beta, fast_state, slots, has_init)
    ref = fused_recurrent_gated_delta_rule_ref(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, ref_state,
                                               slots, has_init)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_state, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("L", [1, 4])
def test_token_by_token_matches_chunked_form(L):
    """Whole sequences fed L tokens per step agree with the chunked (prefill) form over the full sequence."""
    hk, hv, dk, dv, n = 1, 2, 16, 16, 12
    slots = torch.tensor([3, 8, 1], dtype=torch.int64)
    has_init = torch.tensor([True, False, True])
    B = slots.numel()
    q, k, v, g, beta, state = _inputs(B, n, hk, hv, dk, dv, torch.float32, seed=1)
    q, k, v, g, beta = (x.reshape(B, n, *x.shape[1:]) for x in (q, k, v, g, beta))
    init = state.clone()

    outs = []
    for s in range(0, n, L):
        step = [x[:, s:s + L].flatten(0, 1) for x in (q, k, v, g, beta)]
        step_init = has_init if s == 0 else torch.ones_like(has_init)
        outs.append(fused_recurrent_gated_delta_rule(*step, state, slots, step_init, block_v=dv, **_ranges(B, L))
                    .reshape(B, L, hv, dv))
    out = torch.cat(outs, dim=1)

    for b in range(B):
        start = init[slots[b]] if has_init[b] else torch.zeros(hv, dk, dv)
        ref, final = chunk_gated_delta_rule_ref(q[b], k[b], v[b], g[b], beta[b], start, chunk=8)
        torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state[slots[b]], final, rtol=1e-4, atol=1e-5)


def _raw_gate_inputs(n, hv, dtype, gen):
    """b, a as strided views of one merged projection (z, b, a, padding, as GatedDeltaNet's in_proj), with a + dt_bias
    spanning softplus's regimes: far below zero (exp underflows), around zero, near and past the threshold 20, and
    past fp32 exp's overflow (88)."""
    z_width, pad = 3 * hv, 5
    proj = (torch.randn(n, z_width + 2 * hv + pad, generator=gen) * 4).to(dtype)
    b, a = proj[:, z_width:z_width + hv], proj[:, z_width + hv:z_width + 2 * hv]
    extremes = torch.tensor([-120.0, -30.0, -8.0, 19.5, 20.5, 35.0, 95.0])
    pick = torch.randint(0, 3, (n, hv), generator=gen) == 0  # a third of the entries
    a.copy_(torch.where(pick, extremes[torch.randint(0, len(extremes), (n, hv), generator=gen)], a.float()).to(dtype))
    A_log = torch.rand(hv, generator=gen) * 4 - 2  # decay rates exp(A_log) in [0.14, 7.4]
    dt_bias = torch.randn(hv, generator=gen)
    return b, a, A_log, dt_bias


def _raw_case(hk, hv, dk, dv, L, dtype, seed=0):
    slots, has_init, real = _batch()
    B = slots.numel()
    q, k, v, _, _, state = _inputs(B, L, hk, hv, dk, dv, dtype, seed)
    state[slots[1]] = float("nan")  # a fresh request must not read its slot
    b, a, A_log, dt_bias = _raw_gate_inputs(B * L, hv, dtype, torch.Generator().manual_seed(seed + 100))
    return q, k, v, b, a, A_log, dt_bias, state, slots, has_init, real


def _raw_reference(q, k, v, beta, g, state, slots, has_init, L):
    ref_state = state.clone()
    ref = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, has_init, L)
    return ref, ref_state


def _assert_matches(out, fast_state, ref, ref_state, slots, real, L, dtype):
    tok_real = real.repeat_interleave(L)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[tok_real].float(), ref[tok_real].float(), **tol)
    torch.testing.assert_close(fast_state[slots[real]], ref_state[slots[real]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "hk,hv,dk,dv,L,dtype,block_v",
    [
        (2, 4, 16, 16, 1, torch.float32, None),
        (1, 3, 16, 32, 3, torch.float32, 8),
        (2, 6, 16, 16, 1, torch.bfloat16, None),
        (1, 2, 16, 16, 3, torch.bfloat16, 16),
        (2, 4, 16, 16, 1, torch.float16, None),
        (1, 2, 128, 128, 1, torch.bfloat16, 32),
    ],
)
def test_raw_gates_match_gdn_gates_then_reference(hk, hv, dk, dv, L, dtype, block_v):
    """The kernel's own gates = gdn_gates (beta rounded to the input dtype, g in fp32) fed to the reference."""
    q, k, v, b, a, A_log, dt_bias, state, slots, has_init, real = _raw_case(hk, hv, dk, dv, L, dtype)
    fast_state = state.clone()
    out = fused_recurrent_gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, fast_state, slots, has_init,
                                               block_v=block_v, **_ranges(slots.numel(), L))
    beta, g = gdn_gates(b, a, A_log, dt_bias)
    assert torch.isfinite(g).all() and (g <= 0).all()
    ref, ref_state = _raw_reference(q, k, v, beta, g, state, slots, has_init, L)
    assert out.dtype == v.dtype and out.shape == v.shape
    _assert_matches(out, fast_state, ref, ref_state, slots, real, L, dtype)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(fast_state[untouched], state[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_gates_test_detects_wrong_gate_math(dtype):
    """The inputs above are sensitive: gates computed slightly wrong (dt_bias or A_log ignored, a and b swapped,
    beta not rounded to the input dtype) give states the comparison above rejects."""
    L = 2
    q, k, v, b, a, A_log, dt_bias, state, slots, has_init, real = _raw_case(1, 2, 16, 16, L, dtype, seed=4)
    fast_state = state.clone()
    out = fused_recurrent_gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, fast_state, slots, has_init,
                                               **_ranges(slots.numel(), L))
    beta, g = gdn_gates(b, a, A_log, dt_bias)
    wrong = {
        "dt_bias ignored": gdn_gates(b, a, A_log, torch.zeros_like(dt_bias)),
        "A_log ignored": gdn_gates(b, a, torch.zeros_like(A_log), dt_bias),
        "a and b swapped": gdn_gates(a, b, A_log, dt_bias),
    }
    if dtype != torch.float32:
        wrong["beta kept in fp32"] = (torch.sigmoid(b.float()), g)
    for name, (wrong_beta, wrong_g) in wrong.items():
        ref = _raw_reference(q, k, v, wrong_beta, wrong_g, state, slots, has_init, L)
        try:
            _assert_matches(out, fast_state, *ref, slots, real, L, dtype)
        except AssertionError:
            continue
        pytest.fail(f"{name}: not detected")
    _assert_matches(out, fast_state, *_raw_reference(q, k, v, beta, g, state, slots, has_init, L), slots, real, L,
                    dtype)


def _varlen_case(lengths, hk, hv, dk, dv, dtype, seed=0):
    """Requests of the given token counts on shuffled slots; request 1 is fresh with a NaN slot, the last one is
    padding on the null slot 0."""
    slots = torch.tensor([6, 3, 8, 1, 5, 0][: len(lengths) - 1] + [0], dtype=torch.int64)
    has_init = torch.tensor([i != 1 and i != len(lengths) - 1 for i in range(len(lengths))])
    q, k, v, g, beta, state = _inputs(1, sum(lengths), hk, hv, dk, dv, dtype, seed)
    state[slots[1]] = float("nan")
    qsl = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, g, beta, state, slots, has_init, qsl


@pytest.mark.parametrize(
    "lengths,hk,hv,dk,dv,dtype,raw",
    [
        ([3, 2, 1, 5, 2], 1, 2, 16, 16, torch.float32, False),
        ([4, 1, 0, 7, 1, 3], 2, 4, 16, 32, torch.float32, True),
        ([1, 6, 2, 0, 4], 1, 3, 16, 16, torch.bfloat16, True),
        ([2, 2, 9], 1, 2, 32, 16, torch.bfloat16, False),
        ([2, 0, 3, 1], 1, 2, 16, 16, torch.float32, True),  # an empty fresh request: its NaN slot is not written
    ],
)
def test_varlen_matches_reference_per_request(lengths, hk, hv, dk, dv, dtype, raw):
    """query_start_loc: every request runs its own tokens (none for a zero-length one, whose slot is not touched)
    from its own slot; the outputs and final states equal the token-by-token reference run request by request."""
    q, k, v, g, beta, state, slots, has_init, qsl = _varlen_case(lengths, hk, hv, dk, dv, dtype)
    fast_state = state.clone()
    if raw:
        b, a, A_log, dt_bias = _raw_gate_inputs(q.shape[0], hv, dtype, torch.Generator().manual_seed(7))
        out = fused_recurrent_gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, fast_state, slots, has_init,
                                                   query_start_loc=qsl)
        beta, g = gdn_gates(b, a, A_log, dt_bias)
    else:
        out = fused_recurrent_gated_delta_rule(q, k, v, g, beta, fast_state, slots, has_init, query_start_loc=qsl)
    assert out.shape == v.shape and out.dtype == v.dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for r in range(len(lengths) - 1):  # the last request is padding on the null slot
        s, e = int(qsl[r]), int(qsl[r + 1])
        if e == s:  # as the reference: a request without tokens has no state to update, fresh or not
            torch.testing.assert_close(fast_state[slots[r]], state[slots[r]], rtol=0, atol=0, equal_nan=True)
            continue
        start = state[slots[r]] if has_init[r] else torch.zeros_like(state[0])
        ref_slots = start[None].clone()  # one slot: slot 0
        one, true = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.bool)
        if e > s:
            ref = fused_recurrent_gated_delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ref_slots, one, true,
                                                       e - s)
            torch.testing.assert_close(out[s:e].float(), ref.float(), **tol)
        torch.testing.assert_close(fast_state[slots[r]], ref_slots[0], rtol=1e-5, atol=1e-6)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(fast_state[untouched], state[untouched])


@pytest.mark.parametrize("raw,state_dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_verified_rows_store_the_state_after_each_row(raw, state_dtype):
    """Speculative verification: the kernel over each request's own token range stores the state after every row
    with a token slot into that slot, and equals the reference (which runs such requests token by token): outputs,
    final states, stored states; a decode, two verified requests (one fresh, its slot NaN) and no other slot
    touched. In the reference the verified rows equal one-token steps exactly, bf16 state slots included (the state
    is rounded after every token)."""
    from qwen4exp.ops.gated_delta import gated_delta_rule_ref

    hk, hv, dk, dv = 1, 2, 16, 16
    lengths, slots, has_init = [1, 3, 4], [5, 2, 7], [True, False, True]
    qsl = [0, 1, 4, 8]
    token_slots = [-1, 1, 3, -1, 4, 6, 8, -1]
    q, k, v, b, a, A_log, dt_bias, state, *_ = _raw_case(hk, hv, dk, dv, 1, torch.float32)
    gen = torch.Generator().manual_seed(9)
    T = qsl[-1]
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    b, a = torch.randn(T, hv, generator=gen), torch.randn(T, hv, generator=gen)
    state[2] = float("nan")
    state = state.to(state_dtype)
    beta, g = gdn_gates(b, a, A_log, dt_bias)
    ref_state = state.clone()
    ref = gated_delta_rule_ref(q, k, v, g, beta, ref_state, qsl, slots, has_init, token_slots)
    single_state = state.clone()
    for r, slot in enumerate(slots):
        for j in range(lengths[r]):
            t = qsl[r] + j
            o = gated_delta_rule_ref(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], single_state,
                                     [0, 1], [slot], [has_init[r] or j > 0])
            torch.testing.assert_close(ref[t], o[0], rtol=0, atol=0)
            if token_slots[t] >= 0:
                assert torch.equal(ref_state[token_slots[t]], single_state[slot])
        assert torch.equal(ref_state[slot], single_state[slot])

    fast_state = state.clone()
    args = (torch.tensor(slots), torch.tensor(has_init))
    kw = dict(query_start_loc=torch.tensor(qsl, dtype=torch.int32), token_slots=torch.tensor(token_slots))
    if raw:
        out = fused_recurrent_gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, fast_state, *args, **kw)
    else:
        out = fused_recurrent_gated_delta_rule(q, k, v, g, beta, fast_state, *args, **kw)
    # a bf16 state rounds to the same value unless the fp32 sums (in another order) straddle a rounding boundary
    tol = dict(rtol=1e-5, atol=1e-6) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    written = slots + [s for s in token_slots if s >= 0]
    torch.testing.assert_close(fast_state[written].float(), ref_state[written].float(), **tol)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(fast_state[untouched], state[untouched])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_verification_leaves_the_states_of_one_token_steps(state_dtype):
    """The kernel verifying three rows of a request (query_start_loc, token slots) writes bit for bit the outputs and
    states that three one-token calls write, whatever the state slots' dtype: with bf16 or fp16 slots it goes on from
    each verified row's stored (rounded) state, as the next one-token step would (speculative decoding stays
    token-identical to decoding without it). Rounding only at the request's last row fails this for bf16."""
    hk, hv, dk, dv, n = 1, 2, 16, 16, 3
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    b, a, A_log, dt_bias = _raw_gate_inputs(n, hv, torch.float32, gen)
    state = (torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen) * 3).to(state_dtype)
    slot, spares = 4, [1, 6]
    verified = state.clone()
    out = fused_recurrent_gated_delta_rule_raw(
        q, k, v, b, a, A_log, dt_bias, verified, torch.tensor([slot]), torch.tensor([True]),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), token_slots=torch.tensor(spares + [-1]))
    stepped = state.clone()
    for t in range(n):
        o = fused_recurrent_gated_delta_rule_raw(q[t:t + 1], k[t:t + 1], v[t:t + 1], b[t:t + 1], a[t:t + 1], A_log,
                                                 dt_bias, stepped, torch.tensor([slot]), torch.tensor([True]))
        assert torch.equal(out[t], o[0]), t
        if t < n - 1:
            assert torch.equal(verified[spares[t]], stepped[slot]), t
    assert torch.equal(verified[slot], stepped[slot])
