"""Gated DeltaNet (linear attention) with the flat Qwen3.5 projection layout."""

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from .common import GatedRMSNorm
from .merged_linear import Linear, MergedLinear
from .metadata import StepMetadata
from .state import GDNState


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj = MergedLinear(c.hidden_size, {"in_proj_qkv": conv_dim, "in_proj_z": self.value_dim,
                                                    "in_proj_b": self.num_v_heads, "in_proj_a": self.num_v_heads},
                                   quantizable=True)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps, c.output_gate_type)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: StepMetadata, state: GDNState) -> torch.Tensor:
        T = x.shape[0]
        qkv, z, b, a = self.in_proj(x)
        q, k, v = ops.conv.causal_conv1d(qkv, self.conv1d.weight[:, 0, :], state.conv, meta,
                                         split=(self.key_dim, self.key_dim, self.value_dim))
        core = ops.gated_delta.gated_delta_rule_raw(
            q.reshape(T, -1, self.head_k_dim), k.reshape(T, -1, self.head_k_dim), v.reshape(T, -1, self.head_v_dim),
            b, a, self.A_log, self.dt_bias, state.ssm, meta,
        )
        # [T, Hv, Dv] views: flattening z's heads into rows would copy it (its rows are strided) when T > 1
        core = self.norm(core, z.reshape(T, -1, self.head_v_dim)).reshape(T, -1)
        return ops.linear.output_linear(core, self.out_proj.weight, scale=self.out_proj.weight_scale_inv)
