"""Feature maps phi for the keys and queries of linear fast weights (Schlag et al. 2021, sec. 5)."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_fwp import FEATURE_MAPS

Dims = Union[int, Tuple[int, ...]]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """ELU + 1 (Katharopoulos et al. 2020; Schlag et al. 2021 eq. 30), shape-preserving: ``[..., d] -> [..., d]``."""
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


def favor_feature_map(
    x: torch.Tensor, projection: torch.Tensor, sum_normalization: bool = False, rescale_dims: Optional[Dims] = None
) -> torch.Tensor:
    """FAVOR+ (Choromanski et al. 2021) as Schlag et al. 2021 write it, sec. 5.3, eqs. 31-32.

    ``h(x) = exp(-|x|^2 / 2) / sqrt(2)`` (eq. 31), ``phi(x) = h(x) / sqrt(m) [exp(R x); exp(-R x)]`` (eq. 32), so that
    ``E_R[phi(x) . phi(y)] = exp(x . y)`` for rows of R drawn from N(0, I). Computed as
    ``exp(+-R x - |x|^2 / 2) / sqrt(2 m)``, the same numbers without overflowing ``exp(R x)`` for large inputs.
    With `sum_normalization`, eq. 29 of it: ``h(x) / sqrt(m)`` cancels and ``phi(x) / sum_j phi(x)_j`` is
    ``softmax([R x; -R x])``, computed so (it cannot underflow where h(x) does, for large |x|).

    Args:
        x: ``[B, H, T, d_key]``.
        projection: ``[H, m, d_key]``, R (one per head).
        sum_normalization: return eq. 29's ``phi(x) / sum_j phi(x)_j`` instead.
        rescale_dims: return ``phi(x) / max phi(x)``, the maximum over these dimensions of the output (a positive
            factor, constant along them, taken as a constant by autograd), computed from the exponents so that it
            cannot underflow. For uses whose result that factor cancels from: the queries of attention
            normalisation (eqs. 19, 28; dims ``-1``), all keys of a sequence read only through eq. 19 (``(-2, -1)``).
    Returns:
        ``[B, H, T, 2 m]`` (d_dot = 2 m), positive.
    """
    m = projection.shape[-2]
    acc = torch.promote_types(x.dtype, torch.float32)  # the exponent of a bfloat16 input in float32
    xf = x.to(acc)
    rx = torch.einsum("bhtd,hmd->bhtm", xf, projection.to(acc))
    exponent = torch.cat([rx, -rx], dim=-1)
    if sum_normalization:
        return torch.softmax(exponent, dim=-1).to(x.dtype)
    exponent = exponent - 0.5 * xf.pow(2).sum(-1, keepdim=True)
    if rescale_dims is not None:
        return torch.exp(exponent - exponent.detach().amax(dim=rescale_dims, keepdim=True)).to(x.dtype)
    return (torch.exp(exponent) / math.sqrt(2 * m)).to(x.dtype)


def gaussian_random_features(num_heads: int, m: int, d: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """FAVOR+'s R for each head: ``[num_heads, m, d]``, every row drawn from N(0, I_d) (Schlag et al. 2021 sec. 5.3)."""
    return torch.randn(num_heads, m, d, generator=generator)


class FeatureMap(nn.Module):
    """phi applied to keys and queries, followed by the optional sum normalisation (eq. 29).

    ``forward(x [B, H, T, head_dim]) -> [B, H, T, feature_dim]``. For FAVOR+ (eqs. 31-32, feature_dim = 2 m) the
    random projection R is a saved buffer; ``redraw()`` draws a new one: as in sec. 5.3, the model calls it once per
    training batch (outside any gradient-checkpointed region so a replayed block sees the same features) and keeps
    R fixed in evaluation.
    """

    def __init__(self, config) -> None:
        super().__init__()
        if config.feature_map not in FEATURE_MAPS:
            raise ValueError(f"`feature_map` must be one of {FEATURE_MAPS}, got {config.feature_map!r}")
        self.kind = config.feature_map
        self.nu = config.dpfp_nu
        self.sum_normalization = config.sum_normalization
        if self.kind == "favor":
            self.register_buffer(
                "projection",
                gaussian_random_features(config.num_attention_heads, config.favor_features, config.head_dim),
                persistent=True,
            )

    @torch.no_grad()
    def redraw(self) -> None:
        if self.kind == "favor":
            H, m, d = self.projection.shape
            self.projection.copy_(gaussian_random_features(H, m, d).to(self.projection))

    def forward(self, x: torch.Tensor, rescale_dims: Optional[Dims] = None) -> torch.Tensor:
        """``x [B, H, T, head_dim] -> phi(x) [B, H, T, feature_dim]``; `rescale_dims`: see ``favor_feature_map`` (only
        FAVOR+'s exponential features can underflow: the other maps ignore it)."""
        if self.kind == "elu":
            phi = elu_feature_map(x)
        elif self.kind == "relu":
            phi = F.relu(x)
        elif self.kind == "dpfp":
            phi = dpfp_feature_map(x, self.nu)
        elif self.kind == "favor":
            return favor_feature_map(x, self.projection, self.sum_normalization, rescale_dims)  # eq. 29 included
        elif self.kind == "identity":
            phi = x
        elif self.kind == "silu":
            phi = F.silu(x)  # flash-linear-attention's Delta Nets (qk_activation "silu"); not non-negative
        else:
            raise ValueError(f"`feature_map` must be one of {FEATURE_MAPS}, got {self.kind!r}")
        if self.sum_normalization:
            # eq. 29: phi'(x) = phi(x) / sum_j phi(x)_j ; the clamp only matters for an all-zero ReLU/DPFP vector.
            phi = phi / phi.sum(-1, keepdim=True).clamp_min(1e-6)
        return phi
