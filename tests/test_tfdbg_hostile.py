"""Broken and hostile TensorFlow debug dumps get what hostile NPZ/HDF5 files get: one line ``Error: ...``,
exit 1, nothing written, the dump untouched, nothing allocated from a declared size.  Each case edits a
real dump TensorFlow wrote (fixtures/tfdbg/) or builds records with tests/tfdbg_builder.py; the fuzz tests
mutate the real records (checksums mended, so the protobuf decoder sees the damage)."""

from __future__ import annotations

import hashlib
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz import fuzz, watchdog
from tfdbg_builder import event, field, op_creation, packed, record, shape_proto, tensor_proto, trace, write_dump

from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import LstmGradError
from lstmgrad_cli.io import tfdbg, tfrecord

DUMPS = FIXTURES / "tfdbg"
EAGER = DUMPS / "v2_eager_explicit"


def copy_dump(tmp_path: Path, name: str = "v2_eager_explicit") -> Path:
    target = tmp_path / "dump"
    shutil.copytree(DUMPS / name, target)
    return target


def the_file(dump: Path, suffix: str) -> Path:
    return next(dump.glob(f"*.{suffix}"))


def records_of(path: Path) -> list[bytes]:
    return [r.data for r in tfrecord.read_records(path, 1 << 30)]


def digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.iterdir()))).hexdigest()


def cut(dump, nbytes):
    path = the_file(dump, "execution")
    path.write_bytes(path.read_bytes()[:-nbytes])


def flip(dump, offset):
    path = the_file(dump, "execution")
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def replace_execution_records(dump, edit):
    """Rewrite the .execution file's records through ``edit(list of data) -> list of data``, checksums mended."""
    path = the_file(dump, "execution")
    path.write_bytes(b"".join(record(d) for d in edit(records_of(path))))


def declared_length(dump, length):
    path = the_file(dump, "execution")
    head = struct.pack("<Q", length)
    path.write_bytes(path.read_bytes() + head + struct.pack("<I", tfrecord.masked_crc32c(head)) + b"\0" * 64)


def eager_tensor(array=None, proto=None) -> bytes:
    """An eager Execution of a BlockLSTMGradV2 whose first input comes from a Snapshot holding ``proto``."""
    proto = proto if proto is not None else tensor_proto(array)
    snapshot = event(9, field(1, "Snapshot") + packed(5, [100]) + field(6, 7) + field(7, proto))
    grad = event(9, field(1, "BlockLSTMGradV2") + packed(4, [100] * 18) + packed(5, range(200, 208)) + field(6, 7))
    return [snapshot, grad]


