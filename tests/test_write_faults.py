"""Faults while writing (issue 6): disk full, file-size limit, permission denied, read-only filesystem,
missing directory, output equal to an input, interruptions.

Whatever happens: exit 1 with one line that says what happened, the input is byte-for-byte
untouched, no partial or temporary output remains, and an existing output replaced with --force
survives a failed replacement.  Real faults where the machine allows: a 512 KiB tmpfs for disk full
and a read-only remount (root only; skipped otherwise), a dropped-privilege subprocess for
permission denied as root, and RLIMIT_FSIZE in a subprocess everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import FIXTURES, consistent_inputs

from lstmgrad_cli import io
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import OutputFileError
from lstmgrad_cli.io import output

IS_ROOT = os.geteuid() == 0


def seq_inputs(T=16, B=32, I=256, C=32, dtype=np.float64, seed=0) -> dict[str, np.ndarray]:  # noqa: E741
    """Valid BlockLSTMGradV2 inputs; with the defaults x_grad alone is 1 MiB."""
    return consistent_inputs(T, B, I, C, dtype=dtype, seed=seed)


def write_input(path: Path, **shape) -> Path:
    np.savez(path, **seq_inputs(**shape))
    return path


def write_h5_input(path: Path, **shape) -> Path:
    """An HDF5 input: ``seq`` streams its x_grad into an HDF5 output (io.open_hdf5_output) rather than writing
    the output whole (io.write_outputs, as for an NPZ input)."""
    with h5py.File(path, "w") as fh:
        for name, value in seq_inputs(**shape).items():
            fh[name] = value
    return path


TINY = {"T": 2, "B": 2, "I": 3, "C": 2}  # an HDF5 output of 8-10 KiB: limits all through it are tried quickly


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    assert stderr.startswith("Error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in stderr, stderr


@contextlib.contextmanager
def tmpfs(size: str):
    """A fresh tmpfs of ``size`` (root only); skips the test when one cannot be mounted."""
    if not IS_ROOT or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root; disk-full is covered by the RLIMIT_FSIZE tests")
    where = Path(tempfile.mkdtemp(prefix="lstmgrad-tmpfs-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


def remount_read_only(where: Path) -> None:
    proc = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {proc.stderr.strip()}")


# -- disk full -----------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_disk_full_on_a_real_tmpfs(tmp_path, runner, suffix):
    src = write_input(tmp_path / "in.npz")
    before = digest(src)
    with tmpfs("512k") as disk:
        out = disk / f"grads{suffix}"
        result = runner.invoke(main, ["seq", str(src), "-o", str(out)])
        assert result.exit_code == 1
        assert_one_line_error(result.stderr, str(out), "no space left on device", "nothing was written")
        assert listing(disk) == []  # no partial output, no temporary file
    assert digest(src) == before


def test_disk_full_beside_the_input_keeps_the_input(runner):
    """Default output beside an input on a nearly full disk: the input survives intact."""
    with tmpfs("2m") as disk:
        src = write_input(disk / "in.npz", T=8, I=200)  # ~0.9 MB; its gradients need ~0.7 MB more
        filler = disk / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as fh:
            fh.write(b"\0" * (4 << 20))  # fill what is left (the write stops at ENOSPC)
        before = digest(src)
        result = runner.invoke(main, ["seq", str(src)])
        assert result.exit_code == 1
        assert_one_line_error(result.stderr, "no space left on device")
        assert listing(disk) == ["filler", "in.npz"]
        assert digest(src) == before


@pytest.mark.parametrize("free_kib", [4, 8, 12])
def test_hdf5_output_on_a_nearly_full_disk(tmp_path, free_kib):
    """A disk that fills while HDF5 writes, flushes and closes a streamed output (~18 KiB): the one line, in a
    subprocess because HDF5 used to crash the process there (SIGSEGV at exit, after h5py's tracebacks)."""
    src = write_h5_input(tmp_path / "in.h5", T=8, B=4, I=16, C=8)
    with tmpfs("64k") as disk:
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:
            fh.write(b"\0" * ((64 - free_kib) << 10))
        out = disk / "grads.h5"
        env = {**os.environ, "NO_COLOR": "1"}
        env.pop("LSTMGRAD_BACKEND", None)
        proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "seq", str(src), "-o", str(out)],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
        assert_one_line_error(proc.stderr, str(out), "no space left on device", "nothing was written")
        assert listing(disk) == ["filler"]


