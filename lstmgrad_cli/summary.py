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
    if isinstance(value, np.ndarray) and size * 8 <= block_bytes:
        return _summarise_in_memory(name, value)
    rows = shape[0] if shape else 1
    per_row = max(1, size // max(rows, 1)) * 8
    step = max(1, block_bytes // per_row)
    scale, scaled_sq, nonfinite = 0.0, 0.0, 0  # norm = scale * sqrt(scaled_sq)
    for lo in range(0, rows, step) if shape else [None]:
        block = np.asarray(value if lo is None else value[lo:lo + step], dtype=np.float64).ravel()
        bad = int(block.size - np.count_nonzero(np.isfinite(block)))
        nonfinite += bad
        if nonfinite or not block.size:
            continue
        peak = float(np.max(np.abs(block)))
        if peak == 0.0:
            continue
        unit = block / peak
        block_sq = float(np.dot(unit, unit))
        if peak > scale:
            scaled_sq = scaled_sq * (scale / peak) ** 2 + block_sq
            scale = peak
        else:
            scaled_sq += block_sq * (peak / scale) ** 2
    if nonfinite:
        return TensorSummary(name, list(shape), str(value.dtype), None, None, False, nonfinite)
    return TensorSummary(name, list(shape), str(value.dtype), scale * math.sqrt(scaled_sq), scale, True, 0)


def _summarise_in_memory(name: str, value: np.ndarray) -> TensorSummary:
    """``summarise`` of an array of one block, in fewer passes: NaN or Inf anywhere shows in max |value|, and
    only then are they counted."""
    shape, dtype = list(value.shape), str(value.dtype)
    block = value.astype(np.float64).ravel()
    peak = float(np.max(np.abs(block))) if block.size else 0.0
    if not math.isfinite(peak):
        nonfinite = int(block.size - np.count_nonzero(np.isfinite(block)))
        return TensorSummary(name, shape, dtype, None, None, False, nonfinite)
    if peak == 0.0:
        return TensorSummary(name, shape, dtype, 0.0, 0.0, True, 0)
    unit = block / peak
    return TensorSummary(name, shape, dtype, peak * math.sqrt(float(np.dot(unit, unit))), peak, True, 0)


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
