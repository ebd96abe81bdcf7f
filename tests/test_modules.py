"""Whole modules, per-example lengths, Keras masks and other activations, against a reference written apart.

The reference below runs each example on its own, step by step, in float64, exactly as the frameworks describe
their layers (PyTorch's packed sequences, Keras' masking with its carried outputs, go_backwards, Bidirectional);
its gradients are central finite differences of that forward pass.  lstmgrad's engine (schedule.py,
recurrence.py, modules.py) must agree with it on random problems (hypothesis), for every activation it knows.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES, write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main

# -- the reference: one example, one step at a time, float64 -------------------------------------------------


def act(name, z):
    z = np.asarray(z, np.float64)
    return {"tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0),
            "linear": lambda v: v, "hard_sigmoid": lambda v: np.minimum(np.maximum(v + 3, 0), 6) / 6,
            "hard_sigmoid_keras2": lambda v: np.clip(0.2 * v + 0.5, 0, 1)}[name](z)


def cell(x, h, c, kernel, recurrent, bias, a="tanh", g="sigmoid", projection=None):
    """One Keras LSTM step (gates i, f, c, o); ``projection`` [P, C]: PyTorch's weight_hr, h = W_hr (o * tanh(c))."""
    z = x @ kernel + h @ recurrent + bias
    C = c.shape[-1]
    i, f, ci, o = act(g, z[:C]), act(g, z[C:2 * C]), act(a, z[2 * C:3 * C]), act(g, z[3 * C:])
    c = f * c + i * ci
    h = o * act(a, c)
    return (h if projection is None else projection @ h), c


def keras_layer(x, mask, kernel, recurrent, bias, h0, c0, *, go_backwards=False, zero_output=False, a="tanh",
                g="sigmoid"):
    """A Keras LSTM layer on one example x [T, I]: (outputs in the order returned, last output, h_n, c_n)."""
    T = x.shape[0]
    order = range(T - 1, -1, -1) if go_backwards else range(T)
    h, c, prev = h0, c0, np.zeros_like(h0)
    outs = []
    for t in order:
        if mask is None or mask[t]:
            h, c = cell(x[t], h, c, kernel, recurrent, bias, a, g)
            prev = h
            outs.append(h)
        else:
            outs.append(np.zeros_like(h) if zero_output else prev)
    return np.array(outs).reshape(T, h0.shape[0]), (outs[-1] if T else np.zeros_like(h0)), h, c


def torch_direction(x, n, w_ih, w_hh, b, h0, c0, reverse, w_hr=None):
    """One direction of one nn.LSTM layer on one example of a packed batch (its first n steps of x)."""
    T = x.shape[0]
    out = np.zeros((T, h0.shape[0]))
    h, c = h0, c0
    for t in (range(n - 1, -1, -1) if reverse else range(n)):
        h, c = cell(x[t], h, c, w_ih.T, w_hh.T, b, projection=w_hr)
        out[t] = h
    return out, h, c


def torch_module(x, lengths, params, h0, c0, layers, D):
    """A whole nn.LSTM on x [T, B, I] with per-example lengths: (out [T, B, D*H], h_n [L*D, B, H], c_n [L*D, B, C];
    H = proj_size where params holds weight_hr_l{K}, else C)."""
    T, B, _ = x.shape
    H = h0.shape[-1]
    out = np.zeros((T, B, D * H))
    hn, cn = np.zeros_like(h0), np.zeros_like(c0)
    for b in range(B):
        inputs = x[:, b]
        for k in range(layers):
            parts = []
            for d in range(D):
                s = f"_l{k}" + ("_reverse" if d else "")
                o, hn[k * D + d, b], cn[k * D + d, b] = torch_direction(
                    inputs, lengths[b], params["weight_ih" + s], params["weight_hh" + s],
                    params["bias_ih" + s] + params["bias_hh" + s], h0[k * D + d, b], c0[k * D + d, b], bool(d),
                    params.get("weight_hr" + s))
                parts.append(o)
            inputs = np.concatenate(parts, axis=-1)
        out[:, b] = inputs
    return out, hn, cn


