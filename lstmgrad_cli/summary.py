"""Per-tensor summaries (shape, dtype, L2 norm, max |value|, finiteness) for tables and JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSummary:
    name: str
    shape: list[int]
    dtype: str
    l2_norm: float | None  # None when the tensor has NaN or Inf entries
    max_abs: float | None
    finite: bool
    nonfinite: int  # how many entries are NaN or +-Inf


def summarise(name: str, value, block_bytes: int = 64 * 2**20) -> TensorSummary:
    """Summary of an array, or of a lazy one (h5py dataset) read a block of rows at a time.

    The L2 norm is accumulated scaled by the largest magnitude so far (as BLAS nrm2 does), so finite
    values near the float maximum give a finite norm rather than an overflow.
    """
    shape = tuple(value.shape)
    size = math.prod(shape)
    itemsize = max(np.dtype(value.dtype).itemsize, 8)
    if isinstance(value, np.ndarray) and size * itemsize <= block_bytes:
        blocks = [value]
    else:
        rows = shape[0] if shape else 1
        step = max(1, block_bytes // (max(1, size // max(rows, 1)) * itemsize))
        blocks = (value[lo:lo + step] for lo in range(0, rows, step)) if shape else [value[()]]
    scale, scaled_sq, nonfinite = 0.0, 0.0, 0  # norm = scale * sqrt(scaled_sq)
    for block in blocks:
        peak, block_sq, bad = _block_part(np.asarray(block))
        nonfinite += bad
        if nonfinite or peak == 0.0:
            continue
        if peak > scale:
            scaled_sq = scaled_sq * (scale / peak) ** 2 + block_sq
            scale = peak
        else:
            scaled_sq += block_sq * (peak / scale) ** 2
    if nonfinite:
        return TensorSummary(name, list(shape), str(value.dtype), None, None, False, nonfinite)
    return TensorSummary(name, list(shape), str(value.dtype), scale * math.sqrt(scaled_sq), scale, True, 0)


def _block_part(block: np.ndarray) -> tuple[float, float, int]:
    """(max |value|, sum of (value / max)^2, NaN/Inf count) of one block, in few passes: max and min in the
    block's own dtype (NaN and Inf show there; only then are they counted), the squares summed in float64,
    unscaled where they can neither overflow nor underflow."""
    if not block.size:
        return 0.0, 0.0, 0
    peak = float(np.maximum(abs(block.max()), abs(block.min())))  # np.maximum: a NaN is not lost
    if not math.isfinite(peak):
        return peak, 0.0, int(block.size - np.count_nonzero(np.isfinite(block)))
    if peak == 0.0:
        return 0.0, 0.0, 0
    flat = block.astype(np.float64, copy=False).ravel()
    if 1e-100 < peak < 1e100:
        return peak, float(np.dot(flat, flat)) / peak / peak, 0
    unit = flat / peak
    return peak, float(np.dot(unit, unit)), 0


def json_safe(value):
    """A structure JSON can encode strictly: NaN/Inf become null, numpy scalars Python numbers."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.generic):
        return value.item()
    return value
