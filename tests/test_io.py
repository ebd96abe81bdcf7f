"""The readers and the writer on good files, and NaN/Inf reporting (issue 6).

The hardened readers parse NPZ members and walk HDF5 links by hand; these tests pin down that every
legitimate file still reads exactly as numpy and h5py read it (dtypes, values, order, aliases,
groups, attributes, user blocks, big-endian and Fortran-ordered data), that outputs round-trip,
and that NaN/Inf inputs are computed through, reported, and fail only with --strict.
"""

from __future__ import annotations

import json
import zipfile

import h5py
import numpy as np
import pytest
from conftest import FIXTURES, assert_close_scaled, load_case, write_h5

from lstmgrad_cli import io
from lstmgrad_cli.analysis.summary import SummarisedOutput, summarise
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import InputFileError, OutputFileError
from lstmgrad_cli.io import npz_writer
from lstmgrad_cli.ops import validation

SEQ_OUTPUTS = ["x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad", "b_grad"]
ALL_NAMES = [*validation.SEQ_TENSORS]
SCALARS = ["seq_len_max", "use_peephole"]


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.npz")))
def test_every_fixture_reads_exactly_as_numpy_reads_it(fixture):
    path = FIXTURES / fixture
    with np.load(path) as reference:
        expected = {k: reference[k] for k in reference.files}
    loaded = io.read_inputs(path, [k for k in expected if k not in SCALARS], [k for k in expected if k in SCALARS])
    assert sorted(loaded.keys) == sorted(expected)
    for name, value in {**loaded.tensors, **{k: v for k, (v, _) in loaded.scalars.items()}}.items():
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape, name
        np.testing.assert_array_equal(value, expected[name])


def test_demo_h5_reads_exactly_as_h5py_reads_it():
    path = FIXTURES / "demo.h5"
    loaded = io.read_inputs(path, ALL_NAMES, SCALARS, group="lstm")
    with h5py.File(path, "r") as fh:
        for name, value in loaded.tensors.items():
            np.testing.assert_array_equal(value, fh["lstm"][name][()])
            assert value.dtype == fh["lstm"][name].dtype
        assert loaded.scalars["seq_len_max"] == (fh["lstm"].attrs["seq_len_max"], "attribute")


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                                         zipfile.ZIP_LZMA])
def test_compressed_npz_members(tmp_path, compression):
    inputs, expected, _ = load_case("seq_v2_peep")
    path = tmp_path / "in.npz"
    with zipfile.ZipFile(path, "w", compression) as zf:
        for key, value in inputs.items():
            with zf.open(f"{key}.npy", "w") as member:
                np.lib.format.write_array(member, value)
    loaded = io.read_inputs(path, ["x", "w"])
    np.testing.assert_array_equal(loaded.tensors["x"], inputs["x"])


def _npy_with_header(array: np.ndarray, header: str) -> bytes:
    """``.npy`` v1.0 bytes of ``array`` under a header text of our own (padded as numpy pads it)."""
    text = header + " " * ((-(len(header) + 11)) % 64) + "\n"
    data = array.tobytes(order="F" if "'fortran_order': True" in header else "C")
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1") + data


@pytest.mark.parametrize("header, array", [
    # as numpy writes them: parsed by the pattern
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2, 4), }", np.arange(24, dtype="<f4").reshape(3, 2, 4)),
    ("{'descr': '>f8', 'fortran_order': False, 'shape': (5,), }", np.arange(5, dtype=">f8")),
    ("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", np.array(2.5)),
    ("{'descr': '<f4', 'fortran_order': True, 'shape': (3, 4), }", np.asfortranarray(np.arange(12.0, dtype="<f4")
                                                                                     .reshape(3, 4))),
    ("{'descr': '<i8', 'fortran_order': False, 'shape': (0, 3), }", np.zeros((0, 3), "<i8")),
    # anything else: numpy's own parser
    ("{'shape': (3, 2), 'fortran_order': False, 'descr': '<f4'}", np.arange(6, dtype="<f4").reshape(3, 2)),
    ("{'descr':'<f4','fortran_order':False,'shape':(6,)}", np.arange(6, dtype="<f4")),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }", np.arange(6, dtype="<f4").reshape(2, 3)),
    ("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", np.zeros(2, [("a", "<f4")])),
])
@pytest.mark.filterwarnings("ignore:Reading `.npy`")
def test_npy_headers_read_as_numpy_reads_them(tmp_path, header, array):
    """The pattern that parses numpy's own headers and numpy's parser for the rest give what np.load gives."""
    path = tmp_path / "in.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", _npy_with_header(array, header))
    with np.load(path) as reference:
        expected = reference["x"]
    got = io.read_inputs(path, ["x"]).tensors["x"]
    assert got.dtype == expected.dtype.newbyteorder("=") and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    assert got.flags.writeable


