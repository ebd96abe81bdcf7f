"""The seq and cell commands through click's CliRunner, and once as a real subprocess."""

from __future__ import annotations

import errno
import gc
import io
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import FIXTURES, assert_close_scaled, load_case, write_h5, write_npz
from hypothesis import given, settings
from hypothesis import strategies as st

import lstmgrad_cli as lg
from lstmgrad_cli.backends import cpu_blas
from lstmgrad_cli.cli import _common, forward_cmd, grad_cmd, main
from lstmgrad_cli.io import read_metadata

SEQ_OUTPUTS = ["x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad", "b_grad"]


def read_any(path: Path) -> dict:
    if path.suffix == ".npz":
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    with h5py.File(path, "r") as fh:
        return {k: fh[k][()] for k in fh.keys()}


def assert_matches_expected(out: Path, expected: dict):
    got = read_any(out)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        assert_close_scaled(got[key], value, name=key)


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".hdf5"])
def test_seq_writes_tf_gradients_in_the_format_of_the_extension(runner, tmp_path, suffix):
    out = tmp_path / f"grads{suffix}"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    assert_matches_expected(out, load_case("seq_v2_peep")[1])
    names = list(read_any(out))
    assert [n for n in names if not n.startswith("__")] == SEQ_OUTPUTS  # TF's order
    meta = read_metadata(out)
    assert meta["op"] == "BlockLSTMGradV2" and meta["layout"] == "ifco" and meta["backend"] == "numpy"
    assert bool(meta["use_peephole"]) is True and int(meta["seq_len_max"]) == 5
    assert meta["source"].endswith("seq_v2_peep.in.npz")
    assert meta["backend_version"] == np.__version__ + cpu_blas.version_note()  # " with MKL ..." on MKL
    for column in ("x_grad", "L2 norm", "max |value|", "finite", "BlockLSTMGradV2", "seq_len_max=5"):
        assert column in result.stdout


def test_seq_icfo_layout_is_blocklstmgrad(runner, tmp_path):
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v1_peep.in.npz"), "-o", str(out), "--layout", "icfo"])
    assert result.exit_code == 0, result.stderr
    assert_matches_expected(out, load_case("seq_v1_peep")[1])
    assert "BlockLSTMGrad " in result.stdout


def test_cell_writes_all_nine_gradients(runner, tmp_path):
    out = tmp_path / "g.h5"
    result = runner.invoke(main, ["cell", str(FIXTURES / "cell_peep.in.npz"), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert_matches_expected(out, load_case("cell_peep")[1])
    assert read_metadata(out)["op"] == "LSTMBlockCellGrad"


def test_default_output_is_beside_the_input_in_its_format(runner, tmp_path):
    inputs, expected, _ = load_case("seq_v2_nopeep")
    src = write_h5(tmp_path / "run.h5", inputs)
    result = runner.invoke(main, ["seq", str(src)])
    assert result.exit_code == 0, result.stderr
    assert_matches_expected(tmp_path / "run.grads.h5", expected)


def test_hdf5_group_attributes_and_camel_case_names(runner, tmp_path):
    inputs, expected, _ = load_case("seq_v2_partial")
    camel = {"cs_prev": "csPrev", "h_prev": "hPrev", "cs_grad": "csGrad", "h_grad": "hGrad"}
    tensors = {camel.get(k, k): v for k, v in inputs.items() if k not in ("seq_len_max", "use_peephole")}
    src = write_h5(tmp_path / "dump.hdf5", tensors, group="model/lstm",
                   attrs={"seqLenMax": int(inputs["seq_len_max"]), "usePeephole": True})
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(src), "--group", "model/lstm", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    assert_matches_expected(out, expected)
    doc = json.loads(result.stdout)["results"][0]
    assert doc["sources"] == {"use_peephole": "attribute", "seq_len_max": "attribute", "layout": "activations"}
    assert doc["seq_len_max"] == 3


def test_missing_scalars_use_defaults_and_say_so(runner, tmp_path):
    inputs, _, _ = load_case("seq_v2_nopeep")
    src = write_npz(tmp_path / "plain.npz", {k: v for k, v in inputs.items()
                                              if k not in ("seq_len_max", "use_peephole", "wci", "wcf", "wco")})
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.stderr
    assert_matches_expected(tmp_path / "g.npz", load_case("seq_v2_nopeep")[1])
    for note in ("seq_len_max: not in the file, using T = 4", "use_peephole: not in the file",
                 "wci, wcf, wco: not in the file, zeros"):
        assert note in " ".join(result.stdout.split())


def test_flags_override_the_file(runner, tmp_path):
    inputs, _, _ = load_case("seq_v2_peep")
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out), "--no-peephole",
                                  "--seq-len-max", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["results"][0]
    assert doc["use_peephole"] is False and doc["seq_len_max"] == 2
    assert doc["sources"] == {"use_peephole": "flag", "seq_len_max": "flag", "layout": "activations"}
    # the activations were computed with peepholes: computed as asked, and said
    assert doc["warnings"] == [line.split(": ", 2)[2] for line in result.stderr.splitlines()]
    assert "computed with use_peephole=true, not use_peephole=false as asked (--no-peephole)" in result.stderr
    got = read_any(out)
    assert not got["wci_grad"].any() and not got["x_grad"][2:].any() and got["x_grad"][:2].any()


def test_compute_dtype_float16_reproduces_tf_half_rounding(runner, tmp_path):
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["cell", str(FIXTURES / "cell_half.in.npz"), "-o", str(out),
                                  "--compute-dtype", "float16"])
    assert result.exit_code == 0, result.stderr
    np.testing.assert_array_equal(read_any(out)["dicfo"], load_case("cell_half")[1]["dicfo"])