CASES = {
    "truncated record": (lambda d: cut(d, 10), "declares 860 bytes but the file holds 850 after it (truncated, or "
                         "not a TFRecord file); if TensorFlow may still be writing it, read it after "
                         "disable_dump_debug_info()"),
    "length checksum": (lambda d: flip(d, 9), "the checksum of its length does not match"),
    "data checksum": (lambda d: flip(d, 20), "bytes of data does not match"),
    "length past the end": (lambda d: declared_length(d, 10**6), "declares 1000000 bytes but the file holds 60"),
    "length past the memory limit": (lambda d: declared_length(d, 60), "more than the 50-byte memory limit"),
    "not a DebugEvent": (lambda d: replace_execution_records(d, lambda r: [b"\xff\xff\xff"] + r),
                         "is not a valid DebugEvent (truncated varint)"),
    "varint over 10 bytes": (lambda d: replace_execution_records(d, lambda r: [b"\x08" + b"\xff" * 11] + r),
                             "varint longer than 10 bytes"),
    "field longer than its message": (lambda d: replace_execution_records(d, lambda r: [b"\x4a\x7f\x0a"] + r),
                                      "declares 127 bytes, only 1 left"),
    "tensor of 4 TB": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((10**6, 10**6))) + field(4, b"\0" * 16))),
        "x declares shape [1000000, 1000000] of float32 = 3.6 TiB"),
    "tensor data short of its shape": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((4, 4))) + field(4, b"\0" * 12))),
        "x holds 12 bytes of data for shape [4, 4] of float32 (64 bytes); corrupt"),
    "a string tensor": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 7) + field(2, shape_proto((1,))) + field(8, b"hello"))), "x has dtype DT_STRING"),
    "an unknown shape": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, field(2, field(1, -1))))), "x has an unknown shape"),
    "more typed values than the shape": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 9) + field(2, shape_proto((2,))) + packed(10, [1, 2, 3]))), "holds 3 values for shape [2]"),
    # issue 34: counted from the lengths before anything is decoded (records over 4 MiB are walked on disk)
    "2M packed floats for [5, 3, 4]": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((5, 3, 4))) + field(5, bytes(8_000_000)))),
        "x holds 2000000 values for shape [5, 3, 4]; corrupt"),
    "a million one-float fields for [5, 3, 4]": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((5, 3, 4))) + (b"\x2d" + bytes(4)) * 1_000_000)),
        "x holds at least 61 values for shape [5, 3, 4]; corrupt"),
    "8 MB of content for [5, 3, 4]": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((5, 3, 4))) + field(4, bytes(8_000_000)))),
        "x holds 8000000 bytes of data for shape [5, 3, 4] of float32 (240 bytes); corrupt"),
    "2M packed int32 for [5, 3, 4]": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 3) + field(2, shape_proto((5, 3, 4))) + field(7, bytes(2_000_000)))),
        "x holds 2000000 values for shape [5, 3, 4]; corrupt"),
    "100 dimensions": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((1,) * 100)))),
        "x declares 100 dimensions (shape [1, 1, 1, 1, 1, 1, 1, 1, ... (100 dimensions)]); no tensor has more than 32"),
    "a million dimensions": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((1,)) * 1_000_000))),  # (the same bytes as shape_proto((1,) * 10**6))
        "is not a valid DebugEvent (a shape of more than 254 dimensions (TensorFlow's limit))"),
    "no element, dimensions past any array": (lambda d: replace_execution_records(d, lambda r: eager_tensor(
        proto=field(1, 1) + field(2, shape_proto((0, 1 << 62, 1 << 62))))),
        "x declares shape [0, 4611686018427387904, 4611686018427387904], which no array can have"),
    "an execution of a million outputs": (lambda d: replace_execution_records(d, lambda r: [event(
        9, field(1, "IdentityN") + packed(5, range(1_000_000)) + field(6, 7))] + r),
        "is not a valid DebugEvent (an execution with more than 65536 outputs)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_dump_is_one_line_and_writes_nothing(case, tmp_path, runner, monkeypatch):
    edit, message = CASES[case]
    if case == "length past the memory limit":
        monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "50")
    dump = copy_dump(tmp_path)
    edit(dump)
    before = digest(dump)
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(dump), "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["dump"]
    assert digest(dump) == before
    for command in ("inspect", "check"):  # the other commands that read dumps say the same
        other = runner.invoke(main, [command, str(dump)])
        assert other.exit_code == 1 and message in other.output and "Traceback" not in other.output


