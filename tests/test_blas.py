"""Which BLAS the CPU backends call (``cpu_blas``), and the whole pass on MKL and on oneDNN.

The rest of the suite runs on numpy's OpenBLAS (conftest sets LSTMGRAD_BLAS=openblas).  The library
is chosen once per process, and the numba kernels bind its address when they load, so the MKL and
oneDNN runs here are real subprocesses with LSTMGRAD_BLAS=mkl or onednn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import CELL_CASES, FIXTURES, SEQ_CASES, assert_close_scaled, load_case

from lstmgrad_cli.backends import cpu_blas

TESTS = Path(__file__).resolve().parent
needs_mkl = pytest.mark.skipif(cpu_blas.mkl_version() is None,
                               reason="needs the mkl wheel: pip install 'lstmgrad[mkl]'")
needs_onednn = pytest.mark.skipif(cpu_blas.onednn_version() is None,
                                  reason="needs oneDNN's wheel: pip install 'lstmgrad[onednn]'")
NEEDS = {"mkl": needs_mkl, "onednn": needs_onednn}


@pytest.fixture
def choose(monkeypatch):
    """Set LSTMGRAD_BLAS and choose again; the process's own choice is back afterwards."""

    def set_choice(value):
        if value is None:
            monkeypatch.delenv(cpu_blas.BLAS_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_blas.BLAS_ENV, value)
        cpu_blas.find.cache_clear()
        return cpu_blas.find()

    yield set_choice
    monkeypatch.undo()
    cpu_blas.find.cache_clear()


def test_openblas_is_numpys_own_library(choose):
    blas = choose("openblas")
    if cpu_blas.numpy_openblas() is None:
        pytest.skip("numpy's OpenBLAS is not reachable here")
    assert blas is cpu_blas.numpy_openblas() and blas.name == "OpenBLAS (numpy's)"
    assert cpu_blas.describe() == "OpenBLAS (numpy's)" and cpu_blas.version_note() == ""


class _CountingLibrary:
    """A stand-in BLAS library whose thread count is a number, with every change recorded.  ``install`` makes it
    the library every product goes through (``cpu_blas.find``) and numpy's own (``cpu_blas.numpy_openblas``), its
    gemm the real library's, so that a pass computes as before."""

    def __init__(self, count):
        self.count, self.changes = count, []

    def install(self, monkeypatch):
        real = cpu_blas.find()
        blas = cpu_blas.Blas("counting", real.sgemm if real else 0, real.dgemm if real else 0, lambda: self.count,
                             self.set, None)
        monkeypatch.setattr(cpu_blas, "find", lambda: blas)
        monkeypatch.setattr(cpu_blas, "numpy_openblas", lambda: blas)

    def set(self, count):
        self.changes.append(count)
        self.count = count


def test_counts_held_changes_the_count_only_when_a_pass_needs_another(monkeypatch):
    library = _CountingLibrary(2)
    library.install(monkeypatch)
    with cpu_blas.counts_held():
        for _ in range(3):
            with cpu_blas.single_threaded():
                assert library.count == 1
            assert library.count == 1  # not put back after each small pass
        with cpu_blas.threads_for_pass(8, 64, 256, 256):  # a pass that wants threads gets the library's count
            assert library.count == 2
        with cpu_blas.threads_for_pass(5, 3, 4, 4):
            assert library.count == 1
    assert library.count == 2 and library.changes == [1, 2, 1, 2]
    with cpu_blas.single_threaded():  # outside: set and put back each time, as before
        assert library.count == 1
    assert library.count == 2 and library.changes[4:] == [1, 2]


def test_single_threaded_leaves_a_library_already_at_one_thread_alone(monkeypatch):
    # Setting numpy's OpenBLAS's count, even to the one it has, starts its threads again (a worker on one core).
    library = _CountingLibrary(1)
    library.install(monkeypatch)
    for _ in range(2):
        with cpu_blas.single_threaded():
            assert library.count == 1
    assert library.changes == []


