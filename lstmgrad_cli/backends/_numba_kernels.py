"""The numba backend's compiled kernels: imported only when a problem is big enough to use them.

Importing numba and loading even cached kernels costs ~0.5 s per process, more than a small
problem takes in all; ``_numba.NumbaGradient`` runs those on the shared numpy code instead (the
same bits).  Every operation keeps TensorFlow's bracketing and rounds in the compute dtype (no
fast-math, so no contraction into fused multiply-adds).  Kernels are compiled on first use with
``cache=True``, so later processes load them from numba's cache (``NUMBA_CACHE_DIR`` to move it).
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numpy as np
from numba import njit, prange, types

from . import cpu_blas


def _row_kernel(peephole: bool):
    """One batch row's fused step, with or without the peephole terms: ``peephole`` is a constant of the compiled
    kernel (numba takes closure variables as such), so each kernel holds only its own branch."""
    @njit(inline="always")
    def row(one, i, f, o, ci, co, h_grad, cs_grad, cs_prev, cs, carried_h, carried_cs, g_i, g_f, g_c, g_o, new_cs,
            wci, wcf, wco, acc_i, acc_f, acc_o):
        # Row views keep the inner loop simple enough for LLVM to vectorise.
        for c in range(i.shape[0]):
            dh = carried_h[c] + h_grad[c]
            dc = carried_cs[c] + cs_grad[c]
            ov = o[c]
            cov = co[c]
            civ = ci[c]
            iv = i[c]
            fv = f[c]
            if peephole:
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
            else:
                dcs = (((one - cov * cov) * dh) * ov) + dc
                g_o[c] = ((ov * (one - ov)) * dh) * cov
                g_c[c] = ((one - civ * civ) * dcs) * iv
                g_f[c] = ((fv * (one - fv)) * dcs) * cs_prev[c]
                g_i[c] = ((iv * (one - iv)) * dcs) * civ
                new_cs[c] = dcs * fv
    return row


_row = _row_kernel(False)
_row_peephole = _row_kernel(True)


def _step(one, i, f, o, ci, co, h_grad, cs_grad, cs_prev, cs, carried_h, carried_cs, gates, new_cs,
          off_i, off_f, off_c, off_o, use_peephole, wci, wcf, wco, acc_i, acc_f, acc_o):  # pragma: no cover
    B, C = i.shape
    for b in prange(B):
        g = gates[b]
        if use_peephole:
            _row_peephole(one, i[b], f[b], o[b], ci[b], co[b], h_grad[b], cs_grad[b], cs_prev[b], cs[b],
                          carried_h[b], carried_cs[b], g[off_i:off_i + C], g[off_f:off_f + C], g[off_c:off_c + C],
                          g[off_o:off_o + C], new_cs[b], wci, wcf, wco, acc_i[b], acc_f[b], acc_o[b])
        else:  # (wci ... acc_o are not read: without peepholes they are empty)
            _row(one, i[b], f[b], o[b], ci[b], co[b], h_grad[b], cs_grad[b], cs_prev[b], cs[b], carried_h[b],
                 carried_cs[b], g[off_i:off_i + C], g[off_f:off_f + C], g[off_c:off_c + C], g[off_o:off_o + C],
                 new_cs[b], wci, wcf, wco, acc_i, acc_f, acc_o)


serial_step = njit(cache=True, nogil=True)(_step)
parallel_step = njit(cache=True, nogil=True, parallel=True)(_step)


def _gemm_type(real):
    # cblas_?gemm(order, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); pointers as intp
    i32, i64 = types.int32, types.int64
    return types.void(i32, i32, i32, i64, i64, i64, real, types.intp, i64, types.intp, i64, real, types.intp, i64)


# dnnl_sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc): row-major, 'N' or 'T'; a status back
_DNNL_TYPE = types.int32(types.int8, types.int8, types.int64, types.int64, types.int64, types.float32, types.intp,
                         types.int64, types.intp, types.int64, types.float32, types.intp, types.int64)
_NO_DNNL = ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.c_int64] * 13)(lambda *args: -1)  # a refusal (status -1)

# Bound by name: cached kernels link against these symbols, registered in every process below.
_sgemm = types.ExternalFunction("lstmgrad_cblas_sgemm", _gemm_type(types.float32))
_dgemm = types.ExternalFunction("lstmgrad_cblas_dgemm", _gemm_type(types.float64))
_dnnl_sgemm = types.ExternalFunction("lstmgrad_dnnl_sgemm", _DNNL_TYPE)
_BLAS = cpu_blas.find()
DNNL = _BLAS is not None and _BLAS.sgemm_call == "dnnl"  # float32 products through dnnl_sgemm (the kernels' flag)
if _BLAS is not None:
    # oneDNN's float32 products take the dnnl branch; the other branch's symbol is then numpy's OpenBLAS's (and
    # with any other library the dnnl symbol a refusal): both symbols exist, only the flag's is called.
    llvm.add_symbol("lstmgrad_cblas_sgemm", cpu_blas.numpy_openblas().sgemm if DNNL else _BLAS.sgemm)
    llvm.add_symbol("lstmgrad_dnnl_sgemm", _BLAS.sgemm if DNNL else ctypes.cast(_NO_DNNL, ctypes.c_void_p).value)
    llvm.add_symbol("lstmgrad_cblas_dgemm", _BLAS.dgemm)

_step_inline = njit(inline="always")(_step)


def _chunk(one, double, dnnl, i, f, o, ci, co, h_grad, cs_grad, cs_ext, first, cs_prev, carried_h, carried_cs,
           new_cs, gates, w_h_t, off_i, off_f, off_c, off_o, use_peephole, wci, wcf, wco, acc_i, acc_f,
           acc_o):  # pragma: no cover
    # A chunk's time loop, last step first: the fused step, then carried_h = gates[k] @ w_h_t in BLAS.  Returns 0,
    # or the status of a float32 product oneDNN refused (``dnnl``: products through dnnl_sgemm), at once.
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
        elif dnnl:
            status = _dnnl_sgemm(78, 78, B, C, G, np.float32(1.0), a, G, b, C, np.float32(0.0), c, C)  # 78: "N"
            if status != 0:
                return status
        else:
            _sgemm(101, 111, 111, B, C, G, 1.0, a, G, b, C, 0.0, c, C)
    return 0


serial_chunk = njit(cache=True, nogil=True)(_chunk)
parallel_chunk = njit(cache=True, nogil=True, parallel=True)(_chunk)
