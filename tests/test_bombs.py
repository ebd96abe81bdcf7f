"""Inputs that declare far more than they hold or than the op can use (issue 34), met by the real command in a
process of its own: each is refused in one line `Error: ...`, exit 1, with a peak resident memory near the
interpreter's own (under 150 MB, measured by the kernel: ``wait4``'s ru_maxrss), nothing written and the input
untouched.  Before the readers declared every tensor first, these took 0.2-4.3 GB (tests/bombs.py builds them;
benchmarks/bomb_probe.py measures the whole set with `inspect` too).

Every process runs under an address-space limit, so that a regression fails here instead of taking the
machine's memory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bombs
import pytest

PEAK_MB = 150
ADDRESS_SPACE = 4 << 30  # bytes: a reader that inflates a bomb fails under this rather than filling the machine
HANG_SECONDS = 60


# A process forked from a large one is charged that one's resident size: on exec, Linux folds the forked copy's
# high-water mark into the child's ru_maxrss (pytest here holds 170 MB and more by this module).  So each command is
# started by a small launcher process, whose own size (~14 MB) is what its child starts from; it runs the command
# under the address-space limit and HANG_SECONDS (and a limit on the size of any file it writes, when given), and
# sends back its exit status and peak through a pipe.
LAUNCHER = r"""
import os, resource, subprocess, sys, threading
fd, limit, seconds, fsize, argv = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
if fsize:
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
timer = threading.Timer(seconds, proc.kill)
timer.start()
_, status, usage = os.wait4(proc.pid, 0)
timer.cancel()
os.write(fd, f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}".encode())
"""


def measure(argv: list[str], cwd: Path, file_size: int = 0, env: dict | None = None) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, peak RSS in MB) of the command ARGV, killed after HANG_SECONDS; with
    ``file_size``, no file it writes may grow past that many bytes (writing past it fails: "File too large")."""
    env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    env.pop("LSTMGRAD_MAX_TENSOR_BYTES", None)  # the default budget: half of this machine's memory
    report, report_w = os.pipe()
    try:
        launcher = [sys.executable, "-c", LAUNCHER, str(report_w), str(ADDRESS_SPACE), str(HANG_SECONDS),
                    str(file_size), *argv]
        proc = subprocess.run(launcher, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              pass_fds=(report_w,), timeout=HANG_SECONDS + 30)
        os.close(report_w)
        report_w = None
        code, maxrss_kb = os.read(report, 100).decode().split()
    finally:
        os.close(report)
        if report_w is not None:
            os.close(report_w)
    assert proc.returncode == 0, proc.stderr
    return int(code), proc.stdout.decode(), proc.stderr.decode(), int(maxrss_kb) / 1024


def run_measured(args: list[str], cwd: Path, **limits) -> tuple[int, str, str, float]:
    """:func:`measure` of ``python -m lstmgrad_cli ARGS``."""
    return measure([sys.executable, "-m", "lstmgrad_cli", *args], cwd, **limits)


