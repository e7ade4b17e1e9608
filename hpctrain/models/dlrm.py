"""DLRM (Naumov et al. 2019): bottom MLP, pairwise dot interaction, top MLP.

The module holds the dense part only. The embedding rows of a batch arrive as an input
``[B, T, dim]`` from :class:`embeddings.collection.EmbeddingCollection`, so the same model
trains with tables replicated, on parameter servers, or tiered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import NUM_DENSE, ModelConfig

__all__ = ["DLRM", "DotInteraction", "mlp", "interaction_width", "feature_pairs"]


def mlp(widths: Sequence[int], relu_last: bool) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` with ReLU between (and after the last
    when ``relu_last``), initialised as the reference DLRM does."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        linear = nn.Linear(n_in, n_out)
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (n_in + n_out)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / n_out))
        layers.append(linear)
        if relu_last or i < len(widths) - 2:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


def interaction_width(num_tables: int, dim: int) -> int:
    """Top-MLP input: the bottom output plus one dot product per pair of features."""
    features = num_tables + 1
    return dim + features * (features - 1) // 2


class DotInteraction(nn.Module):
    """Top-MLP input ``[B, dim + P]`` from the bottom output ``x`` ``[B, dim]`` and the
    embeddings ``[B, T, dim]``: ``x`` and the dot products of the ``P`` pairs of its
    ``T + 1`` features (the strictly lower triangle of ``F F^T``, row-major, as the reference
    DLRM interacts them). Holds the pairs' index tensors as buffers, so they follow the
    module to its device."""

    def __init__(self, num_tables: int) -> None:
        super().__init__()
        lower, cells = feature_pairs(num_tables + 1)
        self.register_buffer("lower", lower, persistent=False)
        self.register_buffer("cells", cells, persistent=False)

    def forward(self, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        features = torch.cat([x.unsqueeze(1), embedded], dim=1)
        return torch.cat([x, _PairDots.apply(features, self.lower, self.cells)], dim=1)


def feature_pairs(features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lower, cells)`` for ``F = features``: ``lower`` ``[P]``, the flat indices of the
    strictly lower triangle of ``F x F``, row-major (the pairs the reference DLRM
    interacts); ``cells`` ``[F * F]``, the pair each cell of the grid holds (a cell and its
    mirror image hold the same pair), ``P`` on the diagonal."""
    rows, cols = torch.tril_indices(features, features, offset=-1)
    lower = rows * features + cols
    pair = torch.arange(len(lower))
    cells = torch.full((features * features,), len(lower), dtype=torch.long)
    cells[lower] = pair
    cells[cols * features + rows] = pair
    return lower, cells


class _PairDots(torch.autograd.Function):
    """The pairs' dot products ``(F F^T)[lower]``, with a backward of one gather and one
    ``bmm``: the products are symmetric, so the features' gradient is ``(G + G^T) F``, ``G``
    the pairs' gradients in the ``F x F`` grid, which one ``index_select`` lays out (each
    cell takes its pair's gradient, the diagonal a zero). Autograd's own backward (a scatter
    for the selection, two ``bmm`` and a sum) took about a fifth longer at batch 2048, and
    building the grid by two ``index_add_`` into zeros took 139 us against 74 us at batch
    256 (one thread)."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, lower: torch.Tensor,
                cells: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(features, cells)
        return torch.bmm(features, features.transpose(1, 2)).flatten(1).index_select(1, lower)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        features, cells = ctx.saved_tensors
        b, f, _ = features.shape
        grid = F.pad(grad, (0, 1)).index_select(1, cells)
        return torch.bmm(grid.view(b, f, f), features), None, None


class DLRM(nn.Module):
    def __init__(self, config: ModelConfig, num_tables: int) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.bottom = mlp([NUM_DENSE, *config.bottom_mlp], relu_last=True)
        self.interaction = DotInteraction(num_tables)
        self.top = mlp([interaction_width(num_tables, dim), *config.top_mlp], relu_last=False)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` from dense features ``[B, 13]`` and embeddings ``[B, T, dim]``."""
        return self.top(self.interaction(self.bottom(dense), embedded)).squeeze(1)