def _run_with_file_size_limit(args: list[str], limit: int) -> subprocess.CompletedProcess:
    """The real command with RLIMIT_FSIZE: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored)."""
    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("LSTMGRAD_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "lstmgrad_cli", *args], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit_writes, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_file_size_limit_in_a_subprocess(tmp_path, suffix):
    """Works without root: the kernel refuses writes past RLIMIT_FSIZE, like a full disk."""
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")  # (its Rust writer says "File too large (os error 27)")
    src = write_input(tmp_path / "in.npz")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / f"grads{suffix}"
    before = digest(src)
    proc = _run_with_file_size_limit(["seq", str(src), "-o", str(out)], limit=256 * 1024)
    assert proc.returncode == 1, proc.stderr
    assert_one_line_error(proc.stderr, str(out), "file too large")
    assert listing(out_dir) == []
    assert digest(src) == before


def test_failed_force_replacement_keeps_the_old_output(tmp_path):
    """--force over an existing output, then the write fails: the old output is still there, unchanged."""
    src = write_input(tmp_path / "in.npz")
    out = tmp_path / "grads.npz"
    out.write_bytes(b"previous results")
    proc = _run_with_file_size_limit(["seq", str(src), "-o", str(out), "--force"], limit=256 * 1024)
    assert proc.returncode == 1 and "file too large" in proc.stderr
    assert out.read_bytes() == b"previous results"
    assert listing(tmp_path) == ["grads.npz", "in.npz"]


def assert_failed_cleanly(proc: subprocess.CompletedProcess, out: Path, lines: int = 1) -> None:
    """Exit 1 (not a crash: -11 is SIGSEGV), one line per output, no traceback, no output, no temporary file."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == lines, proc.stderr
    for line in proc.stderr.splitlines():
        assert line.startswith("Error: ") and line.endswith(
            ": cannot write: file too large (file size limit reached); nothing was written"), line
    assert listing(out.parent) == [], listing(out.parent)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["npz", "h5"])
def test_hdf5_output_at_every_stage_of_the_file_size_limit(tmp_path, runner, source):
    """Wherever the limit falls in an HDF5 output (raw data, the metadata HDF5 writes as it flushes and closes
    the file), the one-line error and exit 1.  HDF5 cannot recover from a write that fails while it flushes: its
    close failed, h5py retried it for every object collected ("Can't decrement id ref count", a traceback
    each) and HDF5's cleanup at exit crashed the process (SIGSEGV) with the temporary file left, for every
    limit below ~2.5 KiB of this output.  ``source``: an NPZ input's output is written whole, an HDF5 input's
    streamed."""
    writer = write_input if source == "npz" else write_h5_input
    src = writer(tmp_path / f"in.{source}", **TINY)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "grads.h5"
    done = runner.invoke(main, ["seq", str(src), "-o", str(out)])
    assert done.exit_code == 0, done.output
    size = out.stat().st_size
    out.unlink()
    before = digest(src)
    for limit in sorted({1, 512, 1024, 2048, 3072, size // 2, size - 512, size - 1}):
        proc = _run_with_file_size_limit(["seq", str(src), "-o", str(out)], limit=limit)
        assert_failed_cleanly(proc, out)
    assert digest(src) == before


def test_failed_hdf5_force_replacement_keeps_the_old_output(tmp_path):
    """--force over an existing .h5 output and the limit hit where HDF5 used to crash: the old output stays."""
    src = write_h5_input(tmp_path / "in.h5", **TINY)
    out = tmp_path / "grads.h5"
    out.write_bytes(b"previous results")
    proc = _run_with_file_size_limit(["seq", str(src), "-o", str(out), "--force"], limit=1024)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert_one_line_error(proc.stderr, str(out), "file too large", "nothing was written")
    assert out.read_bytes() == b"previous results"
    assert listing(tmp_path) == ["grads.h5", "in.h5"]


@pytest.mark.slow
def test_file_size_limit_in_local_workers(tmp_path):
    """--workers 2: each worker process fails its HDF5 output with the one line (it used to print h5py's
    tracebacks from the worker, or die of SIGSEGV), and the batch goes on and exits 1."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("a", "b"):
        write_h5_input(folder / f"{name}.h5", **TINY)
    out_dir = tmp_path / "out"
    proc = _run_with_file_size_limit(["seq", str(folder), "--out-dir", str(out_dir), "--workers", "2",
                                      "--keep-going"], limit=1024)
    assert_failed_cleanly(proc, out_dir / "a.grads.h5", lines=2)
    assert str(out_dir / "a.grads.h5") in proc.stderr and str(out_dir / "b.grads.h5") in proc.stderr


def test_signals_wait_for_hdf5_to_close():
    """An interrupt while HDF5 flushes and closes an output waits for the close (a KeyboardInterrupt raised in
    the middle of it, from h5py's file object, would be a write that failed as far as HDF5 knows), then comes."""
    from lstmgrad_cli.io.hdf5_writer import signals_held  # noqa: PLC0415

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has another handler here")
    closed = False
    with pytest.raises(KeyboardInterrupt), signals_held():
        signal.raise_signal(signal.SIGINT)
        closed = True
    assert closed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_while_hdf5_writes_an_output_comes_once_the_write_returns(tmp_path, capfd):
    """A real SIGINT while a streamed HDF5 output is written, chunk after chunk (most of the time inside HDF5,
    which writes through h5py's file object, Python): it comes as a KeyboardInterrupt once the write in hand
    returns, never from inside one (h5py's SystemError and tracebacks, a write that failed as far as HDF5 knows;
    seen from a batch stopped by SIGTERM), and nothing is left."""
    import threading

    from lstmgrad_cli import io

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has another handler here")
    rows = np.ones((16, 2**18), np.float32)  # 16 MiB a write
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as caught, io.open_hdf5_output(tmp_path / "out.h5") as out:
        sink = out.create_dataset("x_grad", shape=(4096, 2**18), dtype=np.float32)
        timer.start()
        for lo in range(0, 4096, 16):  # (1 GiB in all: the signal comes long before the end)
            sink[lo:lo + 16] = rows
    timer.join()
    # not raised from inside a call HDF5 made to the output's file object (h5py's "fileobj" driver)
    inside = {"write", "read", "seek", "tell", "truncate", "flush"}
    where = [(entry.path.name, entry.name) for entry in caught.traceback]
    assert not any(path == "hdf5_writer.py" and name in inside for path, name in where), where
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SystemError" not in err, err
    assert list(tmp_path.iterdir()) == []


# -- permissions and read-only filesystems ---------------------------------------------------------

def test_read_only_filesystem(tmp_path, runner):
    with tmpfs("4m") as disk:
        src = write_input(disk / "in.npz", T=2, B=2, I=3, C=2)
        (disk / "out").mkdir()
        before = digest(src)
        remount_read_only(disk)
        for target in (disk / "out" / "grads.h5", None):  # explicit output, then the default beside the input
            args = ["seq", str(src)] + (["-o", str(target)] if target else [])
            result = runner.invoke(main, args)
            assert result.exit_code == 1
            assert_one_line_error(result.stderr, "read-only file system")
        assert listing(disk) == ["in.npz", "out"] and listing(disk / "out") == []
        assert digest(src) == before


_AS_NOBODY = r"""
import os, sys
from lstmgrad_cli.cli import main
# Warm every lazy import while still root (the interpreter lives under /root, unreadable to nobody): the same
# command as below, so that what it shows (rich's console and table) is imported too.
try:
    main(["seq", sys.argv[1], "-o", sys.argv[3]], standalone_mode=True)
except SystemExit as done:
    assert done.code in (0, None), done.code
os.remove(sys.argv[3])
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert os.geteuid() == 65534
main(["seq", sys.argv[1], "-o", sys.argv[2]])
"""


def test_permission_denied(tmp_path, runner):
    """An output directory the user may not write to.  As root (who ignores modes) the real command
    runs in a subprocess that drops to uid 65534 first."""
    work = Path(tempfile.mkdtemp(prefix="lstmgrad-perm-"))  # not under pytest's 0700 tmp dir
    scratch = Path(tempfile.mkdtemp(prefix="lstmgrad-scratch-"))
    try:
        os.chmod(work, 0o755)
        src = write_input(work / "in.npz", T=2, B=2, I=3, C=2)
        os.chmod(src, 0o644)
        locked = work / "locked"
        locked.mkdir(mode=0o755)
        out = locked / "grads.npz"
        before = digest(src)
        if IS_ROOT:
            proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(src), str(out), str(scratch / "warm.npz")],
                                  capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
            if proc.returncode != 1 and "Operation not permitted" in proc.stderr:
                pytest.skip("cannot drop privileges here")
            code, stderr = proc.returncode, proc.stderr
        else:
            os.chmod(locked, 0o555)
            result = runner.invoke(main, ["seq", str(src), "-o", str(out)])
            code, stderr = result.exit_code, result.stderr
        assert code == 1, stderr
        assert_one_line_error(stderr, str(out), "permission denied")
        assert listing(locked) == []
        assert digest(src) == before
    finally:
        with contextlib.suppress(OSError):
            os.chmod(work / "locked", 0o755)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