def test_single_threaded_blocks_on_two_threads_put_the_count_back_when_the_last_ends():
    """Two overlapped passes at once on two threads: the second found numpy's OpenBLAS at one thread; when the first
    ends the count stays at one (the second still runs), and the last to end puts the first's count back."""
    own = cpu_blas.numpy_openblas()
    if own is None:
        pytest.skip("numpy's OpenBLAS is not reachable here")
    before = own.get_threads()
    own.set_threads(2)
    entered, first_left, seen = threading.Event(), threading.Event(), []

    def second():
        with cpu_blas.single_threaded():
            entered.set()
            first_left.wait(10)
            seen.append(own.get_threads())

    try:
        with cpu_blas.single_threaded():
            thread = threading.Thread(target=second)
            thread.start()
            entered.wait(10)
        seen.append(own.get_threads())  # the first has ended, the second not
        first_left.set()
        thread.join(10)
        assert seen == [1, 1] and own.get_threads() == 2
    finally:
        own.set_threads(before)


def test_a_serial_batch_of_small_files_sets_blas_threads_once(monkeypatch, tmp_path):
    """Putting numpy's OpenBLAS back to its count after each file restarts its threads, which spin against the
    next file: in a batch the count is set at the first small file and put back at the end only."""
    from conftest import consistent_inputs, write_npz

    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    if cpu_blas.find() is None:
        pytest.skip("no BLAS reachable here: nothing sets thread counts")
    library = _CountingLibrary(2)
    library.install(monkeypatch)
    paths = [write_npz(tmp_path / f"f{k}.npz", consistent_inputs(5, 3, 4, 4, seed=k)) for k in range(4)]
    (tmp_path / "out").mkdir()
    results = batch.run_batch(batch.plan_tasks(paths, None, tmp_path / "out"), GradOptions("seq"))
    assert [r.status for r in results] == ["ok"] * 4
    assert library.changes == [1, 2] and library.count == 2


def prefer_mkl(cache: Path) -> None:
    """A cached measurement saying MKL is the fastest here (auto then takes it: tests/test_blas_choice.py)."""
    from lstmgrad_cli.backends import blas_calibration

    installed = cpu_blas.other_libraries()
    key = blas_calibration.key(installed, cpu_blas.usable_cores())
    seconds = {**dict.fromkeys(installed, 3.0), "mkl": 1.0, "openblas": 2.0}
    (cache / blas_calibration.CACHE_FILE).write_text(json.dumps({"schema": 1, "entries": {key: {
        "library": "mkl", "seconds": seconds, "measured": "2026-01-01"}}}))


@needs_mkl
@pytest.mark.parametrize("value", [None, "auto", "MKL", " mkl "])
def test_mkl_is_chosen_where_asked_for_or_faster(choose, value, tmp_path, monkeypatch):
    monkeypatch.setenv("LSTMGRAD_CACHE_DIR", str(tmp_path))
    prefer_mkl(tmp_path)
    blas = choose(value)
    assert blas is cpu_blas.mkl() and blas.name == f"MKL {cpu_blas.mkl_version()}"
    assert cpu_blas.version_note() == f" with MKL {cpu_blas.mkl_version()}"


def _without_other_libraries(monkeypatch):
    """As where neither MKL's wheel nor oneDNN's is installed."""
    for name in ("mkl", "onednn", "mkl_version", "onednn_version"):
        monkeypatch.setattr(cpu_blas, name, lambda: None)


@pytest.mark.parametrize(("library", "label"), [("mkl", "MKL"), ("onednn", "oneDNN")])
def test_a_library_asked_for_but_absent_warns_and_uses_openblas(choose, monkeypatch, library, label):
    _without_other_libraries(monkeypatch)
    with pytest.warns(UserWarning, match=rf"LSTMGRAD_BLAS={library}, but {label} is not installed .*"
                                         rf"lstmgrad\[{library}\]"):
        blas = choose(library)
    assert blas is cpu_blas.numpy_openblas()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto without either is quiet
        assert choose("auto") is cpu_blas.numpy_openblas()
    assert cpu_blas.why_chosen().startswith("neither MKL nor oneDNN is installed")


def test_an_unknown_choice_warns_and_counts_as_auto(choose, monkeypatch):
    _without_other_libraries(monkeypatch)
    with pytest.warns(UserWarning, match=r"LSTMGRAD_BLAS='atlas' is not one of auto, mkl, onednn, openblas; using "
                                         r"auto"):
        assert choose("atlas") is cpu_blas.numpy_openblas()


