"""The numba backend: the shared chunked algorithm (``_xp``) with one fused kernel per time step.

The generic step makes 24 numpy passes over ``[B, C]`` arrays; here one compiled loop reads each
activation once and writes the four gate gradients and the carried cell gradient, in parallel
over the batch when the step is large enough to pay for the threads.  Matrix products stay in
numpy's BLAS.  Every operation keeps TensorFlow's bracketing and rounds in the compute dtype (no
fast-math, so no contraction into fused multiply-adds): float32 results equal the numpy backend's.

Kernels are compiled on first use with ``cache=True``, so later processes load them from numba's
cache (``NUMBA_CACHE_DIR`` to move it).  float16 compute (TF's per-op half rounding) falls back to
the numpy step.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

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


class NumbaGradient(XpGradient):
    def __init__(self, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS):
        super().__init__(np)
        self.parallel_min_elements = parallel_min_elements
        self._empty = {}

    def step(self, a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws):
        dtype = carried_h.dtype
        if dtype not in (np.float32, np.float64):  # float16 emulation: the numpy step
            return super().step(a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws)
        B, C = carried_h.shape
        if peep is None:
            empty = self._empty.get(dtype)
            if empty is None:
                empty = self._empty[dtype] = (np.zeros(0, dtype), np.zeros((0, 0), dtype))
            peep, acc = (empty[0],) * 3, (empty[1],) * 3
            use_peephole = False
        else:
            use_peephole = True
        kernel = _parallel if B * C >= self.parallel_min_elements and B > 1 else _serial
        kernel(dtype.type(1), a.i, a.f, a.o, a.ci, a.co, a.h_grad, a.cs_grad, a.cs_prev, a.cs,
               carried_h, carried_cs, gates, new_cs,
               offsets["i"] * C, offsets["f"] * C, offsets["c"] * C, offsets["o"] * C,
               use_peephole, *peep, *acc)


class NumbaBackend:
    name = "numba"

    def __init__(self, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS):
        self._gradient = NumbaGradient(parallel_min_elements)

    @property
    def version(self) -> str:
        return numba.__version__

    def block_lstm_grad(self, tensors, *, seq_len_max, use_peephole, layout, compute_dtype,
                        chunk_steps=None, return_dgates=False, x_grad_out=None, observe=None):
        with np.errstate(all="ignore"):  # NaN/Inf in inputs are computed through, as TF does
            return self._gradient.block_lstm_grad(
                tensors, seq_len_max, use_peephole, layout, compute_dtype, chunk_steps, return_dgates,
                x_grad_out=x_grad_out, observe=observe,
            )