# -- paths that must be refused before any work ---------------------------------------------------

def test_missing_output_directory(tmp_path, runner):
    """-o into a missing directory is refused; --out-dir is made (tests/test_batch.py), as batch tools do."""
    src = write_input(tmp_path / "in.npz", T=2, B=2, I=3, C=2)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "nope" / "g.npz")])
    assert result.exit_code == 1
    assert_one_line_error(result.stderr, "output directory", "does not exist")
    assert listing(tmp_path) == ["in.npz"]


def test_missing_directory_in_the_library_writer(tmp_path):
    with pytest.raises(OutputFileError, match="output directory .* does not exist"):
        io.write_outputs(tmp_path / "nope" / "g.h5", {"a": np.zeros(2)}, {})


@pytest.mark.parametrize("how", ["same path", "force", "symlink", "hard link", "relative spelling"])
def test_output_equal_to_the_input_is_refused(tmp_path, runner, how, monkeypatch):
    src = write_input(tmp_path / "in.npz", T=2, B=2, I=3, C=2)
    before = digest(src)
    out, extra = src, []
    if how == "force":
        extra = ["--force"]
    elif how == "symlink":
        out = tmp_path / "alias.npz"
        out.symlink_to(src)
        extra = ["--force"]
    elif how == "hard link":
        out = tmp_path / "twin.npz"
        os.link(src, out)
        extra = ["--force"]
    elif how == "relative spelling":
        monkeypatch.chdir(tmp_path)
        out = Path(".") / ".." / tmp_path.name / "in.npz"
        extra = ["--force"]
    result = runner.invoke(main, ["seq", str(src), "-o", str(out), *extra])
    assert result.exit_code == 1
    assert_one_line_error(result.stderr, "output path is the input file")
    assert digest(src) == before


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "a batch's --out-dir"])
def test_an_output_never_replaces_the_weights_file(tmp_path, runner, how):
    """--weights is an input of the run too: -o naming it (however spelled) is refused even with --force."""
    weights = tmp_path / "model.weights.h5"
    shutil.copyfile(FIXTURES / "keras" / "keras_two_layers.weights.h5", weights)
    step = tmp_path / "step.npz"
    shutil.copyfile(FIXTURES / "keras" / "keras_two_layers.in.npz", step)
    before = digest(weights)
    target = ["-o", str(weights)]
    if how == "symlink":
        (tmp_path / "alias.h5").symlink_to(weights)
        target = ["-o", str(tmp_path / "alias.h5")]
    elif how == "hard link":
        os.link(weights, tmp_path / "twin.h5")
        target = ["-o", str(tmp_path / "twin.h5")]
    elif how == "a batch's --out-dir":  # the default name of step.npz's output is the weights file's
        (tmp_path / "out").mkdir()
        os.link(weights, tmp_path / "out" / "step.grads.npz")
        target = ["--out-dir", str(tmp_path / "out"), "--keep-going"]
    result = runner.invoke(main, ["seq", str(step), "--weights", str(weights), "--weights-group", "layers/lstm_1",
                                  *target, "--force"])
    assert result.exit_code == 1, result.output
    assert "is the weights file" in result.stderr and "an input of this run" in result.stderr
    assert "Traceback" not in result.output
    assert digest(weights) == before
    with h5py.File(weights) as fh:  # still the model, not gradients
        assert "layers" in fh


