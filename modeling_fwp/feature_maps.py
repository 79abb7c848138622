"""Feature maps phi for the keys and queries of linear fast weights (Schlag et al. 2021, sec. 5)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """ELU + 1 (Katharopoulos et al. 2020), shape-preserving: ``[..., d] -> [..., d]``."""
    return F.elu(x) + 1.0


def dpfp_feature_map(x: torch.Tensor, nu: int) -> torch.Tensor:
    """Deterministic parameter-free projection (Schlag et al. 2021, eq. 37).

    ``r(x) = [ReLU(x), ReLU(-x)]`` (dimension 2d), then for each i in 1..nu the element-wise product of r with
    r rolled by i positions: ``phi_{i*2d + j}(x) = r_j(x) * r_{(j + i) mod 2d}(x)``, concatenated over i.

    Args:
        x: ``[..., d]``.
        nu: the number of rolls.
    Returns:
        ``[..., 2 * d * nu]``, non-negative.
    """
    r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    # torch.roll(r, -i) puts r_{j+i} at position j.
    return torch.cat([r * torch.roll(r, shifts=-i, dims=-1) for i in range(1, nu + 1)], dim=-1)


def favor_feature_map(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """FAVOR+ positive random features (Choromanski et al. 2021), as used by Schlag et al. 2021 sec. 5.

    ``phi(x) = exp(w_i . x' - |x'|^2 / 2) / sqrt(m)`` with ``x' = x * d^{-1/4}`` so that
    ``E[phi(q) . phi(k)] = exp(q . k / sqrt(d))``.

    Args:
        x: ``[B, H, T, d]``.
        projection: ``[H, m, d]`` random features w (one set per head).
    Returns:
        ``[B, H, T, m]``, positive.
    """
    d = x.shape[-1]
    m = projection.shape[-2]
    x = x * d**-0.25
    wx = torch.einsum("bhtd,hmd->bhtm", x, projection.to(x.dtype))
    return torch.exp(wx - 0.5 * x.pow(2).sum(-1, keepdim=True)) / math.sqrt(m)


def orthogonal_random_features(num_heads: int, m: int, d: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draws ``[num_heads, m, d]`` orthogonal Gaussian features (blocks of d orthogonal rows, norms chi(d))."""
    blocks = []
    for _ in range(num_heads):
        rows = []
        for _ in range(math.ceil(m / d)):
            q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
            rows.append(q.T)
        w = torch.cat(rows, dim=0)[:m]
        norms = torch.randn(m, d, generator=generator).norm(dim=-1, keepdim=True)
        blocks.append(w * norms)
    return torch.stack(blocks)


class FeatureMap(nn.Module):
    """phi applied to keys and queries, followed by the optional sum normalisation (eq. 29).

    ``forward(x [B, H, T, head_dim]) -> [B, H, T, feature_dim]``. For FAVOR+ the random projection is a saved
    buffer; ``redraw()`` draws a new one (the model calls it once per training batch, outside any
    gradient-checkpointed region so a replayed block sees the same features).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.kind = config.feature_map
        self.nu = config.dpfp_nu
        self.sum_normalization = config.sum_normalization
        if self.kind == "favor":
            self.register_buffer(
                "projection",
                orthogonal_random_features(config.num_attention_heads, config.favor_features, config.head_dim),
                persistent=True,
            )

    @torch.no_grad()
    def redraw(self) -> None:
        if self.kind == "favor":
            H, m, d = self.projection.shape
            self.projection.copy_(orthogonal_random_features(H, m, d).to(self.projection))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "elu":
            phi = elu_feature_map(x)
        elif self.kind == "relu":
            phi = F.relu(x)
        elif self.kind == "dpfp":
            phi = dpfp_feature_map(x, self.nu)
        elif self.kind == "favor":
            phi = favor_feature_map(x, self.projection)
        else:
            phi = x
        if self.sum_normalization:
            # eq. 29: phi'(x) = phi(x) / sum_j phi(x)_j ; the clamp only matters for an all-zero ReLU/DPFP vector.
            phi = phi / phi.sum(-1, keepdim=True).clamp_min(1e-6)
        return phi