def test_json_document_schema(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz"),
                                  "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["command"] == "seq" and doc["summary"] == {"done": 1, "failed": 0, "skipped": 0, "lost": 0, "not_run": 0}
    res = doc["results"][0]
    for key in ("input", "output", "op", "status", "layout", "backend", "backend_version", "dtype",
                "compute_dtype", "use_peephole", "seq_len_max", "dims", "defaults", "tensors", "seconds"):
        assert key in res
    assert res["dims"] == {"T": 5, "B": 3, "I": 4, "C": 6}
    names = [t["name"] for t in res["tensors"]]
    assert names == SEQ_OUTPUTS
    expected = load_case("seq_v2_peep")[1]
    for t in res["tensors"]:
        value = expected[t["name"]].astype(np.float64)
        assert t["shape"] == list(value.shape) and t["dtype"] == "float32" and t["finite"] is True
        assert t["l2_norm"] == pytest.approx(np.linalg.norm(value), rel=1e-5)
        assert t["max_abs"] == pytest.approx(np.max(np.abs(value)), rel=1e-5)


def test_quiet_prints_nothing(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz"), "-q"])
    assert result.exit_code == 0 and result.stdout == "" and result.stderr == ""
    assert (tmp_path / "g.npz").exists()


COLOR_SGR = re.compile(r"\x1b\[[0-9;]*?(?:3[0-8]|9[0-7])[;m]")


def test_no_color_is_honoured(runner, tmp_path):
    inputs, _, _ = load_case("seq_v2_peep")
    inputs["x"] = inputs["x"].copy()
    inputs["x"][0, 0, 0] = np.inf  # makes the table show a red "no" in the finite column
    src = write_npz(tmp_path / "inf.npz", inputs)
    args = ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--force"]
    colored = runner.invoke(main, args, env={"FORCE_COLOR": "1"})
    plain = runner.invoke(main, args, env={"FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert colored.exit_code == plain.exit_code == 0
    assert COLOR_SGR.search(colored.stdout)
    assert not COLOR_SGR.search(plain.stdout) and "x_grad" in plain.stdout


def test_existing_output_needs_force_and_is_left_untouched(runner, tmp_path):
    out = tmp_path / "g.npz"
    out.write_bytes(b"precious")
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out)])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {FIXTURES / 'seq_v2_peep.in.npz'}: its output {out} already exists and is not "
                             "a complete lstmgrad output; use --force to overwrite it\n")
    assert out.read_bytes() == b"precious"
    forced = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out), "--force"])
    assert forced.exit_code == 0
    assert_matches_expected(out, load_case("seq_v2_peep")[1])


def bad_input_case(tmp_path, name, **changes):
    inputs, _, _ = load_case("seq_v2_peep")
    inputs.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        inputs.pop(key)
    return write_npz(tmp_path / name, inputs)


