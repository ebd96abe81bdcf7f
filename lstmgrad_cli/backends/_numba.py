"""The numba backend: the shared chunked algorithm (``_xp``) with one fused kernel per time step.

The generic step makes 24 numpy passes over ``[B, C]`` arrays; here one compiled loop reads each
activation once and writes the four gate gradients and the carried cell gradient, in parallel
over the batch when the step is large enough to pay for the threads.  A chunk's whole time loop
runs compiled: after each step the recurrent product calls ``cblas_?gemm`` of the library every
host product goes through (``cpu_blas.find()``: MKL when installed, else the OpenBLAS inside numpy's
wheel; no per-step Python, ~15 us of argument dispatch saved per step); where no library is found
the loop stays in Python with ``np.matmul``.  The chunk products stay in the shared code.  Every
operation keeps TensorFlow's bracketing and rounds in the compute dtype (no fast-math, so no
contraction into fused multiply-adds): float32 results equal the numpy backend's bit for bit.

The kernels live in ``_numba_kernels``, compiled on first use with ``cache=True`` so later
processes load them from numba's cache (``NUMBA_CACHE_DIR`` to move it).  Importing numba and
loading them still takes ~0.5 s a process, so problems under ``KERNEL_MIN_FLOPS`` run on the plain
numpy code (the same bits) until something has loaded them.  float16 compute (TF's per-op half
rounding) falls back to the numpy step.
"""

from __future__ import annotations

import sys

import numpy as np

from . import cpu_blas
from ._numpy import NumpyBackend
from ._xp import XpGradient

# Steps with fewer elements than this run on one thread: thread start-up costs more than it saves.
PARALLEL_MIN_ELEMENTS = 8 * 1024

# Smaller problems run on the shared numpy code (the same bits) unless the kernels are loaded already:
# importing numba and loading its cached kernels takes ~0.5 s, more than such a problem takes in all.
KERNEL_MIN_FLOPS = 2 * 10**8

_KERNELS = __name__ + "_kernels"
_BLAS = cpu_blas.find()


def _kernels():
    """The compiled kernels (``_numba_kernels``), imported on first use."""
    from . import _numba_kernels

    return _numba_kernels


class NumbaGradient(XpGradient):
    """``XpGradient`` with the fused step; with numpy's BLAS reachable, whole chunks run compiled.

    ``compiled_loop=False`` keeps the time loop in Python (one kernel call and one ``np.matmul``
    per step), as it always is with an ``observe`` callback or float16 compute.  Problems under
    ``kernel_min_flops`` run on the plain numpy code unless the kernels are loaded already.
    """

    def __init__(self, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS, compiled_loop: bool = True,
                 overlap: bool | None = None, kernel_min_flops: int = KERNEL_MIN_FLOPS):
        super().__init__(np, overlap)
        self.parallel_min_elements = parallel_min_elements
        self.compiled_loop = compiled_loop and _BLAS is not None
        self.kernel_min_flops = kernel_min_flops
        self._plain = XpGradient(np, overlap)
        self._empty = {}

    def block_lstm_grad(self, t, seq_len_max, *args, **kwargs):
        B, I = t.x.shape[1:]  # noqa: E741
        C = t.w.shape[1] // 4
        if 16 * seq_len_max * B * C * (I + C) < self.kernel_min_flops and _KERNELS not in sys.modules:
            return self._plain.block_lstm_grad(t, seq_len_max, *args, **kwargs)
        return super().block_lstm_grad(t, seq_len_max, *args, **kwargs)

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

    def step(self, a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws, one_core=False):
        dtype = carried_h.dtype
        if dtype not in (np.float32, np.float64):  # float16 emulation: the numpy step
            return super().step(a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws)
        B, C = carried_h.shape
        use_peephole, peep, acc = self._peep_args(dtype, peep, acc)
        k = _kernels()
        # Overlapped (one_core), numba's threads would contend for the other core, and would start on the one the
        # schedule holds this thread on, there for the rest of the process (cpu_placement).
        kernel = k.parallel_step if self._parallel(B, C) and not one_core else k.serial_step
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
                                  peep, acc, offsets, ws, observe, one_core)
        B, C = carried_h.shape
        use_peephole, peep, acc = self._peep_args(dtype, peep, acc)
        # Overlapped, the products have the other core: numba's threads would only contend for it.
        k = _kernels()
        kernel = k.parallel_chunk if self._parallel(B, C) and not one_core else k.serial_chunk
        dnnl = k.DNNL and dtype == np.float32
        if dnnl:
            _BLAS.prepare()  # this thread's oneDNN thread count
        status = kernel(dtype.type(1), dtype == np.float64, dnnl, acts["i"], acts["f"], acts["o"], acts["ci"],
                        acts["co"], acts["h_grad"], acts["cs_grad"], cs_ext, first, cs_prev, carried_h, carried_cs,
                        new_cs, gates, w_h_t, offsets["i"] * C, offsets["f"] * C, offsets["c"] * C, offsets["o"] * C,
                        use_peephole, *peep, *acc)
        if status:
            raise cpu_blas.BlasError(f"{_BLAS.name} refused a product of the time loop (status {status})")
        if gates.shape[0] % 2:  # the kernel swapped the two cell-gradient buffers once per step
            return new_cs, carried_cs
        return carried_cs, new_cs


class NumbaBackend(NumpyBackend):
    """The numpy backend's host-array contract with the compiled gradient."""

    name = "numba"

    def __init__(self, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS, compiled_loop: bool = True,
                 overlap: bool | None = None, kernel_min_flops: int = KERNEL_MIN_FLOPS):
        self._gradient = NumbaGradient(parallel_min_elements, compiled_loop, overlap, kernel_min_flops)
        self._numba_version: str | None = None  # found once (~0.3 ms: every file of a batch records the version)

    @property
    def version(self) -> str:
        if self._numba_version is None:
            installed = cpu_blas.installed_version("numba")  # without importing it
            if installed is None:
                import numba  # noqa: PLC0415

                installed = numba.__version__
            self._numba_version = installed
        return self._numba_version + cpu_blas.version_note()
