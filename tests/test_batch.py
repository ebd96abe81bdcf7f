"""Many files: worker processes, a real Dask LocalCluster, resuming, interruption, progress."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, consistent_inputs, load_case, no_thread_can_start, run_on_a_terminal, write_h5, write_npz

from lstmgrad_cli.cli import main

NAMES = ["seq_v2_peep", "seq_v2_nopeep", "seq_v2_partial", "seq_v2_larger", "seq_tiny", "seq_v2_clip"]


def make_inputs(folder: Path) -> list[Path]:
    folder.mkdir(exist_ok=True)
    paths = []
    for k, name in enumerate(NAMES):
        inputs = load_case(name)[0]
        writer = write_npz if k % 2 else write_h5
        paths.append(writer(folder / f"{name}{'.npz' if k % 2 else '.h5'}", inputs))
    return paths


def outputs_of(folder: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(folder.glob("*.grads.*")):
        if path.suffix == ".npz":
            with np.load(path) as data:
                found[path.name] = {k: data[k] for k in data.files if not k.startswith("__")}
        else:
            import h5py

            with h5py.File(path, "r") as fh:
                found[path.name] = {k: fh[k][()] for k in fh}
    return found


def assert_same_outputs(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name])
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key], err_msg=f"{name}:{key}")


@pytest.fixture
def worker_signal():
    """A real stop signal to this process, handled as in a local worker process (execution/interrupts.py's handler,
    with the signals recorded in a state of their own, given back after).  ``signal.raise_signal`` runs the
    handler before it returns, so the signal lands exactly where the test sends it."""
    from lstmgrad_cli.execution import interrupts

    with interrupts.caught(signals=(signal.SIGINT,)):
        yield signal.raise_signal


@pytest.fixture(scope="module")
def serial_outputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serial")
    make_inputs(folder / "in")
    (folder / "out").mkdir()
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["seq", str(folder / "in"), "--out-dir", str(folder / "out"), "-q"])
    assert result.exit_code == 0, result.stderr
    outs = outputs_of(folder / "out")
    assert len(outs) == len(NAMES)
    for name in NAMES:
        got = next(v for k, v in outs.items() if k.startswith(name + ".grads"))
        expected = load_case(name)[1]
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6)
    return outs


# The CLI as a subprocess, its local workers forked (local_workers.start_method, on Linux) or spawned as on macOS and
# Windows.
CLI_WITH_WORKERS = {
    "fork": [sys.executable, "-m", "lstmgrad_cli"],
    "spawn": [sys.executable, "-c", "import sys; from lstmgrad_cli.execution import local_workers; "
                                    "local_workers.start_method = lambda: 'spawn'; "
                                    "from lstmgrad_cli.cli import main; sys.exit(main())"],
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_processes_give_the_serial_results(tmp_path, serial_outputs, method):
    make_inputs(tmp_path / "in")
    (tmp_path / "out").mkdir()
    result = subprocess.run(CLI_WITH_WORKERS[method] + ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out"),
                                                        "--workers", "2", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["summary"] == {"done": 6, "failed": 0, "skipped": 0, "lost": 0, "not_run": 0}
    assert [Path(r["input"]).name for r in doc["results"]] == sorted(p.name for p in (tmp_path / "in").iterdir())
    assert_same_outputs(outputs_of(tmp_path / "out"), serial_outputs)


@pytest.mark.slow
def test_spawned_worker_processes_divide_blas_threads(monkeypatch):
    from lstmgrad_cli.execution import local_workers
    from lstmgrad_cli.operations.batch import make_executor

    monkeypatch.setattr(local_workers, "start_method", lambda: "spawn")  # forked: test_a_forked_worker_starts_as_...
    with make_executor(workers=2) as (executor, threads):
        assert threads == max(1, (os.cpu_count() or 1) // 2)
        seen = executor.submit(_blas_threads_in_worker).result(timeout=120)
    assert seen == [threads] * len(seen) and seen


def _blas_threads_in_worker() -> list[int]:
    from threadpoolctl import threadpool_info

    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


A_FORKED_WORKER = """
import signal, sys
from threadpoolctl import threadpool_info
from lstmgrad_cli.operations import batch
from lstmgrad_cli.execution import local_workers
from lstmgrad_cli.backends import cpu_blas

def state():
    blas = {info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"}
    sigint = signal.getsignal(signal.SIGINT)
    return (getattr(sigint, "__name__", sigint), int(signal.getsignal(signal.SIGTERM)), *blas)

def interrupted(signum, frame):
    raise SystemExit("the parent's handler ran")

cpu_blas.find()  # loaded here, MKL too where installed: they have read their thread counts already
signal.signal(signal.SIGINT, interrupted)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "ignored" else interrupted)
print(local_workers.start_method())
with batch.make_executor(workers=2) as (pool, threads):
    print(threads, *pool.submit(state).result(timeout=60))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork only on Linux")
