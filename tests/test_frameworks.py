"""Keras LSTM and PyTorch nn.LSTM tensors as users hold them, against the frameworks' own autodiff: Keras 3
under TF 2.21's GradientTape (fixtures/keras/, fixtures/make_keras_fixtures.py) and PyTorch 2.13's autograd
(fixtures/torch/, fixtures/make_torch_fixtures.py).  Also: activations recomputed when a TF-named input has
none, --weights from a second file, safetensors in and out."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import zipfile

import h5py
import numpy as np
import pytest
from conftest import FIXTURES, load_case, write_npz

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main

KERAS = FIXTURES / "keras"
TORCH = FIXTURES / "torch"
KERAS_MANIFEST = json.loads((KERAS / "manifest.json").read_text())["cases"]
KERAS_CASES = {c["name"]: c for c in KERAS_MANIFEST if not c.get("needs")}  # layers as the first fixtures had them
TORCH_MANIFEST = json.loads((TORCH / "manifest.json").read_text())
TORCH_CASES = {c["name"]: c for c in TORCH_MANIFEST if "kind" not in c}  # one layer-direction each
TORCH_MODULES = {c["name"]: c for c in TORCH_MANIFEST if c.get("kind") == "module"}  # whole nn.LSTM modules


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
    case = KERAS_CASES[name]
    args = []
    if name == "keras_two_layers":
        args = ["--weights", str(KERAS / "keras_two_layers.weights.h5"), "--weights-group", "layers/lstm_1"]
    elif "weights" in case["files"]:
        args = ["--weights", str(KERAS / case["files"]["weights"]), "--weights-group", case["weights_group"]]
    if case.get("go_backwards"):
        args.append("--go-backwards")
    if name == "keras_bidirectional_backward":  # a Bidirectional's backward layer, h_grad in x's time order
        args.append("--reverse")
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


def module_args(case):
    args = ["--weights", str(TORCH / case["files"]["weights"])]
    if case["weights_prefix"]:
        args += ["--weights-group", case["weights_prefix"].rstrip(".")]
    return args + (["--batch-first"] if case["batch_first"] else [])


@pytest.mark.parametrize("name", list(TORCH_MODULES))
def test_whole_torch_modules_match_autograd(runner, tmp_path, name):
    """A state_dict of every layer and direction, x and the gradient at the module's output (and at h_n, c_n; per-
    example lengths of a packed batch): every gradient autograd gives, under the state_dict's names."""
    case = TORCH_MODULES[name]
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(TORCH / case["files"]["in"]), "-o", str(out), "--json", "--strict",
                                  *module_args(case)])
    assert result.exit_code == 0, result.stderr
    got, expected = npz(out), npz(TORCH / case["files"]["expected"])
    assert set(got) == set(expected)
    assert_matches(got, expected)


def test_a_whole_module_from_python():
    case = TORCH_MODULES["torch_packed_bidir2_bf"]
    from safetensors.numpy import load_file

    state = {k.removeprefix(case["weights_prefix"]): v
             for k, v in load_file(str(TORCH / case["files"]["weights"])).items()}
    inputs = npz(TORCH / case["files"]["in"])
    got = lg.torch_lstm_grad(inputs.pop("x"), state_dict=state, batch_first=True, **inputs)
    assert_matches(got, npz(TORCH / case["files"]["expected"]))


def test_an_lstmcell_state_dict_is_named_for_what_it_is(runner, tmp_path):
    data = npz(TORCH / "torch_seq.in.npz")
    step = write_npz(tmp_path / "step.npz", {"x": data["x"], "h_grad": data["h_grad"]})
    result = runner.invoke(main, ["seq", str(step), "--weights", str(TORCH / "torch_lstmcell.weights.safetensors"),
                                  "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "weight_ih and weight_hh without a layer suffix are an nn.LSTMCell's" in result.stderr
    assert "missing tensors cs_prev" not in result.stderr


@pytest.mark.parametrize(("group", "flags", "said"), [
    ("layers/bidirectional/backward_layer", [], None),  # the group's name says it: computed as --reverse
    ("layers/bidirectional/backward_layer", ["--reverse"], None),
    ("layers/bidirectional/forward_layer", ["--reverse"], "--reverse is a Bidirectional's backward layer, and"),
    ("layers/bidirectional/backward_layer", ["--go-backwards"], "not a go_backwards layer"),
])
def test_a_bidirectionals_layers_are_computed_as_their_group_names_say(runner, tmp_path, group, flags, said):
    case = "keras_bidirectional_backward" if "backward" in group else "keras_bidirectional_forward"
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / f"{case}.in.npz"), "--weights",
                                  str(KERAS / "keras_bidirectional.weights.h5"), "--weights-group", group,
                                  "-o", str(out), "--json", *flags])
    if said is None:
        assert result.exit_code == 0, result.stderr
        assert_matches(npz(out), npz(KERAS / f"{case}.expected.npz"))
        if not flags:
            assert any("backward layer" in n for n in json.loads(result.stdout)["results"][0]["notes"])
    else:
        assert result.exit_code == 1 and said in result.stderr and not out.exists(), result.output


