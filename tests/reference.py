"""A deliberately plain float64 reference of TF's block-LSTM backward pass, written apart from the
package (docs/semantics.md, one step at a time, concatenating [x, h_prev] as TF does).
The property tests compare lstmgrad against it on random shapes."""

from __future__ import annotations

import numpy as np


def reference_block_lstm_grad(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
                              cs_grad, h_grad, use_peephole, layout):
    x, cs_prev, h_prev, w, wci, wcf, wco = (np.asarray(a, np.float64) for a in (x, cs_prev, h_prev, w, wci, wcf, wco))
    i, cs, f, o, ci, co, h, cs_grad, h_grad = (np.asarray(a, np.float64) for a in (i, cs, f, o, ci, co, h, cs_grad,
                                                                                   h_grad))
    T, B, I = x.shape
    C = w.shape[1] // 4
    blocks = {"ifco": ("i", "f", "c", "o"), "icfo": ("i", "c", "f", "o")}[layout]
    x_grad = np.zeros_like(x)
    w_grad = np.zeros_like(w)
    b_grad = np.zeros(4 * C)
    wci_grad, wcf_grad, wco_grad = np.zeros(C), np.zeros(C), np.zeros(C)
    dcs_carry = np.zeros((B, C))
    dh_carry = np.zeros((B, C))
    for t in reversed(range(seq_len_max)):
        c_prev = cs_prev if t == 0 else cs[t - 1]
        hp = h_prev if t == 0 else h[t - 1]
        dh = dh_carry + h_grad[t]
        dc = dcs_carry + cs_grad[t]
        d_o = dh * co[t] * o[t] * (1 - o[t])
        d_cs = dh * o[t] * (1 - co[t] ** 2) + dc
        if use_peephole:
            d_cs = d_cs + d_o * wco
        d_ci = d_cs * i[t] * (1 - ci[t] ** 2)
        d_f = d_cs * c_prev * f[t] * (1 - f[t])
        d_i = d_cs * ci[t] * i[t] * (1 - i[t])
        dcs_carry = d_cs * f[t]
        if use_peephole:
            dcs_carry = dcs_carry + d_i * wci + d_f * wcf
            wci_grad += (d_i * c_prev).sum(0)
            wcf_grad += (d_f * c_prev).sum(0)
            wco_grad += (d_o * cs[t]).sum(0)
        parts = {"i": d_i, "f": d_f, "c": d_ci, "o": d_o}
        dgates = np.concatenate([parts[g] for g in blocks], axis=1)
        xh = np.concatenate([x[t], hp], axis=1)
        xh_grad = dgates @ w.T
        x_grad[t] = xh_grad[:, :I]
        dh_carry = xh_grad[:, I:]
        w_grad += xh.T @ dgates
        b_grad += dgates.sum(0)
    return dict(x_grad=x_grad, cs_prev_grad=dcs_carry, h_prev_grad=dh_carry, w_grad=w_grad, wci_grad=wci_grad,
                wcf_grad=wcf_grad, wco_grad=wco_grad, b_grad=b_grad)
