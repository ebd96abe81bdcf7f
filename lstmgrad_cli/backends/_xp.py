"""The backward pass of TensorFlow's block-LSTM ops, written once against an array module ``xp``.

numpy and cupy spell everything used here the same way, so both backends run this code; the numba
backend replaces only the per-step elementwise kernel (``step``).

Structure (tf-semantics.md 3.3, reorganised for speed, same maths):

* Only the recurrent product ``dgates[t] @ w_h^T`` has to be done step by step.  The gate gradients
  of a chunk of K time steps are collected in one ``[K, B, 4C]`` buffer; after the chunk,
  ``x_grad = dgates @ w_x^T``, ``w_grad += [x; h_prev]^T @ dgates``, ``b_grad`` and the peephole
  gradients are done as a few large products over all K steps at once.
* The factors of the elementwise formula that do not depend on the carried gradients
  (``o(1-o)``, ``1-co^2``, ``1-ci^2``, ``f(1-f)``, ``i(1-i)``) are computed for the whole chunk in
  one vectorised pass each, so the sequential loop does only what must be sequential.  The
  bracketing of every product is TensorFlow's, so with ``compute_dtype=float16`` every operation
  rounds to half exactly where TF's CPU kernel does.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Gate block offsets, in units of C, for the two layouts (tf-semantics.md 1.1).
LAYOUTS = {
    "ifco": {"i": 0, "f": 1, "c": 2, "o": 3},  # BlockLSTMV2 / BlockLSTMGradV2
    "icfo": {"i": 0, "c": 1, "f": 2, "o": 3},  # BlockLSTM / BlockLSTMGrad / LSTMBlockCell(Grad)
}

# Budget for one chunk's gate-gradient buffer and its precomputed factors.
CHUNK_BYTES = 64 * 2**20


class BlockLSTMGradOutputs(NamedTuple):
    """Outputs of BlockLSTMGrad / BlockLSTMGradV2, in TensorFlow's order and names."""

    x_grad: np.ndarray
    cs_prev_grad: np.ndarray
    h_prev_grad: np.ndarray
    w_grad: np.ndarray
    wci_grad: np.ndarray
    wcf_grad: np.ndarray
    wco_grad: np.ndarray
    b_grad: np.ndarray


class SeqTensors(NamedTuple):
    """The 17 tensor inputs of BlockLSTMGrad(V2), in TF's order (seq_len_max is passed apart)."""

    x: object
    cs_prev: object
    h_prev: object
    w: object
    wci: object
    wcf: object
    wco: object
    b: object
    i: object
    cs: object
    f: object
    o: object
    ci: object
    co: object
    h: object
    cs_grad: object
    h_grad: object