@pytest.mark.parametrize("changes, message", [
    ({"i": None, "cs": None, "h_grad": None}, "missing tensors i, cs, h_grad (BlockLSTMGradV2 needs x,"),
    ({"x": np.zeros(5, np.float32)}, "x must be rank 3 but is rank 1"),
    ({"x": np.zeros((5, 3), np.float32)}, "x has shape [5, 3], one step [B, I]: this is a single cell step; use "
                                           "`lstmgrad cell`"),
    ({"cs_prev": np.zeros((4, 6), np.float32)}, "cs_prev.dims(0) != batch_size: 4 vs. 3"),
    ({"seq_len_max": np.int64(9)}, "seq_len_max must be between 0 and 5 but is 9"),
    ({"w": np.zeros((10, 24), np.float64)}, "all tensors must have one dtype"),
    ({"x": np.zeros((5, 3, 4), np.int32)}, "x has dtype int32"),
])
def test_bad_tensors_give_one_line_and_no_output(runner, tmp_path, changes, message):
    src = bad_input_case(tmp_path, "bad.npz", **changes)
    before = src.read_bytes()
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(src), "-o", str(out)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {src}: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]
    assert src.read_bytes() == before


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"", "file is empty (0 bytes)"),
    (b"hello, not a tensor file", "not an HDF5, NPZ or safetensors file"),
])
def test_unreadable_files(runner, tmp_path, content, message):
    src = tmp_path / "in.npz"
    if content is not None:
        src.write_bytes(content)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and message in result.stderr and result.stderr.startswith("Error: ")


def test_truncated_and_pickled_npz(runner, tmp_path):
    whole = (FIXTURES / "seq_v2_peep.in.npz").read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole[: len(whole) // 2])
    result = runner.invoke(main, ["seq", str(cut), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "corrupt or truncated" in result.stderr
    inputs, _, _ = load_case("seq_v2_peep")
    inputs["x"] = np.array([object()], dtype=object)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **inputs)
    result = runner.invoke(main, ["seq", str(pickled), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "pickled object array" in result.stderr


@pytest.mark.parametrize("args, fragment", [
    (["seq", "--frobnicate", "x.npz"], "No such option"),
    (["seq"], "Missing argument"),
    (["seq", "a.npz", "--backend", "nonesuch"], "unknown backend 'nonesuch'; known backends: numpy, numba, cupy"),
    (["seq", "a.npz", "b.npz", "-o", "g.npz"], "-o/--output takes a single INPUT"),
    (["seq", "a.npz", "--layout", "xyz"], "Invalid value for '--layout'"),
    (["seq", "a.npz", "--seq-len-max", "-1"], "Invalid value for '--seq-len-max'"),
    (["seq", "a.npz", "-o", "g.txt"], "Invalid value for '-o' / '--output': g.txt: unknown output extension '.txt'; "
                                      "use .npz, .h5, .hdf5 or .safetensors"),
    (["cell", "a.npz", "-o", "g"], "unknown output extension ''"),
    (["forward", "seq", "a.npz", "-o", "g.txt"], "Invalid value for '-o' / '--output': g.txt: unknown output "
                                                 "extension '.txt'"),
    (["seq", "a.npz", "--out-dir", "never-made", "--op", "NoSuchOp"], "--op and --execution choose executions"),
])
def test_usage_errors_exit_2(runner, args, fragment):
    result = runner.invoke(main, args)
    assert result.exit_code == 2 and fragment in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr


def test_an_unknown_output_extension_is_a_usage_error_before_anything_runs(runner, tmp_path):
    src = tmp_path / "run.npz"
    src.write_bytes((FIXTURES / "seq_v2_peep.in.npz").read_bytes())
    before = src.read_bytes()
    for args in (["seq", str(src), "-o", str(tmp_path / "out.txt")],
                 ["forward", "seq", str(src), "-o", str(tmp_path / "out.txt")]):
        result = runner.invoke(main, args)
        assert result.exit_code == 2, (args, result.stderr)
        assert result.stderr.endswith(f"Error: Invalid value for '-o' / '--output': {tmp_path / 'out.txt'}: unknown "
                                      "output extension '.txt'; use .npz, .h5, .hdf5 or .safetensors\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run.npz"] and src.read_bytes() == before
    # a directory named as the output stays the run's own error (exit 1), whatever its name
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path)])
    assert result.exit_code == 1 and "is a directory" in result.stderr


def test_out_dir_is_made_only_for_a_run_that_gets_going(runner, tmp_path):
    out_dir = tmp_path / "new" / "grads"
    refused = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "--out-dir", str(out_dir),
                                   "--op", "NoSuchOp"])
    assert refused.exit_code == 2 and "--op and --execution" in refused.stderr
    assert not (tmp_path / "new").exists()
    ran = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "--out-dir", str(out_dir), "-q"])
    assert ran.exit_code == 0, ran.stderr
    assert_matches_expected(out_dir / "seq_v2_peep.in.grads.npz", load_case("seq_v2_peep")[1])


