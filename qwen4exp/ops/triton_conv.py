"""Decode-time causal depthwise conv1d with state slots: one Triton kernel over a padded batch, graph capturable.

Each of B requests brings Lq consecutive inputs (Lq = 1 for decode, > 1 for speculative verification):
x [B*Lq, C], weight [C, K], conv_state [S, C, L] with L = (K-1)*dilation holding each request's last L inputs,
oldest first (treated as zeros where has_initial_state[b] is False). With window = [state (L), x_t] the token's
output is act(sum_j weight[c, j] * window[c, j*dilation]), accumulated in fp32 and returned in x's dtype [B*Lq, C].
conv_state[state_slots[b]] is updated in place to the last L inputs (new inputs are stored in the state's dtype, and
are rounded to it before use, as the reference does); intermediate_states [B, Lq, C, L], when given, receives the
state after every token.

Padding rows carry slot 0 (the null slot): they read and write slot 0 only, which may hold garbage.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_pdl import launch_options, pdl_start


@triton.jit
def _load_window(state_base, x_base, stride_sl, stride_xt, shift, offs_p, sel, c_ok, init2d,
                 LST: tl.constexpr, LQ: tl.constexpr):
    """Positions shift + offs_p (where sel) of the history [state (LST), x_0 .. x_{LQ-1}] as fp32 [BC, LP]."""
    pos = shift + offs_p
    in_state = pos < LST
    m_state = c_ok[:, None] & (sel & in_state)[None, :] & init2d
    from_state = tl.load(state_base + pos[None, :] * stride_sl, mask=m_state, other=0.0).to(tl.float32)
    xi = tl.maximum(pos - LST, 0)
    m_x = c_ok[:, None] & (sel & (pos >= LST) & (xi < LQ))[None, :]
    from_x = tl.load(x_base + xi[None, :] * stride_xt, mask=m_x, other=0.0)
    # Inputs live on in the state's dtype, so they are rounded to it whether used now or after the next step.
    from_x = from_x.to(state_base.dtype.element_ty).to(tl.float32)
    return tl.where(in_state[None, :], from_state, from_x)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, has_init_ptr, out_ptr, inter_ptr,
    C,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl, stride_ot, stride_oc,
    stride_ib, stride_il, stride_ic, stride_is,
    LQ: tl.constexpr, LST: tl.constexpr, DIL: tl.constexpr, LP: tl.constexpr, BC: tl.constexpr,
    SILU: tl.constexpr, STORE_INTER: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    # grid (channel tiles, requests), channel tiles fastest: programs that run side by side read adjacent columns of
    # one slot's state (requests fastest had them read 256-byte stripes of rows 33 KB apart; H200 batch 64: 7.37 ->
    # 7.22 us)
    b = tl.program_id(1).to(tl.int64)
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    offs_p = tl.arange(0, LP)
    c_ok = offs_c < C

    slot = tl.load(slots_ptr + b)
    has_init = tl.load(has_init_ptr + b).to(tl.int32)
    # Full-shape mask (not scalar & tile): a fresh request's slot may hold NaNs, which must not be read.
    init2d = (tl.zeros([BC, LP], dtype=tl.int32) + has_init) != 0
    state_base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    x_base = x_ptr + (b * LQ) * stride_xt + offs_c[:, None] * stride_xc

    # Weights spread over window positions: tap j sits at position j*DIL, every other position weighs zero.
    is_tap = (offs_p % DIL == 0) & (offs_p <= LST)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + (offs_p // DIL)[None, :] * stride_wk,
                mask=c_ok[:, None] & is_tap[None, :], other=0.0).to(tl.float32)
    in_state_len = offs_p < LST

    for t in range(LQ):
        win = _load_window(state_base, x_base, stride_sl, stride_xt, t, offs_p, is_tap, c_ok, init2d, LST, LQ)
        acc = tl.sum(win * w, axis=1)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (b * LQ + t) * stride_ot + offs_c * stride_oc, acc.to(out_ptr.dtype.element_ty), mask=c_ok)
        if STORE_INTER:
            after = _load_window(state_base, x_base, stride_sl, stride_xt, t + 1, offs_p, in_state_len, c_ok, init2d,
                                 LST, LQ)
            i_ptrs = (inter_ptr + b * stride_ib + t * stride_il + offs_c[:, None] * stride_ic
                      + offs_p[None, :] * stride_is)
            tl.store(i_ptrs, after.to(inter_ptr.dtype.element_ty), mask=c_ok[:, None] & in_state_len[None, :])

    new_state = _load_window(state_base, x_base, stride_sl, stride_xt, LQ, offs_p, in_state_len, c_ok, init2d,
                             LST, LQ)
    # The shift moves values between positions, which other threads of this program may still be reading.
    tl.debug_barrier()
    tl.store(state_base + offs_p[None, :] * stride_sl, new_state.to(state_ptr.dtype.element_ty),
             mask=c_ok[:, None] & in_state_len[None, :])


def _check_activation(activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    return activation is not None


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
    num_tokens_per_req: int = 1,
    intermediate_states: torch.Tensor | None = None,
    block_c: int | None = None,
    num_warps: int = 1,
) -> torch.Tensor:
    """See the module docstring. block_c / num_warps: tuning overrides (the defaults measured best on an H200 at
    10240 channels: 6.8 us at batch 64 against 29 us with 256 channels over 4 warps; `bench/decode_kernels.py`)."""
    total, channels = x.shape
    kernel = weight.shape[1]
    state_len = (kernel - 1) * dilation
    lq, B = num_tokens_per_req, state_slots.shape[0]
    assert kernel >= 2 and weight.shape[0] == channels and total == B * lq
    assert conv_state.shape[1:] == (channels, state_len), "conv_state must be [S, C, (K-1)*dilation]"
    assert state_slots.dtype == torch.int64 and has_initial_state.shape == (B,)
    if intermediate_states is not None:
        assert intermediate_states.shape == (B, lq, channels, state_len)
    silu = _check_activation(activation)

    out = torch.empty((total, channels), dtype=x.dtype, device=x.device)
    if total == 0:
        return out
    lp = triton.next_power_of_2(state_len + 1)  # the window: state plus the new input
    bc = block_c or min(triton.next_power_of_2(channels), max(16, 512 // lp))
    has_init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    inter = intermediate_states if intermediate_states is not None else conv_state  # never written when absent
    inter_strides = intermediate_states.stride() if intermediate_states is not None else (0,) * 4
    _causal_conv1d_update_kernel[(triton.cdiv(channels, bc), B)](
        x, weight, conv_state, state_slots, has_init, out, inter,
        channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_state.stride(),
        out.stride(0), out.stride(1),
        *inter_strides,
        LQ=lq, LST=state_len, DIL=dilation, LP=lp, BC=bc, SILU=silu, STORE_INTER=intermediate_states is not None,
        num_warps=num_warps, **launch_options(x)
    )
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
    num_tokens_per_req: int = 1,
    intermediate_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch definition of the same contract, vectorised over the batch (and itself free of host syncs)."""
    total, channels = x.shape
    state_len = conv_state.shape[-1]
    lq, B = num_tokens_per_req, state_slots.shape[0]
    silu = _check_activation(activation)

    prev = conv_state[state_slots]
    prev = torch.where(has_initial_state.bool()[:, None, None], prev, torch.zeros_like(prev))
    new = x.reshape(B, lq, channels).transpose(1, 2).to(conv_state.dtype)
    history = torch.cat([prev, new], dim=-1)  # [B, C, L + Lq]
    y = F.conv1d(history.float(), weight.float()[:, None, :], groups=channels, dilation=dilation)  # [B, C, Lq]
    if silu:
        y = F.silu(y)
    if intermediate_states is not None:
        # window after token t = history[t+1 : t+1+L]
        after = history.unfold(-1, state_len, 1)[:, :, 1:]  # [B, C, Lq, L]
        intermediate_states.copy_(after.transpose(1, 2))
    conv_state[state_slots] = history[:, :, lq:]
    return y.transpose(1, 2).reshape(total, channels).to(x.dtype)


