"""Low-precision wire formats for float32 data: bf16 and fp16 messages, float32 at both ends.

Why: the dense gradient reduction and the parameter-server payloads are bandwidth-bound, and
16-bit messages halve their bytes while the master copies (the dense parameters, the
servers' rows and optimizer state) stay float32. Narrowing rounds to nearest even (torch's
conversion, the same rule as :mod:`hpctrain.comm.kernels`).

- ``bf16`` keeps float32's exponent range: values are narrowed as they are (relative error
  ``2^-8`` per rounding).
- ``fp16`` has 3 more mantissa bits (``2^-11``) but overflows above 65504 and loses values
  below ``6e-8``, so data is scaled by a power of two first (exact, undone after widening):
  the largest that keeps ``terms x max|x|`` under 65504, where ``terms`` values may be summed
  on the way (the ranks of a reduction). This is loss scaling done per message, with the
  scale chosen from the data instead of from overflow retries.

:class:`WireAllreduce` sums a float32 buffer over a group with 16-bit messages: each partial
sum is formed in float32 by the kernels and rounded once per hop, so with ``p`` ranks the
error of an element is at most ``2 p u sum_i |x_i|`` (``u`` = ``2^-8`` bf16, ``2^-11``
fp16), plus with fp16 ``2 p 2^-25 / s`` for values in the subnormal range at scale ``s``
(the tests check this bound). Every rank ends with the same bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hpctrain.comm import select
from hpctrain.comm.collectives import allreduce
from hpctrain.comm.group import Group
from hpctrain.comm.types import DTYPES, Request
from hpctrain.errors import CommError

__all__ = ["WIRE_DTYPES", "FP16_MAX", "UNIT_ROUNDOFF", "itemsize", "fp16_scale", "encode",
           "decode", "wire_code", "wire_of", "WireAllreduce", "CARRIERS"]

WIRE_DTYPES = ("float32", "bf16", "fp16")
FP16_MAX = 65504.0
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
_TORCH = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_COMM_DTYPE = {"bf16": DTYPES["bfloat16"], "fp16": DTYPES["float16"]}
CARRIERS = frozenset({"shm", "hierarchical", "recursive_doubling", "halving_doubling", "ring",
                      "tree"})
"""Algorithms whose messages carry 16-bit values as they are; ``native`` widens to float32
before ``MPI_Allreduce`` (MPI has no 16-bit float sum) and ``torch`` hands them to gloo/NCCL."""


def itemsize(wire: str) -> int:
    return 4 if wire == "float32" else 2


def wire_code(wire: str) -> int:
    """The wire format as a small integer (for message headers)."""
    return WIRE_DTYPES.index(wire)


def wire_of(code: int) -> str:
    if not 0 <= code < len(WIRE_DTYPES):
        raise CommError(f"unknown wire format code {code}")
    return WIRE_DTYPES[code]


def fp16_scale(max_abs: float, terms: int = 1) -> float:
    """The power of two ``s`` with ``terms * max_abs * s <= 65504``, as large as possible
    (1 when ``max_abs`` is 0 or not finite, so NaN and Inf pass through as they are)."""
    if not (max_abs > 0 and math.isfinite(max_abs)):
        return 1.0
    exponent = math.floor(math.log2(FP16_MAX / (terms * max_abs)))
    return 2.0 ** max(-120, min(120, exponent))


def encode(values: np.ndarray, wire: str) -> tuple[np.ndarray, float]:
    """``values`` (float32) in ``wire`` format as a flat array (float32, or the 16-bit
    patterns as ``uint16``) and the scale they were multiplied by (fp16; else 1)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if wire == "float32":
        return flat, 1.0
    scale = fp16_scale(float(np.abs(flat).max(initial=0.0))) if wire == "fp16" else 1.0
    source = torch.from_numpy(flat)
    if scale != 1.0:
        source = source * scale
    return source.to(_TORCH[wire]).view(torch.int16).numpy().view(np.uint16), scale


def decode(payload: np.ndarray, wire: str, scale: float = 1.0) -> np.ndarray:
    """The float32 values of a flat ``payload`` made by :func:`encode`."""
    if wire == "float32":
        return payload.view(np.float32)
    bits = torch.from_numpy(np.ascontiguousarray(payload).view(np.int16))
    out = bits.view(_TORCH[wire]).to(torch.float32)
    if scale != 1.0:
        out.div_(scale)
    return out.numpy()


class WireAllreduce:
    """In-place sum of the float32 tensor ``view`` over ``group`` with ``wire`` messages;
    its first ``exact`` elements (step statistics, counts) are summed in float32 apart.

    Issues per call, on ``group``: the float32 allreduce of the exact part (when there is
    one), with fp16 a one-element max allreduce that agrees on the scale, and the 16-bit
    allreduce of the rest, by the cheapest of :data:`CARRIERS` (or ``comm.algorithm``).
    """

    def __init__(self, view: torch.Tensor, group: Group, wire: str, exact: int = 0) -> None:
        if wire not in _COMM_DTYPE:
            raise CommError(f"WireAllreduce: wire {wire!r} is not a 16-bit format")
        self.group, self.wire = group, wire
        self.exact = view[:exact] if exact else None
        self.body = view[exact:]
        self.stage = torch.empty(self.body.numel(), dtype=_TORCH[wire], device=view.device)
        self.peak = np.zeros(1, np.float32)
        self.algorithm = self._algorithm()
        self.bytes = self.stage.numel() * 2 + exact * view.element_size() + (
            4 if wire == "fp16" else 0)
        """Bytes handed to collectives per call (what each rank's traffic scales with)."""

    def _algorithm(self) -> str:
        forced = self.group.config.algorithm
        if forced != "auto" or self.group.size == 1 or self.stage.numel() == 0:
            return forced
        device = self.stage.device.type
        req = Request("allreduce", self.stage.numel(), _COMM_DTYPE[self.wire], "sum", 0,
                      False, device)
        options = [(a, c) for a, c in select.ranking(req, self.group.layout,
                                                     self.group.params)
                   if a.name in CARRIERS]
        if not options:
            raise CommError(f"comm.wire_dtype = {self.wire!r}: no algorithm carries "
                            f"{self.wire} messages on {device}")
        return min(options, key=lambda item: item[1].seconds)[0].name

    @torch.no_grad()
    def __call__(self) -> None:
        if self.exact is not None:
            allreduce(self.exact, comm=self.group)
        if self.stage.numel() == 0:
            return
        scale = 1.0
        if self.wire == "fp16":
            self.peak[0] = float(self.body.abs().max())
            allreduce(self.peak, "max", comm=self.group)
            scale = fp16_scale(float(self.peak[0]), self.group.size)
        self.stage.copy_(self.body.mul(scale) if scale != 1.0 else self.body)
        allreduce(self.stage, comm=self.group, algorithm=self.algorithm)
        self.body.copy_(self.stage)
        if scale != 1.0:
            self.body.div_(scale)