class ClosedPipe(io.StringIO):
    """A stdout whose reader has exited (``| head``): every write is EPIPE."""

    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def closed_stdout_console():
    return _common._stdout_console_class()(file=ClosedPipe(), soft_wrap=False, width=200)


def test_a_closed_stdout_after_the_only_file_is_done_is_not_a_failure(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(grad_cmd, "stdout_console", closed_stdout_console)
    out = tmp_path / "hd.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ("Warning: stdout was closed (its reader exited) before everything was printed; the run "
                             "was not stopped: 1 of 1 files done, 0 failed, every output written is complete\n")
    assert "rerun" not in result.stderr and "batch stopped" not in result.stderr
    assert_matches_expected(out, load_case("seq_v2_peep")[1])


def test_a_closed_stdout_that_stops_a_batch_is_still_a_failure(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(grad_cmd, "stdout_console", closed_stdout_console)
    names = ["seq_v2_peep", "seq_v2_nopeep", "seq_v2_larger", "seq_v2_clip", "seq_v2_partial", "seq_v2_half"]
    (tmp_path / "in").mkdir()
    for name in names:
        write_npz(tmp_path / "in" / f"{name}.npz", load_case(name)[0])
    result = runner.invoke(main, ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert re.fullmatch(r"Error: stdout was closed \(its reader exited\), so the batch stopped: \d of 6 files done, "
                        r"[1-5] not run, every output written is complete; rerun with --skip-existing to finish\n",
                        result.stderr), result.stderr


def test_a_closed_stdout_while_the_json_of_a_finished_batch_is_printed_is_not_a_failure(runner, tmp_path,
                                                                                        monkeypatch):
    def closed(document):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(grad_cmd, "print_json", closed)
    (tmp_path / "in").mkdir()
    for name in ("seq_v2_peep", "seq_v2_nopeep"):
        write_npz(tmp_path / "in" / f"{name}.npz", load_case(name)[0])
    result = runner.invoke(main, ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.startswith("Warning: stdout was closed (its reader exited) before everything was printed; "
                                    "the run was not stopped: 2 of 2 files done, 0 failed")
    assert result.stderr.count("\n") == 1
    for name in ("seq_v2_peep", "seq_v2_nopeep"):
        assert_matches_expected(tmp_path / "out" / f"{name}.grads.npz", load_case(name)[1])


def test_a_closed_stdout_after_forward_wrote_its_output_is_not_a_failure(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(forward_cmd, "stdout_console", closed_stdout_console)
    out = tmp_path / "f.npz"
    result = runner.invoke(main, ["forward", "seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ("Warning: stdout was closed (its reader exited) before everything was printed; "
                             f"{out} is written and complete\n")
    assert out.exists()


def help_of(runner, *command) -> str:
    result = runner.invoke(main, [*command, "--help"], terminal_width=100)
    assert result.exit_code == 0
    return " ".join(result.stdout.split())


def test_help_texts_say_what_the_options_take(runner):
    assert "-o, --output PATH Output file (.npz, .h5, .hdf5, .safetensors)" in help_of(runner, "seq")
    assert "-o, --output PATH Output file (.npz, .h5, .hdf5, .safetensors)" in help_of(runner, "forward", "cell")
    assert "in a TensorFlow debug dump, the execution to inspect" in help_of(runner, "inspect")
    for command in (("cell",), ("forward", "cell")):  # one step: LSTMBlockCell's defaults, nothing of the seq ops
        text = help_of(runner, *command)
        assert "LSTMBlockCell's 1" in text and "LSTMBlockCell's 3" in text, command
        assert "BlockLSTM " not in text and "BlockLSTMV2" not in text, command
    text = help_of(runner, "forward", "seq")
    assert "BlockLSTMV2 has none" in text and "3 for BlockLSTM (--layout icfo), 0 for BlockLSTMV2" in text
    # the gradient commands' words for the same defaults: one table (spec.FORWARD_DEFAULTS), the same words
    assert "3 for BlockLSTM (--layout icfo), 0 for BlockLSTMV2" in help_of(runner, "seq")
    assert "LSTMBlockCell" not in text.split("--forget-bias", 1)[1]


def test_unknown_backend_from_environment_is_a_usage_error(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz")],
                           env={"LSTMGRAD_BACKEND": "nonesuch"})
    assert result.exit_code == 2 and "unknown backend 'nonesuch'" in result.stderr


def test_several_inputs_with_out_dir_and_keep_going(runner, tmp_path):
    good = [write_npz(tmp_path / f"{n}.npz", load_case(n)[0]) for n in ("seq_v2_peep", "seq_v2_nopeep")]
    bad = bad_input_case(tmp_path, "broken.npz", i=None)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    stopped = runner.invoke(main, ["seq", str(bad), *map(str, good), "--out-dir", str(out_dir), "--json"])
    assert stopped.exit_code == 1 and list(out_dir.iterdir()) == []
    assert json.loads(stopped.stdout)["summary"] == {"done": 0, "failed": 1, "skipped": 0, "lost": 0, "not_run": 2}
    going = runner.invoke(main, ["seq", str(bad), *map(str, good), "--out-dir", str(out_dir), "--keep-going",
                                 "--json"])
    assert going.exit_code == 1
    doc = json.loads(going.stdout)
    assert doc["summary"] == {"done": 2, "failed": 1, "skipped": 0, "lost": 0, "not_run": 0}
    assert [r["status"] for r in doc["results"]] == ["failed", "ok", "ok"]
    assert "missing tensor i" in doc["results"][0]["error"]
    for name in ("seq_v2_peep", "seq_v2_nopeep"):
        assert_matches_expected(out_dir / f"{name}.grads.npz", load_case(name)[1])


def test_directory_and_glob_inputs(runner, tmp_path):
    for n in ("seq_v2_peep", "seq_v2_nopeep"):
        write_npz(tmp_path / f"{n}.npz", load_case(n)[0])
    result = runner.invoke(main, ["seq", str(tmp_path), "-q"])
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "seq_v2_peep.grads.npz").exists() and (tmp_path / "seq_v2_nopeep.grads.npz").exists()
    again = runner.invoke(main, ["seq", str(tmp_path / "seq_*[pe].npz"), "--force", "--json"])
    assert again.exit_code == 0, again.stderr
    assert len(json.loads(again.stdout)["results"]) == 2


def test_nan_inputs_are_computed_through_and_flagged(runner, tmp_path):
    inputs, _, _ = load_case("seq_v2_peep")
    inputs["cs_grad"] = inputs["cs_grad"].copy()
    inputs["cs_grad"][1, 0, 0] = np.nan
    src = write_npz(tmp_path / "nan.npz", inputs)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)["results"][0]
    assert doc["nonfinite_inputs"] == {"cs_grad": 1}
    assert any(not t["finite"] for t in doc["tensors"])
    strict = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g2.npz"), "--strict"])
    assert strict.exit_code == 1 and "NaN/Inf in inputs: cs_grad (1)" in strict.stderr
    assert not (tmp_path / "g2.npz").exists()  # a strict failure writes nothing (--skip-existing would skip it)


def test_help_on_every_command(runner):
    for command in main.list_commands(None):
        result = runner.invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.stdout, command


def test_names_are_shown_as_they_are_never_as_emoji(tmp_path, runner):
    """rich turns :smile: into an emoji unless told not to; a file or tensor name keeps its colons."""
    source = tmp_path / "run:smile:.npz"
    source.write_bytes((FIXTURES / "seq_v2_peep.in.npz").read_bytes())
    result = runner.invoke(main, ["seq", str(source), "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.stderr
    assert f"{source} -> {tmp_path / 'out' / 'run:smile:.grads.npz'}" in result.stdout
    assert "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in result.stdout


CELL_TEXT = st.one_of(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=14),
                      st.sampled_from([":smile:", "a :thumbs_up: b", "[bold]x[/]", "\\[b]"])).map(_common.printable)


@settings(max_examples=int(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES", 300)), deadline=None,
          derandomize="LSTMGRAD_FUZZ_EXAMPLES" not in os.environ)
@given(data=st.data(), width=st.integers(10, 200))
def test_a_table_of_plain_cells_is_drawn_as_rich_draws_it(data, width):
    """table_text draws the table a batch prints for every file without rich's layout (~3 ms a file): wherever it
    does (no colours, a UTF-8 console, a table that fits), its text is rich's, character for character, whatever
    the cells (wide, combining, spaces, empty); elsewhere rich draws it."""
    from rich.cells import cell_len

    columns = data.draw(st.lists(st.tuples(CELL_TEXT, st.sampled_from(["left", "right", "center"])), min_size=1,
                                 max_size=6))
    rows = data.draw(st.lists(st.tuples(*[CELL_TEXT] * len(columns)), max_size=5))
    printed = {}
    for how in ("print_rows", "rich"):
        out = io.StringIO()
        console = _common._stdout_console_class()(file=out, width=width, color_system=None, soft_wrap=False)
        if how == "print_rows":
            _common.print_rows(console, columns, rows, "heading", lambda: rich_table(columns, rows))
        else:
            _common.print_table(console, rich_table(columns, rows), "heading")
        printed[how] = out.getvalue()
    assert printed["print_rows"] == printed["rich"]
    headers = [header for header, _ in columns]
    fits = sum(max(map(cell_len, cells)) + 3 for cells in zip(headers, *rows, strict=True)) + 1 <= width
    edges = any(cell != cell.strip() for cell in (*headers, *(cell for row in rows for cell in row)))
    assert (_common.table_text(console, columns, rows) is not None) == (bool(rows) and fits and not edges)


def rich_table(columns, rows):
    """``new_table()`` with these columns and rows, each cell plain text (as ``plain`` gives it)."""
    from rich.text import Text

    table = _common.new_table()
    for header, justify in columns:
        table.add_column(Text(header), justify=justify)
    for row in rows:
        table.add_row(*map(Text, row))
    return table


def test_real_subprocess_run(tmp_path):
    out = tmp_path / "g.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("LSTMGRAD_BACKEND", "NO_COLOR")}
    proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "seq", str(FIXTURES / "seq_v2_peep.in.npz"),
                           "-o", str(out), "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert json.loads(proc.stdout)["results"][0]["status"] == "ok"
    assert_matches_expected(out, load_case("seq_v2_peep")[1])
    bad = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "seq", str(tmp_path / "missing.npz")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and bad.stderr.startswith("Error: ") and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_quiet_run_does_not_import_what_it_does_not_show(tmp_path):
    """Every command pays its imports: rich (~25 ms for its console, ~11 ms more for its progress bar and tables)
    only when something is shown, and what only some inputs need (hashlib, subprocess) only for them."""
    code = ("import sys; from lstmgrad_cli.cli import main; rc = main(sys.argv[1:], standalone_mode=False); "
            "print(sorted(m for m in ('rich.console', 'rich.progress', 'rich.table', 'secrets', 'hashlib', "
            "'subprocess') if m in sys.modules))")
    run = [sys.executable, "-c", code, "seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz")]
    quiet = subprocess.run([*run, "-q"], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "[]"
    as_json = subprocess.run([*run, "--force", "--json"], capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 0, as_json.stderr
    assert as_json.stdout.strip().splitlines()[-1] == "[]"
    shown = subprocess.run([*run, "--force"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    # the summary table (drawn without rich's table module where nothing is coloured: table_text), no progress bar
    assert shown.stdout.strip().splitlines()[-1] == "['rich.console']"
    coloured = subprocess.run([*run, "--force"], capture_output=True, text=True, timeout=120,
                              env={**{k: v for k, v in os.environ.items() if k != "NO_COLOR"}, "FORCE_COLOR": "1"})
    assert coloured.returncode == 0, coloured.stderr
    assert "\x1b[" in coloured.stdout and coloured.stdout.strip().splitlines()[-1] == "['rich.console', 'rich.table']"


@pytest.mark.slow
def test_local_workers_of_a_builtin_backend_do_not_read_the_plugins(tmp_path):
    """Which backends plugins add is read from the installed packages' entry points, whose reading imports
    importlib.metadata (~40 ms); a batch on local workers with a built-in backend knows it by name."""
    for k in range(2):
        write_npz(tmp_path / f"in{k}.npz", load_case("seq_v2_peep")[0])
    code = ("import sys; from lstmgrad_cli.cli import main; rc = main(sys.argv[1:], standalone_mode=False); "
            "print('importlib.metadata' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "LSTMGRAD_BACKEND"}
    for backend in ("numpy", "auto"):
        run = subprocess.run([sys.executable, "-c", code, "seq", str(tmp_path / "in0.npz"), str(tmp_path / "in1.npz"),
                              "--out-dir", str(tmp_path / backend), "--workers", "2", "--backend", backend, "-q"],
                             capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "False"
        assert sorted(p.name for p in (tmp_path / backend).iterdir()) == ["in0.grads.npz", "in1.grads.npz"]


@pytest.mark.slow
def test_the_tf_ops_own_tensors_do_not_load_the_frameworks_modules(tmp_path):
    """Whose tensors an input holds is told from names alone (frameworks/names.py): a TF op's file loads neither the
    Keras and PyTorch modules nor the layer engine under them (~13 ms of every start), a PyTorch layer's file does."""
    code = ("import sys; from lstmgrad_cli.cli import main; rc = main(sys.argv[1:], standalone_mode=False); "
            "print(sorted(m for m in ('lstmgrad_cli.frameworks.keras', 'lstmgrad_cli.frameworks.pytorch', "
            "'lstmgrad_cli.frameworks.cells', 'lstmgrad_cli.layers.modules') if m in sys.modules))")
    tf = subprocess.run([sys.executable, "-c", code, "seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o",
                         str(tmp_path / "g.npz"), "-q"], capture_output=True, text=True, timeout=120)
    assert tf.returncode == 0, tf.stderr
    assert tf.stdout.strip() == "[]"
    rng = np.random.default_rng(0)
    layer = {"weight_ih_l0": rng.standard_normal((12, 2)), "weight_hh_l0": rng.standard_normal((12, 3)),
             "x": rng.standard_normal((4, 2, 2)), "h_grad": rng.standard_normal((4, 2, 3))}
    torch = subprocess.run([sys.executable, "-c", code, "seq", str(write_npz(tmp_path / "torch.npz", layer)), "-o",
                            str(tmp_path / "t.npz"), "-q"], capture_output=True, text=True, timeout=120)
    assert torch.returncode == 0, torch.stderr
    assert torch.stdout.strip() == str(["lstmgrad_cli.frameworks.cells", "lstmgrad_cli.frameworks.keras",
                                        "lstmgrad_cli.frameworks.pytorch", "lstmgrad_cli.layers.modules"])


def test_only_the_command_lines_own_process_freezes_what_it_imported(runner):
    """The command line's own process imports its command with the collector off, then hands what it imported to
    gc.freeze (neither its collections nor its exit walk it again) and turns the collector on for the work; a
    program that invokes the command (CliRunner) keeps its collector as it was."""
    code = ("import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, 'collecting', "
            "gc.isenabled())); from lstmgrad_cli.cli import main; main()")
    own = subprocess.run([sys.executable, "-c", code, "inspect", str(FIXTURES / "seq_v2_peep.in.npz")],
                         capture_output=True, text=True, timeout=120)
    assert own.returncode == 0, own.stderr
    assert own.stdout.splitlines()[-1] == "frozen True collecting True"
    before = gc.get_freeze_count()
    result = runner.invoke(main, ["inspect", str(FIXTURES / "seq_v2_peep.in.npz")])
    assert result.exit_code == 0, result.output
    assert gc.get_freeze_count() == before and gc.isenabled()


def test_names_with_markup_and_control_characters_are_shown_literally(runner, tmp_path):
    (tmp_path / "d[").mkdir()  # the path then reads .../d[/b]c[bold]x.npz: a closing tag rich would choke on
    src = write_npz(tmp_path / "d[" / "b]c[bold]x.npz", load_case("seq_v2_peep")[0])
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g\x1b[2J.npz")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    shown = result.stdout.replace("\n", "")  # the table title may wrap
    assert "d[/b]c[bold]x.npz" in shown and "\x1b[2J" not in shown and "\\x1b[2J" in shown


@pytest.mark.parametrize("command", [["seq"], ["forward", "seq"]])
def test_an_output_name_too_long_for_the_file_system_is_one_line(runner, tmp_path, command):
    too_long = tmp_path / ("g" * 300 + ".npz")
    result = runner.invoke(main, [*command, str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(too_long)])
    assert result.exit_code == 1 and result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr and "too long" in result.stderr


def test_summary_lines_are_not_wrapped_when_piped(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0
    assert any(line.startswith("BlockLSTMGradV2 (layout ifco, found from the activations) · backend numpy")
               and "computed in float32" in line
               for line in result.stdout.splitlines())


ALLOCATION_LOOP = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from lstmgrad_cli.execution.allocator import keep_heap_top
    assert keep_heap_top()
else:  # glibc's own thresholds (128 KiB), which a block freed while importing may have slid up, by chance of layout;
    # and no more imports than numpy: a hole an import leaves in the heap can take the loop's blocks below its top
    import ctypes
    mallopt = ctypes.CDLL(None).mallopt
    assert mallopt(-1, 128 * 1024) and mallopt(-3, 128 * 1024)  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    if sys.argv[2] == "small":  # a batch's per-file pattern: the same few hundred KiB allocated and freed
        arrays = [np.ones(12_000) for _ in range(8)]
    else:  # blocks of 1 MiB, which glibc maps one by one until its threshold slides up
        arrays = [np.ones(131_072) for _ in range(2)]
    del arrays
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keeping_the_heap_top_stops_a_page_fault_per_allocation_and_the_command_line_does_it(runner, monkeypatch):
    """glibc gives the top of the heap back and faults it in again per allocation; lstmgrad's own processes keep
    it (execution/allocator.py). Page faults counted in real subprocesses: a count, not a time."""
    from lstmgrad_cli import cli

    def faults(mode, sizes):
        run = subprocess.run([sys.executable, "-c", ALLOCATION_LOOP, mode, sizes], capture_output=True, text=True,
                             check=True)
        return int(run.stdout)

    small = {mode: faults(mode, "small") for mode in ("default", "keep")}
    assert small["default"] > 2000 and small["keep"] < small["default"] / 10, small
    large = faults("keep", "large")
    assert large < 2000, large  # not a mapping per block (M_TOP_PAD alone turned glibc's sliding threshold off)
    called = []
    monkeypatch.setattr(cli, "keep_heap_top", lambda: called.append(1) or True)
    assert runner.invoke(main, ["backends"]).exit_code == 0
    assert called


def test_forward_options_for_an_input_with_its_own_activations_say_they_change_nothing(runner, tmp_path):
    args = ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz"), "--json"]
    plain = json.loads(runner.invoke(main, args).stdout)["results"][0]
    given = runner.invoke(main, [*args[:-1], "--force", "--json", "--forget-bias", "5"])
    assert given.exit_code == 0, given.output
    notes = json.loads(given.stdout)["results"][0]["notes"]
    assert any("--forget-bias and --cell-clip set how forward outputs are recomputed" in n for n in notes)
    assert not any("--forget-bias" in n for n in plain["notes"])


@pytest.mark.parametrize("old, new", [("jobs", "operations.grad"), ("batch", "operations.batch"),
                                      ("diagnose", "operations.check"), ("inspection", "operations.inspect")])
def test_the_library_paths_the_docs_once_gave_still_import_with_a_warning(old, new):
    code = (f"import warnings; warnings.simplefilter('error'); import importlib\n"
            f"try:\n    importlib.import_module('lstmgrad_cli.{old}')\nexcept DeprecationWarning as err:\n"
            f"    print(err)\nwarnings.simplefilter('ignore'); moved = importlib.import_module('lstmgrad_cli.{old}')\n"
            f"real = importlib.import_module('lstmgrad_cli.{new}')\n"
            f"print(all(getattr(moved, n) is getattr(real, n) for n in dir(real) if not n.startswith('__')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [f"lstmgrad_cli.{old} is now lstmgrad_cli.{new}: import it from there", "True"]


def test_library_messages_name_commands_as_their_caller_spells_them(tmp_path):
    # A library message points at a command; the command line says `lstmgrad cell`, Python what does the same there.
    inputs = load_case("cell_peep")[0]
    step = write_npz(tmp_path / "step.npz", inputs)
    with pytest.raises(lg.InvalidArgumentError) as caught:
        lg.load(step, kind="seq")
    assert str(caught.value).endswith("this is a single cell step; use one cell step's gradient (kind='cell')")
    result = CliRunner().invoke(main, ["seq", str(step)])
    assert result.exit_code == 1 and result.stderr.endswith("this is a single cell step; use `lstmgrad cell`\n")