@pytest.mark.parametrize("sigterm", ["caught", "ignored"])
def test_a_forked_worker_starts_as_a_spawned_one_does(sigterm):
    # A forked worker inherits its parent's signal handlers (the CLI's turn SIGTERM into KeyboardInterrupt)
    # and the thread counts its libraries read when they were loaded.  A new interpreter would keep a signal
    # its parent ignores ignored, and put every other back to its default.
    pytest.importorskip("threadpoolctl")
    done = subprocess.run([sys.executable, "-c", A_FORKED_WORKER, sigterm], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    method, line = done.stdout.split("\n")[:2]
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    sigterm_handler = signal.SIG_IGN if sigterm == "ignored" else signal.SIG_DFL
    assert method == "fork"
    assert line.split() == [threads, "default_int_handler", str(int(sigterm_handler)), threads]


A_WORKER_ON_ONE_CORE = """
import os, sys
os.cpu_count = lambda: 2  # two workers: one core, so one BLAS thread, each
sys.path.insert(0, sys.argv[1])
import numpy as np
from conftest import consistent_inputs
from lstmgrad_cli.operations import batch
from lstmgrad_cli import block_lstm_grad_v2
from lstmgrad_cli.execution import local_workers
from lstmgrad_cli.backends import cpu_blas

def threads_after_small_passes():
    for seed in range(3):  # each pass is below SMALL_PASS_FLOPS: single_threaded()
        block_lstm_grad_v2(4, **consistent_inputs(seed=seed), use_peephole=True)
    return cpu_blas.process_status("Threads")

np.ones((300, 300)) @ np.ones((300, 300))  # the parent's OpenBLAS has run its threads
print(local_workers.start_method())
with batch.make_executor(workers=2) as (pool, threads):
    print(threads, pool.submit(threads_after_small_passes).result(timeout=60))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork only on Linux")
def test_a_forked_worker_on_one_core_runs_no_idle_blas_thread():
    # Setting numpy's OpenBLAS's thread count, even to the count it has, starts its worker threads again, and
    # they spin for a while against the other worker's core: a forked worker ends them once its count is set,
    # and single_threaded() leaves a library at one thread alone (0-3% of --workers 2 on 300 small files).
    done = subprocess.run([sys.executable, "-c", A_WORKER_ON_ONE_CORE, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "1", "1"]


THREADS_AT_THE_POOL = """
import sys, threading, time
from lstmgrad_cli.execution import local_workers
import numpy as np

np.ones((300, 300)) @ np.ones((300, 300))  # numpy's OpenBLAS starts its threads: they are ended, not counted
before = local_workers.start_method()
if sys.argv[1] == "thread":
    import _thread
    _thread.start_new_thread(time.sleep, (30,))  # a thread Python's threading module does not know of
else:
    import numba  # no thread yet, but its pool's size is fixed
print(before, local_workers.start_method(), threading.active_count())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork only on Linux")
@pytest.mark.parametrize("then", ["thread", "numba"])
def test_workers_are_forked_only_from_a_process_with_one_thread(then):
    if then == "numba":
        pytest.importorskip("numba")
    done = subprocess.run([sys.executable, "-c", THREADS_AT_THE_POOL, then], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "spawn", "1"]


def test_workers_are_spawned_while_another_python_thread_runs():
    import threading

    from lstmgrad_cli.execution import local_workers

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert local_workers.start_method() == "spawn"
    finally:
        stop.set()
        thread.join()


@pytest.mark.slow
def test_dask_local_cluster_gives_the_serial_results(runner, tmp_path, serial_outputs):
    distributed = pytest.importorskip("distributed")
    make_inputs(tmp_path / "in")
    (tmp_path / "out").mkdir()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", processes=True,
                                  dashboard_address=None) as cluster:
        result = runner.invoke(main, ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out"), "--dask",
                                      cluster.scheduler_address, "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["done"] == 6
    assert_same_outputs(outputs_of(tmp_path / "out"), serial_outputs)


@pytest.mark.slow
def test_unreachable_dask_scheduler_is_a_clean_error(runner, tmp_path):
    pytest.importorskip("distributed")
    src = write_npz(tmp_path / "a.npz", load_case("seq_v2_peep")[0])
    result = runner.invoke(main, ["seq", str(src), "--dask", "tcp://127.0.0.1:9", "-q"],
                           env={"LSTMGRAD_DASK_TIMEOUT": "1s"})
    assert result.exit_code == 1 and result.stderr.startswith("Error: cannot reach the Dask scheduler")


def test_skip_existing_resumes_and_refuses_foreign_files(runner, tmp_path):
    paths = make_inputs(tmp_path / "in")
    first = runner.invoke(main, ["seq", str(paths[0]), "-q"])
    assert first.exit_code == 0
    done = paths[0].with_name(paths[0].name.replace(".h5", ".grads.h5"))
    stamp = done.stat().st_mtime_ns
    result = runner.invoke(main, ["seq", str(tmp_path / "in"), "--skip-existing", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["summary"] == {"done": 5, "failed": 0, "skipped": 1, "lost": 0, "not_run": 0}
    assert done.stat().st_mtime_ns == stamp
    foreign = paths[1].with_name(paths[1].name.replace(".npz", ".grads.npz"))
    foreign.write_bytes(b"not ours")
    again = runner.invoke(main, ["seq", str(paths[1]), "--skip-existing"])
    assert again.exit_code == 1 and "exists but is not a complete lstmgrad output" in again.stderr
    assert foreign.read_bytes() == b"not ours"


def _long_inputs(folder: Path, count: int) -> list[Path]:
    """Files with many small time steps: each takes a while (the sequential loop) on little data."""
    folder.mkdir()
    base = consistent_inputs(T=3000, B=4, I=4, C=8)
    return [write_h5(folder / f"run{k:03d}.h5", base) for k in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_interrupted_batch_leaves_no_partial_output_and_resumes(tmp_path, sig):
    inputs = _long_inputs(tmp_path / "in", 20)
    digests = {p: p.read_bytes() for p in inputs[:3]}
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "lstmgrad_cli", "seq", str(tmp_path / "in"), "--out-dir", str(out), "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(out.glob("*.grads.h5")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -9}[sig], stderr.decode()
    finished = sorted(out.glob("*.grads.h5"))
    assert 0 < len(finished) < len(inputs), "the run must be interrupted mid-batch"
    from lstmgrad_cli.io.provenance import is_complete_output

    assert all(is_complete_output(p) for p in finished)
    leftovers = [p for p in out.iterdir() if p.name.endswith(".tmp")]
    if sig != signal.SIGKILL:  # a killed process cannot clean up; its temp file is hidden and harmless
        assert leftovers == []
    resumed = subprocess.run(cmd + ["--skip-existing", "--json"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)["summary"]
    assert summary["skipped"] == len(finished) and summary["done"] == len(inputs) - len(finished)
    assert len(list(out.glob("*.grads.h5"))) == len(inputs)
    assert all(p.read_bytes() == data for p, data in digests.items())


def _stderr_on_a_terminal(args: list[str]) -> tuple[int, bytes]:
    """Run the CLI with stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    return run_on_a_terminal([sys.executable, "-m", "lstmgrad_cli", *args], stdout_too=False)


@pytest.mark.slow
def test_progress_bar_on_a_terminal_only_for_humans(tmp_path):
    make_inputs(tmp_path / "in")
    code, seen = _stderr_on_a_terminal(["seq", str(tmp_path / "in"), "--json"])
    assert code == 0 and b"files" not in seen  # --json: no progress bar, even on a terminal
    code, seen = _stderr_on_a_terminal(["seq", str(tmp_path / "in"), "--force"])
    assert code == 0 and b"6/6" in seen and b"files" in seen
    assert b"1/6" in seen and b"5/6" in seen  # drawn again as each file finishes, not only at the end


def test_the_progress_bar_runs_no_thread():
    # A refreshing thread would make every batch with a progress bar spawn its workers (local_workers.start_method).
    import threading

    from lstmgrad_cli.cli._common import progress_bar

    before = threading.active_count()
    with progress_bar(True, 2) as advance:
        advance()
        assert threading.active_count() == before


def _kill_the_first_worker(cmd: list[str], poll: float) -> subprocess.Popen:
    """Start ``cmd`` (a batch with --workers) and SIGKILL its first worker process as soon as it appears."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    children: list[int] = []
    while not children and time.monotonic() < deadline:
        time.sleep(poll)
        children = _worker_pids(proc.pid)
    assert children, "no worker process appeared"
    os.kill(children[0], signal.SIGKILL)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_killed_worker_is_a_failed_file_not_a_crash(tmp_path, method):
    inputs = _long_inputs(tmp_path / "in", 6)
    out = tmp_path / "out"
    out.mkdir()
    cmd = CLI_WITH_WORKERS[method] + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--workers", "2"]
    proc = _kill_the_first_worker(cmd + ["--keep-going", "--json"], poll=0.05)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    doc = json.loads(stdout)
    failed = [r for r in doc["results"] if r["status"] == "failed"]
    assert failed and all("worker process failed" in r["error"] for r in failed)
    from lstmgrad_cli.io.provenance import is_complete_output

    assert all(is_complete_output(p) for p in out.glob("*.grads.h5"))
    resumed = subprocess.run(cmd + ["--skip-existing", "-q"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert len(list(out.glob("*.grads.h5"))) == len(inputs)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_killed_as_the_pool_starts_never_hangs_nor_prints_a_traceback(tmp_path, method):
    # Killing a worker while the pool was still starting others used to race the pool's own teardown
    # (CPython 3.11): a hang, or a traceback from its manager thread, in ~1 run of 5 here.
    _long_inputs(tmp_path / "in", 4)
    for attempt in range(4):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        cmd = CLI_WITH_WORKERS[method] + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--workers", "2",
                                          "--keep-going", "--json"]
        proc = _kill_the_first_worker(cmd, poll=0.002)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "Traceback" not in stderr, stderr
        assert all(r["status"] == "failed" and "worker process failed" in r["error"]
                   for r in json.loads(stdout)["results"] if r["status"] != "ok")


def test_worker_processes_that_cannot_start_fail_each_file_and_the_document_is_printed(runner, tmp_path,
                                                                                       monkeypatch):
    # Starting the pool registers its lock with multiprocessing's resource tracker; a tracker killed as it
    # started left a broken pipe that the command took for its own closed stdout, and printed no JSON.
    import contextlib

    from lstmgrad_cli.cli import main
    from lstmgrad_cli.operations import batch

    @contextlib.contextmanager
    def executor(workers=1, dask_address=None, initializer=None, devices=()):
        raise BrokenPipeError(32, "Broken pipe")
        yield  # (a generator)

    monkeypatch.setattr(batch, "make_executor", executor)
    make_inputs(tmp_path / "in")
    result = runner.invoke(main, ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out"), "--workers", "2",
                                  "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["summary"]["failed"] == len(doc["results"]) > 1
    assert all("the worker processes could not start (BrokenPipeError: [Errno 32] Broken pipe)" in r["error"]
               for r in doc["results"])
    assert "stdout was closed" not in result.stderr and not list((tmp_path / "out").glob("*.grads.*"))


def test_a_task_that_cannot_be_handed_out_is_that_files_failure(tmp_path, monkeypatch):
    import concurrent.futures as cf
    import contextlib
    from concurrent.futures.process import BrokenProcessPool

    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    inputs = make_inputs(tmp_path / "in")[:3]
    tasks = batch.plan_tasks(inputs, None, tmp_path)

    class BreaksOnSecond(cf.ThreadPoolExecutor):
        handed = 0

        def submit(self, fn, *args, **kwargs):
            self.handed += 1
            if self.handed == 2:
                raise BrokenProcessPool("a worker died while tasks were handed out")
            return super().submit(fn, *args, **kwargs)

    @contextlib.contextmanager
    def executor(workers=1, dask_address=None, initializer=None, devices=()):
        with BreaksOnSecond(2) as pool:
            yield pool, 1

    monkeypatch.setattr(batch, "make_executor", executor)
    results = batch.run_batch(tasks, GradOptions("seq"), workers=2, keep_going=True)
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert "the worker process failed (BrokenProcessPool: a worker died" in results[1].error
    assert Path(results[0].output).exists() and not tasks[1].output.exists()


def test_every_worker_starts_before_the_first_task():
    import multiprocessing

    from lstmgrad_cli.operations.batch import make_executor

    before = set(multiprocessing.active_children())
    with make_executor(workers=2) as (pool, threads):
        started = set(multiprocessing.active_children()) - before
        assert len(started) == 2 and threads >= 1  # nothing submitted yet
        assert pool.submit(sum, [1, 2]).result(timeout=60) == 3


@pytest.mark.slow
def test_no_more_worker_processes_than_files(tmp_path, monkeypatch):
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:2], None, tmp_path)
    asked = []
    real = batch.make_executor
    monkeypatch.setattr(batch, "make_executor", lambda workers=1, dask_address=None, initializer=None, devices=(): (
        asked.append(workers) or real(workers, dask_address, initializer, devices)))
    results = batch.run_batch(tasks, GradOptions("seq"), workers=4)
    assert asked == [2] and [r.status for r in results] == ["ok", "ok"]


def _worker_pids(parent: int) -> list[int]:
    """Worker processes of a process pool: children of ``parent`` but the multiprocessing resource tracker
    (forked workers run the parent's command line, spawned ones multiprocessing's).  A child that is still
    between its fork and its exec runs the parent's command line too, whatever it becomes: spawned workers and
    the resource tracker are counted only once they run their own (``_started``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"resource_tracker" not in cmdline and _started(cmdline, parent):
            pids.append(int(entry.name))
    return pids


def _started(cmdline: bytes, parent: int) -> bool:
    """Whether a child whose command line is ``cmdline`` is a worker at work: a spawned one (multiprocessing's
    command line), or a forked one where the parent forks its workers (it runs no resource tracker then)."""
    if b"spawn_main" in cmdline:
        return True
    try:
        forking = b"local_workers.start_method = lambda: 'spawn'" not in Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return False
    return forking


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork only on Linux")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_cli_forks_its_workers_where_it_can(tmp_path, method):
    _long_inputs(tmp_path / "in", 3)
    cmd = CLI_WITH_WORKERS[method] + ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path), "--workers", "2", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        forked, spawned = set(), set()  # a forked worker runs its parent's command line, a spawned one spawn_main
        deadline = time.monotonic() + 60
        while len(forked) + len(spawned) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
            for pid in _worker_pids(proc.pid):
                with contextlib.suppress(OSError):
                    parent = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # read once it runs the CLI
                    command = Path(f"/proc/{pid}/cmdline").read_bytes()
                    (forked if command == parent else spawned if b"spawn_main" in command else set()).add(pid)
    finally:
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert (len(forked), len(spawned)) == ((2, 0) if method == "fork" else (0, 2))


def test_two_inputs_writing_one_output_are_refused_before_anything_runs(runner, tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_npz(tmp_path / folder / "run.npz", load_case("seq_v2_peep")[0])
    (tmp_path / "out").mkdir()
    result = runner.invoke(main, ["seq", str(tmp_path / "a"), str(tmp_path / "b"), "--out-dir", str(tmp_path / "out"),
                                  "--skip-existing"])
    assert result.exit_code == 2 and "would both write" in result.stderr
    assert list((tmp_path / "out").iterdir()) == []
    twice = runner.invoke(main, ["seq", str(tmp_path / "a" / "run.npz"), str(tmp_path / "a"), "--out-dir",
                                 str(tmp_path / "out"), "--json"])
    assert twice.exit_code == 0 and len(json.loads(twice.stdout)["results"]) == 1  # the same input runs once



def test_the_plan_resolves_paths_as_path_resolve_does(tmp_path, monkeypatch):
    from lstmgrad_cli.operations import batch

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "run.npz").write_bytes(b"x")
    (tmp_path / "dirlink").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "filelink.npz").symlink_to(tmp_path / "real" / "sub" / "elsewhere.npz")
    (tmp_path / "real" / "dangling.npz").symlink_to(tmp_path / "nowhere" / "x.npz")
    monkeypatch.chdir(tmp_path / "real" / "sub")
    real, link = tmp_path / "real", tmp_path / "dirlink"
    paths = [Path(p) for p in [
        real / "run.npz", link / "run.npz", link / "sub" / ".." / "run.npz", real / "filelink.npz",
        link / "filelink.npz", real / "dangling.npz", real / "missing.npz", tmp_path / "missing" / "dir" / "a.npz",
        link / "sub" / "..", "../run.npz", "../../dirlink/run.npz", "new.grads.npz", ".", "..", link]]
    resolve = batch._resolver()
    for _ in range(2):  # directories come from its cache the second time
        assert [resolve(p) for p in paths] == [p.resolve() for p in paths]

    def unsearchable(path):  # a directory it may not look into (mode r--, another user's)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "is_symlink", unsearchable)
    assert batch._resolver()(real / "run.npz") == (real / "run.npz").resolve()

def test_skip_existing_does_not_take_another_inputs_output_for_its_own(runner, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_npz(tmp_path / "a" / "run.npz", load_case("seq_v2_peep")[0])
    write_npz(tmp_path / "b" / "run.npz", load_case("seq_v2_nopeep")[0])
    out = tmp_path / "out"
    out.mkdir()
    assert runner.invoke(main, ["seq", str(tmp_path / "a"), "--out-dir", str(out), "-q"]).exit_code == 0
    result = runner.invoke(main, ["seq", str(tmp_path / "b"), "--out-dir", str(out), "--skip-existing"])
    assert result.exit_code == 1
    assert f"exists but was made from another input ({tmp_path / 'a' / 'run.npz'})" in result.stderr


def test_out_dir_is_made_when_missing_and_unmakeable_is_one_line(runner, tmp_path):
    out = tmp_path / "new" / "nested"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "--out-dir", str(out), "-q"])
    assert result.exit_code == 0, result.stderr
    assert (out / "seq_v2_peep.in.grads.npz").exists()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "--out-dir", str(blocker / "sub")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "cannot create the output directory" in result.stderr


def test_a_batch_syncs_each_output_directory_once_and_every_file_before_it_appears(tmp_path, monkeypatch):
    """Each output's data is fsynced before its rename; the directory entries once per directory, at the end."""
    from lstmgrad_cli.io import output
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    events = []
    real_fsync, real_link = os.fsync, os.link
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.path.realpath(
        f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    # an output is put in place by a hard link to its temporary file (without force)
    monkeypatch.setattr(os, "link", lambda tmp, path, **kw: events.append(("publish", str(tmp))) or
                        real_link(tmp, path, **kw))
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:3], None, out)
    results = batch.run_batch(tasks, GradOptions("seq"))
    assert [r.status for r in results] == ["ok"] * 3
    published = [name for kind, name in events if kind == "publish"]
    assert len(published) == 3
    for name in published:  # the file's own fsync comes before its rename
        assert events.index(("fsync", name)) < events.index(("publish", name))
    directory_syncs = [name for kind, name in events if kind == "fsync" and name not in published]
    assert directory_syncs == [str(out.resolve())]
    assert events[-1] == ("fsync", str(out.resolve()))  # after the last file

    events.clear()  # one write outside a batch syncs its directory at once
    output.write_outputs(tmp_path / "one.npz", {"x": np.zeros(2)}, {})
    assert events[-1] == ("fsync", str(tmp_path.resolve()))


def test_each_input_of_a_batch_is_sniffed_once(tmp_path, monkeypatch):
    """The plan finds each input's format for its output's name; the run reads the file as that format."""
    from lstmgrad_cli import io
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    sniffed = []
    real_sniff = io.sniff_format
    monkeypatch.setattr(io, "sniff_format", lambda path: sniffed.append(Path(path).name) or real_sniff(path))
    inputs = make_inputs(tmp_path / "in")[:3]  # HDF5 and NPZ
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(inputs, None, out)
    assert [t.input_format for t in tasks] == ["hdf5", "npz", "hdf5"]
    results = batch.run_batch(tasks, GradOptions("seq"))
    assert [r.status for r in results] == ["ok"] * 3
    assert sorted(sniffed) == sorted(p.name for p in inputs)
    assert outputs_of(out).keys() == {t.output.name for t in tasks}

    broken = tmp_path / "broken.npz"  # not readable while planning: the run sniffs it and says why
    broken.write_bytes(b"not a zip")
    (task,) = batch.plan_tasks([broken], None, out)
    assert task.input_format is None
    (result,) = batch.run_batch([task], GradOptions("seq"))
    assert result.status == "failed" and "broken.npz" in result.error


# -- outputs published behind the next file (io.published_behind) -------------------------------------------------

def test_a_serial_batch_publishes_each_output_while_the_next_file_computes(tmp_path, monkeypatch):
    """Each output's fsync and rename run on the publishing thread, and its result is reported only after."""
    import threading

    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    published, reported = [], []
    real_link = os.link

    def publish(tmp, path, **kw):  # an output is put in place by a hard link to its temporary file
        published.append((Path(path).name, threading.current_thread().name))
        real_link(tmp, path, **kw)

    monkeypatch.setattr(os, "link", publish)
    out = tmp_path / "out"
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:3], None, out.resolve())
    out.mkdir()

    def on_result(task, result):  # the output is in place when its result is reported
        reported.append(task.output.name)
        assert task.output.exists() and result.status == "ok"

    results = batch.run_batch(tasks, GradOptions("seq"), on_result=on_result)
    assert [r.status for r in results] == ["ok"] * 3
    assert reported == [t.output.name for t in tasks]
    assert [name for name, _ in published] == reported
    assert all(thread.startswith("lstmgrad-publish") for _, thread in published)
    assert sorted(p.name for p in out.iterdir()) == sorted(reported)  # no temporary file left


def test_an_output_that_cannot_be_published_fails_that_file_only_and_nothing_is_left(tmp_path, monkeypatch):
    import errno

    from lstmgrad_cli.io import atomic
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    inputs = make_inputs(tmp_path / "in")[:3]
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(inputs, None, out)
    real_fsync = atomic.os.fsync
    doomed = tasks[1].output.name

    def fsync(fd):  # the disk fills up while the second output is synced
        if os.path.basename(os.path.realpath(f"/proc/self/fd/{fd}")).startswith(f".{doomed}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    results = batch.run_batch(tasks, GradOptions("seq"))
    # Without --keep-going the batch stops, but the third file, already computed and handed over, is reported.
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert results[1].error == f"{tasks[1].output}: cannot write: no space left on device; nothing was written"
    assert sorted(p.name for p in out.iterdir()) == sorted([tasks[0].output.name, tasks[2].output.name])

    results = batch.run_batch(tasks, GradOptions("seq"), keep_going=True, skip_existing=True)
    assert [r.status for r in results] == ["skipped", "failed", "skipped"]


def test_an_output_another_run_publishes_first_is_kept_in_a_serial_batch(tmp_path, monkeypatch):
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions, run_grad_file

    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:2], None, out)
    real_link = os.link
    sources = {t.output.name: t.input for t in tasks}

    def other_run_wins(tmp, path, **kw):  # the other run writes the same request's output just before this one's link
        path = Path(path)
        if path.name in sources:
            other = tmp_path / f"other{path.suffix}"
            run_grad_file(sources.pop(path.name), other, GradOptions("seq"))
            real_link(other, path)
            other.unlink()
        real_link(tmp, path, **kw)

    monkeypatch.setattr(os, "link", other_run_wins)
    results = batch.run_batch(tasks, GradOptions("seq"))
    assert [r.status for r in results] == ["skipped", "skipped"], [r.error for r in results]
    assert all("already complete" in r.notes[0] for r in results)
    assert sorted(p.name for p in out.iterdir()) == sorted(t.output.name for t in tasks)


def test_where_no_thread_can_start_outputs_are_published_in_line(tmp_path):
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:3], None, out)
    with no_thread_can_start():
        results = batch.run_batch(tasks, GradOptions("seq"))
    assert [r.status for r in results] == ["ok"] * 3
    assert sorted(p.name for p in out.iterdir()) == sorted(t.output.name for t in tasks)


