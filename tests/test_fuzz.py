"""Fuzzing the readers and validators (issue 6) with hypothesis.

Properties, for any input whatsoever:

* the readers (``io.read_inputs``) return a ``LoadedFile`` or raise ``InputFileError``: never another
  exception type, never a hang (a faulthandler watchdog kills the run with a traceback);
* what an NPZ reader returns is exactly what was stored (zip CRCs make silent corruption impossible);
* a ``.npy`` header that parses gives an array of exactly the declared shape and dtype;
* the whole job (``run_grad_file``: read, validate, compute, write) returns a result or raises an
  ``LstmGradError``; an uncorrupted random problem always succeeds with gradients of the right shapes.

A short run is part of ``make test``.  The long run: ``LSTMGRAD_FUZZ_EXAMPLES=N`` examples per test
(``make fuzz``); it also runs every hostile-file case in a real subprocess.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io as bytes_io
import os
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import FIXTURES
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from lstmgrad_cli import io
from lstmgrad_cli.errors import InputFileError, LstmGradError
from lstmgrad_cli.operations.grad import GradOptions, GradResult, run_grad_file
from lstmgrad_cli.ops import validation

LONG = int(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES", "0") or 0)
HANG_SECONDS = 60  # one example taking this long is a hang: dump every thread's stack and exit
SEQ_NAMES = list(validation.SEQ_TENSORS)
SCALARS = ["seq_len_max", "use_peephole"]


def fuzz(short: int):
    """Settings: ``short`` examples in ``make test`` (derandomized: no flakes), LONG in ``make fuzz``."""
    return settings(max_examples=LONG or short, deadline=None, derandomize=not LONG, database=None if not LONG else
                    settings.default.database, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


@contextlib.contextmanager
def watchdog():
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def bounded_memory(monkeypatch):
    # A mutated dimension may declare gigabytes that would be legitimately read; keep examples small.
    monkeypatch.setenv(io.MAX_BYTES_ENV, str(64 << 20))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def note(text: str) -> None:
    """A hypothesis event (shown with --hypothesis-show-statistics); nothing outside a hypothesis test."""
    with contextlib.suppress(InvalidArgument):
        event(text)


def read_or_refuse(path: Path, group: str | None = None):
    """The reader's contract: a LoadedFile or an InputFileError, nothing else."""
    with watchdog():
        try:
            loaded = io.read_inputs(path, SEQ_NAMES, SCALARS, group=group)
            note(f"read {len(loaded.tensors)} tensors")
            return loaded
        except InputFileError as err:
            note("refused: " + str(err)[len(str(path)) + 2:].split(" ")[0])
            message = str(err)
            assert message.startswith(f"{path}: ") and "\n" not in message, message
            return None


# -- base files to mutate ---------------------------------------------------------------------------

def _tiny_inputs() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "seq_tiny.in.npz") as data:
        return {k: data[k] for k in data.files}


def _npz_bytes(compression) -> bytes:
    buf = bytes_io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for key, value in _tiny_inputs().items():
            member = bytes_io.BytesIO()
            np.lib.format.write_array(member, value)
            zf.writestr(f"{key}.npy", member.getvalue())
    return buf.getvalue()


def _h5_bytes(tmp: Path) -> bytes:
    """seq_tiny as HDF5 with a group, attributes, a gzip-chunked dataset and a soft link."""
    path = tmp / "base.h5"
    with h5py.File(path, "w") as fh:
        group = fh.create_group("lstm")
        for key, value in _tiny_inputs().items():
            if value.ndim == 0:
                group.attrs[key] = value
            elif key == "x":
                group.create_dataset("x_store", data=value, chunks=True, compression="gzip", shuffle=True)
                group["x"] = h5py.SoftLink("/lstm/x_store")
            else:
                group.create_dataset(key, data=value)
    return path.read_bytes()