def finite_differences(loss, arrays: dict, names, eps=1e-6) -> dict:
    grads = {}
    for name in names:
        a = arrays[name]
        g = np.zeros_like(a)
        for index in np.ndindex(a.shape):
            keep = a[index]
            a[index] = keep + eps
            up = loss()
            a[index] = keep - eps
            down = loss()
            a[index] = keep
            g[index] = (up - down) / (2 * eps)
        grads[name] = g
    return grads


# -- PyTorch modules with lengths ----------------------------------------------------------------------------

def random_state_dict(rng, layers: int, D: int, I: int, C: int, H: int, one_bias: bool = False) -> dict:  # noqa: E741
    """An nn.LSTM's parameters, drawn from ``rng``: weight_hr [H, C] too where H < C (proj_size); ``one_bias``:
    bias_ih and bias_hh the same array."""
    params = {}
    for k in range(layers):
        for d in range(D):
            s = f"_l{k}" + ("_reverse" if d else "")
            params["weight_ih" + s] = rng.normal(0, 0.8, (4 * C, I if k == 0 else D * H))
            params["weight_hh" + s] = rng.normal(0, 0.8, (4 * C, H))
            params["bias_ih" + s] = rng.normal(0, 0.5, 4 * C)
            params["bias_hh" + s] = params["bias_ih" + s] if one_bias else rng.normal(0, 0.5, 4 * C)
            if H < C:
                params["weight_hr" + s] = rng.normal(0, 0.8, (H, C))
    return params


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 2), D=st.integers(1, 2), T=st.integers(1, 4),
       B=st.integers(1, 3), packed=st.booleans(), batch_first=st.booleans(), projected=st.booleans())
def test_torch_modules_with_lengths_match_the_reference(seed, layers, D, T, B, packed, batch_first, projected):
    """Every layer and direction, per-example lengths, and (proj_size) h projected by weight_hr [P, C]: h0, h_n and
    the output P wide, c0 and c_n C wide, the layer above reading the projected outputs."""
    rng = np.random.default_rng(seed)
    I, C = 2, 3  # noqa: E741
    H = 2 if projected else C
    params = random_state_dict(rng, layers, D, I, C, H)
    x = rng.normal(size=(T, B, I))
    lengths = rng.integers(0, T + 1, B) if packed else np.full(B, T)
    h0, hn_grad = rng.normal(size=(2, layers * D, B, H))
    c0, cn_grad = rng.normal(size=(2, layers * D, B, C))
    h_grad = rng.normal(size=(T, B, D * H))

    arrays = {"x": x, "h0": h0, "c0": c0, **params}

    def loss():
        out, hn, cn = torch_module(x, lengths, params, h0, c0, layers, D)
        return float((out * h_grad).sum() + (hn * hn_grad).sum() + (cn * cn_grad).sum())

    names = ["x", "h0", "c0", "weight_ih_l0", f"weight_hh_l{layers - 1}"]
    want = finite_differences(loss, arrays, names + [f"weight_hr_l{layers - 1}"] * projected)
    tm = (lambda a: np.swapaxes(a, 0, 1)) if batch_first else (lambda a: a)
    got = lg.torch_lstm_grad(tm(x), state_dict=params, lengths=lengths if packed else None, h_grad=tm(h_grad),
                             h0=h0, c0=c0, hn_grad=hn_grad, cn_grad=cn_grad, batch_first=batch_first)
    assert {f"weight_hr_l{k}{'_reverse' * d}_grad" for k in range(layers) for d in range(D)} <= set(got) or \
        not projected
    for name in want:
        np.testing.assert_allclose(tm(got[f"{name}_grad"]) if name == "x" else got[f"{name}_grad"], want[name],
                                   rtol=1e-5, atol=1e-7, err_msg=name)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 2), D=st.integers(1, 2), T=st.integers(1, 4),
       projected=st.booleans(), last_only=st.booleans(), batch_first=st.booleans())