# -- local workers hand each output's fsync and rename to the parent (io.handed_to_parent) -------------------------

def test_local_workers_leave_fsync_and_rename_to_the_parent_which_reports_each_output_in_place(tmp_path,
                                                                                               monkeypatch,
                                                                                               serial_outputs):
    """The workers write; this process publishes every output (a hard link to the temporary file a worker wrote,
    recorded here: a worker's own links would be recorded in its own copy of the list), then reports it."""
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    published = []
    real_link = os.link
    monkeypatch.setattr(os, "link", lambda tmp, path, **kw: published.append(Path(path).name) or
                        real_link(tmp, path, **kw))
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in"), None, out)

    def on_result(task, result):
        assert result.status == "ok" and task.output.exists() and task.output.name in published

    results = batch.run_batch(tasks, GradOptions("seq"), workers=2, on_result=on_result)
    assert [r.status for r in results] == ["ok"] * len(tasks)
    assert sorted(published) == sorted(t.output.name for t in tasks)
    assert sorted(p.name for p in out.iterdir()) == sorted(published)  # no temporary file left
    assert_same_outputs(outputs_of(out), serial_outputs)


# -- local workers are handed small files several at a time (batch.bundle_small) ------------------------------------

def test_small_files_are_bundled_in_order_and_large_or_special_ones_go_alone(tmp_path, monkeypatch):
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    monkeypatch.setattr(batch, "BUNDLE_INPUT_BYTES", 100)
    monkeypatch.setattr(batch, "BUNDLE_MOST_FILES", 3)
    monkeypatch.setattr(batch, "BUNDLES_PER_WORKER", 1)
    sizes = {"a": 30, "b": 30, "c": 30, "d": 30, "big": 100, "e": 50, "f": 60, "g": 0, "h": 40}
    tasks = []
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
        tasks.append(batch.Task(tmp_path / name, tmp_path / f"{name}.out", input_format="npz"))
    tasks[7:7] = [batch.Task(tmp_path / "dump", tmp_path / "d.out", group="op/1", input_format="tfdbg2"),
                  batch.Task(tmp_path / "bad", tmp_path / "bad.out", error="a corrupt dump"),
                  batch.Task(tmp_path / "unsniffed", tmp_path / "u.out"),
                  batch.Task(tmp_path / "gone", tmp_path / "gone.out", input_format="npz")]
    names = [t.input.name for t in tasks]
    pending = list(range(len(tasks)))

    def bundled(options=None, workers=2, indexes=pending):
        bundles = batch.bundle_small(tasks, indexes, options or GradOptions("seq"), workers)
        return [[names[i] for i in bundle] for bundle in bundles]

    assert bundled() == [["a", "b", "c"], ["d"], ["big"], ["e"], ["f"], ["dump"], ["bad"], ["unsniffed"], ["gone"],
                         ["g", "h"]]
    assert bundled(indexes=[0, 1, 4, 5, 2]) == [["a", "b"], ["big"], ["e", "c"]]  # only the pending, in their order
    assert bundled(indexes=[0, 1, 2, 3]) == [["a", "b"], ["c", "d"]]  # 4 files, 2 workers: at least 2 bundles each
    assert all(len(bundle) == 1 for bundle in bundled(GradOptions("seq", per_step=True)))
    assert all(len(bundle) == 1 for bundle in bundled(workers=len(tasks)))  # too short a batch to share out evenly