@needs_mkl
def test_single_threaded_sets_both_libraries_and_puts_them_back(choose):
    mkl, own = choose("mkl"), cpu_blas.numpy_openblas()
    libraries = [mkl] + ([own] if own is not None else [])
    before = [blas.get_threads() for blas in libraries]
    for blas in libraries:
        blas.set_threads(2)
    try:
        with cpu_blas.single_threaded():
            assert [blas.get_threads() for blas in libraries] == [1] * len(libraries)
        assert [blas.get_threads() for blas in libraries] == [2] * len(libraries)
    finally:
        for blas, count in zip(libraries, before, strict=True):
            blas.set_threads(count)


def test_a_small_pass_and_its_summaries_run_blas_on_one_thread(choose, monkeypatch, tmp_path):
    """Below SMALL_PASS_FLOPS the pass and the work around it run BLAS single-threaded (idle threads would spin
    against the next file); a larger pass keeps the library's count; the count is back afterwards."""
    from conftest import consistent_inputs, write_npz

    from lstmgrad_cli.analysis import summary
    from lstmgrad_cli.backends import get_backend
    from lstmgrad_cli.operations import grad as jobs
    from lstmgrad_cli.operations.grad import GradOptions
    from lstmgrad_cli.spec import SeqTensors

    blas = choose("openblas")
    if blas is None:
        pytest.skip("no BLAS found through ctypes")
    seen = []
    monkeypatch.setattr(jobs, "summarise", lambda name, value: seen.append(("summary", blas.get_threads())) or
                        summary.summarise(name, value))
    before = blas.get_threads()
    blas.set_threads(2)
    try:
        def threads_in_pass(T, B, I, C):  # noqa: E741
            arrays = consistent_inputs(T, B, I, C, seed=1)
            counts = []
            tensors = SeqTensors(**{name: arrays[name] for name in SeqTensors._fields})
            get_backend("numpy").block_lstm_grad(tensors, seq_len_max=T, use_peephole=False, layout="ifco",
                                                 compute_dtype=np.float32,
                                                 observe=lambda *_: counts.append(blas.get_threads()))
            return set(counts)

        assert threads_in_pass(5, 3, 4, 4) == {1}
        assert 16 * 8 * 64 * 256 * (256 + 256) >= cpu_blas.SMALL_PASS_FLOPS
        assert threads_in_pass(8, 64, 256, 256) == {2}
        assert blas.get_threads() == 2

        path = write_npz(tmp_path / "small.npz", consistent_inputs(5, 3, 4, 4, seed=2))
        jobs.run_grad_file(path, tmp_path / "small.grads.npz", GradOptions("seq"))
        assert seen and {count for _, count in seen} == {1}
        assert blas.get_threads() == 2
    finally:
        blas.set_threads(before)


@needs_mkl
def test_matmul_goes_through_the_chosen_library(choose, monkeypatch):
    choose("mkl")
    seen = []
    real = cpu_blas.matmul_into
    monkeypatch.setattr(cpu_blas, "matmul_into", lambda *a, **k: seen.append(a[2].shape) or real(*a, **k))
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    out = np.empty((3, 5), np.float32)
    cpu_blas.matmul(a, b, out)
    np.testing.assert_array_equal(out, np.full((3, 5), 4, np.float32))
    cpu_blas.matmul(a.astype(np.float16), b.astype(np.float16), out.astype(np.float16))  # declined: numpy does it
    assert seen == [(3, 5), (3, 5)]