NPZ_BASES = {"stored": _npz_bytes(zipfile.ZIP_STORED), "deflated": _npz_bytes(zipfile.ZIP_DEFLATED)}
ORIGINAL = _tiny_inputs()


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """``base`` with 1-4 edits: flipped bits, overwritten bytes or words, inserted/deleted runs, truncation."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "word"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[pos] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01, draw(st.integers(0, 255))]))
        elif kind == "word" and len(data) >= pos + 8:  # sizes and offsets: 0, -1, huge
            value = draw(st.sampled_from([0, 2**64 - 1, 2**63, 2**32 - 1, 2**31, 1, draw(st.integers(0, 2**64 - 1))]))
            data[pos:pos + 8] = value.to_bytes(8, "little")
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif kind == "truncate":
            del data[pos:]
    return bytes(data)


# -- the readers --------------------------------------------------------------------------------------

@fuzz(short=40)
@given(prefix=st.sampled_from([b"", io.HDF5_MAGIC, b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY"]),
       body=st.binary(max_size=2048))
def test_random_bytes(work, prefix, body):
    path = work / "random.bin"
    path.write_bytes(prefix + body)
    read_or_refuse(path)


@fuzz(short=60)
@given(which=st.sampled_from(sorted(NPZ_BASES)), data=st.data())
def test_mutated_npz_reads_exactly_what_was_stored_or_refuses(work, which, data):
    path = work / "mutated.npz"
    path.write_bytes(data.draw(mutated(NPZ_BASES[which])))
    loaded = read_or_refuse(path)
    if loaded is None:
        return
    for name, value in loaded.tensors.items():
        assert value.dtype == ORIGINAL[name].dtype and value.shape == ORIGINAL[name].shape, name
        np.testing.assert_array_equal(value, ORIGINAL[name])


@fuzz(short=60)
@given(data=st.data())
def test_mutated_hdf5_reads_or_refuses(work, data, h5_base):
    path = work / "mutated.h5"
    path.write_bytes(data.draw(mutated(h5_base)))
    read_or_refuse(path, group=data.draw(st.sampled_from(["lstm", None])))


@fuzz(short=60)
@given(data=st.data())
def test_mutated_hdf5_streamed_gives_what_hdf5_gives_or_refuses(work, data, h5_base, monkeypatch):
    """The streamed reads (``LazyDataset.read_into``: pread for plain contiguous data, h5py otherwise, NaN/Inf
    counted on the way) give the bytes HDF5 gives, or one-line InputFileErrors; never more than the file."""
    from lstmgrad_cli.io import hdf5
    from lstmgrad_cli.problem.reading import TIME_MAJOR

    monkeypatch.setattr(hdf5, "worth_leaving", lambda shape, dtype: True)  # small datasets left in the file too

    path = work / "mutated.h5"
    path.write_bytes(data.draw(mutated(h5_base)))
    with watchdog():
        try:
            with io.open_inputs(path, SEQ_NAMES, SCALARS, group="lstm", lazy=TIME_MAJOR) as loaded:
                for name, lazy in loaded.tensors.items():
                    if not isinstance(lazy, io.LazyDataset) or lazy.size * lazy.dtype.itemsize > 2**20:
                        continue
                    note(f"{name}: {'pread' if lazy._raw is not None else 'h5py'}")
                    try:
                        expected = np.asarray(lazy._dataset[()])
                    except Exception:  # noqa: BLE001 - HDF5 refuses it: only the reader's own contract is checked
                        expected = None
                    got = lazy.read_into(0, lazy.shape[0], np.empty(lazy.shape, lazy.dtype))
                    if expected is not None:
                        np.testing.assert_array_equal(got, expected)
                        assert lazy.nonfinite() == int(expected.size - np.count_nonzero(np.isfinite(expected)))
        except InputFileError as err:
            message = str(err)
            assert message.startswith(f"{path}: ") and "\n" not in message, message


def _large_npz_bytes() -> bytes:
    """An np.savez archive whose time-major members (2 MiB each) a streamed read leaves in the file."""
    rng = np.random.default_rng(8)
    buf = bytes_io.BytesIO()
    np.savez(buf, x=rng.standard_normal((64, 32, 256)).astype(np.float32),
             h_grad=rng.standard_normal((64, 32, 256)).astype(np.float32), w=np.ones((3, 4), np.float32))
    return buf.getvalue()


LARGE_NPZ = _large_npz_bytes()


@fuzz(short=30)
@given(data=st.data())
def test_mutated_large_npz_streamed_gives_what_was_stored_or_refuses(work, data, monkeypatch):
    """Members left in the file (``npz.LazyMember``: pread by rows, last steps first, CRC-32 summed from the pieces)
    give exactly the bytes stored, or one-line InputFileErrors by the end of the block: a flipped byte never passes."""
    monkeypatch.setenv(io.MAX_BYTES_ENV, "16M")  # members from 1 MiB left in the file
    path = work / "mutated-large.npz"
    if data.draw(st.booleans()):  # one bit flipped: most land in the members' rows, read only as the pass goes
        flipped = bytearray(LARGE_NPZ)
        flipped[data.draw(st.integers(0, len(flipped) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(bytes(flipped))
    else:
        path.write_bytes(data.draw(mutated(LARGE_NPZ)))
    with np.load(bytes_io.BytesIO(LARGE_NPZ)) as archive:
        original = {k: archive[k] for k in archive.files}
    with watchdog():
        try:
            read = {}
            with io.open_inputs(path, ["x", "h_grad", "w"], lazy=["x", "h_grad"]) as loaded:
                for name, value in loaded.tensors.items():
                    note(f"{name}: {type(value).__name__}")
                    if isinstance(value, io.LazyRows):
                        got = read[name] = np.empty(value.shape, value.dtype)
                        for hi in range(value.shape[0], 0, -24):  # as a backward pass reads: last steps first
                            value.read_into(max(hi - 24, 0), hi, got[max(hi - 24, 0):hi])
                    else:
                        read[name] = value
        except InputFileError as err:
            message = str(err)
            assert message.startswith(f"{path}: ") and "\n" not in message, message
            return
    for name, value in read.items():  # the block ended: every member's CRC-32 was checked
        assert value.dtype == original[name].dtype
        np.testing.assert_array_equal(value, original[name], err_msg=name)


@pytest.fixture(scope="module")
def h5_base(tmp_path_factory) -> bytes:
    return _h5_bytes(tmp_path_factory.mktemp("h5base"))


DESCRS = ["<f4", ">f4", "<f8", "<f2", "|b1", "<i8", "<c8", "|O", "<U3", "|V0", "|S0", "<M8[s]",
          [("a", "<f4"), ("b", "|O")], [("a", "<f4")], "not-a-dtype", 7]


@fuzz(short=60)
@given(shape=st.lists(st.one_of(st.integers(-2, 6), st.sampled_from([2**31, 2**62, 2**64 + 1])), max_size=4),
       descr=st.sampled_from(DESCRS), fortran=st.one_of(st.booleans(), st.just(1)), extra=st.integers(-20, 20),
       version=st.sampled_from([(1, 0), (2, 0), (3, 0)]))
def test_npy_headers_give_the_declared_array_or_refuse(work, shape, descr, fortran, extra, version):
    header = {"shape": tuple(shape), "fortran_order": fortran, "descr": descr}
    buf = bytes_io.BytesIO()
    text = repr(header).encode("utf-8")
    text += b" " * (-(len(text) + 13) % 64) + b"\n"
    length = (len(text).to_bytes(2, "little") if version == (1, 0) else len(text).to_bytes(4, "little"))
    buf.write(b"\x93NUMPY" + bytes(version) + length + text)
    try:
        dtype = np.dtype(np.lib.format.descr_to_dtype(descr))
        nbytes = int(np.prod([max(n, 0) for n in shape], dtype=object)) * dtype.itemsize
    except Exception:  # noqa: BLE001 - an invalid descr: the reader must refuse it
        dtype, nbytes = None, 64
    payload = np.arange(max(0, min(nbytes, 4096) + extra), dtype=np.uint64).astype(np.uint8).tobytes()
    buf.write(payload)
    path = work / "header.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", buf.getvalue())
    loaded = read_or_refuse(path)
    if loaded is None:
        return
    array = loaded.tensors["x"]
    assert array.shape == tuple(shape)
    assert dtype is not None and not dtype.hasobject and len(payload) == nbytes
    assert array.dtype == (dtype.newbyteorder("=") if dtype.kind in "biufc" else dtype)
    expected = np.frombuffer(payload, dtype=dtype, count=nbytes // dtype.itemsize)
    np.testing.assert_array_equal(array.ravel(order="F" if fortran else "C"), expected)


LITERAL_CHARS = "{}()[]'\",:. 0123456789-<>|fiuObcSUVdescrhapfortan_orderTrueFalseNone\\\n#"


@fuzz(short=40)
@given(version=st.sampled_from([b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x09\x09"]),
       text=st.one_of(st.text(LITERAL_CHARS, max_size=200).map(lambda t: t.encode("utf-8")), st.binary(max_size=200)),
       declared=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_random_npy_header_text(work, version, text, declared):
    """Whatever follows the .npy magic (header text, its declared length): a clean refusal or an array."""
    size = len(text) if declared is None else declared
    width = 2 if version == b"\x01\x00" else 4
    length = (size % 2 ** (8 * width)).to_bytes(width, "little")
    path = work / "text.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", b"\x93NUMPY" + version + length + text)
    read_or_refuse(path)


# -- declarations checked before reading (issue 34) ---------------------------------------------------------

REFUSAL_PEAK = 4 << 20  # bytes numpy and Python may allocate while refusing a declaration (headers, messages)


@contextlib.contextmanager
def traced_peak():
    """The peak of memory allocated through Python and numpy inside the block (``peak[0]``, in bytes)."""
    tracemalloc.start()
    peak = [0]
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


@pytest.mark.slow
@fuzz(short=40)
@given(name=st.sampled_from([*SEQ_NAMES, "seq_len_max", "kernel", "bias", "h0", "weight_ih_l0", "extra"]),
       shape=st.lists(st.one_of(st.integers(0, 6), st.sampled_from([1 << 20, 3 << 20, 1 << 40, 2**62])), max_size=5),
       held=st.sampled_from(["all", "none", "half"]), deflate=st.booleans(), data=st.data())
def test_a_declared_shape_is_read_as_declared_or_refused_before_its_data(work, name, shape, held, deflate, data):
    """The valid case with one member declaring any shape (zeros behind it, deflated, up to 48 MiB): what is read
    has the declared shape; a refusal allocates nothing of the declared size (traced by tracemalloc)."""
    descr = data.draw(st.sampled_from(["<f4", "<i8", "|u1"]), label="dtype")
    nbytes = int(np.prod(shape, dtype=object)) * np.dtype(descr).itemsize
    stored = {"all": nbytes, "none": 0, "half": nbytes // 2}[held]
    if stored > 48 << 20:
        stored = 0
    from bombs import Member, npy_header, valid_members, write_members

    head = npy_header(shape, descr)
    zeros = stored - stored % (1 << 20)
    member = Member(f"{name}.npy", head + bytes(stored - zeros), zeros, deflate=deflate)
    path = write_members(work / "declared.npz", [m for m in valid_members() if m.name != member.name] + [member])
    names = [*SEQ_NAMES, *([name] if name not in SEQ_NAMES else [])]
    with watchdog(), traced_peak() as peak:
        try:
            loaded = io.read_inputs(path, names, SCALARS)
        except InputFileError as err:
            loaded = None
            message = str(err)
            assert message.startswith(f"{path}: ") and "\n" not in message, message
    if loaded is None:
        assert peak[0] < REFUSAL_PEAK + min(stored, nbytes if stored == nbytes else 0), peak[0]
        return
    value = {**loaded.tensors, **{k: v for k, (v, _) in loaded.scalars.items()}}.get(name)
    if value is not None:
        assert value.shape == tuple(shape) and stored == nbytes


@pytest.mark.slow
@fuzz(short=40)
@given(dims=st.one_of(st.lists(st.sampled_from([0, 1, 2, 3, 5, -1, 2**40, 2**62]), max_size=6),
                      st.integers(30, 300).map(lambda n: [1] * n)),
       code=st.sampled_from([1, 2, 3, 9, 10, 19, 7, 0]), form=st.sampled_from(["content", "packed", "fields", "none"]),
       count=st.sampled_from([0, 1, 59, 60, 61, 1000, 300_000]))
def test_a_tensorproto_is_decoded_as_declared_or_refused_from_its_lengths(tmp_path_factory, dims, code, form, count):
    """Any dims, dtype and amount of values (content bytes, packed values, one field a value): an array of the
    declared shape, or an LstmGradError before the values are decoded."""
    from bombs import eager_dump
    from tfdbg_builder import field, shape_proto

    from lstmgrad_cli.io import tfdbg

    width = {1: 4, 2: 8, 3: 4, 9: 8, 10: 1, 19: 2}.get(code, 4)
    values = {"content": field(4, bytes(width * count)), "none": b"",
              "packed": field({1: 5, 2: 6, 3: 7, 9: 10, 10: 11, 19: 13}.get(code, 5),
                              bytes((width if code in (1, 2) else 1) * count)),
              "fields": (b"\x2d" + bytes(4)) * count if code == 1 else (b"\x38\x00") * count}[form]
    proto = field(1, code) + field(2, shape_proto(dims)) + values
    dump = eager_dump(tmp_path_factory.mktemp("proto") / "dump", proto)
    with watchdog(), traced_peak() as peak:
        try:
            index = tfdbg.index_dump(dump)
            execution = index.gradient_executions()[0]
            loaded = tfdbg.load_execution(index, execution, ["x"], [])
        except LstmGradError as err:
            assert "\n" not in str(err)
            assert peak[0] < REFUSAL_PEAK + len(proto), peak[0]
            return
    assert loaded.tensors["x"].shape == tuple(dims)


@fuzz(short=30)
@given(depth=st.integers(0, 5000), strings=st.lists(st.text("[]{}\"\\ab", max_size=20), max_size=5))
def test_a_safetensors_header_of_any_nesting_is_refused_or_read(work, depth, strings):
    """Brackets nested ``depth`` deep, and inside JSON strings: a table of tensors or a clean refusal, never the
    JSON parser's recursion."""
    import json

    keys = ", ".join(json.dumps(s) + ": 1" for s in strings)
    text = ("{" + keys + (", " if keys else "") + '"x": ' + "[" * depth + "]" * depth + "}").encode()
    path = work / "nested.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    with watchdog():
        try:
            io.read_inputs(path, ["x"], [])
        except InputFileError as err:
            assert "\n" not in str(err)