def test_npy_members_larger_than_one_read_stream_in_chunks(tmp_path, monkeypatch):
    """Members above WHOLE_READ are read in bounded chunks; below it in one call; both read the same."""
    from lstmgrad_cli.io import npy

    array = np.random.default_rng(0).standard_normal((40, 30, 20)).astype(np.float32)
    path = tmp_path / "in.npz"
    np.savez(path, x=array)
    whole = io.read_inputs(path, ["x"]).tensors["x"]
    monkeypatch.setattr(npy, "WHOLE_READ", 1000)
    monkeypatch.setattr(npy, "READ_CHUNK", 4096)
    streamed = io.read_inputs(path, ["x"]).tensors["x"]
    np.testing.assert_array_equal(whole, array)
    np.testing.assert_array_equal(streamed, array)


def test_big_endian_and_fortran_order_are_read_natively(tmp_path, runner):
    inputs, expected, _ = load_case("seq_v2_peep")
    odd = {k: (np.asfortranarray(v.astype(v.dtype.newbyteorder(">"))) if v.dtype.kind == "f" else v)
           for k, v in inputs.items()}
    assert odd["x"].dtype.str == ">f4" and odd["x"].flags.f_contiguous
    for path in (tmp_path / "be.npz", tmp_path / "be.h5"):
        if path.suffix == ".npz":
            np.savez(path, **odd)
        else:
            write_h5(path, odd)
        loaded = io.read_inputs(path, ["x"])
        assert loaded.tensors["x"].dtype == np.float32 and loaded.tensors["x"].dtype.isnative
        np.testing.assert_array_equal(loaded.tensors["x"], inputs["x"])
        out = tmp_path / f"g-{path.suffix[1:]}.npz"
        result = runner.invoke(main, ["seq", str(path), "-o", str(out), "-q"])
        assert result.exit_code == 0, result.stderr
        with np.load(out) as got:
            for name in SEQ_OUTPUTS:
                assert_close_scaled(got[name], expected[name], name=name)