def test_unbatched_torch_input_is_one_example_without_its_batch_axis(seed, layers, D, T, projected, last_only,
                                                                     batch_first):
    """x [T, I], states [L*D, H] and [L*D, C], out [T, D*H] (out[-1]: [D*H]), as nn.LSTM takes an unbatched input
    (batch_first does not apply to it): the gradients of the same example with a batch axis of one, in the
    unbatched shapes."""
    rng = np.random.default_rng(seed)
    I, C = 3, 3  # noqa: E741
    H = 2 if projected else C
    params = random_state_dict(rng, layers, D, I, C, H, one_bias=True)
    x = rng.normal(size=(T, I))
    h0, hn_grad = rng.normal(size=(2, layers * D, H))
    c0, cn_grad = rng.normal(size=(2, layers * D, C))
    h_grad = rng.normal(size=(D * H,) if last_only else (T, D * H))
    got = lg.torch_lstm_grad(x, state_dict=params, h_grad=h_grad, h0=h0, c0=c0, hn_grad=hn_grad, cn_grad=cn_grad,
                             batch_first=batch_first)
    one = np.zeros((T, 1, D * H))
    one[-1 if last_only else slice(None), 0] = h_grad
    batched = lg.torch_lstm_grad(x[:, None], state_dict=params, h_grad=one, h0=h0[:, None], c0=c0[:, None],
                                 hn_grad=hn_grad[:, None], cn_grad=cn_grad[:, None])
    assert got["x_grad"].shape == x.shape and got["h0_grad"].shape == h0.shape and got["c0_grad"].shape == c0.shape
    for name, value in batched.items():
        np.testing.assert_allclose(got[name], value[:, 0] if name in ("x_grad", "h0_grad", "c0_grad") else value,
                                   rtol=1e-12, atol=1e-14, err_msg=name)


# -- Keras layers with masks and activations -----------------------------------------------------------------

@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(0, 5), B=st.integers(1, 3), masked=st.booleans(),
       direction=st.sampled_from(["forward", "go_backwards", "reverse"]), zero_output=st.booleans(),
       last_only=st.booleans(), a=st.sampled_from(["tanh", "relu", "linear"]),
       g=st.sampled_from(["sigmoid", "hard_sigmoid", "hard_sigmoid_keras2"]))
def test_keras_layers_with_masks_and_activations_match_the_reference(seed, T, B, masked, direction, zero_output,
                                                                    last_only, a, g):
    rng = np.random.default_rng(seed)
    I, C = 3, 2  # noqa: E741
    kernel, recurrent = rng.normal(0, 0.7, (I, 4 * C)), rng.normal(0, 0.7, (C, 4 * C))
    bias = rng.normal(0, 0.5, 4 * C)
    x = rng.normal(size=(B, T, I))
    mask = rng.random((B, T)) < 0.6 if masked else None
    h0, c0 = rng.normal(size=(2, B, C))
    h_grad = rng.normal(size=(B, C) if last_only else (B, T, C))
    hn_grad, cn_grad = rng.normal(size=(2, B, C))
    arrays = {"x": x, "kernel": kernel, "recurrent_kernel": recurrent, "bias": bias, "h0": h0, "c0": c0}
    backwards = direction != "forward"

    def loss():
        total = 0.0
        for b in range(B):
            outs, last, h, c = keras_layer(x[b], None if mask is None else mask[b], kernel, recurrent, bias, h0[b],
                                           c0[b], go_backwards=backwards, zero_output=zero_output, a=a, g=g)
            if direction == "reverse":  # a Bidirectional puts its backward layer's outputs back into x's order
                outs = outs[::-1]
            total += float((last * h_grad[b]).sum() if last_only else (outs * h_grad[b]).sum())
            total += float((h * hn_grad[b]).sum() + (c * cn_grad[b]).sum())
        return total

    want = finite_differences(loss, arrays, list(arrays))
    got = lg.keras_lstm_grad(x, kernel, recurrent, bias, h_grad=h_grad, h0=h0, c0=c0, hn_grad=hn_grad,
                             cn_grad=cn_grad, mask=mask, activation=a, recurrent_activation=g,
                             zero_output_for_mask=zero_output, go_backwards=direction == "go_backwards",
                             reverse=direction == "reverse")
    for name, value in zip(("x", "kernel", "recurrent_kernel", "bias", "h0", "c0"), got, strict=True):
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# -- edges ---------------------------------------------------------------------------------------------------

