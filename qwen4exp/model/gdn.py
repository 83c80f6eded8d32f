"""Gated DeltaNet (linear attention) with the flat Qwen3.5 projection layout.

Split over ranks by heads: each rank holds its key heads and the value heads that read them (in_proj's q, k, v, z, b
and a rows, the conv channels, A_log and dt_bias), and the matching columns of out_proj, whose partial products meet
in one all-reduce."""

import torch
from torch import nn

from .. import distributed, ops
from ..config import ModelConfig
from .common import GatedRMSNorm
from .merged_linear import Linear, MergedLinear
from .metadata import StepMetadata
from .state import GDNState


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        k0, k1 = distributed.split(c.linear_num_key_heads, "heads", "linear_num_key_heads")
        v0, v1 = distributed.split(c.linear_num_value_heads, "heads", "linear_num_value_heads")
        self.num_k_heads, self.num_v_heads = k1 - k0, v1 - v0  # this rank's
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.reduce = distributed.world_size() > 1
        shards = {}
        if self.reduce:
            dk, dv, key_dim = self.head_k_dim, self.head_v_dim, c.linear_num_key_heads * self.head_k_dim
            channels = distributed.rows((k0 * dk, k1 * dk), (key_dim + k0 * dk, key_dim + k1 * dk),
                                        (2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv))
            shards = {"in_proj_qkv": channels, "in_proj_z": distributed.rows((v0 * dv, v1 * dv)),
                      "in_proj_b": distributed.rows((v0, v1)), "in_proj_a": distributed.rows((v0, v1))}
        self.in_proj = MergedLinear(c.hidden_size, {"in_proj_qkv": conv_dim, "in_proj_z": self.value_dim,
                                                    "in_proj_b": self.num_v_heads, "in_proj_a": self.num_v_heads},
                                   quantizable=True, shards=shards)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps, c.output_gate_type)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)
        if self.reduce:
            self.conv1d.checkpoint_shards = {"weight": shards["in_proj_qkv"]}
            self.checkpoint_shards = {"dt_bias": distributed.rows((v0, v1)), "A_log": distributed.rows((v0, v1))}
            self.out_proj.checkpoint_shards = {"weight": distributed.columns(v0 * self.head_v_dim,
                                                                             v1 * self.head_v_dim)}

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
        out = ops.linear.output_linear(core, self.out_proj.weight, scale=self.out_proj.weight_scale_inv)
        return distributed.all_reduce(out) if self.reduce else out
