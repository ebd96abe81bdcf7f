"""TF's backward semantics that the golden files alone would not pin down (docs/semantics.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import load_case

import lstmgrad_cli as lg


def seq_inputs(name="seq_v2_partial"):
    inputs, _, case = load_case(name)
    args = dict(inputs)
    peep = args.pop("use_peephole")
    return args, bool(peep), case


def test_beyond_seq_len_max_x_grad_is_zero_and_incoming_grads_are_ignored():
    args, peep, _ = seq_inputs()
    length = int(args["seq_len_max"])
    base = lg.block_lstm_grad_v2(**args, use_peephole=peep)
    assert np.all(base.x_grad[length:] == 0) and np.any(base.x_grad[:length] != 0)
    noisy = dict(args)
    rng = np.random.default_rng(0)
    for key in ("cs_grad", "h_grad", "i", "f", "o", "ci", "co", "cs", "h", "x"):
        noisy[key] = args[key].copy()
        noisy[key][length:] = rng.normal(size=noisy[key][length:].shape).astype(np.float32)
    # h[seq_len_max-1] is never read either (only as h_prev of a step that is not run)
    noisy["h"][length - 1] = 7.0
    again = lg.block_lstm_grad_v2(**noisy, use_peephole=peep)
    for a, b in zip(base, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_seq_len_max_zero_gives_all_zero_gradients():
    args, peep, _ = seq_inputs("seq_v2_peep")
    args["seq_len_max"] = np.int64(0)
    for value in lg.block_lstm_grad_v2(**args, use_peephole=peep):
        assert not np.any(value)


def test_bias_is_never_read():
    args, peep, _ = seq_inputs("seq_v2_peep")
    base = lg.block_lstm_grad_v2(**args, use_peephole=peep)
    args["b"] = args["b"] + 5.0
    for a, b in zip(base, lg.block_lstm_grad_v2(**args, use_peephole=peep), strict=True):
        np.testing.assert_array_equal(a, b)


def test_without_peepholes_their_gradients_are_zero_and_their_values_unused():
    args, _, _ = seq_inputs("seq_v2_peep")
    base = lg.block_lstm_grad_v2(**args, use_peephole=False)
    assert not np.any(base.wci_grad) and not np.any(base.wcf_grad) and not np.any(base.wco_grad)
    for key in ("wci", "wcf", "wco"):
        args[key] = args[key] * 3.0
    for a, b in zip(base, lg.block_lstm_grad_v2(**args, use_peephole=False), strict=True):
        np.testing.assert_array_equal(a, b)


def test_v1_and_v2_differ_only_by_swapping_the_c_and_f_blocks():
    args, peep, case = seq_inputs("seq_v2_peep")
    C = case["C"]
    v2 = lg.block_lstm_grad_v2(**args, use_peephole=peep)

    def swap(a):  # IFCO <-> ICFO columns
        return np.concatenate([a[..., :C], a[..., 2 * C:3 * C], a[..., C:2 * C], a[..., 3 * C:]], axis=-1)

    args_v1 = dict(args, w=swap(args["w"]), b=swap(args["b"]))
    v1 = lg.block_lstm_grad(**args_v1, use_peephole=peep)
    np.testing.assert_allclose(swap(v1.w_grad), v2.w_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(swap(v1.b_grad), v2.b_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v1.x_grad, v2.x_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_steps", [1, 2, 3, 5, 100])
def test_time_chunking_does_not_change_the_result(chunk_steps):
    args, peep, _ = seq_inputs("seq_v2_larger")
    whole = lg.block_lstm_grad_v2(**args, use_peephole=peep)
    chunked = lg.block_lstm_grad_v2(**args, use_peephole=peep, chunk_steps=chunk_steps)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_outputs_keep_the_input_dtype_and_shapes():
    args, peep, case = seq_inputs("seq_v2_peep")
    args64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in args.items()}
    out = lg.block_lstm_grad_v2(**args64, use_peephole=peep)
    T, B, I, C = case["T"], case["B"], case["I"], case["C"]
    shapes = [(T, B, I), (B, C), (B, C), (I + C, 4 * C), (C,), (C,), (C,), (4 * C,)]
    assert [v.shape for v in out] == shapes
    assert all(v.dtype == np.float64 for v in out)


def test_inputs_are_not_modified():
    args, peep, _ = seq_inputs("seq_v2_peep")
    before = {k: np.array(v, copy=True) for k, v in args.items()}
    lg.block_lstm_grad_v2(**args, use_peephole=peep)
    for key, value in before.items():
        np.testing.assert_array_equal(args[key], value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_recomputed_sigmoid_is_accurate_in_the_tails(dtype):
    """Gates far from 0.5 (a bias of -12, large inputs): the logistic keeps its relative precision where
    0.5 (1 + tanh(z/2)) gave exactly 0 in float32 below z = -19 and was 2e-4 off at z = -10."""
    from lstmgrad_cli.ops.forward import sigmoid

    z = np.linspace(-80, 80, 40001).astype(dtype)
    exact = [1 / (1 + math.exp(-float(v))) for v in z[::97]]  # Python floats: a reference computed apart
    got = sigmoid(z)[::97].astype(np.float64)
    rel = np.abs(got - exact) / np.array(exact)
    assert got.dtype == np.float64 and sigmoid(z).dtype == dtype
    assert rel.max() <= 4 * np.finfo(dtype).eps
    assert sigmoid(dtype(-41.7)) == pytest.approx(7.8e-19, rel=1e-2)  # what TF's Eigen kernel gives
    assert sigmoid(dtype(np.inf)) == 1 and sigmoid(dtype(-np.inf)) == 0 and np.isnan(sigmoid(dtype(np.nan)))


def test_a_saturated_forget_gate_still_has_a_gradient():
    """A bias of -12 on every gate: the recomputed forward keeps the tiny gate values, so the kernel gradient
    through them is the float64 one to float32 precision, not zero."""
    rng = np.random.default_rng(7)
    T, B, I, C = 4, 2, 3, 2
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    w = rng.standard_normal((I + C, 4 * C)).astype(np.float32)
    b = np.full(4 * C, -12.0, np.float32)
    z = np.zeros((B, C), np.float32)
    peep = np.zeros(C, np.float32)
    h_grad = rng.standard_normal((T, B, C)).astype(np.float32)
    grads = {}
    for dt in (np.float32, np.float64):
        args = [a.astype(dt) for a in (x, z, z, w, peep, peep, peep, b)]
        acts = lg.block_lstm_v2(T, *args)
        grads[dt] = lg.block_lstm_grad_v2(T, *args, *acts, np.zeros((T, B, C), dt), h_grad.astype(dt), False)
    want, got = grads[np.float64].w_grad, grads[np.float32].w_grad
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6 * np.abs(want).max())