def test_output_equal_to_the_input_is_refused_by_the_library(tmp_path):
    src = write_input(tmp_path / "in.npz", T=2, B=2, I=3, C=2)
    with pytest.raises(OutputFileError, match="output path is the input file"):
        io.check_output(src, True, [src])


# -- interruptions inside the writer ---------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npz", ".h5"])
@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_fault_midway_leaves_nothing(tmp_path, monkeypatch, suffix, fault):
    """A fault after part of the file is on disk: the temporary file goes, the target never appears."""
    real_create = h5py.Group.create_dataset
    calls = []

    def flaky_create(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise fault
        return real_create(self, name, *args, **kwargs)

    def flaky_npz(fh, arrays):
        fh.write(b"PK\x03\x04 partial")
        raise fault

    monkeypatch.setattr(h5py.Group, "create_dataset", flaky_create)
    monkeypatch.setattr(output, "write_npz", flaky_npz)  # what writes an NPZ output's bytes
    out = tmp_path / f"g{suffix}"
    expected = OutputFileError if isinstance(fault, OSError) else KeyboardInterrupt
    with pytest.raises(expected) as info:
        io.write_outputs(out, {"a": np.zeros(3), "b": np.ones(3)}, {"tool": "lstmgrad"})
    if expected is OutputFileError:
        assert "no space left on device" in str(info.value)
    assert listing(tmp_path) == []


def test_h5py_errno_in_message_is_decoded():
    err = OSError("Can't write data (file write failed: time = x, filename = 'f', file descriptor = 3, "
                  "errno = 28, error message = 'No space left on device', buf = 0x1, total write size = 9)")
    assert io._os_reason(err) == "no space left on device"
    assert io._os_reason(OSError(errno.EFBIG, "File too large")).startswith("file too large")


# -- things a careful writer gets right ------------------------------------------------------------

def test_output_name_near_the_filesystem_limit(tmp_path):
    """A 250-character name must not fail because the temporary name is longer."""
    out = tmp_path / ("g" * 246 + ".npz")
    io.write_outputs(out, {"a": np.zeros(2)}, {"tool": "lstmgrad"})
    assert listing(tmp_path) == [out.name]


@pytest.mark.parametrize(("umask", "mode", "name"), [(0o022, 0o644, "g.h5"), (0o027, 0o640, "g.npz"),
                                                     (0o077, 0o600, "g.npz"), (0o022, 0o644, "g.safetensors")])
def test_output_permissions_follow_the_umask(tmp_path, umask, mode, name):
    old = os.umask(umask)
    try:
        io.write_outputs(tmp_path / name, {"a": np.zeros(2)}, {"tool": "lstmgrad"})
    finally:
        os.umask(old)
    assert (tmp_path / name).stat().st_mode & 0o777 == mode
