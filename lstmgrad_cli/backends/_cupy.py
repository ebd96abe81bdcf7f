"""The cupy backend: the numpy backend's array code (``_xp``) on a CUDA device, plus fused kernels.

The inputs are copied to the device once, the whole backward pass runs there (cuBLAS for the
matrix products, one fused elementwise kernel per time step), and the outputs are copied back
once.  The kernels keep TensorFlow's bracketing and are compiled with ``--fmad=false`` so no
multiply-add is contracted: results equal the numpy backend's up to the matrix products.

Usable only when ``cupy.is_available()`` (cupy installed *and* a CUDA device); the registry checks
that before importing this module.  Everything except the kernels is the shared ``_xp`` code, which
the test suite runs with numpy on machines without a GPU.
"""

from __future__ import annotations

import numpy as np

from ..errors import BackendUnavailableError
from ._xp import XpGradient

_PARAMS_IN = "T one, T in_gate, T f, T o, T ci, T co, T h_grad, T cs_grad, T cs_prev, T carried_h, T carried_cs"
_PARAMS_OUT = "T g_i, T g_f, T g_c, T g_o, T new_cs"

# docs/semantics.md, one thread per element, TF's bracketing.  The input gate is ``in_gate``: cupy reserves ``i``
# (its loop index) and refuses it as a parameter name.
_BODY = """
T dh = carried_h + h_grad;
T dc = carried_cs + cs_grad;
T d_o = ((o * (one - o)) * dh) * co;
T dcs = (((one - co * co) * dh) * o) + dc;
"""
_BODY_GATES = """
T d_i = ((in_gate * (one - in_gate)) * dcs) * ci;
T d_f = ((f * (one - f)) * dcs) * cs_prev;
g_o = d_o;
g_c = ((one - ci * ci) * dcs) * in_gate;
g_f = d_f;
g_i = d_i;
"""
STEP_SOURCE = _BODY + _BODY_GATES + "new_cs = dcs * f;\n"
STEP_PEEPHOLE_SOURCE = (
    _BODY + "dcs = dcs + d_o * wco;\n" + _BODY_GATES
    + "new_cs = ((dcs * f) + d_i * wci) + d_f * wcf;\n"
    + "acc_i = acc_i + d_i * cs_prev;\nacc_f = acc_f + d_f * cs_prev;\nacc_o = acc_o + d_o * cs;\n"
)
KERNEL_OPTIONS = ("--fmad=false",)


class CupyGradient(XpGradient):
    """``XpGradient`` over cupy with the per-step work in one fused kernel (``fused=False``: ufuncs)."""

    def __init__(self, cp, fused: bool = True):
        super().__init__(cp)
        self.fused = fused
        self._kernels = None

    def _compile(self):
        cp = self.xp
        plain = cp.ElementwiseKernel(_PARAMS_IN, _PARAMS_OUT, STEP_SOURCE, "lstmgrad_step",
                                     options=KERNEL_OPTIONS)
        peephole = cp.ElementwiseKernel(
            _PARAMS_IN + ", T cs, T wci, T wcf, T wco", _PARAMS_OUT + ", T acc_i, T acc_f, T acc_o",
            STEP_PEEPHOLE_SOURCE, "lstmgrad_step_peephole", options=KERNEL_OPTIONS)
        return plain, peephole

    def step(self, a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws):
        if not self.fused:
            return super().step(a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws)
        if self._kernels is None:
            self._kernels = self._compile()
        C = carried_h.shape[1]
        g_i, g_f, g_c, g_o = (gates[:, offsets[g] * C:(offsets[g] + 1) * C] for g in "ifco")
        one = carried_h.dtype.type(1)
        args = (one, a.i, a.f, a.o, a.ci, a.co, a.h_grad, a.cs_grad, a.cs_prev, carried_h, carried_cs)
        if peep is None:
            self._kernels[0](*args, g_i, g_f, g_c, g_o, new_cs)
        else:
            self._kernels[1](*args, a.cs, *peep, g_i, g_f, g_c, g_o, new_cs, *acc)


class CupyBackend:
    name = "cupy"

    def __init__(self, cp=None, fused: bool = True):
        if cp is None:
            import cupy as cp  # noqa: PLC0415 - imported only when this backend is used
        if not cp.is_available():
            raise BackendUnavailableError("cupy is installed but no CUDA device is usable")
        self._cp = cp
        self._gradient = CupyGradient(cp, fused)

    @property
    def version(self) -> str:
        return self._cp.__version__

    def block_lstm_grad(self, tensors, *, seq_len_max, use_peephole, layout, compute_dtype,
                        chunk_steps=None, return_dgates=False, x_grad_out=None, observe=None):
        cp = self._cp
        # One copy in (lazy inputs such as h5py datasets are read whole: the device holds them all).
        on_device = type(tensors)(*(None if a is None else cp.asarray(a[()] if not hasattr(a, "__array__")
                                                                       else a) for a in tensors))
        result = self._gradient.block_lstm_grad(
            on_device, seq_len_max, use_peephole, layout, compute_dtype, chunk_steps, return_dgates,
            observe=observe,
        )
        outs, dgates = result if return_dgates else (result, None)
        outs = _to_host(cp, outs)
        if x_grad_out is not None:  # one copy out, into the caller's lazy output
            x_grad_out[...] = outs.x_grad
            outs = outs._replace(x_grad=x_grad_out)
        return (outs, cp.asnumpy(dgates)) if return_dgates else outs


def _to_host(cp, outs):
    return type(outs)(*(np.asarray(cp.asnumpy(a)) for a in outs))  # one copy out
