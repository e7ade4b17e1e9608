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
    DLRM interacts them). Holds the pairs' index rows as buffers, so they follow the module
    to its device."""

    def __init__(self, num_tables: int) -> None:
        super().__init__()
        lower, cells = feature_pairs(num_tables + 1)
        self.register_buffer("lower", lower.unsqueeze(0), persistent=False)
        self.register_buffer("cells", cells.unsqueeze(0), persistent=False)

    def forward(self, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return _Interaction.apply(x, embedded, self.lower, self.cells)


def feature_pairs(features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lower, cells)`` for ``F = features``: ``lower`` ``[P]``, the flat indices of the
    strictly lower triangle of ``F x F``, row-major (the pairs the reference DLRM
    interacts); ``cells`` ``[F * F]``, the pair each cell of the grid holds (a cell and its
    mirror image hold the same pair; the diagonal, which holds no pair, says pair 0)."""
    rows, cols = torch.tril_indices(features, features, offset=-1)
    lower = rows * features + cols
    pair = torch.arange(len(lower))
    cells = torch.zeros(features * features, dtype=torch.long)
    cells[lower] = pair
    cells[cols * features + rows] = pair
    return lower, cells


class _Interaction(torch.autograd.Function):
    """``[x, (F F^T)[lower]]`` for the features ``F = [x; embedded]``, written into one
    output (no concatenation of ``x`` and the products), with a backward of one gather and
    one ``bmm``: the products are symmetric, so the features' gradient is ``(G + G^T) F``,
    ``G`` the pairs' gradients in the ``F x F`` grid, which one ``gather`` lays out (each cell
    takes its pair's gradient; the diagonal is zeroed after). Autograd's own backward (a
    scatter for the selection, two ``bmm`` and a sum) took about a fifth longer at batch
    2048; ``gather`` with an expanded index row took 0.94 ms where ``index_select`` took
    1.25-1.48 ms (batch 2048, two threads, within the model's backward). The embeddings'
    gradient is a ``bmm`` of its own, so that it is contiguous: as a slice of one ``bmm``'s
    output it was copied before the lookup's ``index_add_``, and forward and backward at
    batch 2048 took 3.4-3.7% longer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, embedded: torch.Tensor, lower: torch.Tensor,
                cells: torch.Tensor) -> torch.Tensor:
        b, dim = x.shape
        features = torch.cat([x.unsqueeze(1), embedded], dim=1)
        ctx.save_for_backward(features, cells)
        out = x.new_empty(b, dim + lower.shape[1])
        out[:, :dim] = x
        products = torch.bmm(features, features.transpose(1, 2)).flatten(1)
        torch.gather(products, 1, lower.expand(b, -1), out=out[:, dim:])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        features, cells = ctx.saved_tensors
        b, f, dim = features.shape
        grid = torch.gather(grad[:, dim:], 1, cells.expand(b, -1))
        grid[:, :: f + 1] = 0
        grid = grid.view(b, f, f)
        x_grad = torch.bmm(grid[:, :1], features).squeeze(1)
        return grad[:, :dim] + x_grad, torch.bmm(grid[:, 1:], features), None, None


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
