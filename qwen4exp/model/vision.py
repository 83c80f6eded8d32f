"""The vision tower: images (the image processor's flattened patches) -> one feature row per merged patch, in the
text model's width. Parameter names are the checkpoint's under `model.visual.`.

Each image is a grid of t x h x w patches (t frames of `temporal_patch_size`, patches of `patch_size` pixels), its
patches ordered by the processor in spatial-merge blocks (each m x m block of neighbouring patches consecutive, m =
spatial_merge_size). The tower embeds every patch (a 3-D convolution whose kernel is its stride, i.e. one linear map
of the flattened patch), adds the learned position table resampled bilinearly (corners aligned) to the image's
h x w grid, runs `depth` pre-norm blocks of bidirectional attention within each image frame (2-D rotary: the first
half of each head's rotated dims turn with the patch row, the second half with its column) and a GELU MLP, and the
merger maps each m x m block (LayerNorm per patch, then the block's patches side by side) to one text-width row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionConfig


def _gelu(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision_config.hidden_act: unsupported {name!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        k = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # the kernel covers the whole patch: the convolution is one GEMM over the flattened patch
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        # rotated in fp32, as the reference does
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(q)
        start = 0
        for length in lengths:  # attention within each frame of each image
            sl = slice(start, start + length)
            out[sl] = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)).transpose(0, 1)
            start += length
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = _gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        spatial = config.head_dim // 2  # rows and columns each turn a quarter of the head's pairs
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device="cpu")
                                                / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def patch_rows_cols(self, grid_thw: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of every patch in the processor's order (merge blocks consecutive), frames repeated."""
        m = self.config.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grid_thw:
            r = torch.arange(h, device=device)[:, None].expand(h, w)
            c = torch.arange(w, device=device)[None, :].expand(h, w)
            for out, grid in ((rows, r), (cols, c)):
                out.append(grid.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        return torch.cat(rows), torch.cat(cols)

    def position_embeddings(self, grid_thw, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The learned side x side table resampled bilinearly, corners aligned, to each image's h x w grid."""
        side = int(self.config.num_position_embeddings ** 0.5)
        h = torch.cat([torch.full((t * hh * ww,), hh, device=rows.device) for t, hh, ww in grid_thw])
        w = torch.cat([torch.full((t * hh * ww,), ww, device=rows.device) for t, hh, ww in grid_thw])

        def taps(index, size):
            src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
            lo = torch.floor(src)
            frac = src - lo
            lo = lo.long()
            return (lo.clamp(0, side - 1), (lo + 1).clamp(0, side - 1)), (1 - frac, frac)

        (r0, r1), (wr0, wr1) = taps(rows, h)
        (c0, c1), (wc0, wc1) = taps(cols, w)
        table = self.pos_embed.weight
        out = (table[r0 * side + c0] * (wr0 * wc0)[:, None] + table[r0 * side + c1] * (wr0 * wc1)[:, None]
               + table[r1 * side + c0] * (wr1 * wc0)[:, None] + table[r1 * side + c1] * (wr1 * wc1)[:, None])
        return out

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: [patches, patch_dim] of the images one after another; grid_thw: each image's (t, h, w) in
        patches. Returns [patches / merge^2, out_hidden_size], the images' rows one after another."""
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        rows, cols = self.patch_rows_cols(grid_thw, device)
        x = x + self.position_embeddings(grid_thw, rows, cols).to(x.dtype)
        freqs = torch.cat((rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)