def test_a_bundle_runs_its_files_in_turn_and_stops_at_a_failure_or_an_interrupt(tmp_path, monkeypatch,
                                                                                   worker_signal):
    from lstmgrad_cli.execution import interrupts, local_workers
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    inputs = make_inputs(tmp_path / "in")[:3]
    inputs[1].write_bytes(b"not an input")
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(inputs, None, out)

    def kinds(values):
        return [None if v is None else "unpublished" if isinstance(v, batch.Unpublished) else
                "interrupted" if isinstance(v, KeyboardInterrupt) else v.status for v in values]

    stopped = batch.run_tasks_unpublished(tasks, GradOptions("seq"), keep_going=False)
    assert kinds(stopped) == ["unpublished", "failed", None]
    kept_going = batch.run_tasks_unpublished(tasks, GradOptions("seq", force=True), keep_going=True)
    assert kinds(kept_going) == ["unpublished", "failed", "unpublished"]
    handed = [v.output for v in stopped + kept_going if isinstance(v, batch.Unpublished)]
    assert sorted(p.name for p in out.iterdir()) == sorted(h.tmp.name for h in handed)  # written, not in place
    for handoff in handed:
        handoff.tmp.unlink()

    # Interrupted during its second file (the file is gone; the first is kept for the parent) and not run after.
    make_inputs(tmp_path / "in")
    real_run_task = batch.run_task

    def signalled_in_the_second(task, options):
        if task is tasks[1]:
            worker_signal(signal.SIGINT)  # in a task: raises KeyboardInterrupt here
        return real_run_task(task, options)

    monkeypatch.setattr(batch, "run_task", signalled_in_the_second)
    values = batch.run_tasks_unpublished(tasks, GradOptions("seq"), keep_going=True)
    assert kinds(values) == ["unpublished", "interrupted", None]  # the parent reports it (batch._failure)
    assert [p.name for p in out.iterdir()] == [values[0].output.tmp.name]
    assert not interrupts.pending() and not local_workers._state.in_task  # taken: the worker's next task runs


def test_a_bundles_results_are_taken_once_and_a_dead_worker_fails_each_of_its_files(tmp_path):
    import concurrent.futures as cf
    from concurrent.futures.process import BrokenProcessPool

    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions, GradResult

    options = GradOptions("seq")
    tasks = [batch.Task(tmp_path / f"{k}.h5", tmp_path / f"{k}.grads.h5") for k in range(4)]
    done = [GradResult(str(t.input), str(t.output), options.op) for t in tasks]
    finished: cf.Future = cf.Future()
    finished.set_result([done[0], done[1], None])  # the worker stopped before its third file
    results = [None, done[1], None, None]  # the second was reported already (an interrupt came meanwhile)
    assert list(batch._outcomes(finished, [0, 1, 2], tasks, options, results)) == [(0, done[0])]
    assert batch._run_or_running(finished, [0, 1, 2]) == [0, 1]

    # Interrupted in its second file, where the worker may not have cleaned up (a signal as the temporary file
    # was made): reported "interrupted", and what it left for that output is removed.
    left = tmp_path / ".1.grads.h5.4242-0123abcd.tmp"
    left.write_bytes(b"half")
    interrupted: cf.Future = cf.Future()
    interrupted.set_result([done[0], KeyboardInterrupt(), None])
    outcomes = list(batch._outcomes(interrupted, [0, 1, 2], tasks, options, [None] * 4, frozenset({4242})))
    assert [index for index, _ in outcomes] == [0, 1] and outcomes[1][1].error == f"{tasks[1].input}: interrupted"
    assert not left.exists() and batch._run_or_running(interrupted, [0, 1, 2]) == [0, 1]

    left = [tmp_path / f".{k}.grads.h5.4242-0123abcd.tmp" for k in range(4)]
    for path in left:
        path.write_bytes(b"half")
    died: cf.Future = cf.Future()
    died.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
    outcomes = list(batch._outcomes(died, [2, 3], tasks, options, [None] * 4, frozenset({4242})))
    assert [index for index, _ in outcomes] == [2, 3]
    assert all(r.status == "failed" and "the worker process failed (BrokenProcessPool" in r.error for _, r in outcomes)
    assert [p.exists() for p in left] == [True, True, False, False]  # each of its files' temporary files removed
    assert batch._run_or_running(died, [2, 3]) == [2, 3]


