"""Hostile and broken Keras model archives (.keras: a zip of metadata.json, config.json, model.weights.h5) and
framework inputs: every one refused in one line, nothing written, nothing extracted anywhere but a private
temporary copy that is removed, the archive untouched."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lstmgrad_cli.cli import main

KERAS = FIXTURES / "keras"
STEP = KERAS / "keras_relu.in.npz"
WEIGHTS = KERAS / "keras_two_layers.weights.h5"
CONFIG = {"class_name": "Sequential", "config": {"layers": [{"class_name": "LSTM", "config": {"name": "lstm"}}]}}


def archive(path: Path, members: list[tuple[str, bytes]], compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def good_members(config=CONFIG, weights: bytes | None = None):
    return [("metadata.json", b'{"keras_version": "3.15.1"}'), ("config.json", json.dumps(config).encode()),
            ("model.weights.h5", WEIGHTS.read_bytes() if weights is None else weights)]


def run_seq(runner, tmp_path, weights: Path, group="layers/lstm"):
    out = tmp_path / "g.npz"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    temp_before = set(os.listdir(tempfile.gettempdir()))
    result = runner.invoke(main, ["seq", str(STEP), "--weights", str(weights), "--weights-group", group, "-o",
                                  str(out)])
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before
    left = {n for n in set(os.listdir(tempfile.gettempdir())) - temp_before if n.startswith("lstmgrad-keras-")}
    assert not left, left
    return result, out


def assert_refused(result, out, *fragments):
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output and not out.exists()
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_a_zip_bomb_of_weights_is_refused_from_what_it_declares(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "1M")
    bomb = archive(tmp_path / "m.keras", good_members(weights=b"\0" * (8 << 20)), zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size < 100_000
    result, out = run_seq(runner, tmp_path, bomb)
    assert_refused(result, out, "its model.weights.h5 declares 8.0 MiB, more than the 1.0 MiB limit")


def test_a_member_that_inflates_past_what_it_declares_is_stopped(runner, tmp_path):
    path = archive(tmp_path / "m.keras", good_members(weights=b"\0" * 4096), zipfile.ZIP_DEFLATED)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    # declare 100 bytes in both headers (local, central): the stream holds 4096
    central = data.find(b"model.weights.h5", data.find(b"PK\x01\x02"))
    entry = data.rfind(b"PK\x01\x02", 0, central)
    data[entry + 24:entry + 28] = (100).to_bytes(4, "little")
    data[info.header_offset + 22:info.header_offset + 26] = (100).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    result, out = run_seq(runner, tmp_path, path)
    assert_refused(result, out)
    assert "model.weights.h5" in result.stderr


@pytest.mark.parametrize(("members", "said"), [
    ([("metadata.json", b"{}"), ("config.json", b"{}")], "a Keras archive without model.weights.h5"),
    ([("metadata.json", b"{}"), ("model.weights.h5", b"x")], "a Keras archive without config.json"),
    (good_members()[:1] + [("config.json", b"[" * 5000 + b"]" * 5000)] + good_members()[2:],
     "its config.json nests 5000 levels deep"),
    (good_members()[:1] + [("config.json", b"{not json")] + good_members()[2:], "its config.json is not valid JSON"),
    (good_members()[:1] + [("config.json", b"[1, 2]")] + good_members()[2:], "its config.json is not a JSON object"),
    (good_members()[:2] + [("model.weights.h5", b"not an hdf5 file at all")],
     "m.keras (its model.weights.h5): corrupt or truncated HDF5 file"),
])
def test_broken_archives_are_refused_in_one_line(runner, tmp_path, members, said):
    result, out = run_seq(runner, tmp_path, archive(tmp_path / "m.keras", members))
    assert_refused(result, out, said)


def test_member_names_are_never_paths(runner, tmp_path):
    """A member named ../../escape (or absolute) is never extracted: only model.weights.h5 is read, into a private
    temporary file of lstmgrad's own name."""
    members = [*good_members(), ("../../escape.txt", b"x"), ("/tmp/abs-escape.txt", b"x")]
    work = tmp_path / "deep" / "er"
    work.mkdir(parents=True)
    result, out = run_seq(runner, work, archive(work / "m.keras", members), group="layers/lstm_1")
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/abs-escape.txt").exists()
    assert result.exit_code == 1  # (CONFIG has no lstm_1: the archive itself was read, and said so)
    assert "no LSTM layer at 'layers/lstm_1'" in result.stderr