def test_describe_names_the_library_the_products_use():
    # Backend versions and outputs record what describe() says: it must be the library chosen, not a guess.
    code = """
import json
from lstmgrad_cli.backends import cpu_blas
name = cpu_blas.describe()
print(json.dumps([name, cpu_blas.find().name]))
"""
    env = {**os.environ, cpu_blas.BLAS_ENV: "auto"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    name, chosen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert name == chosen and (chosen in ("OpenBLAS (numpy's)", f"MKL {cpu_blas.mkl_version()}")
                               or chosen.startswith("oneDNN ") and cpu_blas.onednn_version() is not None)


# The CLI in a child whose address space is limited to what it uses already plus a margin (``ulimit -v`` as
# batch schedulers set it), everything but MKL imported first so the margin is what MKL gets.  "unchecked": MKL is
# tried whatever the margin, as before address_space_short (its libraries then fail to map, or in a narrow band
# of margins its OpenMP runtime deadlocks).
UNDER_A_LIMIT = """
import resource, sys
import h5py, numpy
import lstmgrad_cli.backends._numpy, lstmgrad_cli.cli, lstmgrad_cli.cli.grad_cmd, lstmgrad_cli.operations.grad
import importlib.metadata, csv
from lstmgrad_cli.backends import cpu_blas
if sys.argv[2] == "unchecked":
    cpu_blas.MKL_ADDRESS_SPACE = cpu_blas.MKL_THREAD_ADDRESS_SPACE = 0
for line in open("/proc/self/status"):
    if line.startswith("VmSize:"):
        used = int(line.split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + int(sys.argv[1]) * 2**20, resource.RLIM_INFINITY))
sys.argv = ["lstmgrad", *sys.argv[3:]]
lstmgrad_cli.cli.main()
"""


def _mkl_room_mb() -> int:
    return (cpu_blas.MKL_ADDRESS_SPACE + cpu_blas.MKL_THREAD_ADDRESS_SPACE * cpu_blas._mkl_threads()) >> 20


@pytest.mark.slow
@needs_mkl
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")
@pytest.mark.parametrize(("choice", "check", "margins"), [
    # MB over what the process uses: too little for MKL (192 once hung in MKL's OpenMP start), then enough
    ("auto", "checked", (64, 128, 192, _mkl_room_mb() + 256)),
    ("mkl", "checked", (64, 128, 192, _mkl_room_mb() + 256)),
    # MKL's libraries do not fit: loading them fails, and lstmgrad goes on.  (A wider margin lets some of MKL's
    # libraries map before one fails, and what they keep may leave OpenBLAS too little for its buffers: with MKL
    # 2026.2 at 96 MB, OpenBLAS gave up allocating.  That is what the address-space check exists for.)
    ("auto", "unchecked", (64,)),
], ids=["auto", "mkl", "unchecked"])
def test_mkl_that_cannot_load_under_a_memory_limit_falls_back_to_openblas(tmp_path, choice, check, margins):
    fell_back = []
    cache = tmp_path / "cache"
    cache.mkdir()
    prefer_mkl(cache)  # (auto takes MKL where it loads: this machine may time numpy's OpenBLAS faster)
    for margin in margins:
        out = tmp_path / f"g{margin}.npz"
        env = {**os.environ, cpu_blas.BLAS_ENV: choice, "LSTMGRAD_CACHE_DIR": str(cache)}
        proc = subprocess.run([sys.executable, "-c", UNDER_A_LIMIT, str(margin), check, "seq",
                               str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out), "--json"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, (margin, proc.stderr)
        doc = json.loads(proc.stdout)  # stdout is the JSON document only: nothing MKL said reached it
        assert "MKL" not in proc.stdout.replace(doc["results"][0]["backend_version"], "")
        warnings_seen = proc.stderr.splitlines()
        if warnings_seen:
            assert len(warnings_seen) == 1 and warnings_seen[0].startswith("Warning: MKL does not load here ("), \
                proc.stderr
            assert warnings_seen[0].endswith("; using numpy's OpenBLAS")
            assert ("the address-space limit (ulimit -v) leaves" in warnings_seen[0]) == (check == "checked")
            assert "MKL" not in doc["results"][0]["backend_version"]  # the output records the library used
            fell_back.append(margin)
        else:
            assert doc["results"][0]["backend_version"].endswith(f" with MKL {cpu_blas.mkl_version()}")
        with np.load(out) as got:
            for key, value in load_case("seq_v2_peep")[1].items():
                assert_close_scaled(got[key], value, name=key)
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert (cache / "blas-choice.json").read_text().count('"library"') == 1  # a failed load is no measurement
    assert fell_back, "no margin was too small for MKL: the fallback was not exercised"
    if check == "checked":
        assert fell_back == list(margins[:-1]), "MKL was not used with room enough for it"


def test_mkl_is_not_tried_with_less_address_space_than_it_may_map(monkeypatch):
    resource = pytest.importorskip("resource")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # the threads it will start: a local worker's share, say
    room = cpu_blas.MKL_ADDRESS_SPACE + cpu_blas.MKL_THREAD_ADDRESS_SPACE * 3
    used = 300 * 2**20
    real_status = cpu_blas.process_status  # what /proc/self/status says; VmSize (KiB) as if the process mapped `used`
    monkeypatch.setattr(cpu_blas, "process_status", lambda field: used >> 10 if field == "VmSize" else
                        real_status(field))
    for limit, short in [(resource.RLIM_INFINITY, False), (used + room, False), (used + room - 1, True),
                         (used // 2, True)]:
        monkeypatch.setattr(resource, "getrlimit", lambda which, limit=limit: (limit, resource.RLIM_INFINITY))
        why = cpu_blas.address_space_short()
        assert (why is not None) == short, limit
        if short:
            left = max(limit - used, 0) >> 20
            assert why.startswith(f"the address-space limit (ulimit -v) leaves {left} MB to map, and MKL may need "
                                  f"{room >> 20} MB")
    monkeypatch.setattr(cpu_blas, "process_status", lambda field: None)  # no /proc: nothing to go on, MKL is tried
    assert cpu_blas.address_space_short() is None
    monkeypatch.delenv("MKL_NUM_THREADS")  # unset (or not a count): one thread per usable core
    monkeypatch.setenv("OMP_NUM_THREADS", "auto")
    assert cpu_blas._mkl_threads() == cpu_blas.usable_cores()


MKL_FAILED = """
import sys
from lstmgrad_cli.backends import cpu_blas
from lstmgrad_cli.cli import main

cpu_blas.on_mkl = lambda: True  # the products go through MKL
cpu_blas.mkl_fatal_error(2)  # which met a fatal error, as MKL reports one through lstmgrad's exit handler
main(sys.argv[1:], prog_name="lstmgrad")
"""


def test_an_mkl_failure_during_a_pass_writes_nothing(tmp_path):
    # With lstmgrad's handler MKL returns from a call it cannot complete instead of exiting the process; the
    # result is then wrong, so the pass must fail rather than be written.  (A process of its own: what MKL
    # reported stays recorded for the rest of the process.)
    out = tmp_path / "g.npz"
    proc = subprocess.run([sys.executable, "-c", MKL_FAILED, "seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("Error: ") and "MKL failed during the computation" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not out.exists() and list(tmp_path.iterdir()) == []


LIBRARY_RUN = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from conftest import load_case, assert_close_scaled
import lstmgrad_cli as lg
from lstmgrad_cli.backends import cpu_blas, _numba, _numba_kernels, get_backend
from lstmgrad_cli.spec import SeqTensors
from lstmgrad_cli.backends._numpy import NumpyBackend
from lstmgrad_cli.operations.bench import make_inputs

library = getattr(cpu_blas, sys.argv[4])()
assert library is not None and cpu_blas.find() is library and _numba_kernels._BLAS is library, cpu_blas.find()
numba = _numba.NumbaBackend(kernel_min_flops=0)
from test_ops_golden import cell_args, seq_call

for name in sys.argv[2].split(","):  # every fixture against TensorFlow's numbers, both host backends
    inputs, expected, case = load_case(name)
    for backend in ("numpy", numba):
        got = seq_call(inputs, case["layout"], backend=backend)
        for key, value in got._asdict().items():
            assert_close_scaled(value, expected[key], name=f"{name} {key}")
for name in sys.argv[3].split(","):
    inputs, expected, case = load_case(name)
    args, peep = cell_args(inputs)
    for backend in ("numpy", numba):
        got = lg.lstm_block_cell_grad_full(**args, use_peephole=peep, backend=backend)
        for key, value in got._asdict().items():
            assert_close_scaled(value, expected[key], name=f"{name} {key}")

# Problems big enough for the overlapped schedule (its products on one thread each, where the sequential schedule's
# have the library's threads): numba and numpy agree bit for bit, in both schedules and both compute dtypes.
same = True
for shape, dtype in [((24, 32, 96, 128), "float32"), ((40, 64, 256, 256), "float32"), ((24, 32, 96, 128), "float64")]:
    T = shape[0]
    t = SeqTensors(**make_inputs(shape, seed=5))
    kw = dict(seq_len_max=T - 3, use_peephole=True, layout="ifco", compute_dtype=np.dtype(dtype))
    runs = {}
    for overlap in (True, False):
        runs[f"numba-{overlap}"] = _numba.NumbaBackend(overlap=overlap, kernel_min_flops=0).block_lstm_grad(t, **kw)
        runs[f"numpy-{overlap}"] = NumpyBackend(overlap=overlap).block_lstm_grad(t, **kw)
    first = runs.pop("numpy-False")
    same = same and all(np.array_equal(a, b) for run in runs.values() for a, b in zip(run, first))
print(json.dumps({"same": same, "versions": [get_backend("numpy").version, numba.version]}))
"""


def _library_name(library: str) -> str:
    """What the outputs record of ``library``'s products ("MKL 2026.2.0", "oneDNN 3.2.0"), asked of a process."""
    code = "from lstmgrad_cli.backends import cpu_blas; print(cpu_blas.describe())"
    env = {**os.environ, cpu_blas.BLAS_ENV: library}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("library", [pytest.param(name, marks=mark) for name, mark in NEEDS.items()])
def test_the_whole_pass_on_each_library_matches_tensorflow_and_the_backends_agree_bit_for_bit(library):
    env = {**os.environ, cpu_blas.BLAS_ENV: library}
    proc = subprocess.run([sys.executable, "-c", LIBRARY_RUN, str(TESTS), ",".join(SEQ_CASES), ",".join(CELL_CASES),
                           library], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["same"], f"numpy and numba, overlapped or not, differ on {library}"
    name = _library_name(library)
    assert name.startswith(("MKL ", "oneDNN ")), name
    assert all(v.endswith(f" with {name}") for v in doc["versions"]), doc["versions"]


@pytest.mark.slow
@pytest.mark.parametrize("library", [pytest.param(name, marks=mark) for name, mark in NEEDS.items()])
def test_cli_on_each_library_records_it_in_the_output(tmp_path, library):
    from lstmgrad_cli.io import read_metadata

    out = tmp_path / "grads.npz"
    lstmgrad = Path(sys.executable).with_name("lstmgrad")
    env = {**os.environ, cpu_blas.BLAS_ENV: library}
    proc = subprocess.run([str(lstmgrad), "seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out),
                           "--backend", "numba"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert read_metadata(out)["backend_version"].endswith(f" with {_library_name(library)}")
    with np.load(out) as got:
        for key, value in load_case("seq_v2_peep")[1].items():
            assert_close_scaled(got[key], value, name=key)


def test_cli_shows_an_unknown_choice_as_one_warning_line(runner, choose, tmp_path, monkeypatch):
    from lstmgrad_cli.cli import main

    _without_other_libraries(monkeypatch)
    choose(None)  # the CLI reads LSTMGRAD_BLAS itself, below
    monkeypatch.setenv(cpu_blas.BLAS_ENV, "atlas")
    cpu_blas.find.cache_clear()
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_tiny.in.npz"), "-o", str(tmp_path / "g.npz"), "-q"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == "Warning: LSTMGRAD_BLAS='atlas' is not one of auto, mkl, onednn, openblas; using auto\n"


@pytest.mark.parametrize("name", ["numpy", "click", "h5py", "mkl", "google-crc32c", "Google_CRC32C", "no-such-dist"])
def test_installed_version_is_what_importlib_metadata_says(name):
    """Every command asks for MKL's version without importlib.metadata (its imports cost 10-20 ms a start)."""
    import importlib.metadata

    try:
        expected = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        expected = None
    assert cpu_blas.installed_version(name) == expected


@pytest.mark.parametrize("layout", ["dist-info", "egg-info folder", "egg-info file"])
def test_installed_version_reads_each_kind_of_metadata_importlib_does(tmp_path, monkeypatch, layout):
    import importlib.metadata

    metadata = "Metadata-Version: 2.1\nName: Fake-MKL.pkg\nVersion: 1.2.3\n\nDescription\n"
    if layout == "dist-info":
        (tmp_path / "fake_mkl.pkg-1.2.3.dist-info").mkdir()
        (tmp_path / "fake_mkl.pkg-1.2.3.dist-info" / "METADATA").write_text(metadata)
    elif layout == "egg-info folder":
        (tmp_path / "Fake_MKL.pkg-1.2.3-py3.11.egg-info").mkdir()
        (tmp_path / "Fake_MKL.pkg-1.2.3-py3.11.egg-info" / "PKG-INFO").write_text(metadata)
    else:
        (tmp_path / "Fake_MKL.pkg-1.2.3-py3.11.egg-info").write_text(metadata)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.metadata.version("fake-mkl.pkg") == "1.2.3"
    assert cpu_blas.installed_version("fake-mkl.pkg") == "1.2.3"
    assert cpu_blas.installed_version("Fake_MKL-pkg") == "1.2.3"


@needs_onednn
def test_onednn_is_chosen_where_asked_for_and_named_by_its_own_version(choose):
    blas = choose("onednn")
    assert blas is cpu_blas.onednn() and blas.sgemm_call == "dnnl"
    assert blas.name.startswith("oneDNN 3.") and cpu_blas.version_note() == f" with {blas.name}"
    assert cpu_blas.library() == "onednn" and cpu_blas.why_chosen() == "LSTMGRAD_BLAS=onednn"
    assert blas.dgemm == cpu_blas.numpy_openblas().dgemm  # oneDNN has no float64 product


@needs_onednn
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_onednn_products_are_right_for_every_operand_layout(choose, dtype):
    """dnnl_sgemm takes its operands as they lie (row-major, 'N' or 'T'), written in place or added into; float64
    goes to numpy's OpenBLAS, to the bit."""
    choose("onednn")
    rng = np.random.default_rng(7)
    for M, K, N in [(3, 4, 5), (64, 1024, 256), (1, 7, 2), (130, 33, 65)]:
        a, b = rng.normal(size=(M, K)).astype(dtype), rng.normal(size=(K, N)).astype(dtype)
        expected = a.astype(np.float64) @ b.astype(np.float64)
        for left in (a, np.asfortranarray(a)):
            for right in (b, np.asfortranarray(b)):
                out = np.full((M, N), np.nan, dtype)
                assert cpu_blas.matmul_into(left, right, out, accumulate=False)
                np.testing.assert_allclose(out, expected, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-4)
                if dtype == np.float64:
                    on_openblas = np.empty_like(out)
                    cpu_blas.gemm_on(cpu_blas.numpy_openblas(), left, right, on_openblas)
                    np.testing.assert_array_equal(out, on_openblas)
                assert cpu_blas.matmul_into(left, right, out, accumulate=True)
                np.testing.assert_allclose(out, 2 * expected, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-3)


@needs_onednn
def test_onednns_thread_count_holds_on_every_thread_that_calls_it(choose):
    """GNU OpenMP keeps the count per thread: the count set on one thread is what a product on another runs on."""
    import ctypes
    import threading

    blas = choose("onednn")
    openmp = ctypes.CDLL("libgomp.so.1")
    before = blas.get_threads()
    seen = []

    def product_on_a_new_thread():
        out = np.empty((2, 2), np.float32)
        cpu_blas.gemm_on(blas, np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32), out)
        seen.append(openmp.omp_get_max_threads())

    try:
        for count in (1, 2, 1):
            blas.set_threads(count)
            thread = threading.Thread(target=product_on_a_new_thread)
            thread.start()
            thread.join()
        with cpu_blas.single_threaded():
            assert blas.get_threads() == 1
    finally:
        blas.set_threads(before)
    assert seen == [1, 2, 1] and blas.get_threads() == before


@needs_onednn
def test_a_product_onednn_refuses_raises_rather_than_leaving_its_output(choose):
    blas = choose("onednn")
    out = np.zeros((2, 2), np.float32)
    a = np.ones((2, 3), np.float32)
    gemm = cpu_blas._product(blas, np.float32)  # a leading dimension shorter than a row: oneDNN refuses it
    with pytest.raises(cpu_blas.BlasError, match=r"oneDNN .* refused a product of 2x3 by 3x2 \(status 2: invalid"):
        gemm(101, 111, 111, 2, 2, 3, 1.0, a.ctypes.data, 1, a.ctypes.data, 2, 0.0, out.ctypes.data, 2)