def default_chunk_steps(L: int, B: int, C: int, itemsize: int) -> int:
    """Time steps per chunk so that the chunk's buffers stay near ``CHUNK_BYTES``."""
    per_step = 9 * B * C * max(itemsize, 1)  # dgates (4) + five factors
    return max(1, min(max(L, 1), CHUNK_BYTES // max(per_step, 1)))


class XpGradient:
    """The chunked backward pass over an array module; subclasses may replace ``step``."""

    def __init__(self, xp):
        self.xp = xp

    # -- the per-step elementwise kernel ------------------------------------------------------
    def step(self, fac, t, dh, dc, cs_prev_t, dgates_t, cs_prev_grad, peep, layout, tmp):
        """One step of tf-semantics.md 3.1, in place.

        ``fac`` holds the chunk's precomputed factors and activations (all ``[K, B, C]``),
        ``dh``/``dc`` the total gradients arriving at h and cs of this step; the gate gradients
        go into ``dgates_t`` ([B, 4C]) and the carried cell gradient into ``cs_prev_grad``.
        """
        xp = self.xp
        C = dh.shape[1]
        blk = {g: dgates_t[:, k * C:(k + 1) * C] for g, k in layout.items()}
        do, dci, df, di = blk["o"], blk["c"], blk["f"], blk["i"]
        dcs = tmp
        xp.multiply(fac.po[t], dh, out=do)          # (o(1-o)) dh
        xp.multiply(do, fac.co[t], out=do)           # ... co
        xp.multiply(fac.pco[t], dh, out=dcs)         # (1-co^2) dh
        xp.multiply(dcs, fac.o[t], out=dcs)          # ... o
        xp.add(dcs, dc, out=dcs)                     # ... + dc
        if peep is not None:
            wci, wcf, wco = peep
            xp.add(dcs, do * wco, out=dcs)
        xp.multiply(fac.pci[t], dcs, out=dci)        # (1-ci^2) dcs
        xp.multiply(dci, fac.i[t], out=dci)          # ... i
        xp.multiply(fac.pf[t], dcs, out=df)          # (f(1-f)) dcs
        xp.multiply(df, cs_prev_t, out=df)           # ... cs_prev
        xp.multiply(fac.pi[t], dcs, out=di)          # (i(1-i)) dcs
        xp.multiply(di, fac.ci[t], out=di)           # ... ci
        xp.multiply(dcs, fac.f[t], out=cs_prev_grad)  # dcs f
        if peep is not None:
            xp.add(cs_prev_grad, di * wci, out=cs_prev_grad)
            xp.add(cs_prev_grad, df * wcf, out=cs_prev_grad)

    # -- the whole backward pass --------------------------------------------------------------
    def block_lstm_grad(self, t: SeqTensors, seq_len_max: int, use_peephole: bool, layout: str,
                        compute_dtype, chunk_steps: int | None = None, return_dgates: bool = False):
        """BlockLSTMGrad(V2) on validated arrays already on this module's device.

        Returns ``BlockLSTMGradOutputs`` in the input dtype (and the gate gradients of all steps
        when ``return_dgates``, used for LSTMBlockCellGrad's ``dicfo``).
        """
        xp = self.xp
        out_dtype = t.x.dtype
        cdt = np.dtype(compute_dtype)
        T, B, I = t.x.shape
        C = t.w.shape[1] // 4
        L = seq_len_max
        offsets = LAYOUTS[layout]

        def cast(a):
            return a if a.dtype == cdt else a.astype(cdt)

        w = cast(t.w)
        w_x_t, w_h_t = w[:I].T, w[I:].T  # [4C, I], [4C, C]: BLAS reads the transposes in place
        peep = tuple(cast(t_) for t_ in (t.wci, t.wcf, t.wco)) if use_peephole else None

        x_grad = xp.zeros((T, B, I), dtype=out_dtype)
        w_grad = xp.zeros((I + C, 4 * C), dtype=cdt)
        b_grad = xp.zeros(4 * C, dtype=cdt)
        peep_grads = [xp.zeros(C, dtype=cdt) for _ in range(3)]
        carried_cs = xp.zeros((B, C), dtype=cdt)
        carried_h = xp.zeros((B, C), dtype=cdt)
        dgates_all = xp.zeros((L, B, 4 * C), dtype=cdt) if return_dgates else None

        K = chunk_steps or default_chunk_steps(L, B, C, cdt.itemsize)
        dgates_buf = xp.empty((min(K, max(L, 1)), B, 4 * C), dtype=cdt)
        dh, dc, tmp = (xp.empty((B, C), dtype=cdt) for _ in range(3))
        new_cs = xp.empty((B, C), dtype=cdt)

        hi = L
        while hi > 0:
            lo = max(0, hi - K)
            n = hi - lo
            fac = _Factors(xp, t, lo, hi, cast)
            cs_prevs = _previous(xp, t.cs, t.cs_prev, lo, hi, cast)   # cs[t-1], cs_prev at t=0
            dgates = dgates_buf[:n]
            for k in range(n - 1, -1, -1):
                step_t = lo + k
                xp.add(carried_h, cast(t.h_grad[step_t]), out=dh)
                xp.add(carried_cs, cast(t.cs_grad[step_t]), out=dc)
                self.step(fac, k, dh, dc, cs_prevs[k], dgates[k], new_cs, peep, offsets, tmp)
                carried_cs, new_cs = new_cs, carried_cs
                xp.matmul(dgates[k], w_h_t, out=carried_h)
            flat = dgates.reshape(n * B, 4 * C)
            x_grad[lo:hi] = (flat @ w_x_t).reshape(n, B, I)
            h_prevs = _previous(xp, t.h, t.h_prev, lo, hi, cast)
            w_grad[:I] += cast(t.x[lo:hi]).reshape(n * B, I).T @ flat
            w_grad[I:] += h_prevs.reshape(n * B, C).T @ flat
            b_grad += flat.sum(axis=0)
            if use_peephole:
                o, f, i = (offsets[g] * C for g in "ofi")
                peep_grads[0] += _dot_sum(xp, dgates[..., i:i + C], cs_prevs)
                peep_grads[1] += _dot_sum(xp, dgates[..., f:f + C], cs_prevs)
                peep_grads[2] += _dot_sum(xp, dgates[..., o:o + C], fac.cs)
            if return_dgates:
                dgates_all[lo:hi] = dgates
            hi = lo

        outs = BlockLSTMGradOutputs(
            x_grad, carried_cs.astype(out_dtype), carried_h.astype(out_dtype),
            w_grad.astype(out_dtype), *(g.astype(out_dtype) for g in peep_grads), b_grad.astype(out_dtype),
        )
        if return_dgates:
            return outs, dgates_all.astype(out_dtype)
        return outs


class _Factors:
    """Activations of time steps [lo, hi) in the compute dtype, and the derivative factors."""

    def __init__(self, xp, t: SeqTensors, lo: int, hi: int, cast):
        one = 1
        self.i, self.f, self.o = cast(t.i[lo:hi]), cast(t.f[lo:hi]), cast(t.o[lo:hi])
        self.ci, self.co, self.cs = cast(t.ci[lo:hi]), cast(t.co[lo:hi]), cast(t.cs[lo:hi])
        self.po = self.o * (one - self.o)          # sigmoid'(o) = o(1-o)
        self.pco = one - self.co * self.co         # tanh'(cs) = 1 - co^2
        self.pci = one - self.ci * self.ci         # tanh'    = 1 - ci^2
        self.pf = self.f * (one - self.f)
        self.pi = self.i * (one - self.i)


def _previous(xp, seq, first, lo: int, hi: int, cast):
    """``seq[t-1]`` for t in [lo, hi), with ``first`` standing for ``seq[-1]``."""
    if lo > 0:
        return cast(seq[lo - 1:hi - 1])
    head = cast(first)[None]
    if hi == 1:
        return head
    return xp.concatenate([head, cast(seq[:hi - 1])], axis=0)


def _dot_sum(xp, a, b):
    """Sum over time and batch of ``a * b`` ([K, B, C] each) -> [C]."""
    return (a * b).sum(axis=(0, 1))
