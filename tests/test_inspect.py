"""``lstmgrad inspect``: tensors, op and layout fit, missing/unused tensors, and every problem at once."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import load_case

from lstmgrad_cli.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = {c["name"]: c for c in json.loads((FIXTURES / "manifest.json").read_text())}


def inspect(*args):
    result = CliRunner().invoke(main, ["inspect", *[str(a) for a in args], "--json"])
    assert result.exit_code in (0, 1), (result.exit_code, result.stderr)
    return result.exit_code, json.loads(result.stdout)["result"]


def problems(doc, severity=None):
    return [p for p in doc["problems"] if severity is None or p["severity"] == severity]


@pytest.mark.parametrize("name", ["seq_v2_peep", "seq_v1_nopeep", "seq_v1_clip", "seq_v2_half", "cell_peep"])
def test_fixtures_fit_their_op_and_layout(name):
    case = MANIFEST[name]
    code, doc = inspect(FIXTURES / f"{name}.in.npz")
    assert code == 0 and doc["ok"] and problems(doc) == []
    assert doc["kind"] == case["kind"] and doc["layout"] == case["layout"]
    expected_op = {"ifco": "BlockLSTMGradV2", "icfo": "BlockLSTMGrad"}[case["layout"]] if case["kind"] == "seq" \
        else "LSTMBlockCellGrad"
    assert doc["op"] == expected_op
    if case["kind"] == "seq":
        assert doc["layout_source"] == "found from the activations" and doc["seq_len_max"] == case["seq_len_max"]
    assert doc["use_peephole"] == case["use_peephole"] and doc["missing"] == []
    x = next(t for t in doc["tensors"] if t["key"] == "x")
    arr = np.load(FIXTURES / f"{name}.in.npz")["x"]
    assert x["shape"] == list(arr.shape) and x["dtype"] == case["dtype"]
    assert x["min"] == pytest.approx(float(arr.min())) and x["max"] == pytest.approx(float(arr.max()))


def test_every_problem_is_reported_at_once(tmp_path):
    t = dict(np.load(FIXTURES / "seq_v2_peep.in.npz"))  # T=5, B=3, I=4, C=6, peepholes on
    t["w"] = t["w"].astype(np.float64)  # dtype mismatch
    t["cs_prev"] = np.zeros((4, 6), np.float32)  # wrong batch
    del t["wco"]  # missing, needed with peepholes
    t["f"] = t["f"] * 10 - 5  # pre-activation values, not sigmoid outputs
    t["seq_len_max"] = np.array(9)  # > T
    t["h"] = t["h"].copy()
    t["h"][1, 0, 0] = np.nan
    t["b"] = t["b"][None]  # wrong rank
    t["comment"] = np.arange(3)  # not an op input
    path = tmp_path / "bad.npz"
    np.savez(path, **t)
    code, doc = inspect(path)
    assert code == 1 and not doc["ok"]
    by_tensor = {}
    for p in problems(doc):
        by_tensor.setdefault(p["tensor"], []).append(p)
    # in the words seq refuses each in (the same rules, validation.py), here all at once
    assert "all tensors must have one dtype: x is float32 but w is float64" in by_tensor["w"][0]["message"]
    assert ("cs_prev.dims(0) != batch_size: 4 vs. 3 (cs_prev has shape [4, 6], expected [batch_size, cell_size] = "
            "[3, 6])") in by_tensor["cs_prev"][0]["message"]
    assert by_tensor["wco"][0]["message"].startswith("missing tensor wco")
    assert "outside [0, 1]" in by_tensor["f"][0]["message"]
    assert "seq_len_max must be between 0 and 5 but is 9" in by_tensor["seq_len_max"][0]["message"]
    assert "b must be rank 1 but is rank 2" in by_tensor["b"][0]["message"]
    assert by_tensor["h"][0]["severity"] == "warning" and "1 NaN/Inf entry" in by_tensor["h"][0]["message"]
    assert doc["missing"] == ["wco"] and doc["unused"] == ["comment"]
    assert len(problems(doc, "error")) == 6
    text = CliRunner().invoke(main, ["inspect", str(path)]).stdout
    assert "6 errors, 1 warning" in text


def test_forward_file_layout_from_metadata_and_weights_only(tmp_path):
    t = dict(np.load(FIXTURES / "seq_v1_peep.in.npz"))
    weights = tmp_path / "weights.npz"
    np.savez(weights, **{k: t[k] for k in ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b", "use_peephole")})
    code, doc = inspect(weights)
    assert code == 0 and doc["kind"] == "forward-seq" and "lstmgrad forward seq" in doc["notes"][0]
    run = tmp_path / "run.h5"
    result = CliRunner().invoke(main, ["forward", "seq", str(weights), "--layout", "icfo", "-o", str(run), "-q"])
    assert result.exit_code == 0, result.stderr
    code, doc = inspect(run)
    assert code == 0 and doc["layout"] == "icfo" and doc["layout_source"] == "metadata"
    assert doc["op"] == "BlockLSTMGrad" and doc["metadata"]["op"] == "BlockLSTM"


def test_gradient_file_and_groups(tmp_path):
    code, doc = inspect(FIXTURES / "seq_v2_peep.expected.npz")
    assert code == 0 and doc["kind"] == "gradients"
    code, doc = inspect(FIXTURES / "demo.h5")
    assert code == 1 and doc["groups"] == ["lstm"] and "use --group" in problems(doc)[0]["message"]
    code, doc = inspect(FIXTURES / "demo.h5", "--group", "lstm")
    assert code == 0 and doc["use_peephole"] is True and doc["use_peephole_source"] == "attribute"
    assert doc["seq_len_max"] == 12 and doc["layout"] == "ifco"


def test_camelcase_unreadable_entry_and_peephole_hint(tmp_path):
    t = dict(np.load(FIXTURES / "seq_v2_peep.in.npz"))
    del t["use_peephole"]  # the activations were computed with peepholes; the file does not say so
    t["csPrev"] = t.pop("cs_prev")
    t["blob"] = np.array([{"a": 1}], dtype=object)  # a pickle: never loaded
    path = tmp_path / "dump.npz"
    np.savez(path, **t)
    code, doc = inspect(path)
    assert code == 1
    assert any(p["tensor"] == "blob" and "cannot be read" in p["message"] for p in problems(doc, "error"))
    assert next(t for t in doc["tensors"] if t["key"] == "csPrev")["name"] == "cs_prev"
    # not given: found from the activations, as seq finds it, and no warning
    assert doc["use_peephole"] is True and doc["use_peephole_source"] == "found from the activations"
    assert not [p for p in problems(doc, "warning") if p["tensor"] == "use_peephole"]
    t["use_peephole"] = np.array(False)  # given, and contradicted: a hint
    np.savez(path, **t)
    code, doc = inspect(path)
    hint = [p for p in problems(doc, "warning") if p["tensor"] == "use_peephole"]
    assert hint and "--peephole" in hint[0]["message"]


def test_inconsistent_activations_are_flagged(tmp_path):
    t = dict(np.load(FIXTURES / "cell_peep.in.npz"))
    t["x"] = t["x"] + np.float32(0.5)  # inputs of another step
    path = tmp_path / "cell.h5"
    with h5py.File(path, "w") as fh:
        for k, v in t.items():
            fh[k] = v
    code, doc = inspect(path)
    assert code == 0 and doc["kind"] == "cell"
    warning = [p["message"] for p in problems(doc, "warning")]
    assert any("the stored activations fit neither gate layout, with or without peepholes" in m for m in warning)


def test_key_names_are_never_markup_or_terminal_control(tmp_path):
    with np.load(FIXTURES / "seq_v2_peep.in.npz") as data:
        inputs = dict(data)
    inputs["[/evil]"] = np.zeros(2, np.float32)
    inputs["\x1b]0;title\x07\x1b[2J"] = np.zeros(2, np.float32)
    src = tmp_path / "odd.npz"
    np.savez(src, **inputs)
    result = CliRunner().invoke(main, ["inspect", str(src)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert "[/evil]" in result.stdout and "\x1b" not in result.stdout and "\\x1b" in result.stdout


def test_inspect_reads_the_file_once_under_one_memory_budget(tmp_path, monkeypatch):
    tensors = {name: np.zeros(100_000, np.float32) for name in ("i", "f", "o")}  # 400 kB each, read by seq
    src = tmp_path / "three.npz"
    np.savez(src, **tensors)
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "1M")  # two fit, the third exceeds the file's budget
    doc = json.loads(CliRunner().invoke(main, ["inspect", str(src), "--json"]).stdout)
    unreadable = [t["key"] for t in doc["result"]["tensors"] if t["role"] == "unreadable"]
    assert unreadable == ["o"]


def test_entries_no_command_reads_are_shown_by_their_header_only(tmp_path, monkeypatch):
    """An entry seq would not read is shown with its shape and dtype, never read (issue 41: a 1.6 GB unused member
    took 8 GB to show its minimum): under a budget it could not fit, it is still listed, without statistics."""
    tensors = {**load_case("seq_v2_peep")[0], "junk": np.ones((1000, 500), np.float32)}  # 2 MB
    src = tmp_path / "with-junk.npz"
    np.savez(src, **tensors)
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "1M")
    result = CliRunner().invoke(main, ["inspect", str(src), "--json"])
    doc = json.loads(result.stdout)["result"]
    junk = next(t for t in doc["tensors"] if t["key"] == "junk")
    assert junk["shape"] == [1000, 500] and junk["dtype"] == "float32" and junk["role"] == "unused"
    assert junk["min"] is None and junk["max"] is None and junk["finite"] is None
    assert doc["ok"] and [t["key"] for t in doc["tensors"]] == list(tensors)  # (the file's order)


@pytest.mark.parametrize("junk_bytes", [800, 8000, 800_000])
def test_an_unused_members_corruption_is_reported_at_any_size_up_to_a_whole_read(tmp_path, junk_bytes):
    """An entry shown by its header only is still read to its end when it is at most the 1 MiB read whole (its
    zip CRC checked: a flipped byte is an error), whether stored or not, and whatever its size below that."""
    import zipfile

    src = tmp_path / "with-junk.npz"
    np.savez(src, **load_case("seq_v2_peep")[0], junk=np.ones(junk_bytes // 4, np.float32))
    with zipfile.ZipFile(src) as archive:
        info = archive.getinfo("junk.npy")
    data = bytearray(src.read_bytes())
    name_length, extra_length = np.frombuffer(data, "<u2", 2, info.header_offset + 26)
    data[info.header_offset + 30 + int(name_length) + int(extra_length) + info.file_size - 1] ^= 0xFF
    src.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["inspect", str(src)])
    assert result.exit_code == 1
    assert "junk is corrupt or truncated (Bad CRC-32 for file 'junk.npy')" in " ".join(result.stdout.split())


# -- NaN/Inf: inspect finds the layout as seq does (detect.py leaves non-finite entries out) -----------------------

def _seq_result(path, tmp_path):
    result = CliRunner().invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz"), "--force", "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["results"][0]


def _with(tmp_path, name, value, index=(0, 0, 1), computed_through=False):
    """seq_v2_peep with one entry of ``name`` replaced; ``computed_through``: the forward outputs recomputed from
    the changed inputs, as TF would have stored them."""
    from lstmgrad_cli import ops

    t = dict(np.load(FIXTURES / "seq_v2_peep.in.npz"))
    t[name] = t[name].copy()
    t[name][index[:t[name].ndim]] = value
    if computed_through:
        inputs = {k: t[k] for k in ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")}
        t.update(ops.block_lstm_v2(int(t["seq_len_max"]), **inputs, use_peephole=True)._asdict())
    path = tmp_path / "nonfinite.npz"
    np.savez(path, **t)
    return path


@pytest.mark.parametrize("name, value, computed_through", [
    ("x", np.nan, False), ("w", np.nan, False), ("h_prev", np.nan, False), ("i", np.nan, False),
    ("cs", np.nan, False), ("x", np.inf, True), ("x", np.nan, True)])
def test_nonfinite_entries_are_left_out_of_the_layout_fit_as_seq_leaves_them(tmp_path, name, value,
                                                                              computed_through):
    path = _with(tmp_path, name, value, computed_through=computed_through)
    ran = _seq_result(path, tmp_path)
    assert ran["layout"] == "ifco" and ran["sources"]["layout"] == "activations"
    assert [w for w in ran["warnings"] if not w.startswith("NaN/Inf in inputs")] == []  # (the count is a warning)
    code, doc = inspect(path)
    assert code == 0 and doc["layout"] == "ifco" and doc["layout_source"] == "found from the activations"
    assert doc["op"] == "BlockLSTMGradV2" and doc["use_peephole"] is True
    assert doc["activations"] == ran["activations"]  # the same detection, the same verdict
    warnings = [p["message"] for p in problems(doc, "warning")]
    assert warnings and all("NaN/Inf entr" in m for m in warnings), warnings  # only the count of each tensor's
    assert any(n.startswith("forward pass reproduced") for n in doc["notes"]), doc["notes"]


def test_activations_that_do_not_fit_their_nonfinite_inputs_are_flagged_by_both(tmp_path):
    path = _with(tmp_path, "x", np.inf)  # the stored gates were computed from the finite x: they do not fit it
    ran = _seq_result(path, tmp_path)
    assert ran["activations"]["fits_nothing"] and any("fit neither gate layout" in m for m in ran["warnings"])
    code, doc = inspect(path)
    assert doc["activations"] == ran["activations"] and doc["layout"] == ran["layout"] == "ifco"
    (said,) = [w for w in ran["warnings"] if "fit neither gate layout" in w]  # the same words
    assert said.removeprefix(f"{path}: ") in [p["message"] for p in problems(doc, "warning")]


def test_a_misfit_at_a_step_seq_does_not_sample_is_still_flagged(tmp_path):
    t = dict(np.load(FIXTURES / "seq_v2_larger.in.npz"))  # T=12: seq samples steps 0, 1, 6, 10, 11
    t["i"] = t["i"].copy()
    t["i"][3] = np.clip(t["i"][3] + 0.1, 0, 1)
    path = tmp_path / "step3.npz"
    np.savez(path, **t)
    assert _seq_result(path, tmp_path)["warnings"] == []
    code, doc = inspect(path)
    assert code == 0 and doc["layout"] == "ifco"
    (warning,) = [p["message"] for p in problems(doc, "warning")]
    assert "not at every step: i (max 0.1, from step 3)" in warning


def test_inspect_reads_and_shows_the_entries_a_command_reads_and_counts_the_rest(runner, tmp_path):
    """An NPZ with thousands of stray members: inspect read and tabled every one (65,000 took minutes and 370 MB);
    it reads the op's tensors and the first OTHERS_SHOWN others, and counts the rest."""
    import bombs

    from lstmgrad_cli.operations.inspect import OTHERS_SHOWN

    path = bombs.npz_many_members(tmp_path / "many.npz", count=2_000)
    result = runner.invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    shown = [t["key"] for t in doc["tensors"]]
    assert {"x", "w", "h_grad"} <= set(shown) and len([k for k in shown if k.startswith("m")]) == OTHERS_SHOWN
    assert doc["not_read"] == [f"m{k}" for k in range(OTHERS_SHOWN, 2_000)] and doc["kind"] == "seq"
    text = " ".join(runner.invoke(main, ["inspect", str(path)]).stdout.split())
    assert f"not read: {2_000 - OTHERS_SHOWN} more entries no command reads (m50, m51, m52, m53, m54 and" in text
    assert "unused: m0, m1," in text and f"and {OTHERS_SHOWN - 20} more" in text