def test_an_archive_of_very_many_members_is_refused(runner, tmp_path):
    members = good_members() + [(f"assets/{k}", b"") for k in range(1500)]
    result, out = run_seq(runner, tmp_path, archive(tmp_path / "m.keras", members))
    assert_refused(result, out, "a Keras archive declaring 1503 members", "refused before reading its directory")


def test_a_truncated_archive_is_refused(runner, tmp_path):
    whole = archive(tmp_path / "whole.keras", good_members()).read_bytes()
    cut = tmp_path / "m.keras"
    cut.write_bytes(whole[: len(whole) // 2])
    result, out = run_seq(runner, tmp_path, cut)
    assert_refused(result, out)


@pytest.mark.slow
def test_a_real_subprocess_refuses_a_bomb_without_growing(tmp_path):
    """Peak memory of the whole command stays near the interpreter's, for a 2 GB declared weights member."""
    bomb = archive(tmp_path / "m.keras", good_members(weights=b"\0" * (64 << 20)), zipfile.ZIP_DEFLATED)
    data = bytearray(bomb.read_bytes())  # then declare 2 GB in the central directory
    central = data.find(b"model.weights.h5", data.find(b"PK\x01\x02"))
    entry = data.rfind(b"PK\x01\x02", 0, central)
    data[entry + 24:entry + 28] = (2 << 30).to_bytes(4, "little")
    bomb.write_bytes(bytes(data))
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(p.stderr)")
    env = {**os.environ, "LSTMGRAD_MAX_TENSOR_BYTES": "100M"}
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "lstmgrad_cli", "seq", str(STEP),
                           "--weights", str(bomb), "--weights-group", "layers/lstm", "-o", str(tmp_path / "g.npz")],
                          capture_output=True, text=True, timeout=120, env=env)
    status, rss_kb = proc.stdout.splitlines()[0].split()
    assert status == "1" and "Error: " in proc.stdout and "Traceback" not in proc.stdout, proc.stdout
    assert int(rss_kb) < 150 * 1024, rss_kb


# -- framework tensors of every shape -------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=int(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(x=shapes, h_grad=shapes, h0=shapes, hn_grad=shapes, lengths=shapes, mask=shapes,
       framework=st.sampled_from(["keras", "torch"]), dtype=st.sampled_from(["float32", "int64", "bool"]))
def test_framework_inputs_of_any_shape_give_one_line(runner, tmp_path, x, h_grad, h0, hn_grad, lengths, mask,
                                                     framework, dtype):
    """x, the gradients, states, lengths and masks of every rank and size: computed, or one line, never a
    traceback."""
    rng = np.random.default_rng(0)
    C, I = 2, 3  # noqa: E741
    tensors = {"x": rng.normal(size=x).astype(np.float32), "h_grad": rng.normal(size=h_grad).astype(np.float32),
               "h0": rng.normal(size=h0).astype(np.float32), "hn_grad": rng.normal(size=hn_grad).astype(np.float32)}
    if framework == "keras":
        tensors.update(kernel=np.ones((I, 4 * C), np.float32), recurrent_kernel=np.ones((C, 4 * C), np.float32),
                       mask=(rng.random(mask) < 0.5).astype(dtype))
    else:
        tensors.update(weight_ih_l0=np.ones((4 * C, I), np.float32), weight_hh_l0=np.ones((4 * C, C), np.float32),
                       lengths=rng.integers(0, 4, lengths).astype(dtype))
    out = tmp_path / "g.npz"
    out.unlink(missing_ok=True)
    result = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "-o", str(out)])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1), result.output
    if result.exit_code == 1:
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
        assert not out.exists()
