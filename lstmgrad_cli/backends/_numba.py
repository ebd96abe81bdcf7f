"""The numba backend: the shared chunked algorithm (``_xp``) with one fused kernel per time step.

The generic step makes 24 numpy passes over ``[B, C]`` arrays; here one compiled loop reads each
activation once and writes the four gate gradients and the carried cell gradient, in parallel
over the batch when the step is large enough to pay for the threads.  A chunk's whole time loop
runs compiled: after each step the recurrent product calls ``cblas_?gemm`` of the OpenBLAS inside
numpy's wheel, the library ``np.matmul`` uses (no per-step Python, ~15 us of argument dispatch
saved per step); where that library is not found the loop stays in Python with ``np.matmul``.  The
chunk products stay in the shared code.  Every operation keeps TensorFlow's bracketing and rounds
in the compute dtype (no fast-math, so no contraction into fused multiply-adds): float32 results
equal the numpy backend's bit for bit.

Kernels are compiled on first use with ``cache=True``, so later processes load them from numba's
cache (``NUMBA_CACHE_DIR`` to move it).  float16 compute (TF's per-op half rounding) falls back to
the numpy step.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import njit, prange, types

from . import _openblas
from ._numpy import NumpyBackend
from ._xp import XpGradient

# Steps with fewer elements than this run on one thread: thread start-up costs more than it saves.
PARALLEL_MIN_ELEMENTS = 8 * 1024


@njit(inline="always")
def _row(one, i, f, o, ci, co, h_grad, cs_grad, cs_prev, carried_h, carried_cs, g_i, g_f, g_c, g_o, new_cs):
    # One batch row; row views keep the inner loop simple enough for LLVM to vectorise.
    for c in range(i.shape[0]):
        dh = carried_h[c] + h_grad[c]
        dc = carried_cs[c] + cs_grad[c]
        ov = o[c]
        cov = co[c]
        civ = ci[c]
        iv = i[c]
        fv = f[c]
        dcs = (((one - cov * cov) * dh) * ov) + dc
        g_o[c] = ((ov * (one - ov)) * dh) * cov
        g_c[c] = ((one - civ * civ) * dcs) * iv
        g_f[c] = ((fv * (one - fv)) * dcs) * cs_prev[c]
        g_i[c] = ((iv * (one - iv)) * dcs) * civ
        new_cs[c] = dcs * fv


@njit(inline="always")
def _row_peephole(one, i, f, o, ci, co, h_grad, cs_grad, cs_prev, cs, carried_h, carried_cs, g_i, g_f, g_c, g_o,
                  new_cs, wci, wcf, wco, acc_i, acc_f, acc_o):
    for c in range(i.shape[0]):
        dh = carried_h[c] + h_grad[c]
        dc = carried_cs[c] + cs_grad[c]
        ov = o[c]
        cov = co[c]
        civ = ci[c]
        iv = i[c]
        fv = f[c]
        csp = cs_prev[c]
        do = ((ov * (one - ov)) * dh) * cov
        dcs = ((((one - cov * cov) * dh) * ov) + dc) + do * wco[c]
        di = ((iv * (one - iv)) * dcs) * civ
        df = ((fv * (one - fv)) * dcs) * csp
        g_o[c] = do
        g_c[c] = ((one - civ * civ) * dcs) * iv
        g_f[c] = df
        g_i[c] = di
        new_cs[c] = ((dcs * fv) + di * wci[c]) + df * wcf[c]
        acc_i[c] += di * csp
        acc_f[c] += df * csp
        acc_o[c] += do * cs[c]


def _step(one, i, f, o, ci, co, h_grad, cs_grad, cs_prev, cs, carried_h, carried_cs, gates, new_cs,
          off_i, off_f, off_c, off_o, use_peephole, wci, wcf, wco, acc_i, acc_f, acc_o):  # pragma: no cover
    B, C = i.shape
    for b in prange(B):
        g = gates[b]
        if use_peephole:
            _row_peephole(one, i[b], f[b], o[b], ci[b], co[b], h_grad[b], cs_grad[b], cs_prev[b], cs[b],
                          carried_h[b], carried_cs[b], g[off_i:off_i + C], g[off_f:off_f + C], g[off_c:off_c + C],
                          g[off_o:off_o + C], new_cs[b], wci, wcf, wco, acc_i[b], acc_f[b], acc_o[b])
        else:
            _row(one, i[b], f[b], o[b], ci[b], co[b], h_grad[b], cs_grad[b], cs_prev[b], carried_h[b],
                 carried_cs[b], g[off_i:off_i + C], g[off_f:off_f + C], g[off_c:off_c + C], g[off_o:off_o + C],
                 new_cs[b])


_serial = njit(cache=True, nogil=True)(_step)
_parallel = njit(cache=True, nogil=True, parallel=True)(_step)


def _gemm_type(real):
    # cblas_?gemm(order, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); pointers as intp
    i32, i64 = types.int32, types.int64
    return types.void(i32, i32, i32, i64, i64, i64, real, types.intp, i64, types.intp, i64, real, types.intp, i64)


# Bound by name: cached kernels link against these symbols, registered in every process below.
_sgemm = types.ExternalFunction("lstmgrad_cblas_sgemm", _gemm_type(types.float32))
_dgemm = types.ExternalFunction("lstmgrad_cblas_dgemm", _gemm_type(types.float64))
_BLAS = _openblas.find()
if _BLAS is not None:
    llvm.add_symbol("lstmgrad_cblas_sgemm", _BLAS.sgemm)
    llvm.add_symbol("lstmgrad_cblas_dgemm", _BLAS.dgemm)

_step_inline = njit(inline="always")(_step)


def _chunk(one, double, i, f, o, ci, co, h_grad, cs_grad, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs,
           gates, w_h_t, off_i, off_f, off_c, off_o, use_peephole, wci, wcf, wco, acc_i, acc_f,
           acc_o):  # pragma: no cover
    # A chunk's time loop, last step first: the fused step, then carried_h = gates[k] @ w_h_t in BLAS.
    n, B, C = i.shape
    G = gates.shape[2]
    for k in range(n - 1, -1, -1):
        csp = cs_ext[k + first - 1] if k + first > 0 else cs_prev
        _step_inline(one, i[k], f[k], o[k], ci[k], co[k], h_grad[k], cs_grad[k], csp, cs_ext[k + first],
                     carried_h, carried_cs, gates[k], new_cs, off_i, off_f, off_c, off_o, use_peephole,
                     wci, wcf, wco, acc_i, acc_f, acc_o)
        carried_cs, new_cs = new_cs, carried_cs
        a, b, c = gates[k].ctypes.data, w_h_t.ctypes.data, carried_h.ctypes.data
        if double:
            _dgemm(101, 111, 111, B, C, G, 1.0, a, G, b, C, 0.0, c, C)  # row major, no transposes
        else:
            _sgemm(101, 111, 111, B, C, G, 1.0, a, G, b, C, 0.0, c, C)


_chunk_serial = njit(cache=True, nogil=True)(_chunk)
_chunk_parallel = njit(cache=True, nogil=True, parallel=True)(_chunk)


class NumbaGradient(XpGradient):
    """``XpGradient`` with the fused step; with numpy's BLAS reachable, whole chunks run compiled.

    ``compiled_loop=False`` keeps the time loop in Python (one kernel call and one ``np.matmul``
    per step), as it always is with an ``observe`` callback or float16 compute.
    """

    def __init__(self, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS, compiled_loop: bool = True,
                 overlap: bool | None = None):
        super().__init__(np, overlap)
        self.parallel_min_elements = parallel_min_elements
        self.compiled_loop = compiled_loop and _BLAS is not None
        self._empty = {}

    def _compiled(self, B, C, dtype) -> bool:
        # With B or C equal to 1 (or 0) np.matmul takes gemv (or no BLAS), which rounds differently.
        return self.compiled_loop and dtype in (np.float32, np.float64) and min(B, C) >= 2

    def _peep_args(self, dtype, peep, acc):
        if peep is not None:
            return True, peep, acc
        empty = self._empty.get(dtype)
        if empty is None:
            empty = self._empty[dtype] = (np.zeros(0, dtype), np.zeros((0, 0), dtype))
        return False, (empty[0],) * 3, (empty[1],) * 3

    def _parallel(self, B, C):
        return B * C >= self.parallel_min_elements and B > 1

    def step(self, a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws):
        dtype = carried_h.dtype
        if dtype not in (np.float32, np.float64):  # float16 emulation: the numpy step
            return super().step(a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws)
        B, C = carried_h.shape
        use_peephole, peep, acc = self._peep_args(dtype, peep, acc)
        kernel = _parallel if self._parallel(B, C) else _serial
        kernel(dtype.type(1), a.i, a.f, a.o, a.ci, a.co, a.h_grad, a.cs_grad, a.cs_prev, a.cs,
               carried_h, carried_cs, gates, new_cs,
               offsets["i"] * C, offsets["f"] * C, offsets["c"] * C, offsets["o"] * C,
               use_peephole, *peep, *acc)

    def _steps(self, lo, acts, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs, gates, w_h_t, peep, acc,
               offsets, ws, observe, one_core=False):
        dtype = carried_h.dtype
        if (observe is not None or not self._compiled(*carried_h.shape, dtype)
                or not (gates.flags.c_contiguous and w_h_t.flags.c_contiguous)):
            return super()._steps(lo, acts, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs, gates, w_h_t,
                                  peep, acc, offsets, ws, observe)
        B, C = carried_h.shape
        use_peephole, peep, acc = self._peep_args(dtype, peep, acc)
        # Overlapped, the products have the other core: numba's threads would only contend for it.
        kernel = _chunk_parallel if self._parallel(B, C) and not one_core else _chunk_serial
        kernel(dtype.type(1), dtype == np.float64, acts["i"], acts["f"], acts["o"], acts["ci"], acts["co"],
               acts["h_grad"], acts["cs_grad"], cs_ext, first, cs_prev, carried_h, carried_cs, new_cs, gates, w_h_t,
               offsets["i"] * C, offsets["f"] * C, offsets["c"] * C, offsets["o"] * C,
               use_peephole, *peep, *acc)
        if gates.shape[0] % 2:  # the kernel swapped the two cell-gradient buffers once per step
            return new_cs, carried_cs
        return carried_cs, new_cs


class NumbaBackend(NumpyBackend):
    """The numpy backend's host-array contract with the compiled gradient."""

    name = "numba"

    def __init__(self, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS, compiled_loop: bool = True,
                 overlap: bool | None = None):
        self._gradient = NumbaGradient(parallel_min_elements, compiled_loop, overlap)

    @property
    def version(self) -> str:
        return numba.__version__