def test_a_result_whose_publishing_was_interrupted_is_reported_interrupted(tmp_path, monkeypatch):
    import concurrent.futures as cf

    from lstmgrad_cli import io
    from lstmgrad_cli.io import output
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions, GradResult

    options = GradOptions("seq")
    task = batch.Task(tmp_path / "a.h5", tmp_path / "a.grads.npz")
    with io.handed_to_parent() as handoffs:
        output.write_outputs(task.output, {"x": np.arange(3.0)}, {})
    finished: cf.Future = cf.Future()
    finished.set_result([batch.Unpublished(GradResult(str(task.input), str(task.output), options.op), handoffs[0])])
    real_publish = io.publish_handed

    def interrupted(handoff):
        monkeypatch.setattr(io, "publish_handed", real_publish)
        handoff.tmp.unlink()  # as publish_handed does when interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "publish_handed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(batch._outcomes(finished, [0], [task], options, [None]))
    [(index, result)] = batch._outcomes(finished, [0], [task], options, [None])  # taken again after the stop
    assert result.status == "failed" and result.error == f"{task.input}: interrupted"
    assert list(tmp_path.iterdir()) == []

    # Interrupted before publishing touched it: its temporary file goes all the same.
    with io.handed_to_parent() as handoffs:
        output.write_outputs(task.output, {"x": np.arange(3.0)}, {})
    finished = cf.Future()
    finished.set_result([batch.Unpublished(GradResult(str(task.input), str(task.output), options.op), handoffs[0])])
    monkeypatch.setattr(io, "publish_handed", lambda handoff: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        list(batch._outcomes(finished, [0], [task], options, [None]))
    assert list(tmp_path.iterdir()) == []

    # Published, then interrupted before it was reported: taken again, it is the published result.
    with io.handed_to_parent() as handoffs:
        output.write_outputs(task.output, {"x": np.arange(3.0)}, {})
    published = GradResult(str(task.input), str(task.output), options.op)
    finished = cf.Future()
    finished.set_result([batch.Unpublished(published, handoffs[0])])
    monkeypatch.setattr(io, "publish_handed", real_publish)
    assert next(batch._outcomes(finished, [0], [task], options, [None])) == (0, published)  # never reported
    assert list(batch._outcomes(finished, [0], [task], options, [None])) == [(0, published)]
    assert [p.name for p in tmp_path.iterdir()] == ["a.grads.npz"]


def test_a_result_interrupted_once_its_output_was_in_place_is_the_published_result(tmp_path, monkeypatch):
    """An interrupt between the rename and the report: the output stays, complete, and the file is reported done
    (no output appears that the results do not list); the batch stops all the same."""
    import concurrent.futures as cf

    from lstmgrad_cli import io
    from lstmgrad_cli.io import output
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions, GradResult

    options = GradOptions("seq")
    task = batch.Task(tmp_path / "a.h5", tmp_path / "a.grads.npz")
    with io.handed_to_parent() as handoffs:
        output.write_outputs(task.output, {"x": np.arange(3.0)}, {})
    published = GradResult(str(task.input), str(task.output), options.op)
    finished: cf.Future = cf.Future()
    finished.set_result([batch.Unpublished(published, handoffs[0])])
    real_link = os.link

    def interrupted_after(tmp, path, **kw):  # Ctrl-C as the hard link that puts the output in place returns
        monkeypatch.setattr(os, "link", real_link)
        real_link(tmp, path, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", interrupted_after)
    with pytest.raises(KeyboardInterrupt):
        list(batch._outcomes(finished, [0], [task], options, [None]))
    assert list(batch._outcomes(finished, [0], [task], options, [None])) == [(0, published)]  # taken again
    assert [p.name for p in tmp_path.iterdir()] == ["a.grads.npz"]
    with np.load(task.output) as got:
        np.testing.assert_array_equal(got["x"], np.arange(3.0))


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("stop", ["interrupt", "error"])
@pytest.mark.parametrize("where", ["after the link", "after the rename"])
def test_publishing_stopped_once_the_output_is_in_place_keeps_it(tmp_path, monkeypatch, where, stop, force):
    """The output's name is there (linked, the temporary name not yet removed; or renamed) when an interrupt or an
    error comes: the output is kept and nothing else stays.  An error there is no failure (it was written); an
    interrupt still stops the run, as ``InterruptedInPlace`` from a handed output (the parent reports it done)."""
    from lstmgrad_cli.io import atomic, output

    real_link, real_replace = os.link, os.replace

    def stopped(tmp, path, **kw):  # for the link (without force) or the rename (with) that puts the output in place
        if where == "after the link":
            real_link(tmp, path)  # (the temporary name still there)
        else:
            real_replace(tmp, path)  # (only the output's name)
        raise KeyboardInterrupt if stop == "interrupt" else PermissionError(13, "Permission denied")

    target = tmp_path / "a.npz"
    replaced = force and where == "after the rename"  # (a link needs the name free)
    if replaced:
        target.write_bytes(b"an older output")

    # handed to the parent process (a local worker's output)
    with atomic.handed_to_parent() as handoffs:
        output.write_outputs(target, {"x": np.arange(3.0)}, {}, force=force)
    monkeypatch.setattr(os, "link", stopped)
    monkeypatch.setattr(os, "replace", stopped)
    handoff = handoffs[0]
    if stop == "interrupt":
        with pytest.raises(atomic.InterruptedInPlace):
            atomic.publish_handed(handoff)
    else:
        assert atomic.publish_handed(handoff) is None
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]
    with np.load(target) as got:
        np.testing.assert_array_equal(got["x"], np.arange(3.0))

    # written in this process
    target.unlink()
    if replaced:
        target.write_bytes(b"an older output")
    if stop == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            output.write_outputs(target, {"x": np.arange(4.0)}, {}, force=force)
    else:
        output.write_outputs(target, {"x": np.arange(4.0)}, {}, force=force)
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]
    with np.load(target) as got:
        np.testing.assert_array_equal(got["x"], np.arange(4.0))


def test_publishing_interrupted_before_the_rename_leaves_nothing_and_is_a_plain_interrupt(tmp_path, monkeypatch):
    from lstmgrad_cli.io import atomic, output

    with atomic.handed_to_parent() as handoffs:
        output.write_outputs(tmp_path / "a.npz", {"x": np.arange(3.0)}, {})
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt) as raised:
        atomic.publish_handed(handoffs[0])
    assert type(raised.value) is KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_failure_stops_the_files_workers_were_handed_beyond_the_one_in_hand(tmp_path, monkeypatch):
    """Without --keep-going: the pool's queue holds bundles no one can take back, and each worker runs at most
    the file in hand once the batch has stopped (the pool's stop_queued: local_workers.pool)."""
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    monkeypatch.setattr(batch, "BUNDLES_PER_WORKER", 1)
    inputs = _small_long_inputs(tmp_path / "in", 16)  # ~0.13 s a file, four or five a bundle
    inputs[0].unlink()
    np.savez(tmp_path / "in" / "run000.npz", x=np.zeros((2, 1, 1), np.float32))  # bundled, and refused at once
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(sorted((tmp_path / "in").iterdir()), None, out)
    assert [len(b) for b in batch.bundle_small(tasks, range(len(tasks)), GradOptions("seq"), 2)] == [5, 4, 4, 3]
    results = batch.run_batch(tasks, GradOptions("seq"), workers=2)
    statuses = [r.status if r else None for r in results]
    assert statuses[0] == "failed"
    ran = [s for s in statuses if s is not None]
    assert len(ran) <= 4, statuses  # the failure, and a file in hand per worker (13 when queued bundles ran on)
    assert sorted(p.name for p in out.iterdir()) == sorted(t.output.name for t, s in zip(tasks, statuses, strict=True)
                                                           if s == "ok")


