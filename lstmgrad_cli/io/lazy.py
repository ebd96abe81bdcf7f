"""Inputs left in their file while a backward pass runs, read a slice of time steps at a time.

``LazyRows`` is what the gradient code sees of such an input (an HDF5 dataset: ``hdf5.LazyDataset``; a stored NPZ
member: ``npz.LazyMember``): ``shape``, ``ndim``, ``dtype``, ``size``, indexing, and ``read_into`` for rows
``[lo, hi)`` into a buffer kept from chunk to chunk.  The NaN/Inf entries of every row read are counted on the way
(once per row, however often it is read), so ``nonfinite()`` after the pass reads only the rows the pass did not; a
subclass may do more with each row the first time it is read (``_first_read``: an NPZ member sums its CRC-32).

Contiguous data in a plain file is read with ``pread`` on the file's own descriptor (``_pread``), which lets go of
the GIL: a thread reading ahead (the backward pass's ``_ReadAhead``) then does not stall the time loop.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from ._common import max_tensor_bytes

# A tensor asked for lazily is left in its file from this size (or from a sixteenth of the memory an input may take,
# LSTMGRAD_MAX_TENSOR_BYTES, where that is less): a smaller one is read whole, as a batch's small files are, where
# the reads a chunk at a time would cost more than they save (100 HDF5 files of 20,16,64,64: 1.74 s left in the
# file, 1.25-1.32 s read whole).
LAZY_LEAST_BYTES = 4 * 2**20


def worth_leaving(shape, dtype) -> bool:
    """Whether a tensor of ``shape`` and ``dtype`` asked for lazily is large enough to be left in its file."""
    return math.prod(shape) * np.dtype(dtype).itemsize >= min(LAZY_LEAST_BYTES, max_tensor_bytes() // 16)


class LazyRows:
    """An input of ``shape`` and ``dtype`` (``key`` of the file ``path``) read by row ranges of its first axis.

    Subclasses give ``_read(index)`` (any index, as numpy takes it) and ``_read_rows(lo, hi, out)`` (rows into a
    C-contiguous buffer of exactly those rows); valid while the ``open_inputs`` block that made it runs."""

    def __init__(self, shape, dtype, key: str, path: Path):
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        self._key, self._path = key, path
        self.ndim, self.size = len(self.shape), int(math.prod(self.shape))
        self._row_bytes = self.size // max(self.shape[0], 1) * self.dtype.itemsize if self.ndim else 0
        self._counted: list[tuple[int, int]] = []  # disjoint, sorted [lo, hi) row ranges already read once
        self._nonfinite = 0
        self._lock = threading.Lock()  # the overlapped schedule reads from two threads

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        value = self._read(index)
        rows = rows_of(index, self.shape[0]) if self.ndim else None
        if rows is not None:
            self._tally(rows, value if isinstance(index, slice) else value[None])
        elif self.ndim and (index is Ellipsis or (isinstance(index, tuple) and not index)) and self.shape[0]:
            self._tally((0, self.shape[0]), value)
        return value

    def read_into(self, lo: int, hi: int, out: np.ndarray, dest=None) -> np.ndarray:
        """Rows ``[lo, hi)`` into ``out`` (C-contiguous, of this dtype), or into ``out[dest]``: a buffer kept
        from chunk to chunk costs no fresh pages per read, as slicing does.  Returns what was filled."""
        filled = out if dest is None else out[dest]
        if lo >= hi:
            return filled
        if dest is None:
            rows = out
            self._read_rows(lo, hi, rows)
        else:  # into a strided place: whole rows read, then copied there
            rows = np.empty(filled.shape, dtype=self.dtype)
            self._read_rows(lo, hi, rows)
            filled[...] = rows
        self._tally((lo, hi), rows)
        return filled

    def nonfinite(self, block_bytes: int = 64 * 2**20) -> int:
        """NaN/Inf entries of the whole input: those counted as rows were read, and the rows never read, read now
        a block at a time."""
        if not self.ndim:
            return count_nonfinite(self[()])
        per_row = max(1, self.size // max(self.shape[0], 1)) * self.dtype.itemsize
        step = max(1, block_bytes // per_row)
        for lo, hi in uncovered(self._counted, 0, self.shape[0]):
            for a in range(lo, hi, step):
                self[a:min(a + step, hi)]  # counted as it is read
        return self._nonfinite

    # -- what subclasses give -----------------------------------------------------------------------------

    def _read(self, index) -> np.ndarray:
        raise NotImplementedError

    def _read_rows(self, lo: int, hi: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def _first_read(self, lo: int, hi: int, rows: np.ndarray) -> None:
        """Called once for each row range read for the first time (under the lock, in no particular order)."""

    # -- shared ---------------------------------------------------------------------------------------------

    def _tally(self, rows: tuple[int, int], value: np.ndarray) -> None:
        lo, hi = rows
        with self._lock:
            for a, b in uncovered(self._counted, lo, hi):
                part = value[a - lo:b - lo]
                self._nonfinite += count_nonfinite(part)
                self._first_read(a, b, part)
            self._counted = merged([*self._counted, rows])

    def _pread(self, fd: int, offset: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Rows ``[lo, hi)`` of data starting at byte ``offset`` of the file ``fd`` into C-contiguous ``out`` (the
        GIL is released meanwhile)."""
        view = memoryview(out).cast("B")
        start, done = offset + lo * self._row_bytes, 0
        if len(view) != (hi - lo) * self._row_bytes:
            raise ValueError("the buffer does not hold those rows")
        while done < len(view):
            try:
                got = os.preadv(fd, [view[done:]], start + done)
            except OSError as err:
                raise InputFileError(f"{self._path}: {self._key} cannot be read ({err.strerror or err})") from None
            if not got:
                raise InputFileError(f"{self._path}: {self._key} cannot be read (the file ends before its data: "
                                     "truncated meanwhile?)")
            done += got


def rows_of(index, n: int) -> tuple[int, int] | None:
    """The rows ``[lo, hi)`` an index of the first axis reads (an int or a slice of step 1), else None."""
    if isinstance(index, int | np.integer) and not isinstance(index, bool | np.bool_):  # (a bool is a new axis)
        row = int(index) + n if index < 0 else int(index)
        return (row, row + 1) if 0 <= row < n else None
    if isinstance(index, slice) and index.step in (None, 1):
        lo, hi, _ = index.indices(n)
        return (lo, hi) if lo < hi else None
    return None


def uncovered(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` outside the sorted, disjoint ``ranges``."""
    parts = []
    for a, b in ranges:
        if b <= lo or a >= hi:
            continue
        if a > lo:
            parts.append((lo, a))
        lo = max(lo, b)
    if lo < hi:
        parts.append((lo, hi))
    return parts


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` as sorted, disjoint ranges (overlapping or touching ones joined)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def count_nonfinite(value: np.ndarray) -> int:
    return int(value.size - np.count_nonzero(np.isfinite(value)))