def test_hdf5_with_a_user_block_and_soft_links(tmp_path, runner):
    inputs, expected, _ = load_case("seq_v2_peep")
    path = tmp_path / "ub.h5"
    with h5py.File(path, "w", userblock_size=1024) as fh:
        store = fh.create_group("store")
        run = fh.create_group("run")
        for key, value in inputs.items():
            store.create_dataset(key, data=value)
            run[key] = h5py.SoftLink(f"/store/{key}")  # every tensor through an in-file soft link
        fh["alias"] = h5py.SoftLink("/run")  # and the group too
    with open(path, "r+b") as fh:
        fh.write(b"user block: anything at all")
    assert io.sniff_format(path) == "hdf5"
    out = tmp_path / "g.h5"
    result = runner.invoke(main, ["seq", str(path), "--group", "alias", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.stderr
    with h5py.File(out, "r") as got:
        assert list(got.keys()) == SEQ_OUTPUTS  # TF's order
        for name in SEQ_OUTPUTS:
            assert_close_scaled(got[name][()], expected[name], name=name)


def test_npz_group_prefix_aliases_and_extra_members(tmp_path):
    inputs, _, _ = load_case("seq_v2_peep")
    path = tmp_path / "runs.npz"
    java = {"cs_prev": "csPrev", "h_prev": "hPrev", "cs_grad": "csGrad", "h_grad": "hGrad", "seq_len_max": "seqLenMax",
            "use_peephole": "usePeephole"}  # TF's Java API names
    camel = {java.get(k, k): v for k, v in inputs.items()}
    with zipfile.ZipFile(path, "w") as zf:
        for key, value in camel.items():
            with zf.open(f"run1/{key}.npy", "w") as member:
                np.lib.format.write_array(member, value)
        zf.writestr("run1/README.txt", b"not an array, never read")
        zf.writestr("run2/", b"")  # a directory entry
    loaded = io.read_inputs(path, ALL_NAMES, SCALARS, group="run1")
    assert set(loaded.tensors) == set(ALL_NAMES)
    np.testing.assert_array_equal(loaded.tensors["cs_prev"], inputs["cs_prev"])
    assert loaded.scalars["use_peephole"][0] == inputs["use_peephole"]
    assert "README.txt" in loaded.keys
    with pytest.raises(InputFileError, match="no group 'run3'"):
        io.read_inputs(path, ALL_NAMES, group="run3")


def test_both_spellings_present_is_an_error(tmp_path):
    path = tmp_path / "both.npz"
    np.savez(path, cs_prev=np.zeros(2), csPrev=np.ones(2))
    with pytest.raises(InputFileError, match="both 'cs_prev' and 'csPrev' are present"):
        io.read_inputs(path, ["cs_prev"])


def test_hdf5_root_attributes_serve_a_group(tmp_path):
    inputs, _, _ = load_case("seq_v2_peep")
    tensors = {k: v for k, v in inputs.items() if k not in SCALARS}
    path = write_h5(tmp_path / "a.h5", tensors, group="g")
    with h5py.File(path, "r+") as fh:
        fh.attrs["seqLenMax"] = 3
    loaded = io.read_inputs(path, ALL_NAMES, SCALARS, group="g")
    assert loaded.scalars["seq_len_max"] == (3, "attribute")
    assert "use_peephole" not in loaded.scalars


def test_outputs_round_trip_with_provenance(tmp_path):
    tensors = {"b_grad": np.arange(4, dtype=np.float16), "a_grad": np.ones((2, 3), np.float32)}
    meta = {"tool": "lstmgrad", "seq_len_max": 3, "use_peephole": True, "note": "ü"}
    for suffix in (".npz", ".h5", ".hdf5"):
        out = io.write_outputs(tmp_path / f"o{suffix}", tensors, meta)
        assert io.read_metadata(out) == meta
        loaded = io.read_inputs(out, ["b_grad", "a_grad"])
        assert list(loaded.keys)[:2] == ["b_grad", "a_grad"]  # the order given, not sorted
        for name, value in tensors.items():
            assert loaded.tensors[name].dtype == value.dtype
            np.testing.assert_array_equal(loaded.tensors[name], value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.h5", "o.hdf5", "o.npz"]


METADATA = io.METADATA_KEY


@pytest.mark.parametrize("zip64_from", [npz_writer.ZIP64_FROM, 1], ids=["one-pass", "np.savez"])
def test_npz_outputs_are_archives_every_reader_takes(tmp_path, zip64_from):
    # write_npz's own archive, and np.savez's where it hands over (zip64): the same arrays for np.load, zipfile (its
    # CRC check too) and lstmgrad's reader, whatever their shape, order, byte order, dtype or name
    rng = np.random.default_rng(0)
    arrays = {"x_grad": rng.standard_normal((3, 4, 5)).astype(np.float32), "empty": np.zeros((0, 5)),
              "scalar": np.float64(3.5), "fortran": np.asfortranarray(rng.standard_normal((4, 3))),
              "strided": rng.standard_normal((5, 6))[::2, 1::2], "half": np.arange(7, dtype=np.float16),
              "big_endian": np.arange(6, dtype=">f4").reshape(2, 3), "słój/w": np.ones(2, np.float32),
              METADATA: np.array('{"note": "ü"}')}
    path = tmp_path / "o.npz"
    with open(path, "wb") as fh:
        npz_writer.write_npz(fh, arrays, zip64_from=zip64_from)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert zf.namelist() == [name + ".npy" for name in arrays]
    with np.load(path, allow_pickle=False) as f:
        for name, value in arrays.items():
            assert f[name].dtype == np.asarray(value).dtype and f[name].shape == np.shape(value)
            np.testing.assert_array_equal(f[name], value)
    loaded = io.read_inputs(path, [n for n in arrays if n != METADATA])
    for name, value in loaded.tensors.items():  # (in native byte order)
        assert value.dtype == np.asarray(arrays[name]).dtype.newbyteorder("=")
        np.testing.assert_array_equal(value, arrays[name])
    assert io.read_metadata(path) == {"note": "ü"}


def test_npz_outputs_are_the_same_bytes_for_the_same_gradients(tmp_path):
    tensors = {"x_grad": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4), "b_grad": np.ones(8, np.float32)}
    first = io.write_outputs(tmp_path / "a.npz", tensors, {"tool": "lstmgrad"}).read_bytes()
    assert io.write_outputs(tmp_path / "b.npz", tensors, {"tool": "lstmgrad"}).read_bytes() == first
    with zipfile.ZipFile(tmp_path / "a.npz") as zf:  # stored members, no extra fields: a plain zip
        assert {(i.compress_type, i.extra, i.date_time) for i in zf.infolist()} == {(zipfile.ZIP_STORED, b"",
                                                                                     (1980, 1, 1, 0, 0, 0))}


def test_npz_outputs_refuse_object_arrays(tmp_path):
    with open(tmp_path / "o.npz", "wb") as fh, pytest.raises(ValueError, match="object arrays"):
        npz_writer.write_npz(fh, {"a": np.array([{"x": 1}], dtype=object)})


def test_read_metadata_of_a_hostile_file_is_a_clean_error(tmp_path):
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{io.METADATA_KEY}.npy", b"\x93NUMPY\x01\x00\x20\x00{'descr': '|O', 'fortran_order': False, "
                                             b"'shape': (1,), }       \n")
    with pytest.raises(InputFileError):
        io.read_metadata(path)


def test_existing_output_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "o.npz"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputFileError, match="already exists"):
        io.write_outputs(out, {"a": np.zeros(1)}, {})
    assert out.read_bytes() == b"keep me" and [p.name for p in tmp_path.iterdir()] == ["o.npz"]


# -- NaN and Inf: computed through, reported, fatal only with --strict ----------------------------

def nan_input(tmp_path, suffix=".npz"):
    inputs, _, _ = load_case("seq_v2_peep")
    inputs["x"] = inputs["x"].copy()
    inputs["x"][0, 0, :2] = [np.nan, np.inf]
    inputs["h_grad"] = inputs["h_grad"].copy()
    inputs["h_grad"][1, 2, 3] = -np.inf
    path = tmp_path / f"nan{suffix}"
    if suffix == ".npz":
        np.savez(path, **inputs)
    else:
        write_h5(path, inputs)
    return path


@pytest.mark.parametrize("extra", [[], ["--compute-dtype", "float64"]])
@pytest.mark.parametrize("case", ["keras/keras_seq.in.npz", "seq_v2_peep.in.npz"])
def test_nan_in_inputs_counts_what_the_input_gave_never_recomputed_forward_outputs(tmp_path, runner, case, extra):
    """A Keras layer's forward outputs are recomputed (made on the host for the op's pass, not at all for a wider
    compute dtype or a GPU's pass): NaN in x is reported as x's alone, the same on every path."""
    tensors = dict(np.load(FIXTURES / case))
    for name in [n for n in ("i", "cs", "f", "o", "ci", "co", "h") if n in tensors]:
        del tensors[name]  # (the TF op's file: its forward outputs recomputed too)
    tensors["x"] = tensors["x"].copy()
    tensors["x"].flat[0] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, **tensors)
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz"), "--json", *extra])
    assert result.exit_code == 0, result.stderr
    run = json.loads(result.stdout)["results"][0]
    assert run["sources"]["activations"] == "recomputed"
    assert run["nonfinite_inputs"] == {"x": 1}


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_nan_and_inf_are_computed_through_and_reported_in_json(tmp_path, runner, suffix):
    path = nan_input(tmp_path, suffix)
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(path), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    run = doc["results"][0]
    assert run["status"] == "ok"
    assert run["nonfinite_inputs"] == {"x": 2, "h_grad": 1}
    tensors = {t["name"]: t for t in run["tensors"]}
    assert tensors["x_grad"]["finite"] is False and tensors["x_grad"]["nonfinite"] > 0
    assert tensors["x_grad"]["l2_norm"] is None  # JSON stays strict: null, never NaN
    with np.load(out) as grads:
        assert np.isnan(grads["w_grad"]).any()  # NaN propagates as in TensorFlow
        assert grads["x_grad"].shape == (5, 3, 4)
        for t in run["tensors"]:
            assert t["nonfinite"] == int(grads[t["name"]].size - np.isfinite(grads[t["name"]]).sum())


