"""Gated delta rule (the Gated DeltaNet recurrence) over a flat batch, with state slots in fp32 (or bf16 / fp16:
EngineConfig.mamba_ssm_cache_dtype).

Per value head, with state S in R^{Dk x Dv}:
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
with q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5. Query/key head h serves value heads h*r .. h*r+r-1.
Prefill runs the chunked (UT-transform) form, single tokens the recurrent form; both are fp32. State slots narrower
than fp32 hold the state rounded to their dtype where it is stored: after a request's last token of the step, and
after each verified row, whose state goes into a spare slot and on, rounded, to the next row, so verifying k drafts
leaves the state that k + 1 one-token steps would. A prefill chunk rounds once, at its end, whichever form computes
it (the recurrent kernel takes the prefill chunks of a CUDA-graph step).
"""

import functools
import logging

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path

if HAS_TRITON:
    from . import gated_delta_triton

logger = logging.getLogger("qwen4exp")

CHUNK = 64


@compiled_on_gpu
def gdn_gates(b, a, A_log, dt_bias):
    """beta = sigmoid(b) (input dtype); log-decay g = -exp(A_log) * softplus(a + dt_bias) <= 0, in fp32."""
    return torch.sigmoid(b), -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, g, beta):
    """[n, H, D] inputs -> fp32 [H, n, D] with grouped q/k heads expanded to the value heads."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (t.transpose(0, 1).float() for t in (q, k, v))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    return q, _l2norm(k), v, g.t().float(), beta.t().float()


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, state, states_after: list | None = None,
                                   state_dtype: torch.dtype = torch.float32):
    """One sequence token by token. q, k: [n, Hk, Dk]; v: [n, Hv, Dv]; g, beta: [n, Hv]; state: [Hv, Dk, Dv] fp32.
    Returns (out [n, Hv, Dv] fp32, final state); `states_after`, when given, receives the state after each token.
    `state_dtype`: the state slots' dtype, to which the state is rounded after each token's output (every token's
    state is stored: a verified request's rows)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = (state * k[:, t, :, None]).sum(-2)
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(-2)
        if state_dtype != torch.float32:
            state = state.to(state_dtype).float()
        if states_after is not None:
            states_after.append(state)
    return out.transpose(0, 1), state


def chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Same contract as the recurrent form, computed chunk by chunk with a triangular solve inside each chunk."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    heads, n, dk = k.shape
    pad = (-n) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    nc = (n + pad) // chunk
    q, k, v = (t.reshape(heads, nc, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, nc, chunk), beta.reshape(heads, nc, chunk)

    cum = g.cumsum(-1)  # log-decay from the chunk start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), i >= j
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + A) with A = strict lower part of (beta k k^T) * decay; solve_triangular ignores the stored diagonal.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()

    out = torch.empty_like(v)
    for c in range(nc):
        v_new = u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(heads, nc * chunk, -1)[:, :n]
    return out.transpose(0, 1), state


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: list[int],
    state_slots: list[int],
    has_initial_state: list[bool],
    token_slots: list[int] | None = None,
) -> torch.Tensor:
    """Flat batch: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; ssm_state [S, Hv, Dk, Dv] fp32, bf16 or fp16.
    Returns out [T, Hv, Dv] in v's dtype and writes each request's final state into its slot. token_slots [T]
    (speculative verification): where token_slots[t] >= 0, the state after row t is also written into that slot
    (such requests run token by token, as decoding does)."""
    out = torch.empty_like(v)
    for r, slot in enumerate(state_slots):
        s, e = query_start_loc[r], query_start_loc[r + 1]
        if e == s:
            continue
        init = ssm_state[slot] if has_initial_state[r] else ssm_state.new_zeros(ssm_state.shape[1:])
        stored = token_slots is not None and any(t >= 0 for t in token_slots[s:e])
        if stored:
            after = []
            o, final = recurrent_gated_delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init.float(), after,
                                                      ssm_state.dtype)
            for t, state in zip(token_slots[s:e], after):
                if t >= 0:
                    ssm_state[t] = state
        else:
            fn = recurrent_gated_delta_rule_ref if e - s == 1 else chunk_gated_delta_rule_ref
            o, final = fn(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init.float())
        out[s:e] = o.to(out.dtype)
        ssm_state[slot] = final
    return out