@pytest.mark.slow
@fuzz(short=40)
@given(packed=st.sampled_from([0, 1, 81, 82, 83, 1 << 20, 2**32 - 1]),
       unpacked=st.sampled_from([0, 127, 128, 129, 84_000, 1 << 30, 2**32 - 1]), method=st.sampled_from([0, 8, 12, 14]))
def test_zip_entry_sizes_are_believed_only_when_the_data_agrees(work, packed, unpacked, method):
    """x's central directory entry declares any sizes and method: the exact array, or a one-line refusal."""
    from bombs import Member, npy_bytes, valid_members, write_members

    original = np.arange(60, dtype=np.float32).reshape(5, 3, 4)
    members = [m for m in valid_members() if m.name != "x.npy"] + [Member("x.npy", npy_bytes(original))]
    path = write_members(work / "sizes.npz", members, sizes={"x.npy": (packed, unpacked)})
    raw = bytearray(path.read_bytes())
    at = raw.rfind(b"PK\x01\x02")
    raw[at + 10:at + 12] = method.to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    loaded = read_or_refuse(path)
    if loaded is not None and "x" in loaded.tensors:
        np.testing.assert_array_equal(loaded.tensors["x"], original)


# -- the whole job on random problems ----------------------------------------------------------------

DTYPES = ["float16", "float32", "float64"]