def test_inspect_says_each_bidirectional_layers_bias_and_direction_as_its_configuration_does(runner):
    keras = Path(__file__).resolve().parent.parent / "fixtures" / "keras"
    result = runner.invoke(main, ["inspect", str(keras / "keras_bidir_backward_nobias.keras")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "Keras Bidirectional 'bidirectional' at layers/bidirectional: kernel [3, 8], recurrent_kernel [2, 8], " \
           "bias: forward [8], backward none" in text, text
    assert "at layers/bidirectional/backward_layer: kernel [3, 8], recurrent_kernel [2, 8], no bias (input size 3, " \
           "2 units); activation=tanh, recurrent_activation=sigmoid, go_backwards=True" in text, text


def test_inspect_of_a_weights_file_reports_a_bias_of_the_wrong_size(runner, tmp_path):
    """A Keras weights file whose bias declares 400M values (a gzip bomb): seq refuses it before reading; inspect
    read its shape and called the file fine."""
    import bombs

    path = bombs.keras_bias_bomb(tmp_path / "w.weights.h5")
    result = runner.invoke(main, ["inspect", str(path)])
    assert result.exit_code == 1, result.output
    assert "layers/lstm: bias has shape [400000000], expected [4C] = [12]: seq refuses this layer" in \
        " ".join(result.stdout.split()), result.output
