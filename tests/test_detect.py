"""The activations decide: layout and use_peephole found from the stored gates, contradictions warned
about (--strict refuses), and the wrong command or file named for what it is.  On TensorFlow's own
golden files: nothing here trusts lstmgrad's forward pass to say what TF's ops produce."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import CASES, FIXTURES, MANIFEST, assert_close_scaled, consistent_inputs, load_case, write_h5, write_npz

from lstmgrad_cli import io
from lstmgrad_cli.analysis import detect
from lstmgrad_cli.cli import main
from lstmgrad_cli.problem.reading import load_problem


def read_any(path):
    if path.suffix == ".npz":
        with np.load(path) as data:
            return {k: data[k] for k in data.files if not k.startswith("__")}
    import h5py

    with h5py.File(path, "r") as fh:
        return {k: fh[k][()] for k in fh}


def without(name, *drop):
    inputs = load_case(name)[0]
    return {k: v for k, v in inputs.items() if k not in drop}


@pytest.mark.parametrize("name", [c["name"] for c in MANIFEST])
def test_tf_golden_case_without_use_peephole_or_layout_gives_tfs_result(runner, tmp_path, name):
    """No use_peephole in the file, no --layout: the activations say which op made them."""
    case = CASES[name]
    src = write_npz(tmp_path / "dump.npz", without(name, "use_peephole"))
    out = tmp_path / "g.npz"
    result = runner.invoke(main, [case["kind"], str(src), "-o", str(out), "--json", "--strict"])
    assert result.exit_code == 0, result.stderr
    assert "Warning" not in result.stderr
    doc = json.loads(result.stdout)["results"][0]
    if case.get("seq_len_max") != 0:  # a run of no steps leaves nothing to recompute (and every gradient is 0)
        assert doc["layout"] == case["layout"] and doc["use_peephole"] == case["use_peephole"]
        assert doc["sources"]["use_peephole"] == "activations"
        assert doc["sources"]["layout"] == ("activations" if case["kind"] == "seq" else "op")
    expected = load_case(name)[1]
    got = read_any(out)
    for key, value in expected.items():
        assert_close_scaled(got[key], value, name=key)


def test_the_table_says_what_was_found_from_the_activations(runner, tmp_path):
    src = write_npz(tmp_path / "v1.npz", without("seq_v1_peep", "use_peephole"))
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "BlockLSTMGrad (layout icfo, found from the activations)" in text
    assert "use_peephole=true (found from the activations)" in text


def test_a_v1_file_as_it_comes_from_tf_gives_blocklstmgrad(runner, tmp_path):
    """The issue's first case: a BlockLSTM dump run with no flag used to give BlockLSTMGradV2, off by 1.6."""
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v1_peep.in.npz"), "-o", str(out), "--strict"])
    assert result.exit_code == 0, result.stderr
    for key, value in load_case("seq_v1_peep")[1].items():
        assert_close_scaled(read_any(out)[key], value, name=key)


TAPE_WARNING = ("the activations fit layout ifco (BlockLSTMV2), not icfo as asked (--layout icfo): BlockLSTMGrad of "
                "them is TensorFlow's GradientTape gradient of BlockLSTMV2")


