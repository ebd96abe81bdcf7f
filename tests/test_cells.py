"""One step of a PyTorch nn.LSTMCell or a Keras LSTMCell (``lstmgrad cell``, ``torch_cell_grad``,
``keras_cell_grad``), against autograd and GradientTape on golden files the frameworks made
(fixtures/make_torch_fixtures.py, fixtures/keras_cell_cases.py): both output gradients or only one, with and
without a state, unbatched, weights in the input or in a state_dict / weights file below the cell's group."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, assert_same_gradients, write_npz
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main

TORCH = FIXTURES / "torch"
KERAS = FIXTURES / "keras"
TORCH_CELLS = {c["name"]: c for c in json.loads((TORCH / "manifest.json").read_text())
               if c.get("kind") == "lstmcell_step"}
KERAS_CELLS = {c["name"]: c for c in json.loads((KERAS / "manifest_cells.json").read_text())["cases"]}
DEFAULT_ACTIVATIONS = [n for n, c in KERAS_CELLS.items() if c["layer"]["activation"] == "tanh"]


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files if not k.startswith("__")}


def torch_args(case):
    args = ["--weights", str(TORCH / case["files"]["weights"])]
    return args + (["--weights-group", case["weights_prefix"].rstrip(".")] if case["weights_prefix"] else [])


def keras_args(case):
    if "weights" not in case["files"]:
        return []
    args = ["--weights", str(KERAS / case["files"]["weights"])]
    return args + (["--weights-group", case["weights_group"]] if case["weights_group"] != "cell" else [])


def test_the_cases_are_there():
    assert {c["output_grads"][0] for c in TORCH_CELLS.values() if len(c["output_grads"]) == 1} == {"h1_grad",
                                                                                                   "c1_grad"}
    assert {c["output_grads"][0] for c in KERAS_CELLS.values() if len(c["output_grads"]) == 1} == {"h1_grad",
                                                                                                   "c1_grad"}


@pytest.mark.parametrize("name", list(TORCH_CELLS))
def test_torch_cell_steps_match_autograd(runner, tmp_path, name):
    case = TORCH_CELLS[name]
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["cell", str(TORCH / case["files"]["in"]), *torch_args(case), "-o", str(out),
                                  "--json", "--strict"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["framework"] == "torch" and doc["module"].startswith("PyTorch nn.LSTMCell step")
    assert_same_gradients(npz(out), npz(TORCH / case["files"]["expected"]))


@pytest.mark.parametrize("name", DEFAULT_ACTIVATIONS)
def test_keras_cell_steps_match_gradient_tape(runner, tmp_path, name):
    case = KERAS_CELLS[name]
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["cell", str(KERAS / case["files"]["in"]), *keras_args(case), "-o", str(out),
                                  "--json", "--strict"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["framework"] == "keras" and doc["module"] == "Keras LSTMCell step"
    assert any("Keras' defaults assumed" in note for note in doc["notes"])
    assert_same_gradients(npz(out), npz(KERAS / case["files"]["expected"]))


@pytest.mark.parametrize("name", list(TORCH_CELLS))
def test_torch_cell_steps_from_python(name):
    from safetensors.numpy import load_file

    case = TORCH_CELLS[name]
    state = {k.removeprefix(case["weights_prefix"]): v
             for k, v in load_file(str(TORCH / case["files"]["weights"])).items()}
    inputs = npz(TORCH / case["files"]["in"])
    got = lg.torch_cell_grad(inputs.pop("x"), state_dict=state, **inputs)._asdict()
    assert_same_gradients({k: v for k, v in got.items() if v is not None}, npz(TORCH / case["files"]["expected"]))
    again = lg.torch_cell_grad(**npz(TORCH / case["files"]["in"]), **state)  # the weights by name
    for k, v in got.items():
        np.testing.assert_array_equal(getattr(again, k), v, err_msg=k)


@pytest.mark.parametrize("name", list(KERAS_CELLS))
def test_keras_cell_steps_from_python(name):
    case = KERAS_CELLS[name]
    inputs = npz(KERAS / case["files"]["in"])
    if "weights" in case["files"]:
        import h5py

        with h5py.File(KERAS / case["files"]["weights"]) as fh:
            group = fh[f"{case['weights_group']}/vars"]
            inputs.update(kernel=group["0"][()], recurrent_kernel=group["1"][()], bias=group["2"][()])
    layer = case["layer"]
    got = lg.keras_cell_grad(**inputs, activation=layer["activation"],
                             recurrent_activation=layer["recurrent_activation"])._asdict()
    assert_same_gradients({k: v for k, v in got.items() if v is not None}, npz(KERAS / case["files"]["expected"]))


def test_a_cell_made_with_other_activations_is_computed_with_them_only_when_told():
    case = KERAS_CELLS["keras_cell_relu"]
    inputs = npz(KERAS / case["files"]["in"])
    expected = npz(KERAS / case["files"]["expected"])
    told = lg.keras_cell_grad(**inputs, activation="relu", recurrent_activation="hard_sigmoid")
    assumed = lg.keras_cell_grad(**inputs)  # Keras' defaults: another cell's gradient
    np.testing.assert_allclose(told.kernel_grad, expected["kernel_grad"], rtol=1e-5, atol=1e-7)
    assert np.abs(assumed.kernel_grad - expected["kernel_grad"]).max() > 1e-2


def test_one_output_gradient_is_the_other_at_zero():
    case = TORCH_CELLS["torch_cell"]
    from safetensors.numpy import load_file

    state = {k.removeprefix("decoder.cell."): v for k, v in load_file(str(TORCH / case["files"]["weights"])).items()}
    inputs = npz(TORCH / case["files"]["in"])
    h_only = lg.torch_cell_grad(**{k: v for k, v in inputs.items() if k != "c1_grad"}, state_dict=state)
    zero_c = lg.torch_cell_grad(**{**inputs, "c1_grad": np.zeros_like(inputs["c1_grad"])}, state_dict=state)
    for k, v in h_only._asdict().items():
        np.testing.assert_array_equal(v, getattr(zero_c, k), err_msg=k)


def test_a_cell_step_in_one_file(runner, tmp_path):
    """The weights beside x in the input itself (a state_dict saved with the step's tensors)."""
    from safetensors.numpy import load_file

    case = TORCH_CELLS["torch_cell_h_only"]
    step = write_npz(tmp_path / "step.npz", {**npz(TORCH / case["files"]["in"]),
                                             **load_file(str(TORCH / case["files"]["weights"]))})
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["cell", str(step), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert_same_gradients(npz(out), npz(TORCH / case["files"]["expected"]))


def test_the_cell_command_in_a_real_subprocess(tmp_path):
    case = KERAS_CELLS["keras_cell_c_only"]
    out = tmp_path / "g.npz"
    proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "cell", str(KERAS / case["files"]["in"]),
                           *keras_args(case), "-o", str(out), "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert_same_gradients(npz(out), npz(KERAS / case["files"]["expected"]))


def test_inspect_says_what_a_cell_is_and_how_to_compute_it(runner):
    case = TORCH_CELLS["torch_cell"]
    text = " ".join(runner.invoke(main, ["inspect", str(TORCH / case["files"]["weights"])]).stdout.split())
    assert ("PyTorch nn.LSTMCell decoder.cell: weight_ih [16, 3], weight_hh [16, 4]: lstmgrad cell DATA --weights "
            f"{TORCH / case['files']['weights']} --weights-group decoder.cell (one step,") in text
    assert "0 errors" in text
    text = " ".join(runner.invoke(main, ["inspect", str(TORCH / "torch_lstmcell.weights.safetensors")]).stdout.split())
    assert "PyTorch nn.LSTMCell: weight_ih [16, 3]" in text and "0 errors" in text
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_cell_h_only.in.npz")])
    assert "fits: Keras LSTMCell step, computed as BlockLSTMGradV2" in " ".join(result.stdout.split())
    result = runner.invoke(main, ["inspect", str(TORCH / case["files"]["in"]), *torch_args(case), "--json"])
    doc = json.loads(result.stdout)["result"]
    assert doc["ok"] and doc["op"].startswith("PyTorch nn.LSTMCell step, computed as"), doc
    result = runner.invoke(main, ["inspect", str(TORCH / case["files"]["in"])])  # no weights
    assert "its weights are missing: an nn.LSTMCell's weight_ih, weight_hh" in " ".join(result.stdout.split())


def test_check_compares_a_cell_step_in_its_names(runner):
    case = KERAS_CELLS["keras_cell"]
    result = runner.invoke(main, ["check", str(KERAS / case["files"]["in"]), *keras_args(case), "-r",
                                  str(KERAS / case["files"]["expected"])])
    assert result.exit_code == 0 and "All 6 compared tensors agree" in result.stdout, result.output


def _renamed(old, new):
    return lambda t: {**{k: v for k, v in t.items() if k != old}, new: t[old]}


@pytest.mark.parametrize(("change", "said"), [
    (_renamed("h1_grad", "h_grad"), "h_grad is there, and one cell step (h1, c1 = cell(x, (h0, c0))) reads h1_grad: "
                                    "give the gradient arriving at the step's new h, or c as h1_grad"),
    (_renamed("c1_grad", "cn_grad"), "cn_grad is there, and one cell step"),
    (_renamed("h0", "h"), "h is there, and one cell step (h1, c1 = cell(x, (h0, c0))) reads h0: give the state the "
                          "step starts from; the ones it returns are not read as h0"),
    (lambda t: {**t, "lengths": np.array([1, 1, 1])}, "lengths is there, and one cell step has none"),
    (lambda t: {k: v for k, v in t.items() if k not in ("h1_grad", "c1_grad")}, "missing tensor h1_grad or c1_grad"),
    (lambda t: {**t, "x": t["x"][None]}, "x has shape [1, 3, 3], a sequence: a cell computes one step, x [B, I]; "
                                         "`lstmgrad seq` computes"),
    (lambda t: {**t, "h0": np.zeros((3, 5), np.float32)}, "h0 has shape [3, 5], expected [B, C] = [3, 4]"),
    (lambda t: {**t, "weight_hh": t["weight_hh"][:12]},
     "weight_hh has 12 gate units for 4 cell units, not 4 * 4: not an LSTM of PyTorch"),
    (lambda t: {k: v for k, v in t.items() if k != "bias_hh"}, "bias_ih and bias_hh come together"),
    (lambda t: {**t, "weight_ih_l0": t["weight_ih"]}, "weight_ih_l0, ... are an nn.LSTM's (a whole layer), not an "
                                                      "nn.LSTMCell's"),
])
def test_what_a_cell_step_does_not_read_is_refused_by_name(runner, tmp_path, change, said):
    from safetensors.numpy import load_file

    case = TORCH_CELLS["torch_cell"]
    weights = load_file(str(TORCH / case["files"]["weights"]))
    tensors = change({**npz(TORCH / case["files"]["in"]), **{k.removeprefix("decoder.cell."): v
                                                            for k, v in weights.items()}})
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["cell", str(write_npz(tmp_path / "step.npz", tensors)), "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and not out.exists(), result.output
    assert said in result.stderr, result.stderr


def test_a_weights_file_without_the_cells_group_says_where_the_cells_are(runner, tmp_path):
    case = TORCH_CELLS["torch_cell"]
    result = runner.invoke(main, ["cell", str(TORCH / case["files"]["in"]), "--weights",
                                  str(TORCH / case["files"]["weights"]), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1, result.output
    assert "which holds LSTM cell weights at decoder.cell: name one with --weights-group" in result.stderr
    case = KERAS_CELLS["keras_cell_c_only"]
    result = runner.invoke(main, ["cell", str(KERAS / case["files"]["in"]), "--weights",
                                  str(KERAS / case["files"]["weights"]), "-o", str(tmp_path / "g.npz")])
    assert "which holds LSTM cell weights at decoder_cell: name one with --weights-group" in result.stderr
    result = runner.invoke(main, ["cell", str(KERAS / case["files"]["in"]), "--weights",  # a .keras archive's cells
                                  str(KERAS / "keras_decoder_states.keras"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "which holds LSTM cell weights at layers/lstm/cell, layers/lstm_1/cell: name one with --weights-group" \
        in result.stderr, result.stderr
    result = runner.invoke(main, ["cell", str(KERAS / case["files"]["in"]), "-o", str(tmp_path / "g.npz")])
    assert "the tensors are a cell step's (x, h0, c0, h1_grad, c1_grad), and its weights are missing" in \
        result.stderr and "--weights FILE" in result.stderr


def test_seq_on_a_cell_says_cell_computes_it(runner, tmp_path):
    case = TORCH_CELLS["torch_cell"]
    result = runner.invoke(main, ["seq", str(TORCH / case["files"]["in"]), *torch_args(case),
                                  "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "`lstmgrad cell` computes one step of it" in result.stderr, result.output
    result = runner.invoke(main, ["seq", str(TORCH / case["files"]["in"]), "--weights",
                                  str(TORCH / case["files"]["weights"]), "-o", str(tmp_path / "g.npz")])
    assert "`lstmgrad cell` computes a step of it with --weights-group decoder.cell" in result.stderr, result.stderr
    case = KERAS_CELLS["keras_cell"]
    result = runner.invoke(main, ["seq", str(KERAS / case["files"]["in"]), *keras_args(case),
                                  "-o", str(tmp_path / "g.npz")])
    assert "x has shape [3, 3], one step [B, I]: a Keras LSTM layer takes a sequence" in result.stderr
    assert "`lstmgrad cell` computes one step of an LSTMCell" in result.stderr


def test_the_tf_cell_op_is_still_the_cell_commands(runner, tmp_path):
    """An LSTMBlockCell's tensors (TF's names) stay the op's, even beside a framework's names."""
    from conftest import load_case

    inputs, expected, _ = load_case("cell_peep")
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["cell", str(write_npz(tmp_path / "in.npz", {**inputs, "h0": inputs["h_prev"]})),
                                  "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["op"] == "LSTMBlockCellGrad"
    np.testing.assert_allclose(npz(out)["x_grad"], expected["x_grad"], rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(framework=st.sampled_from(["torch", "keras"]), B=st.integers(0, 3), I=st.integers(1, 3), C=st.integers(1, 3),
       unbatched=st.booleans(), given_=st.sets(st.sampled_from(["bias", "h0", "c0", "h1_grad", "c1_grad"])),
       mutate=st.sampled_from([None, "shape", "dtype", "nan", "drop"]), data=st.data())
def test_any_cell_step_computes_in_the_users_shapes_or_is_refused_by_name(framework, B, I, C, unbatched, given_,
                                                                          mutate, data):
    """Random steps, one tensor mutated (any shape, an integer dtype, NaN, left out): the gradients have the shapes
    of what they differentiate, or a one-line LstmGradError; never another exception."""
    rng = np.random.default_rng(B * 100 + I * 10 + C)
    unbatched = unbatched and framework == "torch"
    batch = () if unbatched else (B,)
    tensors = {"x": rng.normal(size=(*batch, I))}
    if framework == "torch":
        tensors.update(weight_ih=rng.normal(size=(4 * C, I)), weight_hh=rng.normal(size=(4 * C, C)))
        if "bias" in given_:
            tensors.update(bias_ih=rng.normal(size=4 * C), bias_hh=rng.normal(size=4 * C))
    else:
        tensors.update(kernel=rng.normal(size=(I, 4 * C)), recurrent_kernel=rng.normal(size=(C, 4 * C)))
        if "bias" in given_:
            tensors["bias"] = rng.normal(size=4 * C)
    for name in ("h0", "c0", "h1_grad", "c1_grad"):
        if name in given_:
            tensors[name] = rng.normal(size=(*batch, C))
    if mutate is not None:
        name = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
        if mutate == "shape":
            tensors[name] = np.zeros(data.draw(st.lists(st.integers(0, 5), max_size=4), label="shape"))
        elif mutate == "dtype":
            tensors[name] = tensors[name].astype(np.int64)
        elif mutate == "nan":
            tensors[name] = np.full_like(tensors[name], np.nan)
        else:
            del tensors[name]
    function = lg.torch_cell_grad if framework == "torch" else lg.keras_cell_grad
    try:
        grads = function(**tensors)
    except lg.LstmGradError as err:
        assert "\n" not in str(err) and str(err)
        event(f"refused ({mutate})")
        return
    except TypeError:  # a required argument left out: Python's own error for a call without it
        assert mutate == "drop"
        event("refused (drop)")
        return
    event(f"computed ({mutate})")
    assert grads.x_grad.shape == np.shape(tensors["x"])
    weights = ("weight_ih", "weight_hh") if framework == "torch" else ("kernel", "recurrent_kernel")
    for name in weights:
        assert getattr(grads, f"{name}_grad").shape == np.shape(tensors[name])
    cells = np.shape(tensors["weight_hh"])[1] if framework == "torch" else np.shape(tensors["recurrent_kernel"])[0]
    assert grads.h0_grad.shape == grads.c0_grad.shape == (*np.shape(tensors["x"])[:-1], cells)
