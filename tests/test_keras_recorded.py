"""What a Keras model records reaches its LSTM layer besides x (a mask, initial states, a dtype policy), honoured or
refused by name; what the user names, checked (every tensor of a framework input used or reported); and the
friction of model files (one LSTM needs no group, a layer's own name is its group, inspect says what seq needs).
Golden files: fixtures/keras_recorded_cases.py and make_keras2_fixtures.py, made by Keras 3 / tf_keras under
TF 2.21 (the gradients GradientTape gives with the model's own mask and states)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import FIXTURES, write_h5, write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main
from lstmgrad_cli.frameworks import keras_masks

KERAS = FIXTURES / "keras"
TORCH = FIXTURES / "torch"
CASES = {c["name"]: c for c in json.loads((KERAS / "manifest.json").read_text())["cases"]}
CASES.update({c["name"]: c for c in json.loads((KERAS / "manifest_keras2.json").read_text())["cases"]})
RECORDED = [n for n, c in CASES.items() if {"initial_state", "mixed_precision"} & set(c.get("needs", ()))
            or (c["files"].get("model") and "mask" in c.get("needs", ()))]


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files if not k.startswith("__")}


def seq(runner, data, weights, *flags, out):
    return runner.invoke(main, ["seq", str(KERAS / data), "--weights", str(KERAS / weights), "-o", str(out), "--json",
                                *flags])


def assert_close(got: dict, expected: dict, rtol=2e-6):
    for name, want in expected.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        scale = float(np.max(np.abs(want), initial=0.0))
        err = float(np.max(np.abs(got[name].astype(np.float64) - want), initial=0.0))
        assert err <= 1e-7 + rtol * scale, f"{name}: {err:.3g} of {scale:.3g}"


def test_the_golden_files_cover_every_feature():
    needs = {n for name in RECORDED for n in CASES[name]["needs"]}
    assert {"mask", "initial_state", "mixed_precision", "refusal", "legacy_h5", "bidirectional_wrapper"} <= needs
    assert len([n for n in RECORDED if "refusal" in CASES[n]["needs"]]) >= 5


# -- what the model records, honoured ------------------------------------------------------------------------

COMPUTED = [n for n in RECORDED if "refusal" not in CASES[n]["needs"] and "mixed_precision" not in CASES[n]["needs"]]


@pytest.mark.parametrize("name", COMPUTED)
def test_a_model_files_mask_and_states_give_what_gradient_tape_gives(runner, tmp_path, name):
    """The mask the model computes (given, or a Masking layer's from x), a nested model's LSTM, a mask model input,
    a masked Bidirectional with merge_mode=None, a decoder's initial states: GradientTape's gradients, --strict."""
    case = CASES[name]
    group = ["--weights-group", case["weights_group"]]
    result = seq(runner, case["files"]["in"], case["files"]["model"], *group, "--strict", out=tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    expected = npz(KERAS / case["files"]["expected"])
    assert_close({k: v for k, v in npz(tmp_path / "g.npz").items() if k in expected}, expected)


@pytest.mark.parametrize(("name", "said"), [
    ("keras_embedding_mask_nomask", "the model masks this layer's input (emb, mask_zero=True): save the mask as "
                                    "`mask` [B, T] beside x (True where a step is used)"),
    ("keras_masking_value_nomask", "the model masks this layer's input (pad, Masking(mask_value=-1)): save the mask "
                                   "as `mask` [B, T] beside x (True where a step is used); x has steps of zeros, "
                                   "which Masking makes of the steps it masks"),
    ("keras_mask_input_nomask", "the model masks this layer's input (a mask the model takes as its input 'valid')"),
    ("keras_embedding_mask_misnamed", "save the mask as `mask` [B, T] beside x (True where a step is used); "
                                      "input_mask is there, not used: did you mean mask?; seq_lens is there, not "
                                      "used: did you mean mask? a Keras LSTM layer takes a mask [B, T], True where a "
                                      "step is used: np.arange(T) < seq_lens[:, None] for a post-padded batch"),
    ("keras_decoder_states_nostates", "the model calls this layer with initial_state (the outputs of 'enc'): save "
                                      "them as h0 and c0 beside x"),
    ("keras_mixed_bfloat16", "layer 'lstm' computes in bfloat16 (its dtype policy is mixed_bfloat16), a dtype numpy "
                             "has not: lstmgrad does not compute it"),
])
def test_what_the_model_records_and_the_file_lacks_is_refused_by_name(runner, tmp_path, name, said):
    case = CASES[name]
    out = tmp_path / "g.npz"
    args = [str(KERAS / case["files"]["in"]), "--weights", str(KERAS / case["files"]["model"]), "--weights-group",
            case["weights_group"]]
    result = runner.invoke(main, ["seq", *args, "-o", str(out), "-q"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert said in result.stderr and not out.exists(), result.stderr
    inspected = runner.invoke(main, ["inspect", *args])  # inspect counts it
    assert inspected.exit_code == 1 and said in " ".join(inspected.stdout.split()), inspected.output
    assert " ".join(inspected.stdout.split()).endswith("1 error, 0 warnings")


def test_a_tf_keras_2_model_records_its_mask_by_its_layers(runner, tmp_path):
    """tf.keras 2's model_config has no mask argument: Embedding(mask_zero=True) -> Dropout -> LSTM says it."""
    case = CASES["keras2_embedding_mask"]
    result = seq(runner, case["files"]["in_without_mask"], case["files"]["model"], out=tmp_path / "g.npz")
    assert result.exit_code == 1 and "the model masks this layer's input (emb, mask_zero=True)" in result.stderr
    result = seq(runner, case["files"]["in"], case["files"]["model"], out=tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    assert_close(npz(tmp_path / "g.npz"), npz(KERAS / case["files"]["expected"]))


def test_a_masking_layers_mask_is_computed_from_x_and_said(runner, tmp_path):
    case = CASES["keras_masking_zero"]
    assert "mask" not in npz(KERAS / case["files"]["in"])
    result = seq(runner, case["files"]["in"], case["files"]["model"], out=tmp_path / "g.npz")
    notes = json.loads(result.stdout)["results"][0]["notes"]
    assert "mask computed from x, as the model's Masking layer 'masking' computes it (the steps whose features are " \
           "not all 0)" in notes, notes
    assert "masked" in json.loads(result.stdout)["results"][0]["module"]


def test_a_mask_given_beside_a_masking_layer_that_disagrees_is_a_warning(runner, tmp_path):
    tensors = npz(KERAS / "keras_masking_zero.in.npz")
    mask = np.ones(tensors["x"].shape[:2], bool)  # every step, where the Masking layer masks some
    data = write_npz(tmp_path / "step.npz", {**tensors, "mask": mask})
    args = ["seq", str(data), "--weights", str(KERAS / "keras_masking_zero.keras"), "-q"]
    result = runner.invoke(main, [*args, "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0
    assert "the mask given is not the one the model's Masking layer 'masking' computes from x" in result.stderr
    result = runner.invoke(main, [*args, "--strict", "-o", str(tmp_path / "strict.npz")])
    assert result.exit_code == 1 and not (tmp_path / "strict.npz").exists()


def test_a_mask_given_where_the_model_records_none_is_used_and_said(runner, tmp_path):
    tensors = npz(KERAS / "keras_relu.in.npz")
    mask = np.ones(tensors["x"].shape[:2], bool)
    mask[0, -2:] = False
    data = write_npz(tmp_path / "step.npz", {**tensors, "mask": mask})
    result = runner.invoke(main, ["seq", str(data), "--weights", str(KERAS / "keras_relu.keras"), "-o",
                                  str(tmp_path / "g.npz"), "--json"])
    assert result.exit_code == 0, result.output
    assert "the model records no mask reaching this layer: computed with the mask given" in \
        json.loads(result.stdout)["results"][0]["notes"]


def test_merge_mode_none_is_the_two_outputs_gradients_concatenated(runner, tmp_path):
    case = CASES["keras_bidir_masked_none"]
    result = seq(runner, case["files"]["in"], case["files"]["model"], out=tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    assert any("merge_mode=None: the wrapper returns its two outputs, and h_grad is their gradients concatenated" in n
               for n in json.loads(result.stdout)["results"][0]["notes"])
    text = " ".join(runner.invoke(main, ["inspect", str(KERAS / case["files"]["model"])]).stdout.split())
    assert ("DATA holds x [B, T, 3], h_grad [B, T, 4] (merge_mode=None: the two outputs' gradients concatenated on "
            "the last axis), mask [B, T] (the model masks its input: emb, mask_zero=True)") in text


# -- mixed precision -------------------------------------------------------------------------------------------

def test_a_mixed_float16_layer_is_computed_at_its_precision(runner, tmp_path):
    """x float32 and h_grad float16, as the tape gives them: float32 gradients holding float16 values, within
    Keras' own float16 rounding of its gradients, and closer than those to the exact gradient."""
    case = CASES["keras_mixed_float16"]
    result = seq(runner, case["files"]["in"], case["files"]["model"], "--strict", out=tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["results"][0]["notes"]
    assert any(n.startswith("dtype policy mixed_float16 (keras_mixed_float16.keras config.json): computed at the "
                            "layer's precision") for n in notes), notes
    got, expected = npz(tmp_path / "g.npz"), npz(KERAS / case["files"]["expected"])
    assert_close({k: got[k] for k in expected}, expected, rtol=3e-3)
    for value in got.values():
        assert value.dtype == np.float32 and np.array_equal(value.astype(np.float16).astype(np.float32), value)
    inputs = npz(KERAS / case["files"]["in"])
    with zipfile.ZipFile(KERAS / case["files"]["model"]) as zf:
        weights = zf.read("model.weights.h5")
    (tmp_path / "w.h5").write_bytes(weights)
    with h5py.File(tmp_path / "w.h5") as fh:
        kernel, recurrent, bias = (fh[f"layers/lstm/cell/vars/{k}"][()].astype(np.float64) for k in range(3))
    exact = lg.keras_lstm_grad(inputs["x"].astype(np.float64), kernel, recurrent, bias,
                               h_grad=inputs["h_grad"].astype(np.float64))
    for name in expected:
        want = getattr(exact, name)
        assert np.max(np.abs(got[name] - want)) < np.max(np.abs(expected[name] - want)), name


def test_mixed_float16_tensors_cast_by_hand_are_computed_as_the_policy_says(runner, tmp_path):
    inputs = npz(KERAS / "keras_mixed_float16.in.npz")
    data = write_npz(tmp_path / "cast.npz", {"x": inputs["x"], "h_grad": inputs["h_grad"].astype(np.float32)})
    result = runner.invoke(main, ["seq", str(data), "--weights", str(KERAS / "keras_mixed_float16.keras"), "-o",
                                  str(tmp_path / "g.npz"), "-q"])
    assert result.exit_code == 0, result.output
    assert_close(npz(tmp_path / "g.npz"), npz(KERAS / "keras_mixed_float16.expected.npz"), rtol=3e-3)


def test_mixed_dtypes_without_a_recorded_policy_name_it(runner, tmp_path):
    inputs = npz(KERAS / "keras_mixed_float16.in.npz")
    with zipfile.ZipFile(KERAS / "keras_mixed_float16.keras") as zf:
        (tmp_path / "m.weights.h5").write_bytes(zf.read("model.weights.h5"))
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "s.npz", inputs)), "--weights",
                                  str(tmp_path / "m.weights.h5"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert ("all tensors must have one dtype: x is float32 but h_grad is float16: float32 tensors with float16 output "
            "gradients are what a layer under the mixed_float16 dtype policy gives; give the model file that records "
            "it (a .keras archive or full-model .h5 as --weights FILE), or tensors of one dtype") in result.stderr


def _with_config(tmp_path, source: Path, edit) -> Path:
    """A copy of a .keras archive whose config.json ``edit`` changes."""
    target = tmp_path / source.name
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename == "config.json":
                config = json.loads(data)
                edit(config)
                data = json.dumps(config).encode()
            dst.writestr(info, data)
    return target


@pytest.mark.parametrize(("policy", "said"), [
    ({"module": "keras", "class_name": "QuantizedDTypePolicy", "config": {"name": "int8_from_float32"}},
     "layer 'lstm' has the dtype policy 'int8_from_float32', which lstmgrad does not compute (it computes float16, "
     "float32, float64, mixed_float16)"),
    ("bfloat16", "layer 'lstm' computes in bfloat16 (its dtype policy is bfloat16)"),
])
def test_other_dtype_policies_are_refused_by_name(runner, tmp_path, policy, said):
    def edit(config):
        config["config"]["layers"][-1]["config"]["dtype"] = policy

    model = _with_config(tmp_path, KERAS / "keras_mixed_float16.keras", edit)
    result = runner.invoke(main, ["seq", str(KERAS / "keras_mixed_float16.in.npz"), "--weights", str(model), "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and said in result.stderr, result.output


# -- friction: groups, names, inspect ----------------------------------------------------------------------------

def test_a_model_of_one_lstm_needs_no_group_and_says_which_it_read(runner, tmp_path):
    result = seq(runner, "keras_embedding_mask.in.npz", "keras_embedding_mask.keras", out=tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    assert f"from {KERAS / 'keras_embedding_mask.keras'}: the model's one LSTM layer, 'enc': group layers/lstm" in \
        json.loads(result.stdout)["results"][0]["notes"]
    bidirectional = seq(runner, "keras_bidir_masked_none.in.npz", "keras_bidir_masked_none.keras",
                        out=tmp_path / "b.npz")
    assert bidirectional.exit_code == 0, bidirectional.output
    assert any("the model's one Bidirectional, 'bi': group layers/bidirectional" in n
               for n in json.loads(bidirectional.stdout)["results"][0]["notes"])


@pytest.mark.parametrize(("name", "group", "found"), [
    ("keras_decoder_states", "dec", "layers/lstm_1"),
    ("keras_nested_mask", "enc2", "layers/sequential/layers/lstm"),
    ("keras_bidir_masked_none", "bi", "layers/bidirectional"),
    ("keras2_embedding_mask", "enc", "model_weights/enc/enc"),
])
def test_a_layers_own_name_as_inspect_prints_it_names_its_group(runner, tmp_path, name, group, found):
    case = CASES[name]
    inspected = " ".join(runner.invoke(main, ["inspect", str(KERAS / case["files"]["model"])]).stdout.split())
    assert f"'{group}' at {found}" in inspected
    result = seq(runner, case["files"]["in"], case["files"]["model"], "--weights-group", group,
                 out=tmp_path / "g.npz")
    assert result.exit_code == 0, result.output
    assert f"from {KERAS / case['files']['model']}: layer '{group}': group {found}" in \
        json.loads(result.stdout)["results"][0]["notes"]
    assert_close(npz(tmp_path / "g.npz"), npz(KERAS / case["files"]["expected"]))


def test_a_name_no_layer_has_lists_the_groups(runner, tmp_path):
    result = seq(runner, "keras_decoder_states.in.npz", "keras_decoder_states.keras", "--weights-group", "emb",
                 out=tmp_path / "g.npz")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert (f"{KERAS / 'keras_decoder_states.keras'} has no LSTM layer named 'emb', nor a group of that name holding "
            "one: its LSTM layers are 'enc' at layers/lstm, 'dec' at layers/lstm_1") in result.stderr


@pytest.mark.parametrize(("name", "said"), [
    ("keras_embedding_mask.keras", "Keras LSTM layer 'enc' at layers/lstm: kernel [3, 16], recurrent_kernel [4, 16], "
                                   "bias [16] (input size 3, 4 units); activation=tanh, recurrent_activation=sigmoid, "
                                   "go_backwards=False, return_sequences=True: lstmgrad seq DATA --weights"),
    ("keras_embedding_mask.keras", "--weights-group layers/lstm; DATA holds x [B, T, 3], h_grad [B, T, 4], mask "
                                   "[B, T] (the model masks its input: emb, mask_zero=True)"),
    ("keras_masking_zero.keras", "mask [B, T] (the model masks its input: masking, Masking(mask_value=0); computed "
                                 "from x when not given)"),
    ("keras_decoder_states.keras", "DATA holds x [B, T, 2], h_grad [B, T, 3], h0, c0 [B, 3] (the model calls it with "
                                   "initial_state: 'enc')"),
    ("keras_decoder_states.keras", "h_grad [B, 3] (the last output's), hn_grad, cn_grad [B, 3] where its final "
                                   "states are used (return_state=True)"),
    ("keras_mixed_float16.keras", "computed in float16 (dtype policy mixed_float16)"),
    ("keras_stateful.keras", "h0, c0 [B, 3] (stateful=True: the states the previous batch left)"),
    ("keras_nested_mask.keras", "Keras LSTM layer 'enc2' at layers/sequential/layers/lstm"),
    ("keras2_embedding_mask.h5", "mask [B, T] (the model masks its input: emb, mask_zero=True)"),
])
def test_inspect_says_what_seq_needs_for_each_layer_of_a_model(runner, name, said):
    result = runner.invoke(main, ["inspect", str(KERAS / name)])
    assert result.exit_code == 0, result.output
    assert said in " ".join(result.stdout.split())


def test_inspect_of_a_bfloat16_model_counts_the_refusal(runner):
    result = runner.invoke(main, ["inspect", str(KERAS / "keras_mixed_bfloat16.keras"), "--json"])
    doc = json.loads(result.stdout)["result"]
    assert result.exit_code == 1 and not doc["ok"]
    assert [p["message"] for p in doc["problems"]] == [
        "layers/lstm: layer 'lstm' computes in bfloat16 (its dtype policy is mixed_bfloat16), a dtype numpy has not: "
        "lstmgrad does not compute it"]


def test_a_bare_weights_file_with_a_mask_says_which_zero_output_for_mask_was_assumed(runner, tmp_path):
    data = KERAS / "keras_mask_post_seq.in.npz"  # h_grad is not zero at its masked steps
    result = runner.invoke(main, ["seq", str(data), "-o", str(tmp_path / "g.npz"), "--json"])
    notes = json.loads(result.stdout)["results"][0]["notes"]
    tensors = npz(data)
    steps = int(np.sum(np.any(tensors["h_grad"][~tensors["mask"]], axis=-1)))
    assert any(n.startswith("zero_output_for_mask=False (Keras' default), so the output gradient at masked steps goes "
                            f"to the step whose output Keras carries there; h_grad is not zero at {steps} masked "
                            "step(s)") for n in notes), notes
    backward = runner.invoke(main, ["seq", str(KERAS / "keras_mask_bidirectional_backward.in.npz"), "--weights",
                                    str(KERAS / "keras_mask_bidirectional.weights.h5"), "--weights-group",
                                    "layers/bidirectional/backward_layer", "-o", str(tmp_path / "b.npz"), "--json"])
    assert any(n.startswith("zero_output_for_mask=True (a Bidirectional returning sequences sets it)")
               for n in json.loads(backward.stdout)["results"][0]["notes"])
    tensors["h_grad"][~tensors["mask"]] = 0  # then it does not matter, and nothing is said
    quiet = runner.invoke(main, ["seq", str(write_npz(tmp_path / "z.npz", tensors)), "-o", str(tmp_path / "z.g.npz"),
                                 "--json"])
    assert not any("zero_output_for_mask" in n for n in json.loads(quiet.stdout)["results"][0]["notes"])
    archive = runner.invoke(main, ["seq", str(KERAS / "keras_embedding_mask.in.npz"), "--weights",
                                   str(KERAS / "keras_embedding_mask.keras"), "-o", str(tmp_path / "a.npz"), "--json"])
    assert not any("zero_output_for_mask" in n for n in json.loads(archive.stdout)["results"][0]["notes"])


# -- what the user names, checked --------------------------------------------------------------------------------

def _keras_step(tmp_path, **extra):
    return write_npz(tmp_path / "step.npz", {**npz(KERAS / "keras_seq.in.npz"), **extra})


def test_unused_tensors_of_a_keras_input_are_warned_of_with_what_was_meant(runner, tmp_path):
    B, T = npz(KERAS / "keras_seq.in.npz")["x"].shape[:2]
    data = _keras_step(tmp_path, input_mask=np.ones((B, T), bool), seq_lens=np.full(B, T), kernal=np.zeros(3))
    result = runner.invoke(main, ["seq", str(data), "-q", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0 and result.stderr.count("\n") == 1, result.output
    assert ("tensors not used: input_mask (did you mean mask?), seq_lens (did you mean mask? a Keras LSTM layer takes "
            "a mask [B, T], True where a step is used: np.arange(T) < seq_lens[:, None] for a post-padded batch), "
            "kernal (did you mean kernel?); a Keras LSTM layer's gradient is computed from x, kernel, "
            "recurrent_kernel, bias, h0, c0, h_grad, hn_grad, cn_grad, mask") in result.stderr
    strict = runner.invoke(main, ["seq", str(data), "--strict", "-o", str(tmp_path / "s.npz")])
    assert strict.exit_code == 1 and not (tmp_path / "s.npz").exists() and "--strict: nothing written" in \
        strict.stderr
    doc = json.loads(runner.invoke(main, ["inspect", str(data), "--json"]).stdout)["result"]
    roles = {t["key"]: t["role"] for t in doc["tensors"]}
    assert roles == {"x": "used", "kernel": "used", "recurrent_kernel": "used", "bias": "used", "h_grad": "used",
                     "input_mask": "unused", "seq_lens": "unused", "kernal": "unused"}
    assert doc["unused"] == ["input_mask", "seq_lens", "kernal"] and doc["ok"]
    assert any("did you mean mask?" in p["message"] for p in doc["problems"] if p["severity"] == "warning")


def test_unused_tensors_of_a_torch_input_are_warned_of(runner, tmp_path):
    tensors = npz(TORCH / "torch_packed_bidir2_bf.in.npz")
    tensors["seq_lens"] = tensors.pop("lengths")
    data = write_npz(tmp_path / "step.npz", tensors)
    args = ["--weights", str(TORCH / "torch_packed_bidir2_bf.weights.safetensors"), "--batch-first"]
    result = runner.invoke(main, ["seq", str(data), *args, "-q", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.output
    assert ("tensor not used: seq_lens (did you mean lengths?); a PyTorch nn.LSTM's gradient is computed from x, h0, "
            "c0, h_grad, hn_grad, cn_grad, lengths and its weights") in result.stderr
    doc = json.loads(runner.invoke(main, ["inspect", str(data), *args, "--json"]).stdout)["result"]
    assert {t["key"]: t["role"] for t in doc["tensors"]}["seq_lens"] == "unused" and doc["unused"] == ["seq_lens"]


@pytest.mark.parametrize(("data", "extra", "said"), [
    (TORCH / "torch_packed_bidir2_bf.in.npz", {"mask": np.ones((4, 5), bool)},
     "mask is there (a Keras mask [B, T]), and a PyTorch nn.LSTM takes per-example lengths: save lengths [B] instead "
     "(mask.sum(1) for a post-padded batch, as pack_padded_sequence takes them), or remove it"),
    (KERAS / "keras_seq.in.npz", {"lengths": np.array([5, 3, 2])},
     "lengths is there (per-example lengths, as a PyTorch packed batch has), and a Keras LSTM layer takes a mask: "
     "save mask [B, T] instead (True where a step is used; np.arange(T) < lengths[:, None] for a post-padded "
     "batch), or remove it"),
])
def test_the_other_frameworks_mask_or_lengths_is_refused(runner, tmp_path, data, extra, said):
    args = ["--weights", str(TORCH / "torch_packed_bidir2_bf.weights.safetensors"), "--batch-first"] \
        if "torch" in data.name else []
    tensors = {k: v for k, v in npz(data).items() if k != "lengths"}
    step = write_npz(tmp_path / "step.npz", {**tensors, **extra})
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(step), *args, "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and said in result.stderr, result.output
    assert not out.exists()
    inspected = runner.invoke(main, ["inspect", str(step), *args])
    assert inspected.exit_code == 1 and said in " ".join(inspected.stdout.split())


def test_an_hdf5_inputs_groups_are_not_tensors_left_unused(runner, tmp_path):
    data = write_h5(tmp_path / "step.h5", npz(KERAS / "keras_seq.in.npz"))
    with h5py.File(data, "a") as fh:
        fh.create_group("notes")["text"] = np.zeros(2)
    result = runner.invoke(main, ["seq", str(data), "-q", "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0 and result.stderr == "", result.output


def test_the_warning_reaches_stderr_of_a_real_subprocess_with_q(tmp_path):
    data = _keras_step(tmp_path, attention_mask=np.ones((3, 5), bool))
    proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "seq", str(data), "-q", "-o",
                           str(tmp_path / "g.npz")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("Warning: ") and "attention_mask (did you mean mask?)" in proc.stderr


# -- hostile configurations ----------------------------------------------------------------------------------------

def _functional(layers, inputs=("in", 0, 0), outputs=("lstm", 0, 0)):
    return {"class_name": "Functional", "config": {"name": "m", "layers": layers, "input_layers": list(inputs),
                                                   "output_layers": list(outputs)}}


def _node(*sources, **kwargs):
    tensor = [{"class_name": "__keras_tensor__", "config": {"keras_history": [s, 0, 0]}} for s in sources]
    return {"args": tensor, "kwargs": kwargs}


def test_a_cycle_or_a_chain_too_long_to_follow_is_unknown_never_no_mask():
    cycle = _functional([{"class_name": "InputLayer", "name": "in", "config": {"name": "in"}, "inbound_nodes": []},
                         {"class_name": "Dense", "name": "a", "config": {"name": "a"}, "inbound_nodes": [_node("b")]},
                         {"class_name": "Dense", "name": "b", "config": {"name": "b"}, "inbound_nodes": [_node("a")]},
                         {"class_name": "LSTM", "name": "lstm", "config": {"name": "lstm"},
                          "inbound_nodes": [_node("a")]}])
    assert keras_masks.reaching(cycle, ("lstm",)).mask[0].kind == "unknown"
    chain = [{"class_name": "InputLayer", "name": "in", "config": {"name": "in"}, "inbound_nodes": []},
             {"class_name": "Embedding", "name": "d0", "config": {"name": "d0", "mask_zero": True},
              "inbound_nodes": [_node("in")]}]
    chain += [{"class_name": "Dense", "name": f"d{k}", "config": {"name": f"d{k}"}, "module": "keras.layers",
               "inbound_nodes": [_node(f"d{k - 1}")]} for k in range(1, 5000)]
    chain.append({"class_name": "LSTM", "name": "lstm", "config": {"name": "lstm"}, "inbound_nodes": [_node("d4999")]})
    assert keras_masks.reaching(_functional(chain), ("lstm",)).mask[0].kind == "unknown"
    short = chain[:5] + [{**chain[-1], "inbound_nodes": [_node("d2")]}]
    assert keras_masks.reaching(_functional(short), ("lstm",)).mask_words == "d0, mask_zero=True"


def test_a_custom_layer_after_a_mask_is_unknown_and_refused_unless_the_mask_is_given():
    layers = [{"class_name": "InputLayer", "name": "in", "config": {"name": "in"}, "inbound_nodes": []},
              {"class_name": "Masking", "name": "m", "config": {"name": "m", "mask_value": 0.0},
               "inbound_nodes": [_node("in")]},
              {"class_name": "MyLayer", "name": "mine", "module": "my.layers", "registered_name": "Custom>MyLayer",
               "config": {"name": "mine"}, "inbound_nodes": [_node("m")]},
              {"class_name": "Conv1D", "name": "conv", "module": "keras.layers", "config": {"name": "conv"},
               "inbound_nodes": [_node("m")]},
              {"class_name": "LSTM", "name": "lstm", "config": {"name": "lstm"}, "inbound_nodes": [_node("mine")]},
              {"class_name": "LSTM", "name": "lstm2", "config": {"name": "lstm2"}, "inbound_nodes": [_node("conv")]}]
    found = keras_masks.reaching(_functional(layers), ("lstm",))
    assert found.mask_words == "mine, a layer lstmgrad does not know, after a mask" and not found.computable_from_x()
    assert not keras_masks.reaching(_functional(layers), ("lstm2",)).masked  # a Keras layer that drops it


@settings(max_examples=int(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES", 150)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) |
                    st.sampled_from(["in", "lstm", "a", "Masking", "Embedding", "LSTM", "__keras_tensor__", "Dense",
                                     "Functional", "Sequential", "InputLayer", "Any", "NotEqual", "keras.layers"]),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["class_name", "config", "name", "layers", "inbound_nodes", "args", "kwargs",
                                         "mask", "keras_history", "initial_state", "mask_zero", "mask_value",
                                         "input_layers", "output_layers", "module", "return_sequences"]),
                        inner, max_size=5), max_leaves=40),
       st.lists(st.sampled_from(["lstm", "a", "in", "m"]), min_size=1, max_size=3))
def test_any_configuration_gives_an_answer_and_never_raises(config, names):
    found = keras_masks.reaching(config if isinstance(config, dict) else {"config": config}, tuple(names))
    assert isinstance(found, keras_masks.Reaching)
    assert all(isinstance(m, keras_masks.MaskSource) and isinstance(m.words, str) for m in found.mask)


@pytest.mark.parametrize("mask_value", ["0", True, None, [0.0]])
def test_a_masking_layer_whose_mask_value_is_not_a_number_is_refused_without_the_mask(runner, tmp_path, mask_value):
    def edit(config):
        masking = next(c for c in config["config"]["layers"] if c["class_name"] == "Masking")
        masking["config"]["mask_value"] = mask_value

    model = _with_config(tmp_path, KERAS / "keras_masking_zero.keras", edit)
    result = runner.invoke(main, ["seq", str(KERAS / "keras_masking_zero.in.npz"), "--weights", str(model), "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "the model masks this layer's input (masking, Masking(mask_value=not a number)): save the mask" in \
        result.stderr


LAYER_KINDS = ["Embedding", "EmbeddingMasked", "Masking", "Dense", "Dropout", "Conv1D", "LSTMSeq", "LSTMLast", "Mine",
               "Reshape", "LayerNormalization"]


def _chain_layer(kind: str, name: str, previous: str | None) -> dict:
    cls = {"EmbeddingMasked": "Embedding", "LSTMSeq": "LSTM", "LSTMLast": "LSTM", "Mine": "MyLayer"}.get(kind, kind)
    config = {"name": name, "mask_zero": kind == "EmbeddingMasked", "return_sequences": kind == "LSTMSeq"}
    layer = {"class_name": cls, "name": name, "config": config,
             "inbound_nodes": [_node(previous)] if previous else []}
    layer.update({"module": "my.layers", "registered_name": "Custom>MyLayer"} if kind == "Mine" else
                 {"module": "keras.layers"})
    return layer


@settings(max_examples=int(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES", 200)), deadline=None)
@given(st.lists(st.sampled_from(LAYER_KINDS), max_size=8), st.booleans())
def test_a_chain_of_layers_hands_the_lstm_a_mask_as_keras_rules_say(kinds, sequential):
    """Before the LSTM, any chain: no mask without a maker of one; a Masking layer right before it is computable
    from x; a mask from a maker whose path to the LSTM only hands it on reaches it (named); one past a layer that
    drops it does not."""
    names = [f"l{k}" for k in range(len(kinds))]
    layers = [{"class_name": "InputLayer", "name": "in", "config": {"name": "in"}, "inbound_nodes": []}]
    layers += [_chain_layer(kind, names[k], ["in", *names][k]) for k, kind in enumerate(kinds)]
    layers.append({"class_name": "LSTM", "name": "lstm", "config": {"name": "lstm"}, "module": "keras.layers",
                   "inbound_nodes": [_node(names[-1] if names else "in")]})
    config = {"class_name": "Sequential", "config": {"layers": layers}} if sequential else _functional(layers)
    found = keras_masks.reaching(config, ("lstm",))

    def reference(upto: int) -> str | None:
        """What reaches the layer after the first ``upto`` of the chain, by Keras' rules followed back."""
        for at in reversed(range(upto)):
            if kinds[at] in ("Masking", "EmbeddingMasked"):
                return names[at]
            if kinds[at] in ("Embedding", "Conv1D", "LSTMLast", "Reshape"):
                return None  # (an Embedding without mask_zero makes none; the others drop it)
            if kinds[at] == "Mine":  # a custom layer: unknown where a mask reaches it
                return "unknown" if reference(at) is not None else None
        return None

    reaches = reference(len(kinds))
    if reaches is None:
        assert not found.masked, found
    elif reaches == "unknown":
        assert [m.kind for m in found.mask] == ["unknown"], found
    else:
        assert [m.layer for m in found.mask] == [reaches], found
    direct = bool(kinds) and kinds[-1] == "Masking"
    assert (found.computable_from_x() is not None) == direct


json_values = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3), max_leaves=8)


@settings(max_examples=int(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES", 25)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(dtype=json_values, mask_value=json_values, mask_zero=json_values)
def test_any_policy_or_masking_option_in_an_archive_gives_a_gradient_or_one_line(runner, tmp_path, dtype, mask_value,
                                                                                 mask_zero):
    def edit(config):
        layers = config["config"]["layers"]
        next(c for c in layers if c["class_name"] == "LSTM")["config"]["dtype"] = dtype
        next(c for c in layers if c["class_name"] == "Embedding")["config"]["mask_zero"] = mask_zero
        layers.insert(2, {"class_name": "Masking", "name": "m", "module": "keras.layers",
                          "config": {"name": "m", "mask_value": mask_value}, "inbound_nodes": []})

    model = _with_config(tmp_path, KERAS / "keras_embedding_mask.keras", edit)
    out = tmp_path / "g.npz"
    out.unlink(missing_ok=True)
    result = runner.invoke(main, ["seq", str(KERAS / "keras_embedding_mask_nomask.in.npz"), "--weights", str(model),
                                  "-o", str(out)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and result.exit_code in (0, 1), result.output
    if result.exit_code == 1:
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1 and not out.exists()
    else:
        assert mask_zero is not True  # (a mask the file lacks is never computed without)