def test_one_layer_of_a_whole_module_with_layer(runner, tmp_path):
    """--layer K: that layer alone, from its own input and its output's gradient; the module's are named as such."""
    case = TORCH_MODULES["torch_module_bidir2"]
    base = ["seq", str(TORCH / case["files"]["in"]), *module_args(case), "-o", str(tmp_path / "g.npz")]
    result = runner.invoke(main, [*base, "--layer", "1"])
    assert result.exit_code == 1, result.output
    assert "with --layer 1, x is that layer's own input (the output of the layer below, 8 wide)" in result.stderr
    result = runner.invoke(main, [*base, "--layer", "0"])  # layer 0 reads x, but h_grad is the top's two directions
    assert result.exit_code == 1, result.output
    assert ("its last axis is 2C, the whole bidirectional output's gradient: without --layer and --reverse lstmgrad "
            "computes the whole module from it") in result.stderr


KERAS_OPTIONS = {c["name"]: c for c in KERAS_MANIFEST if c.get("needs") and "refusal" not in c["needs"]
                 and "mixed_precision" not in c["needs"]}  # (float16 arithmetic: test_keras_recorded.py)
KERAS_REFUSALS = {c["name"]: c for c in KERAS_MANIFEST if "refusal" in c.get("needs", ()) and c["files"].get("in")}
KERAS2_CASES = {c["name"]: c for c in json.loads((KERAS / "manifest_keras2.json").read_text())["cases"]}


def keras_model_args(case):
    files = case["files"]
    if files.get("model"):  # a .keras archive or full-model .h5: it says how the layer was made
        return ["--weights", str(KERAS / files["model"]), "--weights-group", case["weights_group"]]
    wrapped = "bidirectional" in (case.get("weights_group") or "")  # (its group's name says how it runs)
    args = ["--go-backwards"] if case.get("go_backwards") and not wrapped else []  # bare tensors: the user says it
    return args + (["--weights", str(KERAS / files["weights"]), "--weights-group", case["weights_group"]]
                   if files.get("weights") else [])


@pytest.mark.parametrize("name", [*KERAS_OPTIONS, *KERAS2_CASES])
def test_keras_layers_with_their_options_match_gradient_tape(runner, tmp_path, name):
    """Masks (Embedding(mask_zero=True), Masking, mask=), layer options read from a .keras archive or a full-model
    .h5 (Keras 3's and tf_keras' hard_sigmoid, relu, linear, use_bias=False), whole Bidirectional wrappers with each
    merge mode, Keras' own bidirectional_test input: what GradientTape gives, under Keras' names."""
    case = KERAS_OPTIONS.get(name) or KERAS2_CASES[name]
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / case["files"]["in"]), "-o", str(out), "--json", "--strict",
                                  *keras_model_args(case)])
    assert result.exit_code == 0, result.stderr
    got, expected = npz(out), npz(KERAS / case["files"]["expected"])
    assert set(expected) <= set(got), (set(got), set(expected))
    assert_matches({k: got[k] for k in expected}, expected)


@pytest.mark.parametrize(("weights", "flags", "said"), [
    ("keras_dropout.keras", [], "layer 'lstm' has dropout=0.2: in training its random masks change the gradient"),
    ("keras_unknown_activation.keras", [], "activation 'selu' is not implemented (lstmgrad computes tanh"),
    ("keras_stacked_cells.weights.h5", ["--weights-group", "layers/rnn"],
     "layers/rnn is a keras.layers.RNN over StackedRNNCells: lstmgrad computes LSTM layers, not cells"),
    ("keras_stacked_cells.weights.h5", [], "holds the LSTM cells of a keras.layers.RNN over StackedRNNCells"),
])
def test_keras_layers_lstmgrad_cannot_compute_are_refused_by_name(runner, tmp_path, weights, flags, said):
    group = ["--weights-group", "layers/lstm"] if weights.endswith(".keras") else []
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_dropout.in.npz"), "--weights", str(KERAS / weights),
                                  *group, *flags, "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert said in result.stderr and "missing tensors" not in result.stderr and not out.exists()


def test_a_layer_with_dropout_is_computed_when_the_gradient_was_taken_in_inference(runner, tmp_path):
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_dropout.in.npz"), "--weights",
                                  str(KERAS / "keras_dropout.keras"), "--weights-group", "layers/lstm", "--inference",
                                  "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    notes = json.loads(result.stdout)["results"][0]["notes"]
    assert any("dropout=0.2 taken as inactive (--inference)" in n for n in notes), notes
    inputs = npz(KERAS / "keras_dropout.in.npz")  # dropout inactive: the maths of the layer without it
    want = lg.keras_lstm_grad(inputs["x"], *_weights_in_archive("keras_dropout.keras"), h_grad=inputs["h_grad"])
    np.testing.assert_allclose(npz(out)["x_grad"], want.x_grad, rtol=1e-6, atol=1e-7)


def _weights_in_archive(name):
    """kernel, recurrent_kernel, bias of the archive's layers/lstm, read with h5py from the zip itself."""
    with zipfile.ZipFile(KERAS / name) as zf, h5py.File(io.BytesIO(zf.read("model.weights.h5"))) as fh:
        return [fh[f"layers/lstm/cell/vars/{k}"][()] for k in range(3)]


def test_a_bare_weights_file_says_what_was_assumed(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(KERAS / "keras_two_layers.in.npz"), "--weights",
                                  str(KERAS / "keras_two_layers.weights.h5"), "--weights-group", "layers/lstm_1",
                                  "-q", "-o", str(tmp_path / "g.npz"), "--json"])
    notes = json.loads(result.stdout)["results"][0]["notes"]
    assert any("Keras' defaults assumed, activation=tanh, recurrent_activation=sigmoid, no mask unless given" in n
               for n in notes), notes


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


