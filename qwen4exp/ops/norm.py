"""RMSNorm variants of the reference, all computed in fp32."""

import torch
import torch.nn.functional as F

from . import compiled_on_gpu


@compiled_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32, cast back to x's dtype.

    x: [..., D]; weight: [D]. With `group_size`, each consecutive group of the last dim is normalised on its own
    (the hyper-connection and PLE norms normalise each residual stream separately).
    """
    xf = x.float()
    if group_size is not None:
        xf = xf.unflatten(-1, (-1, group_size))
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).type_as(x)


@compiled_on_gpu
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str):
    """GDN output norm: w * (x / rms(x)) * act(gate), norm before gate. x, gate: [..., D]; weight: [D] (not centred).

    The normalised value is rounded to x's dtype before the weight multiply, then gated in fp32 (as the reference).
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    act = torch.sigmoid if activation == "sigmoid" else F.silu
    return (out * act(gate.float())).to(dtype)


# Token counts from which the GPU takes the Triton norms below: inductor's compiled forms are single kernels that
# run near launch latency at decode sizes, but well under bandwidth on prefill-sized steps.
TRITON_NORM_MIN_TOKENS = 256


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """`rms_norm`, dispatched: grouped norms of [T, groups*G] on the GPU go through the hyper-connection norm pass
    (`triton_hc.hc_prenorm`, the same per-group arithmetic) from TRITON_NORM_MIN_TOKENS tokens."""
    from . import fast_path

    if (group_size is not None and x.dim() == 2 and fast_path(x) and x.shape[0] >= TRITON_NORM_MIN_TOKENS
            and x.shape[-1] % group_size == 0):
        from .triton_hc import hc_prenorm, prenorm_supported

        groups = x.shape[-1] // group_size
        if prenorm_supported(x, groups):
            return hc_prenorm(x, weight, eps, groups)[1]
    return rms_norm(x, weight, eps, group_size)


def gated_rms_norm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                      activation: str) -> torch.Tensor:
    """`gated_rms_norm`, dispatched: one Triton pass (ops/triton_norm.py) on the GPU from TRITON_NORM_MIN_TOKENS
    tokens."""
    from . import fast_path

    if fast_path(x) and x.shape[0] >= TRITON_NORM_MIN_TOKENS:
        from . import triton_norm

        if triton_norm.supported(x, gate):
            return triton_norm.gated_rms_norm(x, gate, weight, eps, activation)
    return gated_rms_norm(x, gate, weight, eps, activation)
