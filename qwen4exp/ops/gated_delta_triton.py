"""Decode-time gated delta rule: one fused Triton kernel over a padded batch, CUDA-graph capturable.

Each of B requests brings one token (decode), or, with `query_start_loc`, its own range of the flat batch (any
length, none included: speculative verification and the mixed steps of CUDA graphs, where the token loop replaces the
chunked prefill form; its cost grows with the longest request's tokens): q, k [T, Hk, Dk] and v [T, Hv, Dv]
(bf16/fp16/fp32), g [T, Hv] fp32 log-decay, beta [T, Hv]. Per value
head h (query/key head h // (Hv // Hk)), with state S [Dk, Dv] taken from ssm_state[state_slots[b]] (zeros
where has_initial_state[b] is False), q and k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5, each token does
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
in fp32; with state slots in bf16 or fp16, S is rounded to their dtype where it is stored (gated_delta.py).
Returns o [T, Hv, Dv] in v's dtype; writes the state after the last token back into ssm_state[state_slots[b]]
(in place) and, with `query_start_loc` (speculative verification), the state after token t into
ssm_state[token_slots[t]] where token_slots [>= T] int64 is >= 0 (slots no request of the call starts from).

`fused_recurrent_gated_delta_rule_raw` takes the gate projections instead of g and beta: b, a [T, Hv] (views of
the merged in_proj output are fine) with A_log, dt_bias [Hv], and computes the gates of `gated_delta.gdn_gates` in
the kernel, with its dtypes: beta = sigmoid(b) rounded to b's dtype, g = -exp(A_log) * softplus(a + dt_bias) in fp32.

Everything per request is read from device tensors and all shapes are fixed by B, so the call can be captured in a
CUDA graph. Padding rows carry slot 0 (the null slot): they read and write slot 0 only, which may hold garbage;
with `query_start_loc`, requests without tokens read and write nothing.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._triton_utils import INTERPRETED, launch_options, pdl_start, round_to, round_to_bf16

# Below this many programs an H200 (132 SMs) is underfed, so small batches get narrower value tiles.
_MIN_PROGRAMS = 128


@triton.jit
def _token_step(
    state, tok, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, stride_qt, stride_kt, stride_vt, stride_gt, stride_bt,
    stride_ot, q_off, k_off, v_off, g_off, b_off, o_off, offs_k, offs_v, scale, neg_decay_rate, dt_bias,
    RAW_GATES: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One token of one (request, value head, value tile): stores its output, returns the updated state."""
    q = tl.load(q_ptr + tok * stride_qt + q_off + offs_k).to(tl.float32)
    k = tl.load(k_ptr + tok * stride_kt + k_off + offs_k).to(tl.float32)
    v = tl.load(v_ptr + tok * stride_vt + v_off + offs_v).to(tl.float32)
    g = tl.load(g_ptr + tok * stride_gt + g_off).to(tl.float32)
    beta = tl.load(beta_ptr + tok * stride_bt + b_off).to(tl.float32)
    if RAW_GATES:  # g, beta hold the projections a, b
        x = g + dt_bias
        # torch's softplus (threshold 20); the clamp only keeps exp finite in the branch the where drops
        y = tl.exp(tl.minimum(x, 20.0))
        if INTERPRETED:  # no extern libdevice calls there: log1p from log, accurate to a few ulp (Goldberg)
            u = 1.0 + y
            log1p_y = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
        else:  # what inductor emits for the compiled gdn_gates
            log1p_y = libdevice.log1p(y)
        g = neg_decay_rate * tl.where(x > 20.0, x, log1p_y)
        beta = tl.sigmoid(beta)
        if beta_ptr.dtype.element_ty == tl.bfloat16:
            beta = round_to_bf16(beta)
        else:
            beta = beta.to(beta_ptr.dtype.element_ty).to(tl.float32)
    # Every value tile needs the full norms, so each program normalises its own copy of q and k.
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

    state = state * tl.exp(g)
    u = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * u[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + tok * stride_ot + o_off + offs_v, o.to(out_ptr.dtype.element_ty))
    return state