def test_no_steps_at_all_sends_the_final_gradients_to_the_initial_states(runner, tmp_path):
    """T = 0: h_n is h0 and c_n is c0, so their gradients are hn_grad and cn_grad (an IndexError once)."""
    rng = np.random.default_rng(3)
    B, I, C = 2, 3, 4  # noqa: E741
    hn_grad, cn_grad = rng.normal(size=(2, B, C)).astype(np.float32)
    tensors = {"x": np.zeros((B, 0, I), np.float32), "kernel": rng.normal(size=(I, 4 * C)).astype(np.float32),
               "recurrent_kernel": rng.normal(size=(C, 4 * C)).astype(np.float32), "hn_grad": hn_grad,
               "cn_grad": cn_grad}
    got = lg.keras_lstm_grad(**tensors)
    np.testing.assert_array_equal(got.h0_grad, hn_grad)
    np.testing.assert_array_equal(got.c0_grad, cn_grad)
    assert got.x_grad.shape == (B, 0, I) and not got.kernel_grad.any()
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    with np.load(out) as g:
        np.testing.assert_array_equal(g["h0_grad"], hn_grad)


@pytest.mark.parametrize(("lengths", "said"), [
    ([1, 7], "lengths must be in [0, T] = [0, 4], found 1..7"),
    ([1.5, 2], "lengths must be integers, found dtype float64"),
    ([1, 2, 3], "lengths has shape [3], expected [B] = [2]"),
])
def test_bad_lengths_are_refused(runner, tmp_path, lengths, said):
    rng = np.random.default_rng(0)
    tensors = {"x": rng.normal(size=(4, 2, 3)).astype(np.float32), "h_grad": np.ones((4, 2, 2), np.float32),
               "weight_ih_l0": np.ones((8, 3), np.float32), "weight_hh_l0": np.ones((8, 2), np.float32),
               "lengths": np.array(lengths)}
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and said in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_lengths_or_a_mask_beside_the_ops_own_tensors_are_refused(runner, tmp_path):
    from conftest import FIXTURES

    with np.load(FIXTURES / "seq_v2_peep.in.npz") as data:
        tensors = {k: data[k] for k in data.files}
    for key, said in (("lengths", "per-example lengths, as a PyTorch packed batch has"), ("mask", "a Keras mask")):
        bad = write_npz(tmp_path / f"{key}.npz", {**tensors, key: np.ones(3, np.int64)})
        result = runner.invoke(main, ["seq", str(bad), "-o", str(tmp_path / "g.npz")])
        assert result.exit_code == 1 and f"{key} is there ({said}), and the TF block-LSTM ops have none" in \
            result.stderr, result.stderr
    assert not (tmp_path / "g.npz").exists()


# -- what a PyTorch module's user gets back and is told ------------------------------------------------------

