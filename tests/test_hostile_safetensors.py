"""Hostile and broken safetensors files get what hostile NPZ/HDF5 files get: one line ``Error: ...``, exit 1,
nothing written, the input untouched, nothing allocated from a declared size (every header is checked before
the safetensors package reads a byte of data).  Fuzzed: mutated headers, random bytes."""

from __future__ import annotations

import json
import struct

import bombs
import numpy as np
import pytest
from conftest import content_digest, load_case
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz import fuzz, watchdog

from lstmgrad_cli import io
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import LstmGradError


def valid_parts():
    """(header dict, data bytes) of the seq_v2_peep inputs as a safetensors file would hold them."""
    header, data = {}, b""
    for name, value in load_case("seq_v2_peep")[0].items():
        value = np.ascontiguousarray(value)
        dtype = {"float32": "F32", "int64": "I64", "bool": "BOOL"}[value.dtype.name]
        raw = value.tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header, data


def assemble(header, data: bytes, raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _with_x(shape, header, data):
    """``header`` and ``data`` with x replaced by zeros of ``shape``, placed after the rest."""
    x = bytes(4 * int(np.prod(shape)))
    header["x"] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data) + len(x)]}
    return header, data + x


def edited(edit):
    def build(path):
        header, data = valid_parts()
        blob = edit(header, data)
        path.write_bytes(blob if isinstance(blob, bytes) else assemble(header, data))
        return path
    return build


def x_entry(**change):
    def edit(header, data):
        header["x"].update(change)
    return edit


CASES = {
    "header length past the end": (lambda p: p.write_bytes(struct.pack("<Q", 10**6) + b"{}" + b"\0" * 100),
                                   "its safetensors header declares 1000000 bytes; the file holds 102"),
    "header not JSON": (edited(lambda h, d: assemble(h, d, b"{not json" + b" " * 20)), "header is not valid JSON"),
    "header nested too deep": (edited(lambda h, d: assemble(h, d, b'{"a":' + b"[" * 50 + b"1" + b"]" * 50 + b"}")),
                               "header is not a table of tensors"),
    "a key twice": (edited(lambda h, d: assemble(h, d, b'{"x": 1, "x": 2}')), "a key appears twice"),
    "dtype bfloat16": (edited(x_entry(dtype="BF16")), "x has dtype 'BF16'; lstmgrad reads F16, F32, F64"),
    "negative shape": (edited(x_entry(shape=[5, -3, 4])), "x has a malformed shape [5, -3, 4]"),
    "offsets past the data": (edited(x_entry(data_offsets=[0, 10**12])), "x lies at bytes 0..1000000000000"),
    "offsets overlapping": (edited(lambda h, d: h["cs_prev"].update(data_offsets=[h["x"]["data_offsets"][0] + 4,
                                                                                    h["x"]["data_offsets"][0] + 76])),
                            "overlaps"),
    "size not the shape's": (edited(x_entry(shape=[5, 3, 5])), "x holds 240 bytes for shape [5, 3, 5] of float32"),
    "4 TB declared, none stored": (edited(lambda h, d: assemble(
        {"x": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}, b"")),
        "x lies at bytes 0..4000000000000 of a data area of 0 bytes"),
    "metadata not strings": (edited(lambda h, d: h.update(__metadata__={"a": 1})),
                             "__metadata__ is not a table of strings"),
    "truncated data": (edited(lambda h, d: assemble(h, d[:-100])), "of a data area of"),
    # issue 34
    "header nested 900 deep (the JSON parser's recursion)": (
        lambda p: bombs.safetensors_nested(p, 900),
        "its safetensors header is not a table of tensors (nested 901 deep)"),
    "brackets inside strings are not nesting": (edited(lambda h, d: assemble(
        h, d, json.dumps({"[" * 900: {"dtype": "BF16", "shape": [], "data_offsets": [0, 0]}}).encode()[:-1]
        + b', "x": 1}')), "has dtype 'BF16'"),
    "seq_len_max of 375M int32 (a sparse 1.5 GB file)": (
        bombs.safetensors_bomb, "`seq_len_max_tensor` must be rank 0 but is rank 1 (shape [375000000])"),
    "x of [5, 1M, 1] beside a batch of 3": (edited(lambda h, d: assemble(*_with_x((5, 1 << 20, 1), h, d))),
                                            "x declares shape [5, 1048576, 1] of float32 = 20.0 MiB, but the file's "
                                            "other tensors make it [5, 3, 1]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_safetensors_is_one_line_and_writes_nothing(case, tmp_path, runner):
    build, message = CASES[case]
    path = tmp_path / "in.safetensors"
    build(path)
    before = content_digest(path)  # (a sparse 1.5 GB file among them: not read whole)
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(path), "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr
    assert not out.exists() and content_digest(path) == before
    with pytest.raises(LstmGradError):
        io.read_inputs(path, ["x"], ["seq_len_max"])


def test_a_declared_size_over_the_memory_limit_is_refused_before_reading(tmp_path, runner, monkeypatch):
    header, data = valid_parts()
    path = tmp_path / "in.safetensors"
    path.write_bytes(assemble(header, data))
    monkeypatch.setenv(io.MAX_BYTES_ENV, "100")
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "more than the 100 bytes limit" in result.stderr


def test_the_valid_file_behind_the_cases_works(tmp_path, runner):
    header, data = valid_parts()
    path = tmp_path / "in.safetensors"
    path.write_bytes(assemble(header, data))
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.stderr


@fuzz(60)
@given(data=st.data())
def test_mutated_headers_never_crash(tmp_path_factory, data):
    header, payload = valid_parts()
    text = bytearray(json.dumps(header).encode())
    for _ in range(data.draw(st.integers(1, 6), label="edits")):
        at = data.draw(st.integers(0, len(text) - 1))
        text[at] = data.draw(st.sampled_from(list(b'{}[]",:0123456789-eE.xF3I6BOL ')))
    cut = data.draw(st.integers(0, len(payload)), label="data kept")
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + bytes(text) + payload[:cut])
    with watchdog():
        try:
            loaded = io.read_inputs(path, list(header), ["seq_len_max"])
        except LstmGradError:
            return
    for name, value in loaded.tensors.items():  # what was read is exactly what the header said
        entry = json.loads(bytes(text))[name]
        assert list(value.shape) == entry["shape"]


@fuzz(40)
@given(blob=st.binary(max_size=300))
def test_random_bytes_after_a_plausible_length_never_crash(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    path.write_bytes(struct.pack("<Q", min(len(blob), 2)) + b"{" + blob)
    with watchdog():
        try:
            io.read_inputs(path, ["x"], ["use_peephole"])
        except LstmGradError:
            pass