@pytest.mark.parametrize("name, flags, warning, reference", [
    # reproducing TF's tape bug on purpose is legitimate: computed as asked, and it equals TF's tape gradient
    ("seq_v2_peep", ["--layout", "icfo"], TAPE_WARNING, "tape"),
    ("seq_v1_peep", ["--layout", "ifco"], "the activations fit layout icfo (BlockLSTM), not ifco as asked", None),
    ("seq_v2_peep", ["--no-peephole"], "computed with use_peephole=true, not use_peephole=false as asked "
                                       "(--no-peephole)", None),
    ("seq_v2_nopeep", ["--peephole"], "computed with use_peephole=false, not use_peephole=true as asked "
                                      "(--peephole)", None),
    ("cell_peep", ["--no-peephole"], "computed with use_peephole=true, not use_peephole=false", None),
])
def test_an_explicit_contradiction_is_computed_as_asked_with_a_warning(runner, tmp_path, name, flags, warning,
                                                                       reference):
    kind = CASES[name]["kind"]
    out = tmp_path / "g.npz"
    result = runner.invoke(main, [kind, str(FIXTURES / f"{name}.in.npz"), "-o", str(out), *flags])
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Warning: ") and warning in lines[0], result.stderr
    if reference:
        with np.load(FIXTURES / f"{name}.{reference}.npz") as ref:
            for key in ref.files:
                assert_close_scaled(read_any(out)[key], ref[key], name=key)
    strict = runner.invoke(main, [kind, str(FIXTURES / f"{name}.in.npz"), "-o", str(tmp_path / "s.npz"), *flags,
                                  "--strict"])
    assert strict.exit_code == 1
    assert strict.stderr.startswith("Error: ") and strict.stderr.count("\n") == 1 and warning in strict.stderr
    assert "(--strict: nothing written)" in strict.stderr
    assert not (tmp_path / "s.npz").exists()


def test_a_use_peephole_in_the_file_that_the_activations_contradict_is_named_as_the_files(runner, tmp_path):
    inputs = load_case("seq_v2_peep")[0]
    src = write_h5(tmp_path / "dump.h5", {k: v for k, v in inputs.items() if k != "use_peephole"},
                   attrs={"use_peephole": False})
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5")])
    assert result.exit_code == 0
    assert "not use_peephole=false as asked (the file's use_peephole attribute)" in result.stderr


def test_activations_that_fit_nothing_are_warned_about_and_strict_refuses(runner, tmp_path):
    inputs = load_case("seq_v2_peep")[0]
    rng = np.random.default_rng(1)
    for name in ("i", "f", "o"):
        inputs[name] = rng.uniform(size=inputs[name].shape).astype(np.float32)  # not a sigmoid of anything here
    src = write_npz(tmp_path / "odd.npz", inputs)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--json"])
    assert result.exit_code == 0
    assert "fit neither gate layout, with or without peepholes" in result.stderr
    assert "lstmgrad check --gradcheck" in result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["activations"]["fits_nothing"] and doc["sources"]["layout"] == "default"
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "s.npz"), "--strict"])
    assert result.exit_code == 1 and not (tmp_path / "s.npz").exists()


def test_zero_peephole_weights_cannot_tell_and_say_so(runner, tmp_path):
    inputs = without("seq_v2_nopeep", "use_peephole")
    for name in ("wci", "wcf", "wco"):
        inputs[name] = np.zeros_like(inputs[name])
    src = write_npz(tmp_path / "zero.npz", inputs)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--strict"])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "use_peephole: not in the file and the activations cannot tell (the peephole weights wci, wcf, wco are " \
           "all zero); false" in text
    assert "layout ifco, found from the activations" in text