def _torch_params(rng, layers, I, C, bias=0.0):  # noqa: E741
    params = {}
    for k in range(layers):
        params[f"weight_ih_l{k}"] = rng.normal(0, 0.6, (4 * C, I if k == 0 else C)).astype(np.float32)
        params[f"weight_hh_l{k}"] = rng.normal(0, 0.6, (4 * C, C)).astype(np.float32)
        params[f"bias_ih_l{k}"] = (rng.normal(0, 0.5, 4 * C) + bias).astype(np.float32)
        params[f"bias_hh_l{k}"] = (rng.normal(0, 0.5, 4 * C) + bias).astype(np.float32)
    return params


def test_a_modules_initial_state_gradients_have_the_shape_pytorch_keeps_them_in(runner, tmp_path):
    """h0_grad of a one-layer module without h0 is [1, B, C] as nn.LSTM's h0 is; of one layer picked, [B, C]."""
    rng = np.random.default_rng(5)
    T, B, I, C = 4, 3, 2, 5  # noqa: E741
    params = _torch_params(rng, 1, I, C)
    x, h_grad = rng.normal(size=(T, B, I)).astype(np.float32), rng.normal(size=(T, B, C)).astype(np.float32)
    module = lg.torch_lstm_grad(x, state_dict=params, h_grad=h_grad)
    layer = lg.torch_lstm_grad(x, params["weight_ih_l0"], params["weight_hh_l0"], params["bias_ih_l0"],
                               params["bias_hh_l0"], h_grad=h_grad)
    assert module["h0_grad"].shape == module["c0_grad"].shape == (1, B, C)
    assert layer.h0_grad.shape == (B, C)
    np.testing.assert_array_equal(module["h0_grad"][0], layer.h0_grad)
    np.testing.assert_array_equal(module["c0_grad"][0], layer.c0_grad)
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", {"x": x, "h_grad": h_grad, **params})),
                                  "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    with np.load(out) as g:
        np.testing.assert_array_equal(g["h0_grad"], module["h0_grad"])


@pytest.mark.parametrize("layers", [1, 2])
def test_a_stacked_modules_summary_says_dropout_is_not_computed(runner, tmp_path, layers):
    rng = np.random.default_rng(6)
    T, B, I, C = 3, 2, 2, 3  # noqa: E741
    tensors = {"x": rng.normal(size=(T, B, I)).astype(np.float32), "h_grad": np.ones((T, B, C), np.float32),
               **_torch_params(rng, layers, I, C)}
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.stderr
    said = "note: computed without dropout between layers, as the module runs in eval() mode or with dropout=0"
    assert (said in " ".join(result.stdout.split())) == (layers > 1), result.stdout


def test_a_wider_compute_dtype_recomputes_a_layers_forward_in_it(runner, tmp_path):
    """--compute-dtype float64 on a float32 nn.LSTM layer: its forward is recomputed in float64 too, so the result
    is the float64 gradient rounded once (gates near 1 make the float32 forward's rounding visible)."""
    rng = np.random.default_rng(7)
    T, B, I, C = 6, 3, 4, 5  # noqa: E741
    tensors = {"x": rng.normal(0, 2, size=(T, B, I)).astype(np.float32),
               "h_grad": rng.normal(size=(T, B, C)).astype(np.float32), **_torch_params(rng, 1, I, C, bias=5.0)}
    wide = lg.torch_lstm_grad(tensors["x"].astype(np.float64), state_dict={
        k: v.astype(np.float64) for k, v in tensors.items() if k.startswith(("weight", "bias"))},
        h_grad=tensors["h_grad"].astype(np.float64))
    source = write_npz(tmp_path / "in.npz", tensors)
    got = {}
    for dtype in ("float32", "float64"):
        out = tmp_path / f"{dtype}.npz"
        result = runner.invoke(main, ["seq", str(source), "--compute-dtype", dtype, "-o", str(out)])
        assert result.exit_code == 0, result.stderr
        with np.load(out) as g:
            got[dtype] = {k: g[k] for k in g.files if k.endswith("_grad")}
    for name, value in got["float64"].items():
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, wide[name].astype(np.float32), rtol=1e-6, atol=1e-7, err_msg=name)
    worst = max(np.abs(got["float32"][n] - wide[n]).max() / np.abs(wide[n]).max() for n in wide)
    assert worst > 1e-5  # the float32 forward's rounding, which the float64 run must not have


