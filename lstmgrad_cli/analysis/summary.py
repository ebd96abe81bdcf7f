"""Per-tensor summaries (shape, dtype, L2 norm, max |value|, finiteness) for tables and JSON."""

from __future__ import annotations

import functools
import math
import threading
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
    values near the float maximum give a finite norm rather than an overflow.  A ``SummarisedOutput`` is
    summarised from what was written to it, without reading it back, where that covers it.
    """
    if isinstance(value, SummarisedOutput):
        known = value.summary(name)
        if known is not None:
            return known
        value = value.target
    shape = tuple(value.shape)
    size = math.prod(shape)
    itemsize = max(np.dtype(value.dtype).itemsize, 8)
    if isinstance(value, np.ndarray) and size * itemsize <= block_bytes:
        blocks = [value]
    else:
        rows = shape[0] if shape else 1
        step = max(1, block_bytes // (max(1, size // max(rows, 1)) * itemsize))
        blocks = (value[lo:lo + step] for lo in range(0, rows, step)) if shape else [value[()]]
    running = RunningSummary()
    for block in blocks:
        running.add(np.asarray(block))
    return running.summary(name, shape, value.dtype)


class RunningSummary:
    """A summary made from the blocks of a tensor, each given once (``add``)."""

    def __init__(self) -> None:
        self.scale, self.scaled_sq, self.nonfinite = 0.0, 0.0, 0  # norm = scale * sqrt(scaled_sq)

    def add(self, block: np.ndarray) -> None:
        self.add_part(*_block_part(block))

    def add_part(self, peak: float, block_sq: float, bad: int) -> None:
        """A block's ``_block_part``."""
        self.nonfinite += bad
        if self.nonfinite or peak == 0.0:
            return
        if peak > self.scale:
            self.scaled_sq = self.scaled_sq * (self.scale / peak) ** 2 + block_sq
            self.scale = peak
        else:
            self.scaled_sq += block_sq * (peak / self.scale) ** 2

    def summary(self, name: str, shape, dtype) -> TensorSummary:
        if self.nonfinite:
            return TensorSummary(name, list(shape), dtype_name(dtype), None, None, False, self.nonfinite)
        return TensorSummary(name, list(shape), dtype_name(dtype), self.scale * math.sqrt(self.scaled_sq), self.scale,
                             True, 0)


@functools.cache
def dtype_name(dtype) -> str:
    """``str(dtype)``, remembered: numpy builds the text anew each time (~2.5 us, nine times a file's summaries)."""
    return str(dtype)


class SummarisedOutput:
    """A zero-filled writable output too large for memory (an h5py dataset) that summarises the rows written into
    it as they go by, so that its summary needs no second read of the whole tensor.

    The summary holds when rows were written only as slices of whole rows of numpy values of the output's dtype
    (what is stored is then what was given), none twice (the backward pass writes each chunk of steps once, from
    one thread or two); rows never written are zeros, which change nothing.  Otherwise ``summary`` is None and
    ``summarise`` reads the output back.  The blocks are combined in row order, so the summary does not depend on
    which thread wrote which rows when (it may differ from a summary read back in the last bits of the norm).
    """

    def __init__(self, target) -> None:
        self.target = target
        self.shape, self.dtype = tuple(target.shape), target.dtype
        self._parts: dict[int, tuple[float, float, int]] | None = {} if self.shape else None  # first row -> part
        self._written = np.zeros(self.shape[0] if self.shape else 0, dtype=bool)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, key):
        return self.target[key]

    def __setitem__(self, key, value) -> None:
        self.target[key] = value
        rows = _whole_rows(key, self.shape[0]) if self.shape else None
        whole = (rows is not None and isinstance(value, np.ndarray) and value.dtype == self.dtype
                 and value.shape == (rows.stop - rows.start, *self.shape[1:]))
        part = _block_part(value) if whole else None
        if whole and rows.start == rows.stop:
            return  # nothing written
        with self._lock:
            if self._parts is None:
                return
            if part is None or self._written[rows].any():
                self._parts = None  # written otherwise: the summary is read back
                return
            self._written[rows] = True
            self._parts[rows.start] = part

    def summary(self, name: str) -> TensorSummary | None:
        with self._lock:
            if self._parts is None:
                return None
            running = RunningSummary()
            for start in sorted(self._parts):
                running.add_part(*self._parts[start])
        return running.summary(name, self.shape, self.dtype)


def _whole_rows(key, rows: int) -> slice | None:
    """The rows ``key`` selects as a slice with step 1 when it selects whole rows only, else None."""
    if key is Ellipsis:
        return slice(0, rows)
    if isinstance(key, tuple) and len(key) == 1:
        key = key[0]
    if isinstance(key, slice) and key.step in (None, 1):
        start, stop, _ = key.indices(rows)
        return slice(start, max(start, stop))
    return None


def _block_part(block: np.ndarray) -> tuple[float, float, int]:
    """(max |value|, sum of (value / max)^2, NaN/Inf count) of one block, in few passes: max and min in the
    block's own dtype (NaN and Inf show there; only then are they counted), the squares summed in float64,
    unscaled where they can neither overflow nor underflow."""
    if not block.size:
        return 0.0, 0.0, 0
    high, low = float(block.max()), -float(block.min())  # (both NaN where the block holds one: then so is peak)
    peak = high if high >= low else low
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
