"""Forward passes of LSTMBlockCell, BlockLSTM and BlockLSTMV2 (docs/semantics.md), on numpy or cupy arrays.

Used to build consistent inputs for the gradient ops (``lstmgrad forward``) and as the function whose
finite differences the gradient tests check.  Gate values beyond ``seq_len_max`` are zeros, where
TensorFlow leaves uninitialised memory.  The arithmetic is written once against the array module of x
(``array_module``): cupy arrays are computed on their GPU.
"""

from __future__ import annotations

import numpy as np

from ..spec import LAYOUTS


def array_module(a):
    """numpy, or cupy for a cupy array (the module whose functions compute it where it is)."""
    if type(a).__module__.startswith("cupy"):
        import cupy  # noqa: PLC0415 - only for arrays already on a GPU

        return cupy
    return np


def sigmoid(z, xp=None):
    """The logistic function, accurate in relative terms over the whole float range (as TF's Eigen kernel is).

    exp(-|z|) never overflows; 1 / (1 + e) for z >= 0 and e / (1 + e) below keep full relative precision in
    the tails, where 0.5 (1 + tanh(z/2)) loses it (exactly 0 in float32 below z = -19, 2e-4 off at -10).
    ``xp``: the array module computing it (default: z's, ``array_module``)."""
    xp = array_module(z) if xp is None else xp
    z = xp.asarray(z)
    e = xp.exp(-xp.abs(z))
    out = xp.where(z >= 0, e.dtype.type(1), e)
    e += 1.0
    out /= e
    return out if out.ndim else out[()]


def logit(p):
    """The inverse of ``sigmoid`` (infinite at 0 and 1, NaN outside [0, 1], without warnings)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(p) - np.log1p(-p)


def gate_slices(C: int, layout: str) -> dict[str, slice]:
    """The columns of each gate block ("i", "c", "f", "o") of w, b and the gate gradients, by layout."""
    return {g: slice(n * C, (n + 1) * C) for g, n in LAYOUTS[layout].items()}


def block_lstm_forward(seq_len_max: int, x, cs_prev, h_prev, w, wci, wcf, wco, b, *, forget_bias: float,
                       cell_clip: float, use_peephole: bool, layout: str, compute_dtype, clip_offsets=None,
                       offsets_out=None, xp=None) -> tuple:
    """The BlockLSTM recurrence on validated arrays (numpy, or cupy: ``array_module``; ``xp`` names the module
    when the caller knows it, as the layer engine does); returns (i, cs, f, o, ci, co, h) as [T, B, C].

    The state carried from one step to the next is the stored (output-dtype) ``cs``/``h``, so the
    outputs are exactly consistent with each other, as TF's are.  ``offsets_out`` ([T, B, C]), when
    given, receives each step's clip offset ``clip(cs_raw) - cs_raw``; with ``clip_offsets`` given,
    ``cs = cs_raw + clip_offsets[t]`` instead of clipping: the straight-through function whose
    gradient the ops compute (gradcheck.py's finite differences).
    """
    xp = array_module(x) if xp is None else xp
    out_dtype = x.dtype
    cdt = np.dtype(compute_dtype)
    T, B, I = x.shape
    C = w.shape[1] // 4
    L = seq_len_max if B * C else 0  # (no example or no unit: [T, B, C] outputs hold nothing to compute)
    k = gate_slices(C, layout)
    w_c, b_c = w.astype(cdt), b.astype(cdt)
    wci, wcf, wco = (p.astype(cdt) for p in (wci, wcf, wco))
    fb = cdt.type(forget_bias)
    outs = [xp.zeros((T, B, C), dtype=out_dtype) for _ in range(7)]
    i_o, cs_o, f_o, o_o, ci_o, co_o, h_o = outs
    cs_t, h_t = cs_prev.astype(cdt), h_prev.astype(cdt)
    with np.errstate(all="ignore"):  # NaN/Inf in the inputs are computed through, as TF does (cupy never warns)
        gates_x = x[:L].astype(cdt) @ w_c[:I]  # the input part of all steps in one product
        for t in range(L):
            gates = gates_x[t] + h_t @ w_c[I:] + b_c
            zi, zc, zf, zo = gates[:, k["i"]], gates[:, k["c"]], gates[:, k["f"]] + fb, gates[:, k["o"]]
            if use_peephole:
                zi = zi + cs_t * wci
                zf = zf + cs_t * wcf
            i, ci, f = sigmoid(zi, xp), xp.tanh(zc), sigmoid(zf, xp)
            raw = i * ci + f * cs_t
            if clip_offsets is not None:
                cs = raw + clip_offsets[t]
            elif cell_clip > 0:
                cs = xp.clip(raw, -cdt.type(cell_clip), cdt.type(cell_clip))
            else:
                cs = raw
            if offsets_out is not None and clip_offsets is None:
                offsets_out[t] = cs - raw
            co = xp.tanh(cs)
            o = sigmoid(zo + cs * wco, xp) if use_peephole else sigmoid(zo, xp)
            h = o * co
            for store, value in zip(outs, (i, cs, f, o, ci, co, h), strict=True):
                store[t] = value
            cs_t, h_t = cs_o[t].astype(cdt), h_o[t].astype(cdt)
    return tuple(outs)