@pytest.mark.slow
@pytest.mark.parametrize("keep_going", [False, True])
def test_local_workers_handed_bundles_give_every_file_its_result(tmp_path, monkeypatch, keep_going):
    """Real worker processes, several files a task: each file is reported once, its output in place; without
    --keep-going a failure stops its bundle and the batch, and no output appears that the results do not list."""
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    monkeypatch.setattr(batch, "BUNDLES_PER_WORKER", 1)  # 12 small files, 2 workers: two tasks of 6
    inputs = make_inputs(tmp_path / "in")
    inputs += [Path(shutil.copy(path, path.with_name("again_" + path.name))) for path in inputs]
    np.savez(inputs[7], x=np.zeros((2, 1, 1), np.float32))  # an NPZ file (so bundled) that the run refuses
    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(sorted(inputs), None, out)
    handed = []
    real_executor = batch.make_executor

    @contextlib.contextmanager
    def recording_executor(workers=1, dask_address=None, initializer=None, devices=()):  # the real pool, recorded
        with real_executor(workers, dask_address, initializer, devices) as (pool, threads):
            real_submit = pool.submit
            pool.submit = lambda run, bundle, *a: handed.append(len(bundle)) or real_submit(run, bundle, *a)
            yield pool, threads

    monkeypatch.setattr(batch, "make_executor", recording_executor)
    reported = []
    results = batch.run_batch(tasks, GradOptions("seq"), workers=2, keep_going=keep_going,
                              on_result=lambda task, result: reported.append(task))
    assert handed == [6, 6]
    assert len(reported) == len(set(map(id, reported))) == sum(r is not None for r in results)  # each once
    statuses = [r.status if r else None for r in results]
    failing = next(k for k, t in enumerate(tasks) if t.input == inputs[7])
    assert 0 < failing < 5 and statuses[failing] == "failed"
    if keep_going:
        assert statuses == ["ok"] * failing + ["failed"] + ["ok"] * (len(tasks) - failing - 1)
    else:  # the rest of its bundle is not run
        assert statuses[:failing + 1] == ["ok"] * failing + ["failed"]
        assert statuses[failing + 1:6] == [None] * (5 - failing)
    ok = {t.output.name for t, r in zip(tasks, results, strict=True) if r is not None and r.status == "ok"}
    assert {p.name for p in out.iterdir()} == ok  # no temporary file, nothing unreported


def test_an_output_handed_to_the_parent_is_written_closed_and_not_yet_in_place(tmp_path):
    from lstmgrad_cli.io import atomic, output

    with atomic.handed_to_parent() as handoffs:
        output.write_outputs(tmp_path / "a.npz", {"x": np.arange(3.0)}, {})
    [handoff] = handoffs
    assert not (tmp_path / "a.npz").exists() and handoff.tmp.exists() and handoff.path == tmp_path / "a.npz"
    assert atomic.publish_handed(handoff) is None
    assert not handoff.tmp.exists()
    with np.load(tmp_path / "a.npz") as got:
        np.testing.assert_array_equal(got["x"], np.arange(3.0))


@pytest.mark.parametrize("failure", ["exists", "enospc", "gone"])
def test_a_handed_output_that_cannot_be_published_is_an_error_and_leaves_nothing(tmp_path, monkeypatch, failure):
    import errno

    from lstmgrad_cli.errors import OutputExistsError, OutputFileError
    from lstmgrad_cli.io import atomic, output

    with atomic.handed_to_parent() as handoffs:
        output.write_outputs(tmp_path / "a.npz", {"x": np.arange(3.0)}, {})
    [handoff] = handoffs
    if failure == "exists":
        (tmp_path / "a.npz").write_bytes(b"another run's")
    elif failure == "enospc":
        def fsync(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(atomic.os, "fsync", fsync)
    else:
        handoff.tmp.unlink()
    error = atomic.publish_handed(handoff)
    expected = {"exists": OutputExistsError, "enospc": OutputFileError, "gone": OutputFileError}[failure]
    assert isinstance(error, expected), error
    assert "\n" not in str(error) and str(error).startswith(str(tmp_path / "a.npz"))
    assert not handoff.tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["a.npz"] if failure == "exists" else [])
    if failure == "exists":
        assert (tmp_path / "a.npz").read_bytes() == b"another run's"


def test_a_long_file_is_reported_before_the_next_starts(tmp_path, monkeypatch):
    """Small files are reported one file late (their output published meanwhile); one that took longer than
    SETTLE_AT_ONCE_SECONDS is reported before the next file starts, so progress never lags a long file."""
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    events = []
    real_run_task = batch.run_task
    monkeypatch.setattr(batch, "run_task", lambda task, *a: events.append(("start", task.input.name)) or
                        real_run_task(task, *a))
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:3], None, (tmp_path / "out").resolve())
    (tmp_path / "out").mkdir()
    on_result = lambda task, result: events.append(("report", task.input.name))  # noqa: E731
    batch.run_batch(tasks, GradOptions("seq"), on_result=on_result)
    names = [t.input.name for t in tasks]
    assert events[:3] == [("start", names[0]), ("start", names[1]), ("report", names[0])]  # small: one file late

    events.clear()
    monkeypatch.setattr(batch, "SETTLE_AT_ONCE_SECONDS", 0.0)  # every file counts as long
    batch.run_batch(tasks, GradOptions("seq", force=True), on_result=on_result)
    assert events == [(kind, name) for name in names for kind in ("start", "report")]


def test_an_interrupt_while_reporting_still_reports_the_file_already_computed(tmp_path):
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:4], None, out)
    reported = []

    def on_result(task, result):
        reported.append(task.output.name)
        if len(reported) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        batch.run_batch(tasks, GradOptions("seq"), on_result=on_result)
    # the first report was interrupted after the second file was computed and handed over: it is reported too
    assert reported == [tasks[0].output.name, tasks[1].output.name]
    assert sorted(p.name for p in out.iterdir()) == sorted(reported)  # no output unreported, no temporary file


@pytest.mark.slow
def test_local_workers_interrupted_twice_leave_no_temporary_file(tmp_path):
    """A worker's output is a temporary file until the parent publishes it: when a second interrupt stops the
    parent from taking the remaining results, their temporary files are removed, and those files say so."""
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    out = tmp_path / "out"
    out.mkdir()
    tasks = batch.plan_tasks(make_inputs(tmp_path / "in"), None, out)
    results, interrupts = {}, [2]

    def on_result(task, result):
        results[task.output.name] = result
        if result.status == "ok" and interrupts[0]:
            interrupts[0] -= 1
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        batch.run_batch(tasks, GradOptions("seq"), workers=2, on_result=on_result)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    ok = {name for name, r in results.items() if r.status == "ok"}
    assert {p.name for p in out.iterdir()} == ok  # every output there is reported done
    lost = [r for r in results.values() if r.status == "lost"]
    assert all("nothing of it is kept" in r.error for r in lost)


# A batch whose local workers are handed several small files a task (batch.bundle_small) even when it is short.
CLI_BUNDLING = [sys.executable, "-c", "import sys; from lstmgrad_cli.operations import batch; "
                                      "batch.BUNDLES_PER_WORKER = 1; "
                                      "from lstmgrad_cli.cli import main; sys.exit(main())"]