def warm_up_token_counts(num_key_heads: int, max_tokens: int) -> list[int]:
    """One step size (prefill tokens) per autotuning key of fla's chunk path up to max_tokens: its q/k l2norm keys
    its tuning on cdiv(tokens * heads, 65536), one bucket per 65536 / heads tokens. The first bucket is met by every
    smaller step, so it needs no size of its own."""
    per_bucket = max(1, 65536 // num_key_heads)
    return [min(n * per_bucket, max_tokens) for n in range(2, -(-max_tokens // per_bucket) + 1)]


@functools.cache
def fla_chunk():
    """fla-core's chunk kernel, or None with one warning: without it a GPU prefill step runs the torch reference,
    ~50x the kernels and ~3-4x the wall time of a 16 x 1k step, which is otherwise easy to mistake for a slow GPU
    (e.g. with fla installed into another interpreter than the one running)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        logger.warning("fla-core is not importable from this interpreter (%s): bf16 GDN prefill on the GPU runs the "
                       "torch reference, several times slower; install it with `python -m pip install fla-core`", e)
        return None
    return chunk_gated_delta_rule


def gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, ssm_state, meta) -> torch.Tensor:
    """gated_delta_rule from the gate projections b, a [T, Hv] (beta, g = gdn_gates(b, a, A_log, dt_bias)).
    GPU, a step of one-token and verified requests or a step in a CUDA graph: the recurrent kernel computes the gates
    itself, so the step runs no gate kernels; with verified requests or in a graph it runs each request's tokens one
    by one (any mix of lengths, read from the device copy of query_start_loc). Any other step, and the CPU, computes
    the gates first and takes gated_delta_rule."""
    all_decode = meta.num_decode_reqs == meta.num_reqs
    recurrent = meta.num_decode_reqs + meta.num_verify_reqs == meta.num_reqs  # no prefill chunk
    if HAS_TRITON and fast_path(v) and (recurrent or meta.in_cuda_graph):
        return gated_delta_triton.fused_recurrent_gated_delta_rule_raw(
            q, k, v, b, a, A_log, dt_bias, ssm_state, meta.state_slots, meta.has_initial,
            query_start_loc=None if all_decode else meta.query_start_loc, token_slots=meta.state_token_slots)
    beta, g = gdn_gates(b, a, A_log, dt_bias)
    return gated_delta_rule(q, k, v, g, beta, ssm_state, meta)


def gated_delta_rule(q, k, v, g, beta, ssm_state, meta) -> torch.Tensor:
    """Step-level dispatch. GPU: one-token requests take the fused recurrent kernel (in place on the slots), and so
    do verified requests (token by token, storing the state after each row); prefill chunks take fla's varlen chunk
    kernel when installed. CPU: the reference."""
    qsl = meta.query_start_loc_cpu
    if not (HAS_TRITON and fast_path(v)):
        return gated_delta_rule_ref(q, k, v, g, beta, ssm_state, qsl, meta.state_slots_cpu, meta.has_initial_state,
                                    meta.state_token_slots_cpu)

    def fused_recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, slots, has_initial):
        if not meta.num_verify_reqs:
            return gated_delta_triton.fused_recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, slots, has_initial)
        n = slots.shape[0]  # the leading requests: decodes and verified requests
        return gated_delta_triton.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, ssm_state, slots, has_initial, query_start_loc=meta.query_start_loc[: n + 1],
            token_slots=meta.state_token_slots)

    d, r = meta.num_decode_reqs + meta.num_verify_reqs, meta.num_reqs
    if d == r:
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, meta.state_slots, meta.has_initial)
    # fla's chunk kernels use TF32 dots on fp32 inputs (~1e-3 relative error): fp32 callers get the exact reference
    chunk = fla_chunk() if v.dtype != torch.float32 else None
    rows = qsl[d]  # the rows of the decodes and verified requests
    if chunk is None:
        prefill = gated_delta_rule_ref(q[rows:], k[rows:], v[rows:], g[rows:], beta[rows:], ssm_state,
                                       [x - rows for x in qsl[d:]], meta.state_slots_cpu[d:],
                                       meta.has_initial_state[d:])
        if d == 0:
            return prefill
        out = torch.empty_like(v)
        out[rows:] = prefill
    else:
        # fla runs on the whole step's tensors with sequences starting at the first prefill row, so its output
        # holds every row and only the decode rows are filled in afterwards (copying the prefill rows into a fresh
        # tensor cost ~0.1 ms a layer at 16k tokens); rows before cu[0] only pass through fla's q/k l2norm
        slots = meta.state_slots[d:]
        init = torch.where(meta.has_initial[d:, None, None, None], ssm_state[slots].float(), 0.0)
        cu = meta.query_start_loc[d:].long()
        o, final = chunk(q[None], k[None], v[None], g[None].float(), beta[None], initial_state=init,
                         output_final_state=True, cu_seqlens=cu, chunk_indices=meta.prefill_chunk_indices(CHUNK),
                         use_qk_l2norm_in_kernel=True)
        ssm_state[slots] = final.to(ssm_state.dtype)
        out = o[0].to(v.dtype)
    if d:
        out[:rows] = fused_recurrent_gated_delta_rule(q[:rows], k[:rows], v[:rows], g[:rows], beta[:rows], ssm_state,
                                                      meta.state_slots[:d], meta.has_initial[:d])
    return out