def test_nan_summary_table_flags_the_tensors(tmp_path, runner):
    path = nan_input(tmp_path)
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz")], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "no (" in result.stdout
    assert "Warning: " in result.stderr and "NaN/Inf in inputs: x (2), h_grad (1)" in result.stderr
    quiet = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "q.npz"), "-q", "--json"])
    assert quiet.exit_code == 0 and "NaN/Inf in inputs: x (2), h_grad (1)" in quiet.stderr
    assert any("NaN/Inf in inputs: x (2), h_grad (1)" in w for w in json.loads(quiet.stdout)["results"][0]["warnings"])


def test_strict_turns_nan_into_exit_1(tmp_path, runner):
    path = nan_input(tmp_path)
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz"), "--strict"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    assert "NaN/Inf in inputs: x (2), h_grad (1)" in result.stderr and "--strict" in result.stderr
    assert not (tmp_path / "g.npz").exists()


def test_strict_passes_finite_files(tmp_path, runner):
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "g.npz"),
                                  "--strict", "-q"])
    assert result.exit_code == 0, result.stderr


def test_summary_of_finite_values_near_the_float_maximum():
    value = np.array([1e300, -1e300, 3.0])
    summary = summarise("g", value)
    assert summary.finite and summary.l2_norm is not None and np.isfinite(summary.l2_norm)
    assert summary.l2_norm == pytest.approx(np.sqrt(2) * 1e300)