def test_a_streamed_hdf5_input_is_detected_too(runner, tmp_path, monkeypatch):
    """HDF5 sequences are read a chunk at a time: detection reads the sampled steps only."""
    from lstmgrad_cli.io import hdf5

    monkeypatch.setattr(hdf5, "worth_leaving", lambda shape, dtype: True)  # this small input streamed too
    src = write_h5(tmp_path / "v1.h5", without("seq_v1_clip", "use_peephole"))
    out = tmp_path / "g.h5"
    result = runner.invoke(main, ["seq", str(src), "-o", str(out), "--strict", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert (doc["op"], doc["use_peephole"]) == ("BlockLSTMGrad", True)
    for key, value in load_case("seq_v1_clip")[1].items():
        assert_close_scaled(read_any(out)[key], value, name=key)


class CountingSteps:
    """A time-major array that records which steps are read."""

    def __init__(self, array, seen):
        self.array, self.seen = array, seen
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim

    def __getitem__(self, index):
        self.seen.add(index)
        return self.array[index]


def test_detection_reads_a_bounded_number_of_steps():
    inputs = consistent_inputs(T=200, B=40, I=6, C=5, layout="icfo", use_peephole=False)
    seen = set()
    arrays = {k: CountingSteps(v, seen) if v.ndim == 3 else v for k, v in inputs.items()}
    fit = detect.fit_activations(arrays, "seq", 150)
    assert (fit.layout, fit.use_peephole) == ("icfo", False)
    assert fit.steps == [0, 1, 75, 148, 149]
    assert seen == {0, 1, 75, 148, 149} | {74, 147}  # and the step before each, for its state (cs, h)
    assert fit.rows == detect.SAMPLE_ROWS


@pytest.mark.parametrize("layout, use_peephole", [("ifco", True), ("ifco", False), ("icfo", True), ("icfo", False)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_every_layout_and_peephole_setting_is_found(layout, use_peephole, dtype):
    inputs = consistent_inputs(T=6, B=4, I=3, C=5, dtype=dtype, layout=layout, use_peephole=use_peephole, seed=3)
    fit = detect.fit_activations(inputs, "seq", 6)
    assert (fit.layout, fit.use_peephole) == (layout, use_peephole)


def test_a_fit_is_the_same_whatever_the_memory_order_or_laziness_of_the_tensors():
    # C-ordered tensors are sampled through flat indexes, others by fancy indexing, lazy ones a step at a time
    inputs = consistent_inputs(T=9, B=11, I=4, C=7, layout="icfo", use_peephole=True, seed=5)
    inputs["f"][3, 2, 1] = np.nan  # a non-finite stored gate is left out of the fit, in every path alike
    fits = [detect.fit_activations(arrays, "seq", 8).to_json() for arrays in (
        inputs,
        {k: np.asfortranarray(v) for k, v in inputs.items()},
        {k: np.repeat(v, 2, axis=1)[:, ::2] if v.ndim == 3 else v for k, v in inputs.items()},  # strided views
        {k: CountingSteps(v, set()) if v.ndim == 3 else v for k, v in inputs.items()},
    )]
    assert fits[0]["layout"] == "icfo" and fits[0]["use_peephole"] is True
    assert all(fit == fits[0] for fit in fits[1:])


def test_the_json_of_a_fit_holds_every_field_and_what_was_found():
    inputs = consistent_inputs(T=6, B=4, I=3, C=5, layout="icfo", use_peephole=True, seed=2)
    fit = detect.fit_activations(inputs, "seq", 6)
    doc = fit.to_json()
    assert doc == {**dataclasses.asdict(fit), "layout": "icfo", "use_peephole": True, "fits_nothing": False,
                   "layouts": ["icfo"], "peepholes": [True]}
    assert json.loads(json.dumps(doc)) == doc


def test_an_input_size_of_zero_is_detected_from_the_recurrence_alone(runner, tmp_path):
    # I = 0: x is [T, B, 0] and w only the recurrent rows; the sampled x rows are empty, not a reshape error
    inputs = consistent_inputs(T=5, B=3, I=0, C=4, layout="icfo", use_peephole=False, seed=1)
    fit = detect.fit_activations(inputs, "seq", 5)
    assert (fit.layout, fit.use_peephole) == ("icfo", False)
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", inputs)), "-o", str(tmp_path / "g.npz"),
                                  "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["op"] == "BlockLSTMGrad"


def test_check_passes_a_genuine_v1_pair_without_flags(runner):
    """BlockLSTM tensors against TF's genuine BlockLSTMGrad: not the tape bug, and no --layout needed."""
    result = runner.invoke(main, ["check", str(FIXTURES / "seq_v1_peep.in.npz"), "-r",
                                  str(FIXTURES / "seq_v1_peep.expected.npz")])
    assert result.exit_code == 0, result.stdout
    assert "GradientTape" not in result.stdout and "PASS" in result.stdout


def test_check_explains_a_v2_kernel_run_on_v1_activations(runner, tmp_path):
    """The reverse mistake: BlockLSTMGradV2 on BlockLSTM tensors.  The reference is wrong, and check says so
    from what the activations fit (not 'use --layout ifco')."""
    inputs = load_case("seq_v1_peep")[0]
    import lstmgrad_cli as lg

    ref = tmp_path / "ref.npz"
    np.savez(ref, **lg.block_lstm_grad_v2(**inputs)._asdict())
    result = runner.invoke(main, ["check", str(FIXTURES / "seq_v1_peep.in.npz"), "-r", str(ref), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)["result"]
    assert doc["layout"] == "icfo" and doc["sources"]["layout"] == "activations"
    assert "run on activations that BlockLSTM (V1) made" in doc["explanations"][0]
    assert "so it is not their gradient" in doc["explanations"][0]


def test_check_says_where_the_difference_is(runner, tmp_path):
    ref = dict(np.load(FIXTURES / "seq_v2_larger.expected.npz"))
    ref["x_grad"] = ref["x_grad"].copy()
    ref["x_grad"][5, 2, 7] += 0.5
    ref["x_grad"][9, 0, 0] += 0.1
    path = tmp_path / "ref.npz"
    np.savez(path, **ref)
    result = runner.invoke(main, ["check", str(FIXTURES / "seq_v2_larger.in.npz"), "-r", str(path)])
    assert result.exit_code == 1
    text = " ".join(result.stdout.split())
    assert ("x_grad: 2 of 1536 elements out of tolerance; the worst at [t=5, b=2, i=7]: " in text
            and "the first failing time step is t=5" in text)
    assert "max err / max|ref|" in result.stdout
    doc = json.loads(runner.invoke(main, ["check", str(FIXTURES / "seq_v2_larger.in.npz"), "-r", str(path),
                                          "--json"]).stdout)["result"]
    x = next(c for c in doc["comparisons"] if c["name"] == "x_grad")
    assert (x["worst_index"], x["out_of_tolerance"], x["first_bad_step"]) == ([5, 2, 7], 2, 5)
    assert x["worst_reference"] == pytest.approx(float(ref["x_grad"][5, 2, 7]))


def test_the_closest_hint_reads_as_words(runner, tmp_path):
    ref = dict(np.load(FIXTURES / "seq_v2_peep.tape.npz"))
    ref["w_grad"] = ref["w_grad"] * 1.5  # the tape bug, then something no cause explains
    path = tmp_path / "ref.npz"
    np.savez(path, **ref)
    result = runner.invoke(main, ["check", str(FIXTURES / "seq_v2_peep.in.npz"), "-r", str(path)])
    text = " ".join(result.stdout.split())
    assert "closest: layout icfo (BlockLSTMGrad) (7 of 8 tensors match" in text and "{" not in text


# -- the wrong command or the wrong file ------------------------------------------------------------

def test_a_cell_file_under_seq_and_a_sequence_under_cell_name_the_other_command(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "cell_peep.in.npz"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "this is a single cell step; use `lstmgrad cell`" in result.stderr
    result = runner.invoke(main, ["cell", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "a sequence [T, B, I]; use `lstmgrad seq`" in result.stderr
    assert result.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


def test_an_lstmgrad_output_given_as_input_says_so(runner, tmp_path):
    out = tmp_path / "g.h5"
    assert runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out), "-q"]).exit_code == 0
    result = runner.invoke(main, ["seq", str(out), "-o", str(tmp_path / "again.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "is an lstmgrad output (the BlockLSTMGradV2 gradients of" in result.stderr
    assert "seq_v2_peep.in.npz" in result.stderr and "missing tensor" not in result.stderr


def test_a_reference_file_given_as_input_says_so(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.expected.npz"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1
    assert "holds gradients (x_grad, cs_prev_grad," in result.stderr and "lstmgrad check INPUT -r" in result.stderr


def save_npy_dir(folder, tensors):
    folder.mkdir()
    for name, value in tensors.items():
        np.save(folder / f"{name}.npy", value)
    return folder


def test_a_directory_of_npy_files_is_one_input(runner, tmp_path):
    folder = save_npy_dir(tmp_path / "dump", without("seq_v1_nopeep", "use_peephole"))
    result = runner.invoke(main, ["seq", str(folder), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"]
    assert len(doc) == 1 and doc[0]["op"] == "BlockLSTMGrad" and doc[0]["output"] == str(tmp_path / "dump.grads.npz")
    for key, value in load_case("seq_v1_nopeep")[1].items():
        assert_close_scaled(read_any(tmp_path / "dump.grads.npz")[key], value, name=key)
    assert io.sniff_format(folder) == "npy-dir"


def test_a_batch_directory_holds_npy_directories_as_inputs(runner, tmp_path):
    batch = tmp_path / "runs"
    batch.mkdir()
    save_npy_dir(batch / "a", without("seq_v2_peep"))
    save_npy_dir(batch / "b", without("cell_peep"))
    np.savez(batch / "c.npz", **load_case("seq_v2_nopeep")[0])
    (tmp_path / "out").mkdir()
    result = runner.invoke(main, ["seq", str(batch), "--out-dir", str(tmp_path / "out"), "--keep-going", "-q"])
    assert result.exit_code == 1  # b is a cell step
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.grads.npz", "c.grads.npz"]
    assert "b: x has shape [3, 4], one step [B, I]" in result.stderr


def test_a_lone_npy_file_explains_what_to_do(runner, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 4), np.float32))
    result = runner.invoke(main, ["seq", str(tmp_path / "x.npy")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "is a single .npy array" in result.stderr and "x.npy, cs_prev.npy, h_prev.npy" in result.stderr


def test_hostile_npy_directory_members_are_refused_cleanly(runner, tmp_path):
    import pickle

    folder = save_npy_dir(tmp_path / "dump", without("seq_v2_peep"))
    (folder / "x.npy").write_bytes(pickle.dumps(object()))  # not a .npy stream
    result = runner.invoke(main, ["seq", str(folder), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "x is not a numpy array" in result.stderr
    np.save(folder / "x.npy", np.array([object()], dtype=object), allow_pickle=True)
    result = runner.invoke(main, ["seq", str(folder), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "pickled object array" in result.stderr
    with open(folder / "x.npy", "wb") as fh:  # declares 4 TB, holds nothing
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)})
    result = runner.invoke(main, ["seq", str(folder), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "refused before reading" in result.stderr
    assert not (tmp_path / "g.npz").exists()


def test_a_group_of_an_npy_directory_stays_inside_it(tmp_path):
    folder = save_npy_dir(tmp_path / "dump", without("seq_v2_peep"))
    save_npy_dir(folder / "lstm", without("seq_v1_peep"))
    problem = load_problem(folder, group="lstm")
    assert problem.layout == "icfo"
    with pytest.raises(io.InputFileError, match="leaves the directory"):
        io.read_inputs(folder, ["x"], group="../dump")


# A directory given with --group whose tensors sit in that subdirectory alone (npyd/sub/x.npy, ...): one input, as
# docs/inputs.md says a .npy directory's --group is a subdirectory; without --group it stays a batch of its
# subdirectories (docs/batches.md).


@pytest.fixture
def grouped_npy_dir(tmp_path):
    """npyd/sub/{x,cs_prev,...}.npy and nothing else in npyd."""
    folder = tmp_path / "npyd"
    folder.mkdir()
    save_npy_dir(folder / "sub", without("seq_v2_peep"))
    return folder


def test_an_npy_directory_holding_only_its_group_is_one_input_to_the_library(tmp_path, grouped_npy_dir):
    import lstmgrad_cli
    from lstmgrad_cli.io import npydir
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.check import CheckOptions, run_check
    from lstmgrad_cli.operations.grad import GradOptions
    from lstmgrad_cli.operations.inspect import inspect_file

    inputs = lstmgrad_cli.load(grouped_npy_dir, group="sub")
    assert inputs.op == "BlockLSTMGradV2" and inputs.sources["layout"] == "activations"
    for key, value in load_case("seq_v2_peep")[1].items():
        assert_close_scaled(getattr(inputs.gradients(), key), value, name=key)

    report = inspect_file(grouped_npy_dir, "sub")
    assert report.format == "npy-dir" and report.kind == "seq" and report.layout == "ifco" and not report.problems

    check = run_check(grouped_npy_dir, FIXTURES / "seq_v2_peep.expected.npz", CheckOptions(group="sub"))
    assert check.passed and check.op == "BlockLSTMGradV2"

    (task,) = batch.plan_tasks([grouped_npy_dir], None, None, batch.DumpSelection("seq", "sub"))
    assert task.input_format == "npy-dir" and task.group == "sub"
    assert task.output == tmp_path / "npyd.grads.npz"  # beside the directory given, as for any .npy directory
    (result,) = batch.run_batch([task], GradOptions("seq", group="sub"))
    assert result.status == "ok", result.error
    assert_close_scaled(read_any(task.output)["w_grad"], load_case("seq_v2_peep")[1]["w_grad"], name="w_grad")

    assert npydir.sniff_group(grouped_npy_dir, "sub") and npydir.sniff_group(grouped_npy_dir, "/sub/")
    assert npydir.input_format(grouped_npy_dir, "sub") == "npy-dir"
    # a group that is no .npy directory there: what the directory is, as before, and never a batch's error
    with pytest.raises(io.InputFileError, match="is a directory, not a file"):
        lstmgrad_cli.load(grouped_npy_dir, group="nope")
    with pytest.raises(io.InputFileError, match="leaves the directory"):
        lstmgrad_cli.load(grouped_npy_dir, group="../npyd/sub")  # (a .npy directory there, but outside)


def test_a_batch_directory_stays_a_batch_with_a_group(tmp_path):
    """Only a directory holding no input of its own is one input through its group: .npz/.h5 files, .npy files
    at its top, or a TF debug dump keep it what it was, and without a group it is a batch."""
    from lstmgrad_cli.io import npydir

    runs = tmp_path / "runs"
    runs.mkdir()
    save_npy_dir(runs / "sub", without("seq_v2_peep"))
    save_npy_dir(runs / "other", without("seq_v2_nopeep"))
    assert npydir.sniff_group(runs, "sub") and not npydir.sniff_group(runs, None)
    assert not npydir.sniff_group(runs, "missing") and not npydir.sniff_group(runs / "sub" / "x.npy", "sub")
    assert io.input_directory_format(runs) is None  # (what the CLI expands as a batch without --group)
    np.savez(runs / "c.npz", **load_case("seq_v2_nopeep")[0])
    assert not npydir.sniff_group(runs, "sub")  # .npz files beside it: a batch, each input read with the group
    (runs / "c.npz").unlink()
    np.save(runs / "x.npy", np.zeros(3, np.float32))
    assert not npydir.sniff_group(runs, "sub")  # an input itself, whose group is read as a subdirectory
    assert npydir.input_format(runs, "sub") == "npy-dir"
    (runs / "x.npy").unlink()
    for name in ("a.metadata", "a.execution"):  # a TF debug dump: its group is an execution
        (runs / name).write_bytes(b"")
    assert not npydir.sniff_group(runs, "sub")


def test_seq_reads_an_npy_directory_through_its_group(runner, tmp_path, grouped_npy_dir):
    out = tmp_path / "nd.npz"
    result = runner.invoke(main, ["seq", str(grouped_npy_dir), "--group", "sub", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["input"] == str(grouped_npy_dir)
    assert_close_scaled(read_any(out)["x_grad"], load_case("seq_v2_peep")[1]["x_grad"], name="x_grad")


def test_inspect_and_check_read_an_npy_directory_through_its_group(runner, grouped_npy_dir):
    result = runner.invoke(main, ["inspect", str(grouped_npy_dir), "--group", "sub", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["result"]["layout"] == "ifco"
    result = runner.invoke(main, ["check", str(grouped_npy_dir), "--group", "sub",
                                  "-r", str(FIXTURES / "seq_v2_peep.expected.npz")])
    assert result.exit_code == 0, result.stderr


def test_warnings_reach_a_real_terminal_process(tmp_path):
    """Once as a real subprocess: the warning is one stderr line, the output is written, exit 0."""
    out = tmp_path / "g.npz"
    proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "seq", str(FIXTURES / "seq_v2_peep.in.npz"),
                           "-o", str(out), "--layout", "icfo", "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == ""
    assert proc.stderr.startswith("Warning: ") and proc.stderr.count("\n") == 1 and TAPE_WARNING in proc.stderr
    assert out.exists()