@triton.jit
def _round_state(state, state_ptr):
    """The fp32 state rounded to the slots' dtype, kept in fp32."""
    return round_to(state, state_ptr.dtype.element_ty, state_ptr.dtype.element_ty == tl.bfloat16)


@triton.jit
def _store_token_state(state, tok, token_slots_ptr, state_ptr, h, offs_k, offs_v, stride_ss, stride_sh, stride_sk,
                       stride_sv, DK: tl.constexpr, BV: tl.constexpr):
    """The state after token `tok` into slot token_slots[tok], where that is >= 0."""
    out_slot = tl.load(token_slots_ptr + tok)
    ptrs = (state_ptr + tl.maximum(out_slot, 0) * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk
            + offs_v[None, :] * stride_sv)
    tl.store(ptrs, state.to(state_ptr.dtype.element_ty), mask=(tl.zeros([DK, BV], dtype=tl.int64) + out_slot) >= 0)


@triton.jit
def _fused_recurrent_gdn_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, out_ptr, state_ptr, slots_ptr, has_init_ptr,
    qsl_ptr, token_slots_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk, stride_sv,
    scale,
    HEAD_RATIO: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, ROUND_STATE: tl.constexpr,
    RAW_GATES: tl.constexpr, VARLEN: tl.constexpr, TOKEN_SLOTS: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr
):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // HEAD_RATIO
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)

    if VARLEN:  # request b owns tokens query_start_loc[b] : query_start_loc[b + 1]
        start = tl.load(qsl_ptr + b).to(tl.int64)
        end = tl.load(qsl_ptr + b + 1).to(tl.int64)
        if start == end:  # an empty row of a mixed graph (most of them at small batches): no state traffic
            return
    slot = tl.load(slots_ptr + b)
    has_init = tl.load(has_init_ptr + b).to(tl.int32)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    # The mask is built at full shape (not scalar & tile): a fresh request's slot may hold NaNs, which must not be read.
    init_mask = (tl.zeros([DK, BV], dtype=tl.int32) + has_init) != 0
    state = tl.load(s_ptrs, mask=init_mask, other=0.0).to(tl.float32)
    neg_decay_rate = 0.0
    dt_bias = 0.0
    if RAW_GATES:
        neg_decay_rate = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    q_off, k_off, v_off = hk * stride_qh, hk * stride_kh, h * stride_vh
    g_off, b_off, o_off = h * stride_gh, h * stride_bh, h * stride_oh

    if VARLEN:
        for tok in range(start, end):
            state = _token_step(state, tok, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, stride_qt, stride_kt,
                                stride_vt, stride_gt, stride_bt, stride_ot, q_off, k_off, v_off, g_off, b_off, o_off,
                                offs_k, offs_v, scale, neg_decay_rate, dt_bias, RAW_GATES, INTERPRETED)
            if TOKEN_SLOTS:
                if ROUND_STATE:  # a stored row's state goes on rounded, as the next one-token step would read it
                    stored = (tl.zeros([DK, BV], dtype=tl.int64) + tl.load(token_slots_ptr + tok)) >= 0
                    state = tl.where(stored, _round_state(state, state_ptr), state)
                _store_token_state(state, tok, token_slots_ptr, state_ptr, h, offs_k, offs_v, stride_ss, stride_sh,
                                   stride_sk, stride_sv, DK, BV)
    else:  # decode: request b's one token is row b
        state = _token_step(state, b, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, stride_qt, stride_kt, stride_vt,
                            stride_gt, stride_bt, stride_ot, q_off, k_off, v_off, g_off, b_off, o_off, offs_k, offs_v,
                            scale, neg_decay_rate, dt_bias, RAW_GATES, INTERPRETED)

    if ROUND_STATE:
        state = _round_state(state, state_ptr)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block_v(num_heads_total: int, dv: int) -> int:
    # H200, Dv = 128, us per call by width 8/16/32/64/128: 48 heads (batch 1)
    # 4.4/3.9/3.8/4.0/5.7, 3072 heads (batch 64) 363/202/127/110/116
    bv = min(dv, 64)
    while bv > 8 and num_heads_total * (dv // bv) < _MIN_PROGRAMS:
        bv //= 2
    return bv


def _num_warps(dk: int, bv: int) -> int:
    return max(1, min(4, dk * bv // 1024))


def _launch(q, k, v, g, beta, gate_params, ssm_state, state_slots, has_initial_state, block_v, query_start_loc=None,
            token_slots=None):
    total, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    if query_start_loc is None:
        assert total == B and k.shape == q.shape and v.shape[0] == total, "q/k/v must hold one token a request"
        assert token_slots is None, "token slots need query_start_loc"
    else:
        assert query_start_loc.shape == (B + 1,) and k.shape == q.shape and v.shape[0] == total
    assert hv % hk == 0 and _is_pow2(dk) and _is_pow2(dv), "grouped heads; Dk and Dv powers of two"
    assert g.shape == (total, hv) and beta.shape == (total, hv)
    assert ssm_state.dtype in (torch.float32, torch.bfloat16, torch.float16) and ssm_state.shape[1:] == (hv, dk, dv)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert state_slots.dtype == torch.int64 and has_initial_state.shape == (B,)
    if gate_params is not None:
        assert all(p.shape == (hv,) and p.stride(0) == 1 for p in gate_params), "A_log and dt_bias: [Hv]"
    if token_slots is not None:
        assert token_slots.dtype == torch.int64 and token_slots.shape[0] >= total
    # with query_start_loc, at most `total` requests bring tokens (a mixed graph has a row for every batch slot)
    # the interpreter runs programs one after another at Python's pace: fewest programs there
    heads = (B if query_start_loc is None else min(B, max(total, 1))) * hv
    bv = block_v or (dv if INTERPRETED else _block_v(heads, dv))
    assert _is_pow2(bv) and bv <= dv

    out = torch.empty((total, hv, dv), dtype=v.dtype, device=v.device)
    if B == 0 or (total == 0 and query_start_loc is None):
        return out
    # A bool tensor reinterpreted as bytes costs nothing and keeps the kernel's pointer type simple.
    has_init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    a_log, dt_bias = gate_params if gate_params is not None else (g, g)  # never read without RAW_GATES
    qsl = query_start_loc if query_start_loc is not None else state_slots  # never read without VARLEN
    tok_slots = token_slots if token_slots is not None else state_slots  # never read without TOKEN_SLOTS
    _fused_recurrent_gdn_kernel[(B, hv, dv // bv)](
        q, k, v, g, beta, a_log, dt_bias, out, ssm_state, state_slots, has_init, qsl, tok_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        *ssm_state.stride(),
        dk ** -0.5,
        HEAD_RATIO=hv // hk, DK=dk, BV=bv, ROUND_STATE=ssm_state.dtype != torch.float32,
        RAW_GATES=gate_params is not None, VARLEN=query_start_loc is not None, TOKEN_SLOTS=token_slots is not None,
        INTERPRETED=INTERPRETED,
        num_warps=_num_warps(dk, bv), **launch_options(q)
    )
    return out


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    block_v: int | None = None,
    query_start_loc: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module docstring. block_v overrides the value-tile width (a power of two dividing Dv);
    query_start_loc (int32 [B + 1], device) gives each request its own token range instead of one token each."""
    return _launch(q, k, v, g, beta, None, ssm_state, state_slots, has_initial_state, block_v, query_start_loc,
                   token_slots)


def fused_recurrent_gated_delta_rule_raw(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    block_v: int | None = None,
    query_start_loc: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_recurrent_gated_delta_rule(q, k, v, g, beta, ...) with (beta, g) = gdn_gates(b, a, A_log, dt_bias)
    computed inside the kernel: the gate kernels' launches disappear from the decode step."""
    return _launch(q, k, v, a, b, (A_log, dt_bias), ssm_state, state_slots, has_initial_state, block_v,
                   query_start_loc, token_slots)
