"""DLRM (Naumov et al. 2019): bottom MLP, pairwise dot interaction, top MLP.

The module holds the dense part only. The embedding rows of a batch arrive as an input
``[B, T, dim]`` from :class:`embeddings.collection.EmbeddingCollection`, so the same model
trains with tables replicated, on parameter servers, or tiered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from hpctrain.config import NUM_DENSE, ModelConfig

__all__ = ["DLRM", "mlp", "interaction_width", "dot_interaction", "feature_pairs"]


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


def dot_interaction(x: torch.Tensor, embedded: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Top-MLP input ``[B, dim + P]``: the bottom output ``x`` ``[B, dim]`` and the dot
    products of the ``P`` feature pairs of ``x`` and the embeddings ``[B, T, dim]``
    (``pairs[0]``: flat indices of the pairs into the ``F x F`` products, ``pairs[1]``: of
    their mirror images, see :func:`feature_pairs`)."""
    features = torch.cat([x.unsqueeze(1), embedded], dim=1)
    return torch.cat([x, _PairDots.apply(features, pairs)], dim=1)


def feature_pairs(features: int) -> torch.Tensor:
    """``[2, P]``: the flat indices of the strictly lower triangle of ``F x F``, row-major
    (the pairs the reference DLRM interacts), and of their mirror images."""
    rows, cols = torch.tril_indices(features, features, offset=-1)
    return torch.stack([rows * features + cols, cols * features + rows])


class _PairDots(torch.autograd.Function):
    """The pairs' dot products ``(F F^T)[pairs]``, with a backward of one ``bmm``: the
    products are symmetric, so the features' gradient is ``(G + G^T) F``, ``G`` the pairs'
    gradients in the ``F x F`` grid; autograd's own backward (a scatter for the selection,
    two ``bmm`` and a sum) took about a fifth longer at batch 2048."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(features, pairs)
        return torch.bmm(features, features.transpose(1, 2)).flatten(1).index_select(
            1, pairs[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        features, pairs = ctx.saved_tensors
        b, f, _ = features.shape
        grid = grad.new_zeros(b, f * f).index_add_(1, pairs[0], grad).index_add_(
            1, pairs[1], grad)
        return torch.bmm(grid.view(b, f, f), features), None


class DLRM(nn.Module):
    def __init__(self, config: ModelConfig, num_tables: int) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.bottom = mlp([NUM_DENSE, *config.bottom_mlp], relu_last=True)
        self.top = mlp([interaction_width(num_tables, dim), *config.top_mlp], relu_last=False)
        self.register_buffer("_pairs", feature_pairs(num_tables + 1), persistent=False)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` from dense features ``[B, 13]`` and embeddings ``[B, T, dim]``."""
        return self.top(dot_interaction(self.bottom(dense), embedded, self._pairs)).squeeze(1)
