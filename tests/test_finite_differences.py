"""float64 central finite differences through our own forward pass agree with the analytic gradients.

Loss = sum(cs * cs_grad) + sum(h * h_grad) over the forward outputs: its gradient with respect to
every input is exactly what BlockLSTMGrad(V2) returns for those cs_grad/h_grad (no clipping here:
with clipping TF's gradient is straight-through by definition, tested with the golden files).
"""

from __future__ import annotations

import numpy as np
import pytest

import lstmgrad_cli as lg

PARAMS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")


def make_problem(rng, T, B, I, C):
    return {
        "x": rng.normal(size=(T, B, I)), "cs_prev": rng.normal(size=(B, C)), "h_prev": rng.normal(size=(B, C)),
        "w": rng.normal(size=(I + C, 4 * C)) / np.sqrt(I + C), "wci": rng.normal(size=C) * 0.5,
        "wcf": rng.normal(size=C) * 0.5, "wco": rng.normal(size=C) * 0.5, "b": rng.normal(size=4 * C) * 0.5,
    }


def central_differences(loss, params: dict, eps: float = 1e-6) -> dict:
    """d loss / d params[name][idx] for every entry, by central differences in float64."""
    grads = {}
    for name, value in params.items():
        numeric = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            plus = {k: v.copy() for k, v in params.items()}
            minus = {k: v.copy() for k, v in params.items()}
            plus[name][idx] += eps
            minus[name][idx] -= eps
            numeric[idx] = (loss(plus) - loss(minus)) / (2 * eps)
        grads[name] = numeric
    return grads


def forward(layout, seq_len_max, params, peephole):
    if layout == "ifco":
        return lg.block_lstm_v2(seq_len_max, **params, cell_clip=0.0, use_peephole=peephole)
    return lg.block_lstm(seq_len_max, **params, forget_bias=1.0, cell_clip=-1.0, use_peephole=peephole)


@pytest.mark.parametrize("layout", ["ifco", "icfo"])
@pytest.mark.parametrize("peephole", [True, False])
@pytest.mark.parametrize("seq_len_max", [4, 2])
def test_sequence_gradient_matches_central_differences(layout, peephole, seq_len_max):
    rng = np.random.default_rng(7)
    T, B, I, C = 4, 3, 2, 3
    params = make_problem(rng, T, B, I, C)
    cs_grad, h_grad = rng.normal(size=(T, B, C)), rng.normal(size=(T, B, C))

    def loss(p):
        out = forward(layout, seq_len_max, p, peephole)
        return float(np.sum(out.cs * cs_grad) + np.sum(out.h * h_grad))

    acts = forward(layout, seq_len_max, params, peephole)
    grad_fn = lg.block_lstm_grad_v2 if layout == "ifco" else lg.block_lstm_grad
    grads = grad_fn(seq_len_max, **params, **acts._asdict(), cs_grad=cs_grad, h_grad=h_grad, use_peephole=peephole)

    numerics = central_differences(loss, params)
    for name in PARAMS:
        numeric = numerics[name]
        analytic = getattr(grads, f"{name}_grad")
        scale = max(np.max(np.abs(numeric)), 1e-12)
        rel = np.max(np.abs(analytic - numeric)) / scale
        if not peephole and name in ("wci", "wcf", "wco"):
            assert not np.any(analytic) and not np.any(numeric)
            continue
        assert rel < 1e-7, f"{name}: relative error {rel:.2e}"


def test_cell_gradient_matches_central_differences():
    rng = np.random.default_rng(11)
    B, I, C = 3, 4, 2
    params = {k: v[0] if k == "x" else v for k, v in make_problem(rng, 1, B, I, C).items()}
    cs_grad, h_grad = rng.normal(size=(B, C)), rng.normal(size=(B, C))

    def loss(p):
        out = lg.lstm_block_cell(**p, forget_bias=1.0, cell_clip=-1.0, use_peephole=True)
        return float(np.sum(out.cs * cs_grad) + np.sum(out.h * h_grad))

    acts = lg.lstm_block_cell(**params, forget_bias=1.0, cell_clip=-1.0, use_peephole=True)._asdict()
    acts.pop("h")
    grads = lg.lstm_block_cell_grad_full(**params, **acts, cs_grad=cs_grad, h_grad=h_grad, use_peephole=True)
    numerics = central_differences(loss, params)
    for name in PARAMS:
        numeric = numerics[name]
        analytic = getattr(grads, f"{name}_grad")
        rel = np.max(np.abs(analytic - numeric)) / max(np.max(np.abs(numeric)), 1e-12)
        assert rel < 1e-7, f"{name}: relative error {rel:.2e}"
    # dicfo is the gradient with respect to the pre-activation gates: b's gradient is its batch sum
    np.testing.assert_allclose(grads.dicfo.sum(axis=0), grads.b_grad, rtol=1e-12)
