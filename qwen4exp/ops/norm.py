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