@pytest.mark.parametrize("value", [
    np.array([1e300, -1e300, 3.0]), np.zeros((3, 4), np.float32), np.zeros((0, 5)), np.float32(2.5),
    np.array([[1.0, np.nan], [np.inf, -np.inf]], np.float32), np.array([3e38, -3e38, 1.0], np.float32),
    np.arange(-60, 60, dtype=np.float16).reshape(4, 30), np.random.default_rng(3).standard_normal((7, 5, 3)),
], ids=["near-max", "zeros", "empty", "0-d", "nonfinite", "f32-near-max", "f16", "normal"])
def test_a_summary_in_one_pass_equals_the_one_read_a_block_at_a_time(value):
    """The in-memory fast path and the blocked path (lazy datasets, huge arrays) give the same summary."""
    value = np.asarray(value)
    whole = summarise("g", value)
    assert whole == summarise("g", _Lazy(value))  # not an ndarray: the blocked loop, here one block
    rows = summarise("g", _Lazy(value), block_bytes=8)  # one row per block: the same but for rounding
    assert (rows.finite, rows.nonfinite, rows.max_abs) == (whole.finite, whole.nonfinite, whole.max_abs)
    assert rows.l2_norm == (None if whole.l2_norm is None else pytest.approx(whole.l2_norm, rel=1e-12))
    assert whole.nonfinite == int(value.size - np.count_nonzero(np.isfinite(value)))


@pytest.mark.parametrize("value", [
    np.random.default_rng(4).standard_normal((9, 3, 2)).astype(np.float32),
    np.array([[1e300, 2.0], [-1e300, 0.0], [3.0, 1e-300]]),
    np.array([[1.0, np.nan], [np.inf, 2.0], [0.0, 0.0]], np.float32),
], ids=["normal", "near-max", "nonfinite"])
def test_an_output_summarised_as_written_equals_the_summary_read_back(value):
    """The chunks of a backward pass, written last first (and some rows never), give the summary of the whole."""
    target = _Written(value.shape, value.dtype)
    out = SummarisedOutput(target)
    rows = value.shape[0]
    for lo in reversed(range(0, rows - 1, 2)):  # the last row is never written: it stays zero
        out[lo:min(lo + 2, rows - 1)] = value[lo:min(lo + 2, rows - 1)]
    out[rows - 1:rows - 1] = value[:0]  # an empty write changes nothing
    expected = value.copy()
    expected[-1] = 0
    np.testing.assert_array_equal(target.value, expected)
    got, want = out.summary("g"), summarise("g", expected)
    assert got is not None and target.reads == 0
    assert (got.finite, got.nonfinite, got.max_abs, got.shape, got.dtype) == (
        want.finite, want.nonfinite, want.max_abs, want.shape, want.dtype)
    assert got.l2_norm == (None if want.l2_norm is None else pytest.approx(want.l2_norm, rel=1e-12))
    assert summarise("g", out) == got and target.reads == 0


