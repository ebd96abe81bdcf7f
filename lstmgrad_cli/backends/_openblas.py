"""numpy's own OpenBLAS, reached through ctypes: its ``cblas_?gemm`` and its thread count.

The numba backend calls the recurrent product from compiled code through the very library numpy's
``matmul`` uses (one thread pool, the same speed and rounding), and the host backends run BLAS
single-threaded on two threads of their own while the chunk products overlap the time loop
(``XpGradient._run_overlapped``).  Where numpy's OpenBLAS is not found (another BLAS, an unknown
wheel layout), ``find()`` gives None: the numba loop stays in Python, ``single_threaded`` and
``stop_spinning_workers`` do nothing, and ``matmul_into`` declines.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
from typing import NamedTuple

import numpy as np


class Blas(NamedTuple):
    sgemm: int  # address of cblas_sgemm (64-bit integer interface)
    dgemm: int
    get_threads: object  # ctypes functions: the library's thread count, global to the process
    set_threads: object
    stop_pool: object  # ends the library's worker threads (started again on demand), or None


@functools.cache
def find() -> Blas | None:
    """The OpenBLAS inside numpy's wheel, or None."""
    root = os.path.dirname(np.__file__)
    paths = sorted(glob.glob(os.path.join(root + ".libs", "*openblas*")))
    paths += sorted(glob.glob(os.path.join(root, ".dylibs", "*openblas*")))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_")):
            try:
                gemms = [getattr(lib, f"{prefix}cblas_{kind}gemm{suffix}") for kind in "sd"]
                get_threads = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}")
                set_threads = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}")
            except AttributeError:
                continue
            get_threads.restype, get_threads.argtypes = ctypes.c_int, []
            set_threads.restype, set_threads.argtypes = None, [ctypes.c_int]
            stop_pool = getattr(lib, "blas_thread_shutdown_", None)  # OpenBLAS's own fork handler
            if stop_pool is not None:
                stop_pool.restype, stop_pool.argtypes = ctypes.c_int, []
            return Blas(*(ctypes.cast(f, ctypes.c_void_p).value for f in gemms), get_threads, set_threads,
                        stop_pool)
    return None


_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@functools.cache
def _gemm(dtype):
    """ctypes ``cblas_?gemm`` for float32 or float64 (it releases the GIL while it runs)."""
    blas = find()
    real = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i32, i32, i32, i64, i64, i64, real, ptr, i64, ptr, i64, real, ptr, i64)
    return proto(blas.sgemm if dtype == np.float32 else blas.dgemm)


def _operand(a):
    """(transpose flag, leading dimension) of a 2-D array BLAS reads in place, or None."""
    if a.flags.c_contiguous:
        return _NO_TRANS, max(a.shape[1], 1)
    if a.flags.f_contiguous:
        return _TRANS, max(a.shape[0], 1)
    return None


def matmul_into(a, b, out, accumulate: bool) -> bool:
    """``out = a @ b`` or, with ``accumulate``, ``out += a @ b`` in one ``cblas_?gemm`` call.

    Accumulating this way needs no ``[M, N]`` temporary and no separate addition pass.  Returns
    False, having done nothing, where BLAS cannot take the arrays as they are (not numpy's
    OpenBLAS, not one float32/float64 dtype, not 2-D, an operand neither C- nor F-contiguous, ``out``
    not C-contiguous and writeable); the caller then uses numpy.
    """
    dtype = out.dtype if isinstance(out, np.ndarray) else None
    if (find() is None or dtype not in (np.float32, np.float64)
            or not all(isinstance(m, np.ndarray) and m.dtype == dtype and m.ndim == 2 for m in (a, b))
            or out.ndim != 2 or not (out.flags.c_contiguous and out.flags.writeable)
            or a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1])):
        return False
    layout_a, layout_b = _operand(a), _operand(b)
    if layout_a is None or layout_b is None:
        return False
    (M, K), N = a.shape, b.shape[1]
    if min(M, N, K) == 0:  # BLAS returns at once; numpy's rules for empty products apply
        return False
    _gemm(dtype.type)(_ROW_MAJOR, layout_a[0], layout_b[0], M, N, K, 1.0, a.ctypes.data, layout_a[1],
                      b.ctypes.data, layout_b[1], 1.0 if accumulate else 0.0, out.ctypes.data, max(N, 1))
    return True


@contextlib.contextmanager
def single_threaded():
    """Run BLAS calls on one thread each meanwhile (a no-op where numpy's OpenBLAS is not found).

    OpenBLAS keeps one thread count for the whole process: it is set once and put back.
    """
    blas = find()
    if blas is None:
        yield
        return
    previous = blas.get_threads()
    blas.set_threads(1)
    try:
        yield
    finally:
        blas.set_threads(previous)


def stop_spinning_workers():
    """End OpenBLAS's idle worker threads, which spin for ~0.1 s after each threaded call.

    OpenBLAS starts them again on demand.  Only call this when no other thread can be inside BLAS,
    and after setting the thread count (setting it starts them again).
    """
    blas = find()
    if blas is not None and blas.stop_pool is not None:
        blas.stop_pool()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
