"""RMSNorm variants of the reference, all computed in fp32."""

import torch
import torch.nn.functional as F

from . import tuning
from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path

if HAS_TRITON:
    from . import hyper_connection_triton, norm_triton


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


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """`rms_norm`, dispatched: grouped norms of [T, groups*G] on the GPU go through the hyper-connection norm pass
    (`hyper_connection_triton.hc_prenorm`, the same per-group arithmetic) from tuning.TRITON_NORM_MIN_TOKENS
    tokens."""
    if (group_size is not None and HAS_TRITON and x.dim() == 2 and fast_path(x)
            and x.shape[0] >= tuning.TRITON_NORM_MIN_TOKENS and x.shape[-1] % group_size == 0):
        groups = x.shape[-1] // group_size
        if hyper_connection_triton.prenorm_supported(x, groups):
            return hyper_connection_triton.hc_prenorm(x, weight, eps, groups)[1]
    return rms_norm(x, weight, eps, group_size)


def gated_rms_norm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                      activation: str) -> torch.Tensor:
    """`gated_rms_norm`, dispatched: one Triton pass (norm_triton.py) on the GPU from tuning.TRITON_NORM_MIN_TOKENS
    tokens."""
    if (HAS_TRITON and fast_path(x) and x.shape[0] >= tuning.TRITON_NORM_MIN_TOKENS
            and norm_triton.supported(x, gate)):
        return norm_triton.gated_rms_norm(x, gate, weight, eps, activation)
    return gated_rms_norm(x, gate, weight, eps, activation)