def test_the_python_api_says_where_a_models_state_dict_keeps_its_lstm(tmp_path):
    rng = np.random.default_rng(8)
    params = {f"encoder.rnn.{k}": v for k, v in _torch_params(rng, 1, 2, 3).items()}
    params["decoder.weight"] = np.ones((3, 3), np.float32)
    x, h_grad = np.ones((2, 1, 2), np.float32), np.ones((2, 1, 3), np.float32)
    with pytest.raises(lg.LstmGradError, match=r"keeps nn.LSTM modules at encoder\.rnn: give that module's "
                                               r"state_dict \(model\.encoder\.rnn\.state_dict\(\)\)"):
        lg.torch_lstm_grad(x, state_dict=params, h_grad=h_grad)
    cell = {"cell.weight_ih": np.ones((12, 2), np.float32), "cell.weight_hh": np.ones((12, 3), np.float32)}
    with pytest.raises(lg.LstmGradError, match="cell holds an nn.LSTMCell's weights"):
        lg.torch_lstm_grad(x, state_dict=cell, h_grad=h_grad)


def test_a_torch_tensor_numpy_cannot_hold_is_refused_by_its_dtype():
    class Bfloat16Tensor:  # what torch gives for a bfloat16 tensor: .numpy() raises TypeError
        dtype = "torch.bfloat16"

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            raise TypeError("Got unsupported ScalarType BFloat16")

    with pytest.raises(lg.LstmGradError, match=r"a torch tensor of torch\.bfloat16, which numpy has no dtype for"):
        lg.torch_lstm_grad(Bfloat16Tensor(), np.ones((8, 2)), np.ones((8, 2)), h_grad=np.ones((1, 1, 2)))


def test_a_weights_group_above_the_module_names_where_it_is(runner, tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(9)
    params = {f"encoder.rnn.{k}": v for k, v in _torch_params(rng, 1, 3, 4).items()}
    params["decoder.weight_ih_l0"], params["decoder.weight_hh_l0"] = np.ones((16, 4), np.float32), np.ones(
        (16, 4), np.float32)
    save_file(params, str(tmp_path / "w.safetensors"))
    step = write_npz(tmp_path / "step.npz", {"x": np.ones((5, 2, 3), np.float32),
                                              "h_grad": np.ones((5, 2, 4), np.float32)})
    result = runner.invoke(main, ["seq", str(step), "--weights", str(tmp_path / "w.safetensors"), "--weights-group",
                                  "encoder", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "(group encoder), which holds LSTM layers at encoder.rnn: name one with --weights-group" in \
        result.stderr and "cs_prev" not in result.stderr, result.stderr


def test_load_takes_the_request_a_command_line_gives(tmp_path):
    # lg.load built its own request from six arguments and could not take a PyTorch input's batch_first.
    path = FIXTURES / "torch" / "torch_batch_first.in.npz"
    with np.load(FIXTURES / "torch" / "torch_batch_first.expected.npz") as f:
        expected = {k: f[k] for k in f.files}
    plain = lg.load(path, batch_first=True)
    asked = lg.load(path, request=lg.Request(framework=lg.frameworks.FrameworkOptions(batch_first=True)))
    for inputs in (plain, asked):
        got = inputs.gradients()
        assert inputs.framework == "torch" and set(got) == set(expected)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    with pytest.raises(lg.InvalidArgumentError):  # batch-first tensors read as time-major do not fit
        lg.load(path).gradients()
    with pytest.raises(TypeError, match="unknown request field batchfirst; a request takes .*batch_first"):
        lg.load(path, batchfirst=True)
    with pytest.raises(TypeError, match="not both"):
        lg.load(path, request=lg.Request(), layout="ifco")
