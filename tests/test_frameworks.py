"""Keras LSTM and PyTorch nn.LSTM tensors as users hold them, against the frameworks' own autodiff: Keras 3
under TF 2.21's GradientTape (fixtures/keras/, fixtures/make_keras_fixtures.py) and PyTorch 2.13's autograd
(fixtures/torch/, fixtures/make_torch_fixtures.py).  Also: activations recomputed when a TF-named input has
none, --weights from a second file, safetensors in and out."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from conftest import FIXTURES, load_case, write_npz

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main

KERAS = FIXTURES / "keras"
TORCH = FIXTURES / "torch"
KERAS_CASES = {c["name"]: c for c in json.loads((KERAS / "manifest.json").read_text())["cases"]}
TORCH_CASES = {c["name"]: c for c in json.loads((TORCH / "manifest.json").read_text())}


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files if not k.startswith("__")}


def read_out(path):
    if str(path).endswith(".safetensors"):
        from safetensors.numpy import load_file

        return load_file(str(path))
    return npz(path)


def assert_matches(got: dict, expected: dict):
    for name, want in expected.items():
        have = np.asarray(got[name], np.float64)
        assert have.shape == want.shape and got[name].dtype == want.dtype, name
        scale = float(np.max(np.abs(want), initial=0.0))
        err = float(np.max(np.abs(have - want), initial=0.0))
        assert err <= 1e-7 + 2e-6 * scale, f"{name}: {err:.3g} of {scale:.3g}"


def keras_args(name):
    args = []
    if name == "keras_two_layers":
        args = ["--weights", str(KERAS / "keras_two_layers.weights.h5"), "--weights-group", "layers/lstm_1"]
    return args


def torch_args(name):
    case = TORCH_CASES[name]
    args = ["--batch-first"] if case["batch_first"] else []
    if case["layer"]:
        args += ["--layer", str(case["layer"])]
    if case["reverse"]:
        args.append("--reverse")
    if name == "torch_prefixed":
        args += ["--weights", str(TORCH / "torch_prefixed.weights.safetensors"), "--weights-group", "encoder.rnn"]
    return args


@pytest.mark.parametrize("name", list(KERAS_CASES))
def test_keras_layers_match_gradient_tape(runner, tmp_path, name):
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / f"{name}.in.npz"), "-o", str(out), "--json", "--strict",
                                  *keras_args(name)])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["framework"] == "keras" and doc["op"] == "BlockLSTMGradV2"
    got = npz(out)
    expected = npz(KERAS / f"{name}.expected.npz")
    assert_matches(got, expected)
    has_bias = KERAS_CASES[name]["use_bias"]
    assert set(got) == {"x_grad", "kernel_grad", "recurrent_kernel_grad", "h0_grad", "c0_grad"} | (
        {"bias_grad"} if has_bias else set())


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_layers_match_autograd(runner, tmp_path, name):
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(TORCH / f"{name}.in.npz"), "-o", str(out), "--json", "--strict",
                                  *torch_args(name)])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["framework"] == "torch"
    got = npz(out)
    assert_matches(got, npz(TORCH / f"{name}.expected.npz"))
    if TORCH_CASES[name]["bias"]:
        sfx = next(k for k in got if k.startswith("bias_ih"))[len("bias_ih"):-len("_grad")]
        np.testing.assert_array_equal(got[f"bias_ih{sfx}_grad"], got[f"bias_hh{sfx}_grad"])


def test_the_summary_says_what_was_computed(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(KERAS / "keras_states.in.npz"), "-o", str(tmp_path / "g.npz")])
    text = " ".join(result.stdout.split())
    assert "Keras LSTM layer, computed as BlockLSTMGradV2 of the recomputed BlockLSTMV2" in text
    assert "activations recomputed: BlockLSTMV2 with forget_bias=0, cell_clip=0 (no clipping)" in text
    for name in ("x_grad", "kernel_grad", "recurrent_kernel_grad", "bias_grad", "h0_grad", "c0_grad"):
        assert name in result.stdout


def test_python_api_for_both_frameworks():
    inputs = npz(KERAS / "keras_states.in.npz")
    grads = lg.keras_lstm_grad(**inputs)
    assert type(grads).__name__ == "KerasLSTMGradOutputs"
    assert_matches(grads._asdict(), npz(KERAS / "keras_states.expected.npz"))
    inputs = npz(TORCH / "torch_bidir_l1_reverse.in.npz")
    args = {k.removesuffix("_l1_reverse"): v for k, v in inputs.items()}
    grads = lg.torch_lstm_grad(**args, reverse=True, backend="numba")._asdict()
    expected = {k.replace("_l1_reverse", ""): v for k, v in npz(TORCH / "torch_bidir_l1_reverse.expected.npz").items()}
    assert_matches(grads, expected)


def test_check_against_a_reference_in_the_frameworks_names(runner, tmp_path):
    result = runner.invoke(main, ["check", str(KERAS / "keras_seq.in.npz"), "-r",
                                  str(KERAS / "keras_seq.expected.npz")])
    assert result.exit_code == 0 and "All 4 compared tensors agree" in " ".join(result.stdout.split())
    wrong = npz(TORCH / "torch_seq.expected.npz")
    wrong["weight_hh_l0_grad"] = wrong["weight_hh_l0_grad"] * 1.01
    path = write_npz(tmp_path / "ref.npz", wrong)
    result = runner.invoke(main, ["check", str(TORCH / "torch_seq.in.npz"), "-r", str(path), "--json"])
    assert result.exit_code == 1
    failed = [c["name"] for c in json.loads(result.stdout)["result"]["comparisons"] if not c["passed"]]
    assert failed == ["weight_hh_l0_grad"]


def test_a_batch_shares_one_weights_file(runner, tmp_path):
    data = npz(TORCH / "torch_prefixed.in.npz")
    folder = tmp_path / "runs"
    folder.mkdir()
    write_npz(folder / "a.npz", data)
    write_npz(folder / "b.npz", {**data, "h_grad": 2 * data["h_grad"]})
    result = runner.invoke(main, ["seq", str(folder), "--weights", str(TORCH / "torch_prefixed.weights.safetensors"),
                                  "--weights-group", "encoder.rnn", "--json", "--backend", "numba"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["done"] == 2
    a, b = npz(folder / "a.grads.npz"), npz(folder / "b.grads.npz")
    assert_matches(a, npz(TORCH / "torch_prefixed.expected.npz"))
    np.testing.assert_allclose(b["weight_ih_l0_grad"], 2 * a["weight_ih_l0_grad"], rtol=1e-5, atol=1e-7)


def test_the_input_wins_over_the_weights_file_and_says_so(runner, tmp_path):
    inputs = npz(KERAS / "keras_seq.in.npz")
    weights = write_npz(tmp_path / "w.npz", {"kernel": inputs["kernel"] * 2, "bias": inputs["bias"]})
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_seq.in.npz"), "-o", str(out), "--weights", str(weights)])
    assert result.exit_code == 0, result.stderr
    assert "in both the input and" in result.stdout and "kernel, bias; the input's are used" in result.stdout
    assert_matches(npz(out), npz(KERAS / "keras_seq.expected.npz"))


def test_wrong_layer_and_direction_are_named(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(TORCH / "torch_bidir_l1_reverse.in.npz"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "missing tensors weight_ih_l0, weight_hh_l0" in result.stderr
    assert "the weights here are of _l1_reverse (--layer 1 --reverse)" in result.stderr


def test_other_kinds_of_rnn_are_refused(runner, tmp_path):
    inputs = npz(TORCH / "torch_seq.in.npz")
    projected = write_npz(tmp_path / "proj.npz", {**inputs, "weight_hr_l0": np.zeros((3, 4), np.float32)})
    result = runner.invoke(main, ["seq", str(projected), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "proj_size > 0" in result.stderr
    C = inputs["weight_hh_l0"].shape[1]
    gru = {**inputs, "weight_ih_l0": inputs["weight_ih_l0"][:3 * C], "weight_hh_l0": inputs["weight_hh_l0"][:3 * C]}
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "gru.npz", gru)), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1
    message = f"weight_hh_l0 has {3 * C} gate units for {C} cell units, not 4 * {C}: not an LSTM of PyTorch"
    assert message in result.stderr


def test_pytorch_pickles_are_refused_with_the_way_to_save_them(runner, tmp_path):
    zipped = tmp_path / "model.pt"  # torch.save's zip layout: archive/data.pkl and the storages
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"weight_ih_l0": [1.0]}))
        zf.writestr("archive/version", "3\n")
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps({"weight_ih_l0": [1.0]}, protocol=2))
    for path in (zipped, legacy):
        result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz")])
        assert result.exit_code == 1 and result.stderr.count("\n") == 1
        assert "lstmgrad never unpickles" in result.stderr
        assert "safetensors.torch.save_file(model.state_dict(), 'model.safetensors')" in result.stderr


def test_inspect_lists_the_lstm_layers_of_weights_files(runner):
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_two_layers.weights.h5"), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)["result"]
    assert doc["kind"] == "keras-weights"
    assert [(layer["group"], layer["name"], layer["kernel"], layer["units"]) for layer in doc["framework_layers"]] == [
        ("layers/lstm", "lstm", [3, 16], 4), ("layers/lstm_1", "lstm_1", [4, 12], 3)]
    text = runner.invoke(main, ["inspect", str(KERAS / "keras_two_layers.weights.h5")]).stdout
    assert "--weights-group layers/lstm_1" in text
    result = runner.invoke(main, ["inspect", str(TORCH / "torch_prefixed.weights.safetensors"), "--json"])
    doc = json.loads(result.stdout)["result"]
    assert result.exit_code == 0 and doc["kind"] == "torch-weights"
    assert doc["framework_layers"][0]["prefix"] == "encoder.rnn"


def test_safetensors_in_and_out(runner, tmp_path):
    from safetensors.numpy import save_file

    inputs = {k: np.ascontiguousarray(v) for k, v in load_case("seq_v1_peep")[0].items()}
    src = tmp_path / "in.safetensors"
    save_file(inputs, str(src))
    out = tmp_path / "g.safetensors"
    result = runner.invoke(main, ["seq", str(src), "-o", str(out), "--strict"])
    assert result.exit_code == 0, result.stderr
    assert_matches(read_out(out), load_case("seq_v1_peep")[1])
    assert lg.io.read_metadata(out)["op"] == "BlockLSTMGrad"
    assert runner.invoke(main, ["check", str(src), "-r", str(out)]).exit_code == 0
    default = runner.invoke(main, ["seq", str(src), "--json"])
    assert json.loads(default.stdout)["results"][0]["output"].endswith("in.grads.safetensors")


def test_activations_are_recomputed_when_the_input_has_none(runner, tmp_path):
    """TF's own inputs of a clipped BlockLSTM (V1) without its outputs: the forward op runs first, with the
    cell_clip given and BlockLSTM's forget_bias 1, and the gradient is TF's."""
    inputs = load_case("seq_v1_clip")[0]
    forward_only = {k: v for k, v in inputs.items() if k not in ("i", "cs", "f", "o", "ci", "co", "h")}
    src = write_npz(tmp_path / "run.npz", forward_only)
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(src), "-o", str(out), "--layout", "icfo", "--cell-clip", "0.5",
                                  "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["sources"]["activations"] == "recomputed" and doc["sources"]["forget_bias"] == "default"
    assert "activations recomputed: BlockLSTM with forget_bias=1, cell_clip=0.5" in doc["notes"][0]
    got, expected = npz(out), load_case("seq_v1_clip")[1]
    for name, want in expected.items():
        assert float(np.max(np.abs(got[name] - want))) <= 1e-5 * float(np.max(np.abs(want))), name
    cell = {k: v for k, v in load_case("cell_clip")[0].items() if k not in ("i", "cs", "f", "o", "ci", "co", "h")}
    result = runner.invoke(main, ["cell", str(write_npz(tmp_path / "cell.npz", cell)), "-o", str(tmp_path / "c.npz")])
    assert result.exit_code == 0, result.stderr  # LSTMBlockCell's defaults: forget_bias 1, cell_clip 3 (the case's)
    assert_matches(npz(tmp_path / "c.npz"), {k: v for k, v in load_case("cell_clip")[1].items()})


def test_some_activations_without_the_others_are_an_error(runner, tmp_path):
    inputs = {k: v for k, v in load_case("seq_v2_peep")[0].items() if k not in ("cs", "co")}
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "half.npz", inputs)), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1
    assert "missing tensors cs, co" in result.stderr and "of the forward outputs it has i, f, o, ci, h" in result.stderr
    assert "or none and lstmgrad recomputes them" in result.stderr


def test_a_real_subprocess_with_keras_weights(tmp_path):
    out = tmp_path / "g.npz"
    proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "seq", str(KERAS / "keras_two_layers.in.npz"), "-o",
                           str(out), "--weights", str(KERAS / "keras_two_layers.weights.h5"), "--weights-group",
                           "layers/lstm_1", "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    assert_matches(npz(out), npz(KERAS / "keras_two_layers.expected.npz"))


def test_keras_time_major_and_the_older_tf_keras_weights_layout(runner, tmp_path):
    import h5py

    inputs = npz(KERAS / "keras_seq.in.npz")
    time_major = {**inputs, "x": np.swapaxes(inputs["x"], 0, 1).copy(), "h_grad": np.swapaxes(inputs["h_grad"], 0, 1)}
    out = tmp_path / "tm.npz"
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "tm_in.npz", time_major)), "-o", str(out),
                                  "--time-major"])
    assert result.exit_code == 0, result.stderr
    expected = npz(KERAS / "keras_seq.expected.npz")
    assert_matches(npz(out), {**expected, "x_grad": np.swapaxes(expected["x_grad"], 0, 1)})
    legacy = tmp_path / "model.h5"  # tf.keras (Keras 2) HDF5: .../<layer>/lstm_cell/kernel:0
    with h5py.File(legacy, "w") as fh:
        group = fh.create_group("model_weights/lstm/lstm/lstm_cell")
        for name in ("kernel", "recurrent_kernel", "bias"):
            group[f"{name}:0"] = inputs[name]
    data = write_npz(tmp_path / "data.npz", {"x": inputs["x"], "h_grad": inputs["h_grad"]})
    result = runner.invoke(main, ["seq", str(data), "-o", str(tmp_path / "legacy.npz"), "--weights", str(legacy),
                                  "--weights-group", "model_weights/lstm/lstm"])
    assert result.exit_code == 0, result.stderr
    assert_matches(npz(tmp_path / "legacy.npz"), expected)