# ----- prefill: any number of requests of any length in one flat batch -----

@triton.jit
def _conv_taps(x_ptr, w_ptr, state_ptr, offs_t, offs_c, local, slot, init, ok, c_ok,
               stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl,
               K: tl.constexpr, LST: tl.constexpr, DIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               WITH_STATE: tl.constexpr):
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        back = (K - 1 - j) * DIL  # tap j reads the input `back` positions before the token
        src = local - back
        from_x = src >= 0
        xv = tl.load(x_ptr + tl.maximum(offs_t - back, 0)[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                     mask=ok & from_x[:, None], other=0.0)
        # inputs live on in the state's dtype, so they are rounded to it here too (as the reference does)
        xv = xv.to(state_ptr.dtype.element_ty).to(tl.float32)
        if WITH_STATE:
            sv = tl.load(state_ptr + slot[:, None] * stride_ss + offs_c[None, :] * stride_sc
                         + tl.maximum(LST + src, 0)[:, None] * stride_sl,
                         mask=ok & (~from_x & init)[:, None], other=0.0).to(tl.float32)
            xv = tl.where(from_x[:, None], xv, sv)
        wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    return acc


@triton.jit(do_not_specialize=["T"])
def _conv1d_varlen_out_kernel(
    x_ptr, w_ptr, state_ptr, req_ptr, local_ptr, slots_ptr, has_init_ptr, out_ptr,
    T, C,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl, stride_ot, stride_oc,
    K: tl.constexpr, LST: tl.constexpr, DIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    # grid (channel tiles, token tiles), channel tiles fastest, as in the update kernel (8 x 1024 tokens on an H200:
    # 221.3 -> 216.8 us)
    t_tile, c_tile = tl.program_id(1), tl.program_id(0)
    offs_t = t_tile * BT + tl.arange(0, BT)
    offs_c = c_tile * BC + tl.arange(0, BC)
    t_ok, c_ok = offs_t < T, offs_c < C
    req = tl.load(req_ptr + offs_t, mask=t_ok, other=0)
    local = tl.load(local_ptr + offs_t, mask=t_ok, other=LST)
    slot = tl.load(slots_ptr + req, mask=t_ok, other=0)
    init = tl.load(has_init_ptr + req, mask=t_ok, other=0) != 0
    ok = t_ok[:, None] & c_ok[None, :]
    # Only a request's first LST tokens reach back into its state: most tiles skip those gathers (a strided,
    # unvectorised load per tap and element, even when masked off, made the kernel ~4x slower than its bandwidth).
    if tl.min(local, axis=0) < LST:
        acc = _conv_taps(x_ptr, w_ptr, state_ptr, offs_t, offs_c, local, slot, init, ok, c_ok,
                         stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl,
                         K, LST, DIL, BT, BC, True)
    else:
        acc = _conv_taps(x_ptr, w_ptr, state_ptr, offs_t, offs_c, local, slot, init, ok, c_ok,
                         stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl,
                         K, LST, DIL, BT, BC, False)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    if S0 > 0:
        # planar output: channel parts [0, S0), [S0, S0+S1), [S0+S1, C) each stored as its own contiguous [T, width]
        # block, one after the other (a channel tile never straddles two parts)
        c0 = c_tile * BC
        part_start = tl.where(c0 >= S0 + S1, S0 + S1, tl.where(c0 >= S0, S0, 0))
        width = tl.where(c0 >= S0 + S1, C - S0 - S1, tl.where(c0 >= S0, S1, S0))
        base = out_ptr + T.to(tl.int64) * part_start
        ptrs = base + offs_t[:, None].to(tl.int64) * width + (offs_c - part_start)[None, :]
    else:
        ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_c[None, :] * stride_oc
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv1d_varlen_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slots_ptr, has_init_ptr,
    C,
    stride_xt, stride_xc, stride_ss, stride_sc, stride_sl,
    LST: tl.constexpr, LP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    r = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_p = tl.arange(0, LP)
    start = tl.load(qsl_ptr + r)
    n = tl.load(qsl_ptr + r + 1) - start
    slot = tl.load(slots_ptr + r)
    init = tl.load(has_init_ptr + r).to(tl.int32)
    c_ok, p_ok = offs_c < C, offs_p < LST
    # scalar conditions as full-shape masks (the interpreter rejects scalar & tile)
    zero = tl.zeros([BC, LP], dtype=tl.int32)
    init2d, nonempty = (zero + init) != 0, (zero + n) > 0
    pos = n + offs_p  # new state position p = position n + p of the window [old state (LST), inputs (n)]
    in_state = pos < LST
    base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    old = tl.load(base + tl.minimum(pos, LST - 1)[None, :] * stride_sl,
                  mask=c_ok[:, None] & (p_ok & in_state)[None, :] & init2d, other=0.0)
    xv = tl.load(x_ptr + (start + tl.maximum(pos - LST, 0))[None, :] * stride_xt + offs_c[:, None] * stride_xc,
                 mask=c_ok[:, None] & (p_ok & ~in_state)[None, :], other=0.0)
    new = tl.where(in_state[None, :], old, xv.to(state_ptr.dtype.element_ty))
    tl.debug_barrier()  # the shift moves values between positions that other threads may still be reading
    tl.store(base + offs_p[None, :] * stride_sl, new, mask=c_ok[:, None] & p_ok[None, :] & nonempty)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
    token_local: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
    block_t: int = 32,
    block_c: int = 128,
    num_warps: int = 4,
    split: tuple[int, int, int] | None = None,
):
    """`ops.conv.causal_conv1d_ref`'s contract for a whole flat batch in two launches: x [T, C]; request r owns rows
    query_start_loc[r]:query_start_loc[r+1] (token_req / token_local: each row's request and index within it) and
    state row state_slots[r]. Outputs are accumulated in fp32; the states are updated in place.

    split: channel widths of three parts (GDN's q, k, v), returned as three contiguous [T, width] tensors, where
    `out.split(split, -1)` would give strided views that fla's kernels copy (~200 us per layer at 8k tokens)."""
    total, channels = x.shape
    kernel = weight.shape[1]
    state_len = (kernel - 1) * dilation
    assert conv_state.shape[1:] == (channels, state_len), "conv_state must be [S, C, (K-1)*dilation]"
    silu = _check_activation(activation)
    bt, bc = block_t, min(block_c, triton.next_power_of_2(channels))
    planar = split is not None and split[0] % bc == 0 and split[1] % bc == 0
    out = torch.empty((total, channels), dtype=x.dtype, device=x.device)

    def result():
        if split is None:
            return out
        if not planar:
            return out.split(list(split), -1)
        flat = out.view(-1)
        return tuple(flat[total * a: total * (a + w)].view(total, w)
                     for a, w in zip((0, split[0], split[0] + split[1]), split))

    num_reqs = state_slots.shape[0]
    if total == 0 or num_reqs == 0:
        return result()
    has_init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    _conv1d_varlen_out_kernel[(triton.cdiv(channels, bc), triton.cdiv(total, bt))](
        x, weight, conv_state, token_req, token_local, state_slots, has_init, out,
        total, channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_state.stride(),
        out.stride(0), out.stride(1),
        K=kernel, LST=state_len, DIL=dilation, BT=bt, BC=bc, SILU=silu,
        S0=split[0] if planar else 0, S1=split[1] if planar else 0,
        num_warps=num_warps, **launch_options(x)
    )
    lp = triton.next_power_of_2(state_len)
    bcs = min(triton.next_power_of_2(channels), max(16, 2048 // lp))
    _conv1d_varlen_state_kernel[(num_reqs, triton.cdiv(channels, bcs))](
        x, conv_state, query_start_loc, state_slots, has_init,
        channels,
        x.stride(0), x.stride(1), *conv_state.stride(),
        LST=state_len, LP=lp, BC=bcs, num_warps=4, **launch_options(x)
    )
    return result()