def test_a_directory_of_unrelated_files_with_a_metadata_name(tmp_path, runner):
    folder = tmp_path / "junk"
    folder.mkdir()
    (folder / "run.metadata").write_text("not a record")
    (folder / "run.execution").write_bytes(b"\x00" * 7)
    (folder / "notes.txt").write_text("hello")
    result = runner.invoke(main, ["seq", str(folder), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "run.metadata: the record at byte 0 is corrupt: the checksum of its length does not match" in result.stderr


def test_a_dump_without_lstm_ops(tmp_path, runner):
    dump = write_dump(tmp_path / "dump", {"execution": [event(9, field(1, "MatMul") + field(6, 7))]})
    result = runner.invoke(main, ["seq", str(dump), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "no BlockLSTMGrad or BlockLSTMGradV2 executions" in result.stderr
    result = runner.invoke(main, ["inspect", str(dump)])
    assert result.exit_code == 1 and "no execution of BlockLSTM" in result.stdout


def test_a_graph_input_whose_producer_was_never_traced(tmp_path, runner):
    """A circular-buffer dump drops early records: the producer exists, its value does not."""
    dump = write_dump(tmp_path / "dump", {
        "graphs": [op_creation("ReadVariableOp", "r", "g"),
                   op_creation("BlockLSTMGradV2", "grad", "g", ["r:0"] * 18, 8)],
        "graph_execution_traces": [trace("g", "grad", 0, np.zeros((1, 1, 1), np.float32))]})
    result = runner.invoke(main, ["seq", str(dump), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "circular_buffer_size=-1" in result.stderr
    assert "has no recorded output before this execution" in result.stderr
    assert "op_regex or tensor_dtypes" in result.stderr  # the filters drop values as a circular buffer does


def test_an_identity_loop_does_not_hang(tmp_path):
    dump = write_dump(tmp_path / "dump", {
        "graphs": [op_creation("Identity", "a", "g", ["b:0"]), op_creation("Identity", "b", "g", ["a:0"]),
                   op_creation("BlockLSTMGradV2", "grad", "g", ["a:0"] * 18, 8)],
        "graph_execution_traces": [trace("g", "grad", 0, np.zeros((1, 1, 1), np.float32))]})
    execution = tfdbg.index_dump(dump).gradient_executions()[0]
    assert len(execution.missing) == 18


def test_a_named_pipe_named_like_a_dump_file_is_refused_at_once(tmp_path, runner):
    """Reading it would wait for a writer forever; it is refused without being opened to read."""
    import bombs
    from test_hostile_files import fifo_watchdog

    dump = bombs.dump_with_fifo(tmp_path / "dump")
    with fifo_watchdog(tmp_path):  # (a regression fails instead of hanging)
        for command in (["seq", str(dump), "-o", str(tmp_path / "g.npz")], ["inspect", str(dump)]):
            result = runner.invoke(main, command)
            assert result.exit_code == 1 and "Traceback" not in result.output
            assert "tfdbg_events.1.test.execution: is not a regular file (a named pipe); refused" in result.output
    assert not (tmp_path / "g.npz").exists()


@pytest.mark.slow
def test_a_dump_of_many_processes_is_listed_in_linear_time(tmp_path):
    """20,000 file sets (a .metadata file each): matching each set's files against a list of names made the
    listing quadratic (32,000 files took 90 s); every set is found, the dump indexed."""
    import bombs

    dump = bombs.dump_many_files(tmp_path / "dump", count=20_000)
    with watchdog():
        assert len(tfdbg.file_sets(dump)) == 20_000 - 5
        index = tfdbg.index_dump(dump)
    assert len(index.gradient_executions()) == 1 and index.records == 20_000 - 5 + 2


def test_member_slugs_are_distinct_and_plain_where_they_can_be():
    slugs = tfdbg.member_slugs(["train_step/g!#0", "train_step/g?#0", "train_step/g#1", "eager/BlockLSTMGrad#0"])
    assert slugs == {"train_step/g!#0": "train_step%2Fg%21%230", "train_step/g?#0": "train_step%2Fg%3F%230",
                     "train_step/g#1": "train_step.g.1", "eager/BlockLSTMGrad#0": "eager.BlockLSTMGrad.0"}


# -- fuzz -------------------------------------------------------------------------------------------------

def mended(path: Path) -> list[bytes]:
    return records_of(path)


@pytest.mark.slow
@fuzz(60)
@given(data=st.data())
def test_mutated_records_never_crash(tmp_path_factory, data):
    """Any byte of any record changed (checksums mended): index, load every execution, inspect, check; only
    LstmGradError may come out."""
    name = data.draw(st.sampled_from(["v2_eager_explicit", "cell_explicit", "v1_peep_clip"]), label="dump")
    dump = tmp_path_factory.mktemp("fuzz") / "dump"
    shutil.copytree(DUMPS / name, dump)
    suffix = data.draw(st.sampled_from(["execution", "graphs", "graph_execution_traces", "metadata"]))
    path = the_file(dump, suffix)
    records = mended(path)
    if not records:
        return
    k = data.draw(st.integers(0, len(records) - 1), label="record")
    body = bytearray(records[k])
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        if not body:
            break
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans(), label="truncate"):
        body = body[:data.draw(st.integers(0, len(body)))]
    records[k] = bytes(body)
    path.write_bytes(b"".join(record(r) for r in records))
    with watchdog():
        try:
            index = tfdbg.index_dump(dump)
            for execution in index.executions:
                with_values = [n for n, v in {**execution.inputs, **execution.outputs}.items()
                               if isinstance(v, tfdbg.TensorRef)]
                tfdbg.load_execution(index, execution, with_values, [])
        except LstmGradError:
            pass


@fuzz(40)
@given(blob=st.binary(max_size=400), framed=st.booleans())
def test_random_bytes_as_dump_files_never_crash(tmp_path_factory, blob, framed):
    dump = tmp_path_factory.mktemp("fuzz") / "dump"
    dump.mkdir()
    for suffix in ("metadata", "graphs", "execution", "graph_execution_traces"):
        (dump / f"x.{suffix}").write_bytes(record(blob) if framed else blob)
    with watchdog():
        try:
            for execution in tfdbg.index_dump(dump).executions:
                tfdbg.load_execution(tfdbg.index_dump(dump), execution, ["x"], [])
        except LstmGradError:
            pass