def _small_long_inputs(folder: Path, count: int) -> list[Path]:
    """~0.9 MB files that take a while each (many small time steps): four to a bundle."""
    folder.mkdir()
    base = consistent_inputs(T=3000, B=2, I=2, C=4)
    return [write_h5(folder / f"run{k:03d}.h5", base) for k in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "bundled"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_whole_process_group_stops_workers_cleanly(tmp_path, method, sig):
    # What `timeout`, a job scheduler or a terminal's Ctrl-C do: every process gets the signal. A worker used
    # to die of SIGTERM mid-write (a temporary file left, its files "worker process failed", a traceback from
    # the pool's manager thread); each now interrupts its file as Ctrl-C does in the command. "bundled": forked
    # workers handed four files a task, stopped mid-bundle.
    if method == "bundled":
        inputs, cli = _small_long_inputs(tmp_path / "in", 16), CLI_BUNDLING
    else:
        inputs, cli = _long_inputs(tmp_path / "in", 12), CLI_WITH_WORKERS[method]
    out = tmp_path / "out"
    out.mkdir()
    cmd = cli + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--workers", "2"]
    proc = subprocess.Popen(cmd + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(out.glob("*.grads.h5")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr and "worker process failed" not in stderr, stderr
    assert "cannot write" not in stderr, stderr  # a publishing the command's own interrupt stopped says so
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == [], stderr
    from lstmgrad_cli.io.provenance import is_complete_output

    finished = list(out.glob("*.grads.h5"))
    assert 0 < len(finished) < len(inputs) and all(is_complete_output(p) for p in finished)
    resumed = subprocess.run(cmd + ["--skip-existing", "-q"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert len(list(out.glob("*.grads.h5"))) == len(inputs)


@pytest.mark.slow
def test_a_worker_interrupted_mid_bundle_keeps_the_files_before_and_runs_none_after(tmp_path, monkeypatch):
    # Ctrl-C to the workers alone (the command goes on, --keep-going): each interrupts the file in hand, and the
    # rest of that bundle is not run; the files it finished before are published and reported.
    inputs = _small_long_inputs(tmp_path / "in", 16)
    out = tmp_path / "out"
    out.mkdir()
    cmd = CLI_BUNDLING + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--workers", "2", "--keep-going",
                          "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(out.glob("*.grads.h5")) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in _worker_pids(proc.pid):
        os.kill(pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    status = {Path(r["input"]).name: r["status"] for r in json.loads(stdout)["results"]}
    interrupted = {name for name, r in status.items() if r == "failed"}
    assert interrupted and all(f"{name}: interrupted" in stderr for name in interrupted)
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    monkeypatch.setattr(batch, "BUNDLES_PER_WORKER", 1)
    tasks = batch.plan_tasks(inputs, None, out)
    bundles = batch.bundle_small(tasks, range(len(tasks)), GradOptions("seq"), 2)
    assert len(bundles) == 4  # as the command bundled them
    for bundle in bundles:  # done, then at most one interrupted, then not run
        states = [status.get(tasks[k].input.name, "not run") for k in bundle]
        assert states == sorted(states, key=["ok", "failed", "not run"].index), states
        assert states.count("failed") <= 1
        assert [tasks[k].output.exists() for k in bundle] == [state == "ok" for state in states]
    assert sorted(p.name for p in out.iterdir()) == sorted(tasks[k].output.name for k in range(len(tasks))
                                                           if status.get(tasks[k].input.name) == "ok")

def test_a_worker_signalled_between_files_interrupts_the_next_as_it_starts(tmp_path, monkeypatch, worker_signal):
    from lstmgrad_cli.execution import interrupts, local_workers
    from lstmgrad_cli.io.atomic import atomic_file
    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    tasks = batch.plan_tasks(make_inputs(tmp_path / "in")[:3], None, tmp_path / "out")
    (tmp_path / "out").mkdir()
    worker_signal(signal.SIGINT)  # between tasks: remembered, not raised (SIGTERM would end pytest)
    with pytest.raises(KeyboardInterrupt):
        batch.run_task_unpublished(tasks[0], GradOptions("seq"))
    assert list((tmp_path / "out").iterdir()) == []
    assert not interrupts.pending() and not local_workers._state.in_task  # delivered: the next task runs

    def written_then_signalled(task, options):  # the signal lands after the output is written and handed over
        with atomic_file(task.output, force=False) as tmp:
            tmp.path.write_bytes(b"complete")
        worker_signal(signal.SIGINT)
        return batch.GradResult(str(task.input), str(task.output), "op")

    # Handed over, the file is committed: it is not interrupted, its output goes to the parent to be put in place,
    # and the signal interrupts the next file as it starts.
    monkeypatch.setattr(batch, "run_task", written_then_signalled)
    value = batch.run_task_unpublished(tasks[1], GradOptions("seq"))
    assert isinstance(value, batch.Unpublished)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [value.output.tmp.name]
    assert interrupts.pending()
    with pytest.raises(KeyboardInterrupt):
        batch.run_task_unpublished(tasks[2], GradOptions("seq"))
    assert [p.name for p in (tmp_path / "out").iterdir()] == [value.output.tmp.name]
    assert not interrupts.pending()


SIGNALLED_AS_IT_STARTS = """
import os, signal, sys
from pathlib import Path
from lstmgrad_cli.operations import batch
from lstmgrad_cli.execution import local_workers
from lstmgrad_cli.operations.grad import GradOptions

def signalled_while_starting():  # a stop signal lands before the worker's handlers are in place
    os.kill(os.getpid(), signal.SIGTERM)
    batch._worker_started()

if __name__ == "__main__":
    local_workers.start_method = lambda: sys.argv[1]
    task = batch.Task(Path(sys.argv[2]), Path(sys.argv[3]))
    with batch.make_executor(workers=2, initializer=signalled_while_starting) as (pool, _threads):
        error = pool.submit(batch.run_task_unpublished, task, GradOptions("seq")).exception(timeout=60)
    print(type(error).__name__, Path(sys.argv[3]).exists(), signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks (Windows)")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_stop_signal_while_a_worker_starts_interrupts_its_first_file(tmp_path, method):
    # Blocked from before the worker exists until its handlers are in place: SIGTERM would otherwise have killed
    # it (a broken pool, every file "worker process failed"), or run the handler its parent had when it forked.
    if method == "fork" and not sys.platform.startswith("linux"):
        pytest.skip("workers fork only on Linux")
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_AS_IT_STARTS)
    src = write_npz(tmp_path / "a.npz", load_case("seq_v2_peep")[0])
    done = subprocess.run([sys.executable, str(script), method, str(src), str(tmp_path / "a.grads.npz")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["KeyboardInterrupt", "False", "set()"], done.stdout  # the parent's mask is back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "signalled.py"]  # no output, no temporary file


def test_a_local_task_that_failed_has_the_temporary_file_its_worker_left_removed(tmp_path):
    # A worker killed mid-write (out of memory, SIGKILL) or interrupted where it could not clean up leaves its
    # temporary file; the parent removes it when it hears of the failure, and another process's is kept.
    import concurrent.futures as cf

    from lstmgrad_cli.operations import batch
    from lstmgrad_cli.operations.grad import GradOptions

    task = batch.Task(tmp_path / "run.h5", tmp_path / "run.grads.h5")
    ours = tmp_path / ".run.grads.h5.4242-0123abcd.tmp"
    others = [tmp_path / ".run.grads.h5.4343-0123abcd.tmp", tmp_path / ".run.grads.h5.4242-x.tmp",
              tmp_path / ".other.grads.h5.4242-0123abcd.tmp"]
    for path in [ours, *others]:
        path.write_bytes(b"half")
    for err in (KeyboardInterrupt(), RuntimeError("A process in the process pool was terminated abruptly")):
        future: cf.Future = cf.Future()
        future.set_exception(err)
        [(index, result)] = batch._outcomes(future, [0], [task], GradOptions("seq"), [None], frozenset({4242, 17}))
        assert index == 0 and result.status == "failed" and not ours.exists()
        assert all(path.exists() for path in others)
        ours.write_bytes(b"half")


# -- a batch keeps its word: every file gets its result, no two share an output (issue 34) ------------------------

def test_an_unexpected_exception_in_one_file_is_that_files_failure_in_a_serial_batch(runner, tmp_path, monkeypatch):
    """A bug met on one file (here a RuntimeError from the job) fails that file, named by its type; the batch goes
    on and reports every file, in one JSON document."""
    from lstmgrad_cli.operations import batch

    paths = make_inputs(tmp_path / "in")
    real = batch.run_grad_file

    def buggy(path, *args, **kwargs):
        if Path(path).name == paths[1].name:
            raise RuntimeError("something no one foresaw\non two lines")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(batch, "run_grad_file", buggy)
    out = tmp_path / "out"
    result = runner.invoke(main, ["seq", *map(str, paths), "--out-dir", str(out), "--keep-going", "--json"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    results = {Path(r["input"]).name: r for r in json.loads(result.stdout)["results"]}
    assert len(results) == len(paths)
    bad = results.pop(paths[1].name)
    assert bad["status"] == "failed"
    assert "unexpected RuntimeError: something no one foresaw on two lines" in bad["error"]
    assert all(r["status"] == "ok" for r in results.values())
    assert len(list(out.glob("*.grads.*"))) == len(paths) - 1


def gradient_ops_dump(folder: Path, op_names: list[str]) -> Path:
    """A tf.function in which one BlockLSTMV2 feeds a BlockLSTMGradV2 under each of ``op_names``, all traced."""
    from tfdbg_builder import ACTS, GRADS, SEQ_INPUTS, event, field, op_creation, trace, write_dump

    run = consistent_inputs(T=3, B=2, I=3, C=2)
    run["seq_len_max"] = np.int64(3)
    gid = "graph-0"
    graphs = [event(8, field(1, gid) + field(2, "train_step"))]
    reads = (*SEQ_INPUTS, "cs_grad", "h_grad")
    graphs += [op_creation("ReadVariableOp", f"read_{n}", gid, [f"r_{n}:0"]) for n in reads]
    graphs.append(op_creation("BlockLSTMV2", "fwd", gid, [f"read_{n}:0" for n in SEQ_INPUTS], 7))
    grad_inputs = [f"read_{n}:0" for n in SEQ_INPUTS] + [f"fwd:{k}" for k in range(7)] + ["read_cs_grad:0",
                                                                                          "read_h_grad:0"]
    graphs += [op_creation("BlockLSTMGradV2", name, gid, grad_inputs, 8) for name in op_names]
    traces = [trace(gid, f"read_{n}", 0, run[n]) for n in reads]
    traces += [trace(gid, "fwd", k, run[n]) for k, n in enumerate(ACTS)]
    for name in op_names:
        traces += [trace(gid, name, k, np.zeros_like(run[g.removesuffix("_grad")])) for k, g in enumerate(GRADS)]
    return write_dump(folder, {"graphs": graphs, "graph_execution_traces": traces})


@pytest.mark.parametrize("force", [False, True])
def test_executions_whose_names_differ_only_in_characters_a_file_name_cannot_hold_get_their_own_outputs(
        runner, tmp_path, force):
    """'g!' and 'g?' were both written to <dump>.train_step.g.0.grads.npz: one result lost ("skipped", or with
    --force replaced by the other).  Each now has its own output, whose name and provenance say which it holds."""
    from lstmgrad_cli.io import read_metadata

    dump = gradient_ops_dump(tmp_path / "dump", ["g!", "g?", "other"])
    out = tmp_path / "out"
    result = runner.invoke(main, ["seq", str(dump), "--out-dir", str(out), "--json", "--keep-going",
                                  *(["--force"] if force else [])])
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)["results"]
    assert [r["status"] for r in results] == ["ok"] * 3
    outputs = {r["member"]: Path(r["output"]) for r in results}
    assert len(set(outputs.values())) == 3 and sorted(out.iterdir()) == sorted(outputs.values())
    assert outputs["train_step/g!#0"].name == "dump.train_step%2Fg%21%230.grads.npz"
    assert outputs["train_step/g?#0"].name == "dump.train_step%2Fg%3F%230.grads.npz"
    assert outputs["train_step/other#0"].name == "dump.train_step.other.0.grads.npz"  # a name of its own: as before
    for member, path in outputs.items():
        assert read_metadata(path)["group"] == member


# -- what a folder INPUT gives ------------------------------------------------------------------------------------

def _write_safetensors_input(path: Path, tensors: dict) -> Path:
    pytest.importorskip("safetensors")
    from lstmgrad_cli.io.safetensors import write_safetensors

    with open(path, "wb") as fh:
        write_safetensors(fh, tensors, {})
    return path


def test_every_file_format_lstmgrad_reads_is_picked_up_in_a_folder(tmp_path):
    # A new input format must say by which names a folder gives its files (a Keras model archive never: it is a
    # --weights file).
    from lstmgrad_cli import io
    from lstmgrad_cli.io.discovery import expand_inputs

    files = {name: fmt for name, fmt in io.FORMATS.items() if not fmt.directory}
    assert all(fmt.suffixes for fmt in files.values()) and not files["keras"].in_folders
    for fmt in files.values():
        for suffix in fmt.suffixes:
            (tmp_path / f"a{suffix}").touch()
            (tmp_path / f"a.grads{suffix}").touch()  # an earlier output: never an input
    found = {p.name for p in expand_inputs([tmp_path]).paths}
    assert found == {f"a{suffix}" for fmt in files.values() if fmt.in_folders for suffix in fmt.suffixes}


def test_a_folder_gives_its_safetensors_files_and_a_folder_of_them_alone_is_a_batch(runner, tmp_path):
    inputs = load_case("seq_v2_peep")[0]
    folder = tmp_path / "in"
    folder.mkdir()
    _write_safetensors_input(folder / "a.safetensors", inputs)
    _write_safetensors_input(folder / "b.safetensors", inputs)
    (folder / "c.safetensors").write_bytes(b"not a safetensors file")
    result = runner.invoke(main, ["seq", str(folder), "--out-dir", str(tmp_path / "out"), "--json", "--keep-going"])
    assert result.exit_code == 1, result.stderr
    doc = json.loads(result.stdout)
    assert [(Path(r["input"]).name, r["status"]) for r in doc["results"]] == [
        ("a.safetensors", "ok"), ("b.safetensors", "ok"), ("c.safetensors", "failed")]  # the corrupt one reported
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.grads.safetensors", "b.grads.safetensors"]


def test_recursive_looks_in_subfolders_and_mirrors_them_under_out_dir(runner, tmp_path):
    inputs = load_case("seq_v2_peep")[0]
    top = tmp_path / "runs"
    for relative in ("day1/a.npz", "day1/late/b.npz", "day2/a.npz", "c.npz"):
        (top / relative).parent.mkdir(parents=True, exist_ok=True)
        write_npz(top / relative, inputs)
    (top / "day2" / "a.grads.npz").write_bytes(b"an earlier output: never an input")
    (top / "npydir").mkdir()  # a folder that is one input (its .npy files): given whole, not looked into
    for name, value in inputs.items():
        np.save(top / "npydir" / f"{name}.npy", value)
    out = tmp_path / "out"

    flat = runner.invoke(main, ["seq", str(top), "--out-dir", str(out), "-q"])
    assert flat.exit_code == 0, flat.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.grads.*")) == ["c.grads.npz", "npydir.grads.npz"]

    deep = runner.invoke(main, ["seq", str(top), "--out-dir", str(out), "--recursive", "--json"])
    assert deep.exit_code == 0, deep.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.grads.*")) == [
        "c.grads.npz", "day1/a.grads.npz", "day1/late/b.grads.npz", "day2/a.grads.npz", "npydir.grads.npz"]
    statuses = {Path(r["input"]).relative_to(top).as_posix(): r["status"] for r in json.loads(deep.stdout)["results"]}
    assert statuses == {"c.npz": "skipped", "npydir": "skipped", "day1/a.npz": "ok", "day1/late/b.npz": "ok",
                        "day2/a.npz": "ok"}  # depth first, in name order; the first run's outputs kept


def test_a_folder_of_subfolders_only_says_recursive_looks_in_them(runner, tmp_path):
    (tmp_path / "runs" / "day1").mkdir(parents=True)
    write_npz(tmp_path / "runs" / "day1" / "a.npz", load_case("seq_v2_peep")[0])
    result = runner.invoke(main, ["seq", str(tmp_path / "runs"), "-q"])
    assert result.exit_code == 2
    assert "no input files found: " in result.stderr and "holds only subfolders; --recursive looks" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(main, ["seq", str(empty), "-q"])
    assert result.exit_code == 2 and "no input files found\n" in result.stderr  # nothing to hint at


def test_the_weights_file_in_a_folder_is_not_one_of_its_inputs(runner, tmp_path):
    inputs = load_case("seq_v2_peep")[0]
    folder = tmp_path / "in"
    folder.mkdir()
    weights = {k: inputs.pop(k) for k in ("w", "wci", "wcf", "wco", "b")}
    write_npz(folder / "step1.npz", inputs)
    write_npz(folder / "step2.npz", inputs)
    write_npz(folder / "weights.npz", weights)
    result = runner.invoke(main, ["seq", str(folder), "--weights", str(folder / "weights.npz"), "--json",
                                  "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.stderr
    assert [Path(r["input"]).name for r in json.loads(result.stdout)["results"]] == ["step1.npz", "step2.npz"]


def test_quiet_still_prints_the_counts_of_a_batch_with_failures(runner, tmp_path):
    paths = make_inputs(tmp_path / "in")
    clean = runner.invoke(main, ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out"), "-q"])
    assert clean.exit_code == 0 and clean.stdout == "" and clean.stderr == ""  # -q: nothing on success
    paths[2].write_bytes(b"broken")
    failed = runner.invoke(main, ["seq", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out2"), "-q",
                                  "--keep-going"])
    assert failed.exit_code == 1 and failed.stdout == ""
    assert failed.stderr.splitlines()[-1] == "batch: 6 files, 5 done, 1 failed, 0 skipped, 0 not run"


def test_a_batch_report_owns_its_counts_summary_and_exit_code():
    from lstmgrad_cli.errors import ExitCode
    from lstmgrad_cli.operations.batch import BatchReport
    from lstmgrad_cli.operations.grad import GradResult

    def result(status):
        return GradResult("in.npz", None, "BlockLSTMGradV2", status=status)

    clean = BatchReport([result("ok"), result("skipped"), None])
    assert clean.counts == {"ok": 1, "failed": 0, "skipped": 1, "lost": 0, "not_run": 1}
    assert clean.summary() == {"done": 1, "failed": 0, "skipped": 1, "lost": 0, "not_run": 1}
    assert clean.done == 2 and clean.exit_code == ExitCode.SUCCESS == 0 and clean.interrupted is None
    assert BatchReport([result("ok"), result("failed")]).exit_code == ExitCode.ERROR == 1
    assert BatchReport([result("lost")]).exit_code == ExitCode.ERROR
    stopped = BatchReport([result("failed"), None], signals=[signal.SIGTERM])
    assert stopped.exit_code == 143 and stopped.interrupted == "SIGTERM"
    assert BatchReport([None], signals=[signal.SIGINT]).exit_code == ExitCode.signalled(signal.SIGINT) == 130


def test_a_batch_reads_its_weights_file_once_and_anew_in_the_next_batch(tmp_path, runner, monkeypatch):
    """Every input of a batch takes the same tensors from --weights: the file is read once a batch (2.4-4 ms a file
    from a small HDF5 one), and a later batch reads it anew (rewritten in place here, same size)."""
    from lstmgrad_cli import io

    weight_names = ("w", "b", "wci", "wcf", "wco")
    real, reads = io.read_inputs, []
    monkeypatch.setattr(io, "read_inputs", lambda path, *a, **k: reads.append(Path(path).name) or real(path, *a, **k))
    weights = tmp_path / "weights.h5"
    for seed in (0, 1):
        inputs = consistent_inputs(seed=seed)
        write_h5(weights, {name: inputs[name] for name in weight_names})
        names = [write_npz(tmp_path / f"in{seed}{k}.npz", {n: v for n, v in inputs.items() if n not in weight_names})
                 for k in range(3)]
        whole = write_npz(tmp_path / f"whole{seed}.npz", inputs)
        out = tmp_path / f"out{seed}"
        assert runner.invoke(main, ["seq", str(whole), "--out-dir", str(out), "-q"]).exit_code == 0
        reads.clear()
        result = runner.invoke(main, ["seq", *map(str, names), "--weights", str(weights), "--out-dir", str(out), "-q"])
        assert result.exit_code == 0, result.stderr
        assert reads.count("weights.h5") == 1
        with np.load(out / f"whole{seed}.grads.npz") as f:
            expected = {name: f[name] for name in f.files if name != "__lstmgrad__"}
        for path in names:
            with np.load(out / f"{path.stem}.grads.npz") as f:
                for name, value in expected.items():
                    np.testing.assert_array_equal(f[name], value)