@pytest.mark.parametrize("writes", [
    [(np.s_[0:4], None), (np.s_[2:3], None)],  # a row written twice
    [(np.s_[0:4], None), (np.s_[1], None)],  # one row by index: not a slice of rows
    [(np.s_[0:4], None), (np.s_[4:6, :1], None)],  # part of the rows' columns
    [(np.s_[0:4], "list")],  # not a numpy array
    [(np.s_[0:4], "float32")],  # another dtype: the output stores it converted
], ids=["twice", "index", "columns", "not-ndarray", "other-dtype"])
def test_an_output_written_otherwise_is_summarised_by_reading_it_back(writes):
    value = np.arange(12.0).reshape(6, 2) - 5
    target = _Written(value.shape, value.dtype)
    out = SummarisedOutput(target)
    for key, kind in writes:
        part = value[key]
        out[key] = part.tolist() if kind == "list" else part.astype(kind) if kind else part
    assert out.summary("g") is None
    assert summarise("g", out) == summarise("g", target.value) and target.reads > 0


def test_an_output_written_whole_is_summarised_without_reading_it():
    value = np.linspace(-3, 4, 12).reshape(3, 4)
    target = _Written(value.shape, value.dtype)
    out = SummarisedOutput(target)
    out[...] = value  # how the cupy backend fills it, in one copy
    assert summarise("g", out) == summarise("g", value) and target.reads == 0


class _Written:
    """A stand-in for a zero-filled HDF5 output dataset: writable by key, counting reads."""

    def __init__(self, shape, dtype):
        self.value, self.shape, self.dtype, self.reads = np.zeros(shape, dtype), shape, np.dtype(dtype), 0

    def __len__(self):
        return len(self.value)

    def __setitem__(self, key, value):
        self.value[key] = value

    def __getitem__(self, key):
        self.reads += 1
        return self.value[key]


class _Lazy:
    """A stand-in for an on-disk dataset: shape, dtype and slicing, not an ndarray."""

    def __init__(self, value):
        self.value, self.shape, self.dtype = value, value.shape, value.dtype

    def __getitem__(self, key):
        return self.value[key]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype=dtype)


def test_describe_keys_is_safe_for_one_line_messages():
    keys = ["x", "\x1b[2J\x1b[31mred", "line\nbreak", "k" * 5000, *[f"n{i}" for i in range(30)]]
    text = io.describe_keys(keys)
    assert text.isprintable() and "\x1b" not in text and "\n" not in text
    assert "\\x1b[2J" in text and "line\\nbreak" in text and "k" * 60 + "...(5000 characters)" in text
    assert text.endswith(" and 14 more") and len(text) < 600
    assert io.describe_keys([]) == "nothing"


def test_provenance_is_one_json_attribute_and_older_outputs_still_count(tmp_path, runner):
    from lstmgrad_cli.io.provenance import is_complete_output

    src = FIXTURES / "seq_v2_peep.in.npz"
    out = tmp_path / "new.h5"
    assert runner.invoke(main, ["seq", str(src), "-o", str(out), "-q"]).exit_code == 0
    with h5py.File(out, "r") as fh:
        assert list(fh.attrs) == [io.METADATA_KEY]  # no root attribute named like an input (use_peephole, ...)
    assert io.read_metadata(out)["use_peephole"] is True and is_complete_output(out, src)
    old = tmp_path / "old.h5"  # an output of lstmgrad 0.1: provenance as separate root attributes
    with h5py.File(old, "w") as fh:
        fh["x_grad"] = np.zeros(3)
        fh.attrs.update({"tool": "lstmgrad", "source": str(src.resolve()), "use_peephole": True, "seq_len_max": 5})
    assert io.read_metadata(old)["source"] == str(src.resolve()) and is_complete_output(old, src)
