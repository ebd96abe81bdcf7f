"""PyTorch nn.LSTM features beyond the op's maths, against autograd on golden files torch made
(fixtures/torch/, fixtures/make_torch_fixtures.py): ``proj_size`` (h projected by ``weight_hr_l{K}``), unbatched
input (x [T, I]), and the words a refusal uses for the layout the user has (batch-first, bidirectional,
unbatched), with the flag that would fix a shape error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES, assert_same_gradients, write_npz
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main

TORCH = FIXTURES / "torch"
CASES = {c["name"]: c for c in json.loads((TORCH / "manifest.json").read_text())}
PROJECTED = [n for n, c in CASES.items() if c.get("proj_size")]
UNBATCHED = [n for n, c in CASES.items() if c.get("unbatched") and c.get("kind") == "module"]


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files if not k.startswith("__")}


def state_dict(case):
    from safetensors.numpy import load_file

    weights = load_file(str(TORCH / case["files"]["weights"]))
    return {k.removeprefix(case["weights_prefix"]): v for k, v in weights.items()}


def seq_args(case):
    args = ["--weights", str(TORCH / case["files"]["weights"])]
    if case["weights_prefix"]:
        args += ["--weights-group", case["weights_prefix"].rstrip(".")]
    return args + (["--batch-first"] if case["batch_first"] else [])


def test_the_new_cases_are_there():
    assert len(PROJECTED) >= 3 and len(UNBATCHED) >= 2


@pytest.mark.parametrize("name", PROJECTED + [n for n in UNBATCHED if n not in PROJECTED])
def test_projected_and_unbatched_modules_match_autograd_from_python(name):
    case = CASES[name]
    inputs = npz(TORCH / case["files"]["in"])
    got = lg.torch_lstm_grad(inputs.pop("x"), state_dict=state_dict(case), batch_first=case["batch_first"], **inputs)
    assert_same_gradients(got, npz(TORCH / case["files"]["expected"]))


def test_a_projected_modules_summary_says_what_it_computed(runner, tmp_path):
    case = CASES["torch_proj_bidir2_packed_bf"]
    result = runner.invoke(main, ["seq", str(TORCH / case["files"]["in"]), *seq_args(case), "-o",
                                  str(tmp_path / "g.npz"), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["module"] == "PyTorch nn.LSTM, 2 layers, bidirectional, proj_size=2, per-example lengths"
    assert doc["computed_as"] == "the LSTM recurrence with its projection of h, recomputed and differentiated " \
        "by lstmgrad's layer engine (numpy; cupy on a GPU backend)"
    assert {"weight_hr_l0_grad", "weight_hr_l1_reverse_grad"} <= {t["name"] for t in doc["tensors"]}


def test_an_unbatched_input_says_batch_first_does_not_apply(runner, tmp_path):
    case = CASES["torch_unbatched_proj_bidir2_last"]
    assert case["batch_first"]  # the module was made with batch_first=True, which nn.LSTM ignores here
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(TORCH / case["files"]["in"]), *seq_args(case), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert "x is unbatched [T, I]: --batch-first does not apply to it" in " ".join(result.stdout.split())
    assert_same_gradients(npz(out), npz(TORCH / case["files"]["expected"]))


def test_one_projected_layer_with_layer_and_reverse(runner, tmp_path):
    """--layer 1 --reverse of a projected module: its own input (the layer below's two projections, 2P wide), its
    own output's gradient [T, B, P], its states [B, P] and [B, C]; the same weight gradients as the whole module
    where only that direction's output has a gradient."""
    case = CASES["torch_proj_stacked_nobias"]
    params = state_dict(case)
    rng = np.random.default_rng(3)
    T, B, P, C = 4, 2, 3, 4
    x, h_grad = rng.normal(size=(T, B, P)).astype(np.float32), rng.normal(size=(T, B, P)).astype(np.float32)
    h0, c0 = rng.normal(size=(B, P)).astype(np.float32), rng.normal(size=(B, C)).astype(np.float32)
    one = {k.replace("_l1", "_l0"): v for k, v in params.items() if k.endswith("_l1")}
    alone = lg.torch_lstm_grad(x, state_dict=one, h_grad=h_grad, h0=h0[None], c0=c0[None])
    step = write_npz(tmp_path / "step.npz", {"x": x, "h_grad": h_grad, "h0": h0, "c0": c0, **params})
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(step), "--layer", "1", "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    got = npz(out)
    assert got["h0_grad"].shape == (B, P) and got["c0_grad"].shape == (B, C)
    for name in ("weight_ih", "weight_hh", "weight_hr"):
        np.testing.assert_allclose(got[f"{name}_l1_grad"], alone[f"{name}_l0_grad"], rtol=1e-6, atol=1e-7)


def test_inspect_describes_a_projected_state_dict(runner):
    result = runner.invoke(main, ["inspect", str(TORCH / "torch_proj_bidir2_packed_bf.weights.safetensors")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "PyTorch nn.LSTM encoder.rnn: 2 layers, bidirectional, proj_size=2: lstmgrad seq DATA" in text
    assert "gates" not in text and "0 errors, 0 warnings" in text


@pytest.mark.parametrize(("change", "said"), [
    ({"weight_hr_l0": np.zeros((3, 5), np.float32)},  # proj_size 3, but weight_hh_l0 is [20, 2]
     "weight_hh_l0 has shape [20, 2] and weight_hr_l0 [3, 5]: with proj_size P = 3 and hidden_size C = 5, "
     "weight_hh_l0 is [4C, P] = [20, 3]"),
    ({"weight_hr_l0": np.zeros((2, 5, 1), np.float32)}, "weight_hr_l0 must be rank 2 [P, C]"),
    ({"weight_hr_l0": None}, "weight_hh_l0 has 20 gate units for 2 cell units"),  # no LSTM's without weight_hr
    ({"h0": np.zeros((1, 3, 5), np.float32)}, "h0 has shape [1, 3, 5], expected [1, B, P] or [B, P] = [1, 3, 2]"),
])
def test_a_projection_that_does_not_fit_is_refused_by_name(runner, tmp_path, change, said):
    case = CASES["torch_proj"]
    tensors = {**npz(TORCH / case["files"]["in"]), **state_dict(case), **change}
    tensors = {k: v for k, v in tensors.items() if v is not None}
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and not out.exists(), result.output
    assert said in result.stderr, result.stderr


def test_a_projection_in_some_layers_only_is_refused(tmp_path):
    params = state_dict(CASES["torch_proj_stacked_nobias"])
    del params["weight_hr_l1"]
    with pytest.raises(lg.LstmGradError, match="weight_hr_l0 is there and weight_hr_l1 is not"):
        lg.torch_lstm_grad(np.ones((3, 2, 4), np.float32), state_dict=params, h_grad=np.ones((3, 2, 3), np.float32))


@pytest.mark.parametrize(("change", "said"), [
    ({"lengths": np.array([5])}, "lengths is there, and x is unbatched [T, I] (one example, [5, 3])"),
    ({"h0": np.zeros((1, 1, 4), np.float32)},
     "h0 has shape [1, 1, 4], expected [1, C] or [C] = [1, 4] for unbatched x [T, I]"),
    ({"h_grad": np.zeros((5, 1, 4), np.float32)}, "h_grad must be rank 2 [T, C] or [C]"),
    ({"h_grad": np.zeros((5, 3), np.float32)}, "h_grad has shape [5, 3], expected [T, C] = [5, 4]"),
    ({"h_grad": np.zeros(3, np.float32)}, "h_grad has shape [3], expected [C] = [4]"),
])
def test_unbatched_shapes_are_said_unbatched(runner, tmp_path, change, said):
    case = CASES["torch_unbatched"]
    tensors = {**npz(TORCH / case["files"]["in"]), **change}
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "--weights",
                                  str(TORCH / case["files"]["weights"]), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert said in result.stderr, result.stderr


def test_a_batch_first_file_without_the_flag_is_told_the_flag(runner, tmp_path):
    case = CASES["torch_packed_bidir2_bf"]  # x [B=4, T=5, I]: read time-major, B would be 5
    base = ["seq", str(TORCH / case["files"]["in"]), "--weights", str(TORCH / case["files"]["weights"]),
            "-o", str(tmp_path / "g.npz")]
    result = runner.invoke(main, base)
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert ("lengths has shape [4], expected [B] = [5] (each example's number of steps); with --batch-first (x "
            "batch-first, [B, T, I]: [4, 5, ...], as nn.LSTM(batch_first=True) takes it) the shapes fit") in \
        result.stderr
    inputs = npz(TORCH / case["files"]["in"])
    last = write_npz(tmp_path / "last.npz", {"x": inputs["x"], "h_grad": inputs["h_grad"][:, -1]})
    result = runner.invoke(main, ["seq", str(last), *base[2:]])
    assert "h_grad has shape [4, 6], expected [B, 2*C] = [5, 6]; with --batch-first" in result.stderr, result.stderr
    time_major = write_npz(tmp_path / "tm.npz", {k: np.swapaxes(v, 0, 1) if k in ("x", "h_grad") else v
                                                  for k, v in inputs.items()})
    result = runner.invoke(main, ["seq", str(time_major), *base[2:], "--batch-first"])
    assert "; without --batch-first (x time-major, [T, B, I]: [5, 4, ...]) the shapes fit" in result.stderr, \
        result.stderr


def test_a_shape_error_no_layout_fixes_has_no_hint(runner, tmp_path):
    inputs = npz(TORCH / "torch_packed_bidir2_bf.in.npz")
    bad = write_npz(tmp_path / "bad.npz", {**inputs, "h_grad": inputs["h_grad"][..., :5]})
    weights = TORCH / "torch_packed_bidir2_bf.weights.safetensors"
    result = runner.invoke(main, ["seq", str(bad), "--weights", str(weights), "--batch-first", "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "h_grad has shape [4, 5, 5], expected [B, T, 2*C] = [4, 5, 6]" in result.stderr
    assert "the shapes fit" not in result.stderr


def test_refusals_speak_in_the_users_layout(runner, tmp_path):
    """A batch-first bidirectional module's last-step refusal names out[:, -1] and [B, 2*C], not out[-1] and
    [B, C]; an unbatched one's out[-1] and [2*C]."""
    case = CASES["torch_packed_bidir2_bf"]
    inputs = npz(TORCH / case["files"]["in"])
    last = write_npz(tmp_path / "last.npz", {**inputs, "h_grad": inputs["h_grad"][:, -1]})
    result = runner.invoke(main, ["seq", str(last), "--weights", str(TORCH / case["files"]["weights"]),
                                  "--batch-first", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1, result.output
    assert ("h_grad is [B, 2*C], the gradient at out[:, -1]; with lengths, out[:, -1] is padding for every shorter "
            "example") in result.stderr
    case = CASES["torch_unbatched_proj_bidir2_last"]
    inputs = npz(TORCH / case["files"]["in"])
    wrong = write_npz(tmp_path / "wrong.npz", {**inputs, "h_grad": inputs["h_grad"][:2]})
    result = runner.invoke(main, ["seq", str(wrong), "--weights", str(TORCH / case["files"]["weights"]),
                                  "-o", str(tmp_path / "g.npz")])
    assert "h_grad has shape [2], expected [2*P] = [4]; its last axis is P, one direction's" in result.stderr, \
        result.stderr


def test_check_labels_an_unbatched_modules_axes(runner, tmp_path):
    """x_grad of an unbatched input is [T, I]: a difference is placed at its time step, not read as a batch."""
    case = CASES["torch_unbatched"]
    reference = npz(TORCH / case["files"]["expected"])
    reference["x_grad"] = reference["x_grad"].copy()
    reference["x_grad"][3] += 1
    result = runner.invoke(main, ["check", str(TORCH / case["files"]["in"]), "--weights",
                                  str(TORCH / case["files"]["weights"]), "-r",
                                  str(write_npz(tmp_path / "ref.npz", reference))])
    assert result.exit_code == 1, result.output
    assert "the worst at [t=3, i=0]" in result.stdout and "the first failing time step is t=3" in result.stdout


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 2), D=st.integers(1, 2), T=st.integers(0, 3), B=st.integers(0, 2), C=st.integers(1, 3),
       P=st.sampled_from([0, 1, 2]), unbatched=st.booleans(), last=st.booleans(),
       mutate=st.sampled_from([None, "shape", "dtype", "drop", "stray"]), data=st.data())
def test_any_projected_or_unbatched_module_computes_in_the_users_shapes_or_is_refused(layers, D, T, B, C, P,
                                                                                      unbatched, last, mutate, data):
    """Random state_dicts with weight_hr (proj_size P) or without, unbatched or batched x, one tensor mutated (any
    shape, an integer dtype, left out, a stray weight_hr_l{K}): every gradient has the shape of what it
    differentiates, or a one-line LstmGradError; never another exception."""
    rng = np.random.default_rng(layers * 1000 + D * 100 + T * 10 + C)
    H = P or C
    batch = () if unbatched else (B,)
    params = {}
    for k in range(layers):
        for d in range(D):
            s = f"_l{k}" + ("_reverse" if d else "")
            params["weight_ih" + s] = rng.normal(size=(4 * C, 2 if k == 0 else D * H))
            params["weight_hh" + s] = rng.normal(size=(4 * C, H))
            params["bias_ih" + s] = params["bias_hh" + s] = rng.normal(size=4 * C)
            if P:
                params["weight_hr" + s] = rng.normal(size=(P, C))
    state = {"x": rng.normal(size=(T, *batch, 2)), "h0": rng.normal(size=(layers * D, *batch, H)),
             "c0": rng.normal(size=(layers * D, *batch, C)),
             "h_grad": rng.normal(size=(*batch, D * H) if last else (T, *batch, D * H))}
    if mutate is not None:
        name = data.draw(st.sampled_from(sorted([*params, *state])), label="tensor")
        where = params if name in params else state
        if mutate == "shape":
            where[name] = np.zeros(data.draw(st.lists(st.integers(0, 5), max_size=4), label="shape"))
        elif mutate == "dtype":
            where[name] = where[name].astype(np.int64)
        elif mutate == "drop":
            del where[name]
        else:
            params[f"weight_hr_l{data.draw(st.integers(0, 3), label='layer')}"] = np.ones((1, C))
    try:
        grads = lg.torch_lstm_grad(state.pop("x", None), state_dict=params, **state)
    except lg.LstmGradError as err:
        assert "\n" not in str(err) and str(err)
        event(f"refused ({mutate})")
        return
    event(f"computed ({mutate})")
    for name, value in params.items():
        assert grads[f"{name}_grad"].shape == value.shape, name
    for name in ("x", "h0", "c0"):
        if name in state or name == "x":
            assert grads[f"{name}_grad"].shape == (state.get(name) if name != "x" else grads["x_grad"]).shape
    assert all(np.isfinite(v).all() for v in grads.values())


def test_a_keras_layers_time_major_flag_is_told_the_same_way(runner, tmp_path):
    """The hint is the frameworks' one: a Keras layer's --time-major (x [T, B, I]) that its shapes contradict."""
    keras = FIXTURES / "keras"
    result = runner.invoke(main, ["seq", str(keras / "keras_states.in.npz"), "--time-major", "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert ("hn_grad has shape [2, 4], expected [B, C] = [5, 4]; without --time-major (x batch-first, [B, T, I]: "
            "[2, 5, ...]) the shapes fit") in result.stderr
