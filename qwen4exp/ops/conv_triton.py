"""Causal depthwise conv1d with state slots: the decode kernel (one token a request, graph capturable) and the
varlen kernel (any flat batch of requests).

x [T, C], weight [C, K], conv_state [S, C, L] with L = (K-1)*dilation holding each request's last L inputs, oldest
first (treated as zeros where has_initial_state[b] is False). With window = [state (L), x_t] the token's output is
act(sum_j weight[c, j] * window[c, j*dilation]), accumulated in fp32 and returned in x's dtype [T, C].
conv_state[state_slots[b]] is updated in place to the last L inputs (new inputs are stored in the state's dtype, and
are rounded to it before use, as the reference does).

Padding rows carry slot 0 (the null slot): they read and write slot 0 only, which may hold garbage.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import launch_options, pdl_start


@triton.jit
def _load_window(state_base, x, stride_sl, shift, offs_p, sel, c_ok, init2d, LST: tl.constexpr):
    """Positions shift + offs_p (where sel) of the history [state (LST), x] as fp32 [BC, LP]; x [BC] fp32."""
    pos = shift + offs_p
    in_state = pos < LST
    m_state = c_ok[:, None] & (sel & in_state)[None, :] & init2d
    from_state = tl.load(state_base + pos[None, :] * stride_sl, mask=m_state, other=0.0).to(tl.float32)
    from_x = tl.where((sel & (pos == LST))[None, :], x[:, None], 0.0)
    return tl.where(in_state[None, :], from_state, from_x)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, has_init_ptr, out_ptr,
    C,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl, stride_ot, stride_oc,
    LST: tl.constexpr, DIL: tl.constexpr, LP: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr
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
    x = tl.load(x_ptr + b * stride_xt + offs_c * stride_xc, mask=c_ok, other=0.0)
    # Inputs live on in the state's dtype, so they are rounded to it whether used now or after the next step.
    x = x.to(state_ptr.dtype.element_ty).to(tl.float32)

    # Weights spread over window positions: tap j sits at position j*DIL, every other position weighs zero.
    is_tap = (offs_p % DIL == 0) & (offs_p <= LST)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + (offs_p // DIL)[None, :] * stride_wk,
                mask=c_ok[:, None] & is_tap[None, :], other=0.0).to(tl.float32)

    win = _load_window(state_base, x, stride_sl, 0, offs_p, is_tap, c_ok, init2d, LST)
    acc = tl.sum(win * w, axis=1)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * stride_ot + offs_c * stride_oc, acc.to(out_ptr.dtype.element_ty), mask=c_ok)

    in_state_len = offs_p < LST
    new_state = _load_window(state_base, x, stride_sl, 1, offs_p, in_state_len, c_ok, init2d, LST)
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
    block_c: int | None = None,
    num_warps: int = 1,
) -> torch.Tensor:
    """One token a request (x [B, C]); see the module docstring. block_c / num_warps: tuning overrides (the
    defaults measured best on an H200 at 10240 channels: 6.8 us at batch 64 against 29 us with 256 channels over 4
    warps)."""
    B, channels = x.shape
    kernel = weight.shape[1]
    state_len = (kernel - 1) * dilation
    assert kernel >= 2 and weight.shape[0] == channels and state_slots.shape[0] == B
    assert conv_state.shape[1:] == (channels, state_len), "conv_state must be [S, C, (K-1)*dilation]"
    assert state_slots.dtype == torch.int64 and has_initial_state.shape == (B,)
    silu = _check_activation(activation)

    out = torch.empty((B, channels), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    lp = triton.next_power_of_2(state_len + 1)  # the window: state plus the new input
    bc = block_c or min(triton.next_power_of_2(channels), max(16, 512 // lp))
    has_init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    _causal_conv1d_update_kernel[(triton.cdiv(channels, bc), B)](
        x, weight, conv_state, state_slots, has_init, out,
        channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_state.stride(),
        out.stride(0), out.stride(1),
        LST=state_len, DIL=dilation, LP=lp, BC=bc, SILU=silu, num_warps=num_warps, **launch_options(x)
    )
    return out


# ----- prefill: any number of requests of any length in one flat batch -----

@triton.jit
def _out_ptrs(out_ptr, rows, offs_c, T, C, stride_ot, stride_oc, S0: tl.constexpr, S1: tl.constexpr):
    if S0 > 0:
        # planar output: channel parts [0, S0), [S0, S0+S1), [S0+S1, C) each stored as its own contiguous [T, width]
        # block, one after the other
        part_start = tl.where(offs_c >= S0 + S1, S0 + S1, tl.where(offs_c >= S0, S0, 0))
        width = tl.where(offs_c >= S0 + S1, C - S0 - S1, tl.where(offs_c >= S0, S1, S0))
        return (out_ptr + T.to(tl.int64) * part_start + rows.to(tl.int64) * width + offs_c - part_start)
    else:
        return out_ptr + rows * stride_ot + offs_c * stride_oc


@triton.jit
def _varlen_out_rows(
    x_ptr, w_ptr, state_ptr, local_ptr, out_ptr, pid, T, C,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_ot, stride_oc,
    K: tl.constexpr, LST: tl.constexpr, DIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr
):
    """Program `pid` of the rows whose window lies inside their request's inputs (index in the request >= LST): a
    tile of BT rows x BC channels, channel tiles fastest (programs side by side read adjacent columns). The taps
    are read as if the batch were one sequence; a request's first LST rows, which reach back into its state, are
    left to `_varlen_request_head`. Knowing nothing else of requests keeps this pass at its loads and stores
    (per-token request, slot and state loads double it: 16k tokens on an H200, 437 us against 226 us for the taps
    alone)."""
    n_ct = tl.cdiv(C, BC)
    offs_t = (pid // n_ct) * BT + tl.arange(0, BT)
    offs_c = (pid % n_ct) * BC + tl.arange(0, BC)
    t_ok, c_ok = offs_t < T, offs_c < C
    ok = t_ok[:, None] & c_ok[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        back = (K - 1 - j) * DIL  # tap j reads the input `back` rows before the token
        xv = tl.load(x_ptr + tl.maximum(offs_t - back, 0)[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                     mask=ok & (offs_t >= back)[:, None], other=0.0)
        # inputs live on in the state's dtype (state_ptr is here for it), so they are rounded to it, as the
        # reference does
        xv = xv.to(state_ptr.dtype.element_ty).to(tl.float32)
        wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    inside = tl.load(local_ptr + offs_t, mask=t_ok, other=0) >= LST
    ptrs = _out_ptrs(out_ptr, offs_t[:, None], offs_c[None, :], T, C, stride_ot, stride_oc, S0, S1)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok & inside[:, None])


@triton.jit
def _state_after(state_ptr, base, x_ptr, start, m, offs_p, offs_c, c_p_ok, init2d, stride_sl, stride_xt, stride_xc,
                 LST: tl.constexpr):
    """A request's state after its first m rows, in the state's dtype [BC, LP]: position p is position m + p of
    the window [old state (LST), the request's inputs]."""
    pos = m + offs_p
    in_state = pos < LST
    old = tl.load(base[:, None] + tl.minimum(pos, LST - 1)[None, :] * stride_sl,
                  mask=c_p_ok & in_state[None, :] & init2d, other=0.0)
    xv = tl.load(x_ptr + (start + tl.maximum(pos - LST, 0))[None, :] * stride_xt + offs_c[:, None] * stride_xc,
                 mask=c_p_ok & ~in_state[None, :], other=0.0)
    return tl.where(in_state[None, :], old, xv.to(state_ptr.dtype.element_ty))


@triton.jit
def _varlen_request_head(
    x_ptr, w_ptr, state_ptr, qsl_ptr, slots_ptr, has_init_ptr, token_slots_ptr, out_ptr, r, ct, T, C,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl, stride_ot, stride_oc,
    K: tl.constexpr, LST: tl.constexpr, DIL: tl.constexpr, LP: tl.constexpr, BC: tl.constexpr,
    SILU: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, TOKEN_STATES: tl.constexpr
):
    """Request r, channel tile ct: its first LST output rows, which reach back into its state, with TOKEN_STATES
    the state after each of a verified request's rows into that row's token slot, then the state's update to its
    last LST inputs (the state is read before it is overwritten, in one program)."""
    offs_c = ct * BC + tl.arange(0, BC)
    start = tl.load(qsl_ptr + r)
    n = tl.load(qsl_ptr + r + 1) - start
    if n > 0:  # not an empty row of a mixed graph (most of them at small batches)
        slot = tl.load(slots_ptr + r)
        init = tl.load(has_init_ptr + r).to(tl.int32)
        c_ok = offs_c < C
        # scalar conditions as full-shape masks (the interpreter rejects scalar & tile)
        zero_c = tl.zeros([BC], dtype=tl.int32)
        init_c = (zero_c + init) != 0
        base = state_ptr + slot * stride_ss + offs_c * stride_sc

        for t in tl.static_range(LST):
            acc = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(K):
                src = t - (K - 1 - j) * DIL  # the request's input index the tap reads; negative: in the state
                if src >= 0:
                    v = tl.load(x_ptr + (start + src) * stride_xt + offs_c * stride_xc,
                                mask=c_ok & (zero_c + src < n), other=0.0)
                    v = v.to(state_ptr.dtype.element_ty).to(tl.float32)
                else:
                    v = tl.load(base + (LST + src) * stride_sl, mask=c_ok & init_c, other=0.0).to(tl.float32)
                wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
                acc += v * wj
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            ptrs = _out_ptrs(out_ptr, start + t, offs_c, T, C, stride_ot, stride_oc, S0, S1)
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=c_ok & (zero_c + t < n))

        offs_p = tl.arange(0, LP)
        p_ok = offs_p < LST
        zero = tl.zeros([BC, LP], dtype=tl.int32)
        init2d = (zero + init) != 0
        c_p_ok = c_ok[:, None] & p_ok[None, :]
        if TOKEN_STATES:
            # a verified request (its first row has a token slot): the state after each row but its last, into the
            # row's slot; no request owns those slots, so they are written before the barrier
            if tl.load(token_slots_ptr + start) >= 0:
                for row in range(0, n - 1):
                    out_slot = tl.load(token_slots_ptr + start + row)
                    after = _state_after(state_ptr, base, x_ptr, start, row + 1, offs_p, offs_c, c_p_ok, init2d,
                                         stride_sl, stride_xt, stride_xc, LST)
                    tl.store(state_ptr + tl.maximum(out_slot, 0) * stride_ss + offs_c[:, None] * stride_sc
                             + offs_p[None, :] * stride_sl, after, mask=c_p_ok & ((zero + out_slot) >= 0))
        new = _state_after(state_ptr, base, x_ptr, start, n, offs_p, offs_c, c_p_ok, init2d, stride_sl, stride_xt,
                           stride_xc, LST)
        tl.debug_barrier()  # the shift moves values between positions that other threads may still be reading
        tl.store(base[:, None] + offs_p[None, :] * stride_sl, new, mask=c_p_ok)