@st.composite
def problems(draw):
    """A valid BlockLSTMGradV2 problem, then 0-3 corruptions of shape, dtype, presence or values."""
    T, B, I, C = (draw(st.integers(0, 4)), draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shapes = {"x": (T, B, I), "cs_prev": (B, C), "h_prev": (B, C), "w": (I + C, 4 * C), "wci": (C,), "wcf": (C,),
              "wco": (C,), "b": (4 * C,)}
    shapes.update({n: (T, B, C) for n in ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad")})
    tensors = {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()}
    scalars = {"seq_len_max": np.int64(draw(st.integers(0, T))), "use_peephole": np.bool_(draw(st.booleans()))}
    corruptions = draw(st.lists(st.sampled_from(["shape", "dtype", "drop", "rank", "nan", "scalar", "huge"]),
                                max_size=3))
    for kind in corruptions:
        name = draw(st.sampled_from(SEQ_NAMES))
        if name not in tensors:
            continue
        if kind == "shape":
            axis_shape = list(tensors[name].shape) or [1]
            axis_shape[draw(st.integers(0, len(axis_shape) - 1))] += draw(st.sampled_from([-1, 1, 3]))
            tensors[name] = np.zeros([max(n, 0) for n in axis_shape], dtype=dtype)
        elif kind == "dtype":
            target = draw(st.sampled_from(["int32", "bool", "complex64", "float16", "float64", "uint8"]))
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # NaN or huge values cast to integers
                tensors[name] = tensors[name].astype(target)
        elif kind == "drop":
            tensors.pop(name, None)
        elif kind == "rank":
            tensors[name] = tensors[name].reshape(tensors[name].shape + (1,))
        elif kind in ("nan", "huge") and tensors[name].size and tensors[name].dtype.kind == "f":
            flat = tensors[name].reshape(-1)
            flat[draw(st.integers(0, flat.size - 1))] = np.nan if kind == "nan" else np.finfo(flat.dtype).max
        elif kind == "scalar":
            scalars[draw(st.sampled_from(SCALARS))] = draw(st.sampled_from(
                [np.int64(-1), np.int64(T + 1), np.float64(0.5), np.float64(np.nan), np.array([1, 2]),
                 np.int64(2), np.bytes_(b"yes")]))
    valid = not any(k in ("shape", "dtype", "drop", "rank", "scalar") for k in corruptions)
    return tensors, scalars, valid, (T, B, I, C)


@pytest.mark.slow
@fuzz(short=40)
@given(problem=problems(), fmt=st.sampled_from(["npz", "hdf5"]), layout=st.sampled_from(["ifco", "icfo"]))
def test_whole_job_on_random_problems(work, problem, fmt, layout):
    tensors, scalars, valid, (T, B, I, C) = problem
    path = work / f"problem.{'npz' if fmt == 'npz' else 'h5'}"
    if fmt == "npz":
        np.savez(path, **tensors, **scalars)
    else:
        with h5py.File(path, "w") as fh:
            for key, value in {**tensors, **scalars}.items():
                fh.create_dataset(key, data=value)
    out = work / "problem.grads.npz"
    with watchdog(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numeric warnings would be stray lines on stderr
        try:
            result = run_grad_file(path, out, GradOptions("seq", layout, "numpy", force=True))
        except LstmGradError as err:
            event("refused")
            assert not valid, f"a valid problem was refused: {err}"
            assert "\n" not in str(err)
            return
    event("computed")
    assert isinstance(result, GradResult) and result.status == "ok"
    with np.load(out) as grads:
        assert grads["x_grad"].shape == (T, B, I) and grads["w_grad"].shape == (I + C, 4 * C)
        assert grads["b_grad"].shape == (4 * C,) and grads["x_grad"].dtype == tensors["x"].dtype
    nonfinite = {n: int(np.size(a) - np.count_nonzero(np.isfinite(a))) for n, a in tensors.items()}
    assert result.nonfinite_inputs == {n: c for n, c in nonfinite.items() if c}


# -- what the long runs found, pinned down ---------------------------------------------------------

def test_found_blank_member_name_in_central_directory(work):
    """Long fuzz run 1: a central-directory entry with an empty name made ZipInfo.is_dir() raise IndexError."""
    path = work / "blank.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", b"\x93NUMPY")
    raw = bytearray(path.read_bytes())
    cd, eocd = raw.rfind(b"PK\x01\x02"), raw.rfind(b"PK\x05\x06")
    name_len = int.from_bytes(raw[cd + 28:cd + 30], "little")
    del raw[cd + 46:cd + 46 + name_len]  # drop the name from the central directory entry ...
    raw[cd + 28:cd + 30] = (0).to_bytes(2, "little")  # ... and say it is empty
    eocd -= name_len
    size = int.from_bytes(raw[eocd + 12:eocd + 16], "little") - name_len
    raw[eocd + 12:eocd + 16] = size.to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with zipfile.ZipFile(path) as zf:
        assert [i.filename for i in zf.infolist()] == [""]
    loaded = io.read_inputs(path, ["x"])  # the blank entry is skipped like a directory; x is then missing
    assert loaded.tensors == {} and loaded.keys == []
