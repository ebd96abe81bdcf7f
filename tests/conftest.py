"""Shared test helpers: the TF golden fixtures, file writers, a CliRunner, a clean environment."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pty
import select
import subprocess
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

# The suite runs on numpy's OpenBLAS, the BLAS of a default install (set LSTMGRAD_BLAS=mkl to run it all on
# MKL); tests/test_blas.py runs the MKL path in subprocesses.
os.environ.setdefault("LSTMGRAD_BLAS", "openblas")
# A choice of BLAS that a test's process measures (LSTMGRAD_BLAS=auto) is cached in a folder of the session's own,
# never in the user's cache.
if "LSTMGRAD_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LSTMGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="lstmgrad-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LSTMGRAD_CACHE_DIR"], True)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
CASES = {case["name"]: case for case in MANIFEST}
SEQ_CASES = [c["name"] for c in MANIFEST if c["kind"] == "seq"]
CELL_CASES = [c["name"] for c in MANIFEST if c["kind"] == "cell"]


def load_case(name: str) -> tuple[dict, dict, dict]:
    """(inputs, expected gradients, manifest entry) of one TF golden case."""
    with np.load(FIXTURES / f"{name}.in.npz") as src, np.load(FIXTURES / f"{name}.expected.npz") as exp:
        return {k: src[k] for k in src.files}, {k: exp[k] for k in exp.files}, CASES[name]


def tolerance(dtype) -> tuple[float, float]:
    """(rtol of the largest expected magnitude, atol): float32 to a few ulp of the scale, float16 ~1e-2."""
    return (2e-2, 1e-3) if np.dtype(dtype) == np.float16 else (2e-6, 1e-7)


def assert_close_scaled(got, expected, dtype=None, name=""):
    dtype = dtype or expected.dtype
    rtol, atol = tolerance(dtype)
    got64, exp64 = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got64.shape == exp64.shape, f"{name}: shape {got64.shape} != {exp64.shape}"
    scale = float(np.max(np.abs(exp64), initial=0.0))
    err = float(np.max(np.abs(got64 - exp64), initial=0.0))
    assert err <= atol + rtol * scale, f"{name}: max abs error {err:.3g} > {atol + rtol * scale:.3g}"


def consistent_inputs(T=4, B=3, I=5, C=4, *, dtype=np.float32, seed=0, layout="ifco", use_peephole=True,  # noqa: E741
                      w_scale=1.0) -> dict[str, np.ndarray]:
    """A sequence problem as a real dump holds one: random weights, inputs and output gradients, and the
    activations the forward op (BlockLSTMV2 for ifco, BlockLSTM for icfo) computes from them, so that
    they fit the layout and peephole setting (what ``seq`` checks before computing)."""
    from lstmgrad_cli import block_lstm, block_lstm_v2

    rng = np.random.default_rng(seed)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    tensors = {"x": r(T, B, I), "cs_prev": r(B, C), "h_prev": r(B, C),
               "w": r(I + C, 4 * C, scale=w_scale / np.sqrt(I + C)), "wci": r(C, scale=0.5),
               "wcf": r(C, scale=0.5), "wco": r(C, scale=0.5), "b": r(4 * C, scale=0.5)}
    forward = block_lstm_v2 if layout == "ifco" else block_lstm
    tensors.update(forward(T, **tensors, use_peephole=use_peephole)._asdict())
    tensors["cs_grad"], tensors["h_grad"] = r(T, B, C), r(T, B, C)
    return tensors


def assert_same_gradients(got: dict, expected: dict):
    """The gradients a framework's golden file holds, each of its shape and dtype, within 2e-6 of its largest value
    (and no other)."""
    assert set(got) == set(expected), set(got) ^ set(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        scale = float(np.max(np.abs(want), initial=0.0))
        assert float(np.max(np.abs(got[name] - want), initial=0.0)) <= 1e-7 + 2e-6 * scale, name


def write_npz(path: Path, tensors: dict) -> Path:
    np.savez(path, **tensors)
    return path


def write_h5(path: Path, tensors: dict, group: str | None = None, attrs: dict | None = None, **file_kwargs) -> Path:
    with h5py.File(path, "w", **file_kwargs) as fh:
        node = fh.create_group(group) if group else fh
        for key, value in tensors.items():
            node.create_dataset(key, data=value)
        for key, value in (attrs or {}).items():
            node.attrs[key] = value
    return path


# LSTMGRAD_TEST_BACKEND=cupy runs what the suite computes on that backend by default (make gpu-check).
TEST_BACKEND = os.environ.get("LSTMGRAD_TEST_BACKEND")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("LSTMGRAD_BACKEND", "LSTMGRAD_OVERLAP", "NO_COLOR", "FORCE_COLOR"):  # (the schedule: as measured)
        monkeypatch.delenv(var, raising=False)
    if TEST_BACKEND:
        monkeypatch.setenv("LSTMGRAD_BACKEND", TEST_BACKEND)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def content_digest(path: Path) -> str:
    """sha256 of the file's size and of each stretch of data with its offset, the holes of a sparse file skipped
    (a hostile 3 GB sparse input is hashed in a moment, not read whole twice): any byte changed, or written into a
    hole, changes it."""
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        sha.update(f"{size}".encode())
        position = 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA) if hasattr(os, "SEEK_DATA") else position
            except OSError:  # ENXIO: only a hole from here to the end
                break
            end = os.lseek(fd, start, os.SEEK_HOLE) if hasattr(os, "SEEK_HOLE") else size
            sha.update(f"@{start}:".encode())
            fh.seek(start)
            for _ in range(start, end, 1 << 20):
                sha.update(fh.read(min(1 << 20, end - fh.tell())))
            position = end
    return sha.hexdigest()


@contextlib.contextmanager
def no_thread_can_start():
    """Meanwhile the system refuses every new thread of this process, as under a tight ``ulimit -v``: each one's
    stack is asked to be larger than any address space, so its mapping fails and Python raises RuntimeError
    ("can't start new thread").  Threads already running go on."""
    previous = threading.stack_size(2**50)
    try:
        yield
    finally:
        threading.stack_size(previous)


def run_on_a_terminal(command: list[str], *, stdout_too: bool, columns: int = 120) -> tuple[int, bytes]:
    """Run ``command`` with stderr (and stdout, with ``stdout_too``) on a pseudo-terminal; (exit code, what the
    terminal showed).  Reads at most 60 s of silence; the process is ended by pid whatever happens."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm"}
    proc = subprocess.Popen(command, stdout=follower if stdout_too else subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    try:
        while select.select([leader], [], [], 60)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(timeout=60), seen
