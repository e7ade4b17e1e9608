"""Whether a tensor holds only finite values, cheaply."""

from __future__ import annotations

import torch

__all__ = ["all_finite"]


def all_finite(values: torch.Tensor) -> bool:
    """One sum first (a NaN or Inf makes it non-finite: one pass instead of ``isfinite``'s
    four), the element-wise test only when the sum is not finite (finite values whose sum
    overflows)."""
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())