def test_python_api_for_layers_that_run_backwards():
    inputs = npz(KERAS / "keras_go_backwards.in.npz")
    assert_matches(lg.keras_lstm_grad(**inputs, go_backwards=True)._asdict(),
                   npz(KERAS / "keras_go_backwards.expected.npz"))
    weights = {}
    with h5py.File(KERAS / "keras_bidirectional.weights.h5", "r") as f:
        for k, name in enumerate(("kernel", "recurrent_kernel", "bias")):
            weights[name] = f[f"layers/bidirectional/backward_layer/cell/vars/{k}"][()]
    inputs = npz(KERAS / "keras_bidirectional_backward.in.npz")
    assert_matches(lg.keras_lstm_grad(**inputs, **weights, reverse=True)._asdict(),
                   npz(KERAS / "keras_bidirectional_backward.expected.npz"))
    inputs = npz(TORCH / "torch_bidir_last_reverse.in.npz")
    args = {k.removesuffix("_l0_reverse"): v for k, v in inputs.items()}
    grads = lg.torch_lstm_grad(**args, batch_first=True, reverse=True)._asdict()
    expected = npz(TORCH / "torch_bidir_last_reverse.expected.npz")
    assert_matches(grads, {k.replace("_l0_reverse", ""): v for k, v in expected.items()})


def test_only_the_final_states_gradients(runner, tmp_path):
    """``_, (h_n, c_n) = lstm(x)``: the output is unused, so there is no h_grad, only hn_grad and cn_grad."""
    inputs = npz(TORCH / "torch_states.in.npz")
    zero_output = dict(inputs, h_grad=np.zeros_like(inputs["h_grad"]))
    without = {k: v for k, v in inputs.items() if k != "h_grad"}
    args = {k.removesuffix("_l0"): v for k, v in without.items()}
    np.testing.assert_array_equal(lg.torch_lstm_grad(**args).x_grad,
                                  lg.torch_lstm_grad(**dict(args, h_grad=zero_output["h_grad"])).x_grad)
    np.savez(tmp_path / "states.npz", **without)
    result = runner.invoke(main, ["seq", str(tmp_path / "states.npz"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.output
    del without["hn_grad"], without["cn_grad"]
    np.savez(tmp_path / "nothing.npz", **without)
    result = runner.invoke(main, ["seq", str(tmp_path / "nothing.npz"), "-o", str(tmp_path / "h.npz")])
    assert result.exit_code == 1 and "missing tensor h_grad" in result.stderr and "hn_grad, cn_grad" in result.stderr


@pytest.mark.parametrize(("name", "flags", "said"), [
    ("keras_seq", ["--batch-first"], "--batch-first is for a PyTorch nn.LSTM's tensors"),
    ("keras_seq", ["--layer", "1"], "--layer is for a PyTorch nn.LSTM's tensors"),
    ("torch_seq", ["--time-major"], "--time-major is for a Keras LSTM layer's tensors"),
    ("torch_seq", ["--go-backwards"], "--go-backwards is for a Keras LSTM layer's tensors"),
    ("keras_seq", ["--reverse", "--go-backwards"], "--reverse and --go-backwards do not go together"),
])
def test_options_for_another_frameworks_tensors_are_refused(runner, tmp_path, name, flags, said):
    folder = KERAS if name.startswith("keras") else TORCH
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(folder / f"{name}.in.npz"), "-o", str(out), *flags])
    assert result.exit_code == 1, result.output
    assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_options_for_layers_are_refused_for_the_ops_own_tensors(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz"),
                                  "--reverse"])
    assert result.exit_code == 1
    assert "--reverse is for a Keras LSTM layer's and a PyTorch nn.LSTM's tensors, and this input holds the TF " \
           "op's own" in result.stderr


