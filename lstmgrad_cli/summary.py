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


def summarise(name: str, value: np.ndarray) -> TensorSummary:
    value = np.asarray(value)
    wide = value.astype(np.float64, copy=False)
    finite_mask = np.isfinite(wide)
    nonfinite = int(value.size - np.count_nonzero(finite_mask))
    if nonfinite:
        l2 = max_abs = None
    else:
        l2 = float(math.sqrt(float(np.dot(wide.ravel(), wide.ravel())))) if value.size else 0.0
        max_abs = float(np.max(np.abs(wide))) if value.size else 0.0
    return TensorSummary(name, list(value.shape), str(value.dtype), l2, max_abs, nonfinite == 0, nonfinite)


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