def fingerprint(path: Path) -> dict:
    """What must not change: every file's size and modification time, and the content of the small ones."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    out = {}
    for f in files:
        info = f.stat()
        small = f.is_file() and info.st_size < 32 << 20
        out[str(f)] = (info.st_size, info.st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest() if small else None)
    return out


# name -> (builder(folder) -> (input, extra arguments), fragment of the message); the sizes are what each declares.
CASES = {
    "npz member 400 MB (seq_len_max of rank 1)": (
        lambda d: (bombs.npz_member_bomb(d / "in.npz", shape=(100_000_000,)), ()),
        "`seq_len_max_tensor` must be rank 0 but is rank 1 (shape [100000000]); refused before reading"),
    "npz member 400 MB (x of [33M, 3, 1])": (
        lambda d: (bombs.npz_member_bomb(d / "in.npz", "x", (33_333_333, 3, 1), "<f4"), ()),
        "x declares shape [33333333, 3, 1] of float32 = 381.5 MiB, but the file's other tensors make it [5, 3, 1]"),
    "HDF5 gzip 1.5 GB (x of [125M, 3, 4])": (
        lambda d: (bombs.h5_gzip_bomb(d / "in.h5"), ()),
        "i.dims(0) != timelen"),  # seq leaves HDF5 tensors on disk: validation refuses by their shapes
    "HDF5 gzip 400 MB (seq_len_max of rank 1)": (
        lambda d: (bombs.h5_gzip_bomb(d / "in.h5", "seq_len_max", (100_000_000,), 1 << 18), ()),
        "`seq_len_max_tensor` must be rank 0 but is rank 1"),
    "Keras weights, gzip bias 1.6 GB": (
        lambda d: (bombs.KERAS_INPUT, ("--weights", str(bombs.keras_bias_bomb(d / "w.weights.h5")),
                                       "--weights-group", "layers/lstm")),
        "cell/vars/2 declares shape [400000000] of float32 = 1.5 GiB, but the file's other tensors make it [12]"),
    "TensorProto [5, 3, 4] with 20M packed values": (
        lambda d: (bombs.dump_content_bomb(d / "dump"), ()),
        "x holds 20000000 values for shape [5, 3, 4]; corrupt"),
    "TensorProto [5, 3, 4] with 20M one-value fields": (
        lambda d: (bombs.dump_content_bomb(d / "dump", how="unpacked"), ()),
        "x holds at least 61 values for shape [5, 3, 4]; corrupt"),
    "sparse 3 GB seq_len_max.npy": (
        lambda d: (bombs.npy_dir_sparse(d / "tensors"), ()),
        "`seq_len_max_tensor` must be rank 0 but is rank 1 (shape [750000000])"),
    "npy header of 4 GiB (format 3.0), stored NPZ member": (
        lambda d: (bombs.npz_v3_header_bomb(d / "in.npz"), ()),
        "x has a corrupt .npy header (EOF: reading array header, expected 4294967295 bytes"),
    "npy header of 4 GiB (format 3.0), deflated NPZ member": (
        lambda d: (bombs.npz_v3_header_bomb(d / "in.npz", stored=False), ()),
        "x has a corrupt .npy header (EOF: reading array header, expected 4294967295 bytes"),
    "npy header of 4 GiB (format 3.0), .npy file": (
        lambda d: (bombs.npy_dir_v3_header_bomb(d / "tensors"), ()),
        "x has a corrupt .npy header (EOF: reading array header, expected 4294967295 bytes"),
    "safetensors header nested 900 deep": (
        lambda d: (bombs.safetensors_nested(d / "in.safetensors"), ()),
        "its safetensors header is not a table of tensors (nested 901 deep)"),
    "safetensors sparse 1.5 GB (seq_len_max of rank 1)": (
        lambda d: (bombs.safetensors_bomb(d / "in.safetensors"), ()),
        "`seq_len_max_tensor` must be rank 0 but is rank 1"),
}


def build_cases(root, cases: dict) -> dict:
    """Each case of ``cases`` (name -> (build, expected)) built in a folder of its own under ``root``, with an empty
    ``out`` folder beside it: name -> (folder, input path, extra arguments)."""
    built = {}
    for k, (name, (build, _)) in enumerate(cases.items()):
        folder = root / f"case{k}"
        folder.mkdir()
        path, extra = build(folder)
        (folder / "out").mkdir()
        built[name] = (folder, path, extra)
    return built


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every case built, then run by `lstmgrad seq` (and the NPZ and HDF5 ones by `lstmgrad inspect`), two at a
    time: name -> (input, output folder, fingerprint before, [(command, exit code, stdout, stderr, MB)])."""
    built = {name: (path, extra, folder, fingerprint(folder))
             for name, (folder, path, extra) in build_cases(tmp_path_factory.mktemp("bombs"), CASES).items()}
    runs = []
    for name, (path, extra, folder, _) in built.items():
        runs.append((name, "seq", ["seq", str(path), *extra, "-o", str(folder / "out" / "g.npz")], folder))
        if path.suffix in (".npz", ".h5") and not extra:
            runs.append((name, "inspect", ["inspect", str(path)], folder))
    with ThreadPoolExecutor(max_workers=2) as pool:
        measured = list(pool.map(lambda run: run_measured(run[2], run[3] / "out"), runs))
    out = {name: (path, folder, before, []) for name, (path, _, folder, before) in built.items()}
    for (name, command, _, _), result in zip(runs, measured, strict=True):
        out[name][3].append((command, *result))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_bomb_is_refused_in_one_line_near_the_interpreters_memory(refusals, name):
    path, folder, before, results = refusals[name]
    fragment = CASES[name][1]
    for command, code, stdout, stderr, peak in results:
        assert peak < PEAK_MB, f"{command}: peak RSS {peak:.0f} MB"
        assert code == 1, (command, code, stderr)
        assert "Traceback" not in stderr + stdout
        if command == "seq":
            assert stderr.startswith("Error: ") and stderr.count("\n") == 1, stderr
            assert fragment in stderr, stderr
        else:  # inspect reports what it could not read, in its table's words
            assert ("refused before reading" in stdout or fragment in stdout.replace("\n", " ")
                    or stderr.startswith("Error: ")), stdout + stderr
    assert list((folder / "out").iterdir()) == []
    assert fingerprint(folder) == before  # the input untouched, nothing written beside it


@pytest.mark.slow
def test_the_measure_sees_memory_that_is_used(tmp_path):
    """The peak the tests above compare is the command's own: a process that holds 300 MB is measured above the
    bound, and the interpreter alone below it while this process holds 300 MB (a child forked from it directly
    would be charged those)."""
    held = b"\x01" * (300 << 20)
    code, _, _, peak = run_measured(["--version"], tmp_path)
    assert code == 0 and peak < PEAK_MB, peak
    code, _, _, peak = measure([sys.executable, "-c", "b = b'\\x01' * (300 << 20)"], tmp_path)
    assert code == 0 and peak > 300, peak
    assert len(held) == 300 << 20