def test_shapes_are_said_in_the_frameworks_layout(runner, tmp_path):
    inputs = npz(KERAS / "keras_seq.in.npz")  # x [B=3, T=5, I=4], h_grad [3, 5, 3]
    bad = tmp_path / "bad.npz"
    np.savez(bad, **dict(inputs, h_grad=np.zeros((3, 4, 3), np.float32)))
    result = runner.invoke(main, ["seq", str(bad), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1
    assert "h_grad has shape [3, 4, 3], expected [B, T, C] = [3, 5, 3]" in result.stderr


@pytest.mark.parametrize(("folder", "name", "flags"), [
    (KERAS, "keras_seq", []),  # batch-first x, B != T
    (TORCH, "torch_bidir_last_reverse", ["--batch-first", "--reverse"]),
])
def test_gradcheck_of_a_frameworks_layer(runner, folder, name, flags):
    result = runner.invoke(main, ["check", str(folder / f"{name}.in.npz"), "-r", str(folder / f"{name}.expected.npz"),
                                  "--gradcheck", "--json", *flags])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    assert doc["gradcheck"]["ok"]
    stored = doc["gradcheck"]["stored_vs_recomputed"]
    assert set(stored) >= {"x_grad", "w_grad", "b_grad"} and max(stored.values()) < 1e-5, stored


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


@pytest.mark.parametrize(("name", "said"), [
    ("keras_bidir_sum.keras", "Keras Bidirectional 'bidirectional' at layers/bidirectional: kernel [2, 12], "
                              "recurrent_kernel [3, 12], bias [12] (input size 2, 3 units, each direction); "
                              "activation=tanh, "
                              "recurrent_activation=sigmoid, go_backwards=False, return_sequences=True, "
                              "merge_mode=sum: lstmgrad seq DATA --weights"),
    ("keras2_hard_sigmoid.h5", "recurrent_activation=hard_sigmoid_keras2"),
    ("keras_stacked_cells.weights.h5", "an LSTMCell of a StackedRNNCells at layers/rnn/cell/cells/lstm_cell: not a "
                                       "layer lstmgrad computes"),
])
def test_inspect_says_what_each_layer_of_a_model_file_was_made_with(runner, name, said):
    result = runner.invoke(main, ["inspect", str(KERAS / name)])
    assert result.exit_code == 0, result.output
    assert said in " ".join(result.stdout.split())


def test_inspect_counts_a_layer_seq_refuses_as_an_error(runner):
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_dropout.keras")])
    assert result.exit_code == 1, result.output
    text = " ".join(result.stdout.split())
    assert ("error: layers/lstm: layer 'lstm' has dropout=0.2: in training its random masks change the gradient, "
            "and lstmgrad cannot know them; if the gradient was taken in inference (training=False, where dropout "
            "does nothing), say so with --inference") in text
    assert text.endswith("1 error, 0 warnings")
    allowed = runner.invoke(main, ["inspect", str(KERAS / "keras_dropout.keras"), "--inference"])
    assert allowed.exit_code == 0 and "DATA holds x [B, T, 3], h_grad [B, T, 2]" in " ".join(allowed.stdout.split())


def test_inspect_lists_a_whole_nn_lstm_first(runner):
    result = runner.invoke(main, ["inspect", str(TORCH / "torch_module_bidir2.weights.safetensors")])
    assert result.exit_code == 0, result.output
    assert ("PyTorch nn.LSTM encoder.rnn: 2 layers, bidirectional: lstmgrad seq DATA --weights "
            f"{TORCH / 'torch_module_bidir2.weights.safetensors'} --weights-group encoder.rnn (the whole module; "
            "--layer for one layer)") in " ".join(result.stdout.split())


def test_inspect_finds_lstm_layers_inside_wrappers_and_older_files(runner, tmp_path):
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_bidirectional.weights.h5"), "--json"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.stdout)["result"]["framework_layers"]
    assert [(layer["group"], layer["units"], layer.get("bidirectional")) for layer in layers] == [
        ("layers/bidirectional", 3, True), ("layers/bidirectional/backward_layer", 3, None),
        ("layers/bidirectional/forward_layer", 3, None)]
    text = " ".join(runner.invoke(main, ["inspect", str(KERAS / "keras_bidirectional.weights.h5")]).stdout.split())
    assert "Keras Bidirectional 'bidirectional' at layers/bidirectional:" in text  # the wrapper, and each layer
    assert "options not recorded: Keras' defaults assumed: lstmgrad seq DATA --weights" in text
    assert "--weights-group layers/bidirectional/backward_layer" in text
    legacy = tmp_path / "legacy.h5"  # how an older tf.keras model.save("m.h5") keeps a nested layer's weights
    with h5py.File(legacy, "w") as f:
        cell = f.create_group("model_weights/lstm/sequential/lstm/lstm_cell")
        cell["kernel:0"], cell["recurrent_kernel:0"] = np.zeros((3, 8), "f4"), np.zeros((2, 8), "f4")
        f.create_group("model_weights/gru/gru/gru_cell")["kernel:0"] = np.zeros((3, 6), "f4")
    result = runner.invoke(main, ["inspect", str(legacy), "--json"])
    layers = json.loads(result.stdout)["result"]["framework_layers"]
    assert [(layer["group"], layer["kernel"], layer["bias"]) for layer in layers] == [
        ("model_weights/lstm/sequential/lstm", [3, 8], None)]


@pytest.mark.parametrize(("data", "weights", "groups"), [
    (KERAS / "keras_two_layers.in.npz", KERAS / "keras_two_layers.weights.h5", "layers/lstm, layers/lstm_1"),
    (TORCH / "torch_prefixed.in.npz", TORCH / "torch_prefixed.weights.safetensors", "encoder.rnn"),
])
def test_a_weights_file_without_its_group_says_where_the_layers_are(runner, tmp_path, data, weights, groups):
    result = runner.invoke(main, ["seq", str(data), "--weights", str(weights), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"nothing was read from {weights}, which holds LSTM layers at {groups}: name one with --weights-group" \
        in result.stderr


def _archive(path, config, weights=KERAS / "keras_two_layers.weights.h5"):
    """A .keras archive as model.save writes it: metadata.json first, config.json, model.weights.h5."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
        zf.writestr("config.json", json.dumps(config))
        zf.write(weights, "model.weights.h5")
    return path


def _sequential(*lstm_configs):
    layers = [{"class_name": "InputLayer", "config": {"name": "input_layer"}}]
    layers += [{"class_name": "LSTM", "config": {"name": f"lstm{i}", **c}} for i, c in enumerate(lstm_configs)]
    return {"class_name": "Sequential", "config": {"name": "sequential", "layers": layers}}


def test_a_keras_model_archive_is_read_with_its_configuration(runner, tmp_path):
    """The weights inside a .keras archive, at the group Keras 3 names after the layer's class (a Sequential's
    input layer left out), with the options its config.json records; equal to the bare weights file's run."""
    archive = _archive(tmp_path / "m.keras", _sequential({"return_sequences": True}, {"return_sequences": True}))
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_two_layers.in.npz"), "--weights", str(archive),
                                  "--weights-group", "layers/lstm_1", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    assert_matches(npz(out), npz(KERAS / "keras_two_layers.expected.npz"))
    notes = json.loads(result.stdout)["results"][0]["notes"]
    assert any("layer options from m.keras config.json: activation=tanh, recurrent_activation=sigmoid" in n
               for n in notes), notes


@pytest.mark.parametrize(("config", "said"), [
    ({}, "the model configuration has no LSTM layer at 'layers/lstm_1' (its LSTM layers' groups: none)"),
    (_sequential({}, {"activation": "selu"}), "activation 'selu' is not implemented (lstmgrad computes tanh"),
    (_sequential({}, {"dropout": 0.25}), "layer 'lstm1' has dropout=0.25: in training its random masks change"),
    (_sequential({}, {"return_sequences": False}), "the layer was made with return_sequences=False"),
    # activation=lambda x: ...: Keras 3 keeps its bytecode, which was read as no activation (linear) once
    (_sequential({}, {"activation": {"value": ["4wEAAAAAAAAAAAAAAAMAAAAD", None, None]}}),
     "activation is a Python lambda or function saved by its code, not by a name"),
])
def test_a_keras_archive_whose_layer_cannot_be_computed_is_refused_by_name(runner, tmp_path, config, said):
    archive = _archive(tmp_path / "m.keras", config)
    result = runner.invoke(main, ["seq", str(KERAS / "keras_two_layers.in.npz"), "--weights", str(archive),
                                  "--weights-group", "layers/lstm_1", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert said in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "g.npz").exists()


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


def test_check_compares_a_whole_module_and_says_what_needs_one_op(runner, tmp_path):
    case = TORCH_MODULES["torch_module_bidir2"]
    args = [str(TORCH / case["files"]["in"]), *module_args(case)]
    result = runner.invoke(main, ["check", *args, "-r", str(TORCH / case["files"]["expected"]), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    assert doc["passed"] and len(doc["comparisons"]) == len(npz(TORCH / case["files"]["expected"]))
    for command in (["check", *args, "--gradcheck"], ["seq", *args, "--per-step", "-o", str(tmp_path / "g.npz")]):
        result = runner.invoke(main, command)
        assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
        assert "several layers or directions: give --layer (and --reverse) for one of them" in result.stderr


def test_check_of_a_whole_module_that_differs_says_what_it_is_and_tried(runner, tmp_path):
    """A module's reference that differs: the head names the module (not the op it is computed with), and the
    explanation says no cause was tried (it said the shapes differ, which they do not)."""
    case = TORCH_MODULES["torch_module_bidir2"]
    reference = npz(TORCH / case["files"]["expected"])
    reference["weight_hh_l1_reverse_grad"] = reference["weight_hh_l1_reverse_grad"] * 1.5
    path = write_npz(tmp_path / "ref.npz", reference)
    result = runner.invoke(main, ["check", str(TORCH / case["files"]["in"]), *module_args(case), "-r", str(path)])
    assert result.exit_code == 1, result.output
    text = " ".join(result.stdout.split())
    assert "PyTorch nn.LSTM, 2 layers, bidirectional, computed as BlockLSTMGradV2" in text, text
    assert "No known cause was tried: the known causes are variants of one op's computation, and this is PyTorch " \
           "nn.LSTM, 2 layers, bidirectional." in text and "do not have this input's shapes" not in text, text


def test_a_whole_bidirectional_from_python():
    case = next(c for c in KERAS_MANIFEST if c["name"] == "keras_bidir_mul")
    with zipfile.ZipFile(KERAS / case["files"]["model"]) as zf, \
            h5py.File(io.BytesIO(zf.read("model.weights.h5"))) as fh:
        weights = {f"{d}_{name}": fh[f"layers/bidirectional/{d}_layer/cell/vars/{k}"][()]
                   for d in ("forward", "backward") for k, name in enumerate(("kernel", "recurrent_kernel", "bias"))}
    inputs = npz(KERAS / case["files"]["in"])
    got = lg.keras_lstm_grad(inputs["x"], weights=weights, merge_mode="mul", h_grad=inputs["h_grad"])
    assert_matches(got, npz(KERAS / case["files"]["expected"]))


@pytest.mark.parametrize(("folder", "name", "flags", "batch_major"), [
    (KERAS, "keras_seq", [], True),  # Keras: x [B, T, I] unless time_major
    (TORCH, "torch_seq", [], False),  # PyTorch: x [T, B, I] unless batch_first
])
def test_check_labels_a_difference_in_the_layout_the_input_gave(runner, tmp_path, folder, name, flags, batch_major):
    """check reported a batch-first Keras x_grad's worst element as [t=2, b=3, ...] where it is [b=2, t=3, ...],
    and the first failing step from the batch axis."""
    reference = npz(folder / f"{name}.expected.npz")
    x_grad = reference["x_grad"].copy()
    T = npz(folder / f"{name}.in.npz")["x"].shape[1 if batch_major else 0]
    where = (1, T - 2, 0) if batch_major else (T - 2, 1, 0)  # batch row 1, step T - 2
    x_grad[where] += 1.0
    path = write_npz(tmp_path / "ref.npz", {**reference, "x_grad": x_grad})
    result = runner.invoke(main, ["check", str(folder / f"{name}.in.npz"), "-r", str(path), "--json", *flags])
    assert result.exit_code == 1, result.output
    (c,) = [c for c in json.loads(result.stdout)["result"]["comparisons"] if not c["passed"]]
    assert c["name"] == "x_grad" and c["axes"] == (["b", "t", "i"] if batch_major else ["t", "b", "i"])
    assert c["worst_index"] == list(where) and c["first_bad_step"] == T - 2
    text = " ".join(runner.invoke(main, ["check", str(folder / f"{name}.in.npz"), "-r", str(path), *flags]).stdout
                    .split())
    labelled = f"b=1, t={T - 2}, i=0" if batch_major else f"t={T - 2}, b=1, i=0"
    assert f"the worst at [{labelled}]" in text and f"the first failing time step is t={T - 2}" in text


def test_the_python_api_names_its_own_parameters():
    """The same refusal names flags on the command line and keyword arguments in Python (issue 33)."""
    inputs = npz(KERAS / "keras_seq.in.npz")
    with pytest.raises(lg.LstmGradError) as err:
        lg.keras_lstm_grad(inputs["x"], inputs["kernel"], inputs["recurrent_kernel"], h_grad=inputs["h_grad"],
                           reverse=True, go_backwards=True)
    assert "the reverse argument and the go_backwards argument do not go together" in str(err.value)
    state = {"weight_ih_l1_reverse": np.ones((8, 4), np.float32), "weight_hh_l1_reverse": np.ones((8, 2), np.float32)}
    with pytest.raises(lg.LstmGradError) as err:
        lg.torch_lstm_grad(np.ones((3, 2, 4), np.float32), state_dict=state, h_grad=np.ones((3, 2, 2), np.float32))
    assert "_l1_reverse (layer=1 reverse=True)" in str(err.value) and "--" not in str(err.value)


def test_inspect_checks_a_step_file_with_its_model(runner):
    """inspect --weights reads the two as seq does: what it would compute, or why it would refuse (exit 1)."""
    case = TORCH_MODULES["torch_packed_bidir2_bf"]
    result = runner.invoke(main, ["inspect", str(TORCH / case["files"]["in"]), *module_args(case), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    assert doc["kind"] == "torch" and doc["op"].startswith("PyTorch nn.LSTM, 2 layers, bidirectional, per-example")
    assert doc["dims"] == {"T": 5, "B": 4, "I": 4, "C": 3} and doc["ok"]
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_dropout.in.npz"), "--weights",
                                  str(KERAS / "keras_dropout.keras"), "--weights-group", "layers/lstm"])
    assert result.exit_code == 1
    assert "dropout=0.2" in result.stdout and "say so with --inference" in " ".join(result.stdout.split())
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_dropout.in.npz"), "--weights",
                                  str(KERAS / "keras_dropout.keras"), "--weights-group", "layers/lstm", "--inference"])
    assert result.exit_code == 0, result.output


def test_a_keras_archive_whose_weights_start_where_hdf5_is_looked_for_is_still_an_archive(runner, tmp_path):
    """Keras stores model.weights.h5 uncompressed: when its bytes start at 4096 (a config.json of the right length,
    which Keras itself writes) the zip also bears HDF5's signature at an offset HDF5 looks at. It was read as a bare
    weights file, its recorded activation=relu ignored: every gradient ~100% off, exit 0."""
    with zipfile.ZipFile(KERAS / "keras_relu.keras") as zf:
        members = {name: zf.read(name) for name in ("metadata.json", "config.json", "model.weights.h5")}
    before = 30 + len("metadata.json") + len(members["metadata.json"]) + 30 + len("config.json") + len(
        members["config.json"]) + 30 + len("model.weights.h5")
    members["config.json"] += b" " * (4096 - before)  # (JSON allows trailing spaces; Keras loads it unchanged)
    padded = tmp_path / "m.keras"
    with zipfile.ZipFile(padded, "w", zipfile.ZIP_STORED) as out:
        for name, data in members.items():
            out.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data)
    with open(padded, "rb") as fh:
        fh.seek(4096)
        assert fh.read(8) == b"\x89HDF\r\n\x1a\n"
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_relu.in.npz"), "--weights", str(padded),
                                  "--weights-group", "layers/lstm", "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert_matches(npz(out), npz(KERAS / "keras_relu.expected.npz"))


def test_a_bidirectionals_backward_layer_zeroes_masked_outputs_as_keras_sets_it():
    """A Bidirectional returning sequences gives both its layers zero_output_for_mask=True: reverse=True (its backward
    layer) says so, as the group name backward_layer does (it was taken as False: the gradient ~100% off with a mask
    that has holes)."""
    rng = np.random.default_rng(11)
    B, T, I, C = 2, 5, 3, 2  # noqa: E741
    x, h_grad = rng.normal(size=(B, T, I)), rng.normal(size=(B, T, C))
    kernel, recurrent, bias = rng.normal(size=(I, 4 * C)), rng.normal(size=(C, 4 * C)), rng.normal(size=4 * C)
    mask = np.array([[0, 0, 1, 1, 1], [1, 0, 1, 1, 0]], bool)
    implied = lg.keras_lstm_grad(x, kernel, recurrent, bias, h_grad=h_grad, mask=mask, reverse=True)
    said = lg.keras_lstm_grad(x, kernel, recurrent, bias, h_grad=h_grad, mask=mask, reverse=True,
                              zero_output_for_mask=True)
    carried = lg.keras_lstm_grad(x, kernel, recurrent, bias, h_grad=h_grad, mask=mask, reverse=True,
                                 zero_output_for_mask=False)
    np.testing.assert_array_equal(implied.kernel_grad, said.kernel_grad)
    assert not np.allclose(implied.kernel_grad, carried.kernel_grad)


def test_a_whole_bidirectional_of_a_full_model_h5_file(runner, tmp_path):
    """model.save("m.h5") keeps a Bidirectional's layers under their own names (forward_lstm_1/, backward_lstm_1/ for a
    second one): the wrapper's group is computed whole, with what its model_config records."""
    case = next(c for c in KERAS_MANIFEST if c["name"] == "keras_bidir_concat")
    with zipfile.ZipFile(KERAS / case["files"]["model"]) as zf:
        config = json.loads(zf.read("config.json"))
        with h5py.File(io.BytesIO(zf.read("model.weights.h5"))) as fh:
            weights = {d: [fh[f"layers/bidirectional/{d}_layer/cell/vars/{k}"][()] for k in range(3)]
                       for d in ("forward", "backward")}
    wrapper = next(layer for layer in config["config"]["layers"] if layer["class_name"] == "Bidirectional")
    wrapper["config"]["name"] = "bidirectional_1"
    legacy = tmp_path / "m.h5"
    with h5py.File(legacy, "w") as fh:
        fh.attrs["model_config"] = json.dumps(config)
        fh.attrs["keras_version"] = "3.15.1"
        for d, values in weights.items():
            cell = fh.create_group(f"model_weights/bidirectional_1/bidirectional_1/{d}_lstm_1/lstm_cell")
            for name, value in zip(("kernel", "recurrent_kernel", "bias"), values, strict=True):
                cell[name] = value
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / case["files"]["in"]), "--weights", str(legacy),
                                  "--weights-group", "model_weights/bidirectional_1/bidirectional_1", "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert_matches(npz(out), npz(KERAS / case["files"]["expected"]))


@pytest.mark.parametrize(("layer", "said"), [
    ({"class_name": "GRU", "config": {"name": "gru"}}, "layers/gru is a GRU layer, not an LSTM"),
    ({"class_name": "RNN", "config": {"name": "rnn", "cell": {"class_name": "StackedRNNCells", "config": {}}}},
     "layers/rnn is a keras.layers.RNN over StackedRNNCells"),
])
def test_recurrent_layers_that_are_not_lstms_are_named_from_an_archive(runner, tmp_path, layer, said):
    config = {"class_name": "Sequential", "config": {"layers": [layer]}}
    weights = tmp_path / "w.h5"
    group = f"layers/{'gru' if 'GRU' in said else 'rnn'}"
    with h5py.File(weights, "w") as fh:  # a GRU's weights: 3 gates (the RNN's group too: its weights are no matter)
        cell = fh.create_group(f"{group}/cell/vars")
        cell["0"], cell["1"], cell["2"] = np.ones((3, 6), "f4"), np.ones((2, 6), "f4"), np.ones(6, "f4")
    archive = _archive(tmp_path / "m.keras", config, weights)
    for flags in ([], ["--weights-group", group]):
        result = runner.invoke(main, ["seq", str(KERAS / "keras_relu.in.npz"), "--weights", str(archive), *flags,
                                      "-o", str(tmp_path / "g.npz")])
        assert result.exit_code == 1 and said in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert "missing tensors" not in result.stderr


def test_an_rnn_over_one_lstmcell_is_an_lstm_layer(runner, tmp_path):
    """keras.layers.RNN(LSTMCell(...)) keeps its weights where an LSTM does, and computes what the cell was made
    with (the cell's activation, the RNN's return_sequences)."""
    relu = json.loads(zipfile.ZipFile(KERAS / "keras_relu.keras").read("config.json"))
    lstm = next(layer for layer in relu["config"]["layers"] if layer["class_name"] == "LSTM")
    cell_options = {k: lstm["config"][k] for k in ("units", "activation", "recurrent_activation", "use_bias")}
    rnn = {"class_name": "RNN", "config": {"name": "rnn", "return_sequences": True,
                                           "cell": {"class_name": "LSTMCell", "config": cell_options}}}
    weights = tmp_path / "w.h5"
    with zipfile.ZipFile(KERAS / "keras_relu.keras") as zf:
        weights.write_bytes(zf.read("model.weights.h5"))
    archive = _archive(tmp_path / "m.keras", {"class_name": "Sequential", "config": {"layers": [rnn]}}, weights)
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_relu.in.npz"), "--weights", str(archive),
                                  "--weights-group", "layers/lstm", "-o", str(out)])
    assert result.exit_code == 1 and "no LSTM layer at 'layers/lstm' (its LSTM layers' groups: layers/rnn)" in \
        result.stderr  # (the RNN's group is layers/rnn: a weights file of its own has its weights there)
    with h5py.File(weights, "a") as fh:
        fh.move("layers/lstm", "layers/rnn")
    archive = _archive(tmp_path / "m2.keras", {"class_name": "Sequential", "config": {"layers": [rnn]}}, weights)
    result = runner.invoke(main, ["seq", str(KERAS / "keras_relu.in.npz"), "--weights", str(archive),
                                  "--weights-group", "layers/rnn", "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert_matches(npz(out), npz(KERAS / "keras_relu.expected.npz"))


def test_an_lstmcell_or_gru_in_a_state_dict_is_named(runner, tmp_path):
    from safetensors.numpy import save_file

    step = write_npz(tmp_path / "step.npz", {"x": np.ones((4, 2, 3), np.float32),
                                             "h_grad": np.ones((4, 2, 2), np.float32)})
    save_file({"cell.weight_ih": np.ones((8, 3), np.float32), "cell.weight_hh": np.ones((8, 2), np.float32)},
              str(tmp_path / "cell.safetensors"))
    result = runner.invoke(main, ["seq", str(step), "--weights", str(tmp_path / "cell.safetensors"), "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "cell holds an nn.LSTMCell's weights" in result.stderr, result.stderr
    save_file({"rnn.weight_ih_l0": np.ones((6, 3), np.float32), "rnn.weight_hh_l0": np.ones((6, 2), np.float32)},
              str(tmp_path / "gru.safetensors"))
    result = runner.invoke(main, ["inspect", str(tmp_path / "gru.safetensors")])
    assert "weight_hh_l0 has shape [6, 2], 3 gates: not an nn.LSTM" in " ".join(result.stdout.split())
    result = runner.invoke(main, ["seq", str(step), "--weights", str(tmp_path / "gru.safetensors"),
                                  "--weights-group", "rnn", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "a GRU has 3 gates" in result.stderr, result.stderr


@pytest.mark.parametrize(("path", "weights", "group"), [
    (KERAS / "keras_mask_holes_states.in.npz", None, None),  # a masked layer with states: not the op's x, h0, c0
    (KERAS / "keras_relu.in.npz", KERAS / "keras_relu.keras", "layers/lstm"),  # activations the op has not
])
def test_load_of_a_keras_layer_gives_its_gradients_in_keras_names(runner, tmp_path, path, weights, group):
    """lg.load(...).gradients() of a Keras layer is the layer's gradients, as seq writes them (it gave the op's
    gradients of the recomputed problem, or a TypeError for a layer the op does not compute)."""
    inputs = lg.load(path, weights=weights, weights_group=group)
    assert inputs.framework == "keras"
    out = tmp_path / "g.npz"
    extra = [] if weights is None else ["--weights", str(weights), "--weights-group", group]
    result = runner.invoke(main, ["seq", str(path), *extra, "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    written = npz(out)
    got = inputs.gradients()
    assert set(got) == set(written)
    for name, value in got.items():
        np.testing.assert_array_equal(value, written[name], err_msg=name)
    expected = npz(path.with_name(path.name.replace(".in.npz", ".expected.npz")))
    assert_matches(got, expected)


def test_a_stateful_layer_without_its_initial_states_is_a_warning(runner, tmp_path):
    """stateful=True: the states a batch starts from are the previous batch's; without h0 and c0 they are zeros,
    right for a first batch only.  Said on stderr (with -q too), and an error under --strict."""
    archive = _archive(tmp_path / "m.keras", _sequential({"return_sequences": True},
                                                         {"return_sequences": True, "stateful": True}))
    args = ["seq", str(KERAS / "keras_two_layers.in.npz"), "--weights", str(archive), "--weights-group",
            "layers/lstm_1", "-q"]
    result = runner.invoke(main, [*args, "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.stderr
    assert "Warning:" in result.stderr and "the layer was made with stateful=True" in result.stderr, result.stderr
    result = runner.invoke(main, [*args, "--strict", "-o", str(tmp_path / "strict.npz")])
    assert result.exit_code == 1 and "stateful=True" in result.stderr and not (tmp_path / "strict.npz").exists()


def test_reverse_on_a_bidirectionals_forward_layer_in_an_archive_is_refused(runner, tmp_path):
    """The archive says forward_layer runs forwards: --reverse on it was computed as a backward layer."""
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / "keras_bidir_concat.in.npz"), "--weights",
                                  str(KERAS / "keras_bidir_concat.keras"), "--weights-group",
                                  "layers/bidirectional/forward_layer", "--reverse", "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "--reverse says the layer is a Bidirectional's backward layer, and it is a Bidirectional's forward layer" \
        in result.stderr and not out.exists()


@pytest.mark.parametrize(("name", "said"), [
    ("keras_lambda_activation", "activation is a Python lambda or function saved by its code, not by a name"),
    ("keras_bidir_fwd_go_backwards", "wraps a layer made with go_backwards=True (its backward layer runs forwards"),
])
def test_keras_made_archives_lstmgrad_cannot_compute_are_refused_by_name(runner, tmp_path, name, said):
    """Archives Keras itself wrote: a lambda activation (read as linear once) and a Bidirectional wrapping a
    go_backwards layer (computed as the usual arrangement once)."""
    case = KERAS_REFUSALS[name]
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(KERAS / case["files"]["in"]), *keras_model_args(case), "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert said in result.stderr and not out.exists(), result.stderr
    result = runner.invoke(main, ["inspect", str(KERAS / case["files"]["in"]), *keras_model_args(case)])
    assert result.exit_code == 1 and said in " ".join(result.stdout.split()), result.output


def test_a_keras_made_stateful_layers_second_batch_without_its_states_is_a_warning(runner, tmp_path):
    case = KERAS_REFUSALS["keras_stateful_nostates"]
    args = ["seq", str(KERAS / case["files"]["in"]), *keras_model_args(case)]
    result = runner.invoke(main, [*args, "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0 and "the layer was made with stateful=True" in result.stderr, result.output
    result = runner.invoke(main, [*args, "--strict", "-o", str(tmp_path / "strict.npz")])
    assert result.exit_code == 1 and not (tmp_path / "strict.npz").exists()
