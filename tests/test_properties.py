"""Property tests: on random shapes and values, lstmgrad equals the plain per-step reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_block_lstm_grad

import lstmgrad_cli as lg


@st.composite
def problems(draw):
    T = draw(st.integers(0, 5))
    B = draw(st.integers(0, 4))
    I = draw(st.integers(1, 4))  # noqa: E741
    C = draw(st.integers(1, 4))
    seq_len_max = draw(st.integers(0, T))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # Activations need not be consistent with the weights: TF's grad uses only what it is given.
    tensors = {
        "x": rng.normal(size=(T, B, I)), "cs_prev": rng.normal(size=(B, C)), "h_prev": rng.normal(size=(B, C)),
        "w": rng.normal(size=(I + C, 4 * C)), "wci": rng.normal(size=C), "wcf": rng.normal(size=C),
        "wco": rng.normal(size=C), "b": rng.normal(size=4 * C),
        **{k: rng.uniform(0, 1, size=(T, B, C)) for k in ("i", "f", "o")},
        **{k: rng.uniform(-1, 1, size=(T, B, C)) for k in ("ci", "co")},
        **{k: rng.normal(size=(T, B, C)) for k in ("cs", "h", "cs_grad", "h_grad")},
    }
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    return seq_len_max, tensors, draw(st.booleans()), draw(st.sampled_from(["ifco", "icfo"])), draw(
        st.one_of(st.none(), st.integers(1, 3)))


@settings(max_examples=150, deadline=None)
@given(problems())
def test_matches_plain_reference(problem):
    seq_len_max, tensors, peephole, layout, chunk_steps = problem
    fn = lg.block_lstm_grad_v2 if layout == "ifco" else lg.block_lstm_grad
    got = fn(np.int64(seq_len_max), **tensors, use_peephole=peephole, chunk_steps=chunk_steps)
    want = reference_block_lstm_grad(seq_len_max, **tensors, use_peephole=peephole, layout=layout)
    tol = 1e-11 if tensors["x"].dtype == np.float64 else 2e-5
    for key, value in got._asdict().items():
        assert value.dtype == tensors["x"].dtype
        assert value.shape == want[key].shape, key
        scale = max(1.0, float(np.max(np.abs(want[key]), initial=0.0)))
        np.testing.assert_allclose(value, want[key], rtol=0, atol=tol * scale, err_msg=key)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_cell_is_one_icfo_step(problem):
    _, tensors, peephole, _, _ = problem
    if tensors["x"].shape[0] == 0:
        return
    step = {k: (v[0] if v.ndim == 3 else v) for k, v in tensors.items() if k != "h"}
    got = lg.lstm_block_cell_grad_full(**step, use_peephole=peephole)
    want = reference_block_lstm_grad(1, **{k: v[:1] for k, v in tensors.items() if v.ndim == 3},
                                     **{k: v for k, v in tensors.items() if v.ndim < 3},
                                     use_peephole=peephole, layout="icfo")
    tol = 1e-11 if tensors["x"].dtype == np.float64 else 2e-5
    for key in want:
        value = getattr(got, key)
        expected = want[key][0] if key == "x_grad" else want[key]
        scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
        np.testing.assert_allclose(value, expected, rtol=0, atol=tol * scale, err_msg=key)