@triton.jit(do_not_specialize=["T", "NUM_HEAD_PROGRAMS"])
def _conv1d_varlen_kernel(
    x_ptr, w_ptr, state_ptr, qsl_ptr, local_ptr, slots_ptr, has_init_ptr, token_slots_ptr, out_ptr,
    T, C, NUM_HEAD_PROGRAMS,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl, stride_ot, stride_oc,
    K: tl.constexpr, LST: tl.constexpr, DIL: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BCH: tl.constexpr, SILU: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, TOKEN_STATES: tl.constexpr,
    PDL: tl.constexpr
):
    """One launch, two kinds of program: the first NUM_HEAD_PROGRAMS each take one request's head rows and state
    (one per request and channel tile of BCH), the rest the rows inside their request's inputs. The two never
    write the same row, and only the first reads or writes states."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    if pid < NUM_HEAD_PROGRAMS:
        n_ct = tl.cdiv(C, BCH)
        _varlen_request_head(x_ptr, w_ptr, state_ptr, qsl_ptr, slots_ptr, has_init_ptr, token_slots_ptr, out_ptr,
                             pid // n_ct, pid % n_ct, T, C,
                             stride_xt, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sl, stride_ot,
                             stride_oc, K, LST, DIL, LP, BCH, SILU, S0, S1, TOKEN_STATES)
    else:
        _varlen_out_rows(x_ptr, w_ptr, state_ptr, local_ptr, out_ptr, pid - NUM_HEAD_PROGRAMS, T, C,
                         stride_xt, stride_xc, stride_wc, stride_wk, stride_ot, stride_oc,
                         K, LST, DIL, BT, BC, SILU, S0, S1)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_local: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
    block_t: int = 32,
    block_c: int = 128,
    num_warps: int = 4,
    split: tuple[int, int, int] | None = None,
    token_slots: torch.Tensor | None = None,
):
    """`ops.conv.causal_conv1d_ref`'s contract for a whole flat batch in one launch: x [T, C]; request r owns rows
    query_start_loc[r]:query_start_loc[r+1] (consecutive, covering all T rows) and state row state_slots[r];
    token_local [T] is each row's index in its request. Outputs are accumulated in fp32; the states are updated in
    place. token_slots [>= T] (speculative verification): the reference's rule, by the request's head program.

    split: channel widths of three parts (GDN's q, k, v), returned as three contiguous [T, width] tensors, where
    `out.split(split, -1)` would give strided views that fla's kernels copy (~200 us per layer at 8k tokens)."""
    total, channels = x.shape
    kernel = weight.shape[1]
    state_len = (kernel - 1) * dilation
    assert conv_state.shape[1:] == (channels, state_len), "conv_state must be [S, C, (K-1)*dilation]"
    assert token_local.shape[0] >= total
    silu = _check_activation(activation)
    bt, bc = block_t, min(block_c, triton.next_power_of_2(channels))
    out = torch.empty((total, channels), dtype=x.dtype, device=x.device)

    def result():
        if split is None:
            return out
        flat = out.view(-1)
        return tuple(flat[total * a: total * (a + w)].view(total, w)
                     for a, w in zip((0, split[0], split[0] + split[1]), split))

    num_reqs = state_slots.shape[0]
    if total == 0 or num_reqs == 0:
        return result()
    assert split is None or (split[0] > 0 and sum(split) == channels)
    s0, s1 = split[:2] if split is not None else (0, 0)
    has_init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    lp = triton.next_power_of_2(state_len)
    bch = min(triton.next_power_of_2(channels), max(16, 2048 // lp))
    if token_slots is not None:
        assert token_slots.shape[0] >= total
    head_programs = num_reqs * triton.cdiv(channels, bch)
    _conv1d_varlen_kernel[(head_programs + triton.cdiv(channels, bc) * triton.cdiv(total, bt),)](
        x, weight, conv_state, query_start_loc, token_local, state_slots, has_init,
        token_slots if token_slots is not None else state_slots, out,
        total, channels, head_programs,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_state.stride(),
        out.stride(0), out.stride(1),
        K=kernel, LST=state_len, DIL=dilation, LP=lp, BT=bt, BC=bc, BCH=bch, SILU=silu, S0=s0, S1=s1,
        TOKEN_STATES=token_slots is not None, num_warps=num_warps, **launch_options(x)
    )
    return result()
