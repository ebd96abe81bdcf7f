"""Faults around the input file, as real processes: finished outputs, concurrent runs, Dask clusters losing a
worker or the scheduler, terminals that are not UTF-8 or that escape codes would reach, closed pipes.

Every process started here is ended by pid; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, consistent_inputs, load_case, run_on_a_terminal, write_h5, write_npz

from lstmgrad_cli import io
from lstmgrad_cli.cli import main
from lstmgrad_cli.io.provenance import is_complete_output, output_difference
from lstmgrad_cli.operations.grad import GradOptions, run_grad_file

CLI = [sys.executable, "-m", "lstmgrad_cli"]
PEEP = FIXTURES / "seq_v2_peep.in.npz"


def _long_inputs(folder: Path, count: int, T: int = 3000) -> list[Path]:
    """Files that each take a while (many small steps) on little data."""
    folder.mkdir(parents=True, exist_ok=True)
    base = consistent_inputs(T=T, B=4, I=4, C=8)
    return [write_h5(folder / f"run{k:03d}.h5", base) for k in range(count)]


def _grads(folder: Path) -> set[str]:
    """Outputs under their final names (a killed process may leave a hidden temporary file beside them)."""
    return {str(p) for p in folder.glob("*.grads.*") if not p.name.startswith(".")}


# -- a finished output is a success whoever finished it -----------------------------------------------------------

def test_a_rerun_keeps_a_complete_output_of_the_same_input_and_options(runner, tmp_path):
    out = tmp_path / "g.npz"
    assert runner.invoke(main, ["seq", str(PEEP), "-o", str(out), "-q"]).exit_code == 0
    before = (out.read_bytes(), out.stat().st_mtime_ns)
    again = runner.invoke(main, ["seq", str(PEEP), "-o", str(out)])
    assert again.exit_code == 0, again.stderr
    assert again.stdout == (f"{PEEP} -> {out}: already complete, from this input with the same options; kept "
                            "(--force recomputes it)\n")
    assert (out.read_bytes(), out.stat().st_mtime_ns) == before
    doc = json.loads(runner.invoke(main, ["seq", str(PEEP), "-o", str(out), "--json"]).stdout)
    assert doc["summary"]["skipped"] == 1 and doc["results"][0]["status"] == "skipped"
    assert doc["results"][0]["output"] == str(out) and "already complete" in doc["results"][0]["notes"][0]
    # The backend and chunking change how, not what: still the same output.
    assert runner.invoke(main, ["seq", str(PEEP), "-o", str(out), "--backend", "numba", "--chunk-steps", "1",
                                "-q"]).exit_code == 0


def test_an_output_from_other_options_or_a_changed_input_is_refused_saying_why(runner, tmp_path):
    src = write_npz(tmp_path / "run.npz", load_case("seq_v2_peep")[0])
    out = tmp_path / "run.grads.npz"
    assert runner.invoke(main, ["seq", str(src), "-q"]).exit_code == 0
    other = runner.invoke(main, ["seq", str(src), "--layout", "ifco", "--no-peephole"])
    assert other.exit_code == 1
    assert other.stderr == (f"Error: {src}: its output {out} already exists and was made with other options (layout:"
                            ' was unset, now "ifco", use_peephole: was unset, now false); use --force to overwrite '
                            "it\n")
    stat = src.stat()
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the input rewritten since
    changed = runner.invoke(main, ["seq", str(src)])
    assert changed.exit_code == 1
    assert f"was made from an earlier version of {src} (it has changed since)" in changed.stderr
    skipping = runner.invoke(main, ["seq", str(src), "--skip-existing"])  # --skip-existing does not keep it either
    assert skipping.exit_code == 1 and "earlier version" in skipping.stderr
    assert runner.invoke(main, ["seq", str(src), "--force", "-q"]).exit_code == 0
    assert runner.invoke(main, ["seq", str(src), "-q"]).exit_code == 0


def test_an_older_output_without_its_request_is_resumed_but_not_taken_for_a_rerun(runner, tmp_path):
    src = write_npz(tmp_path / "run.npz", load_case("seq_v2_peep")[0])
    out = tmp_path / "run.grads.npz"
    assert runner.invoke(main, ["seq", str(src), "-q"]).exit_code == 0
    with np.load(out) as data:
        tensors = {k: data[k] for k in data.files if k != "__lstmgrad__"}
    meta = io.read_metadata(out)
    del meta["request"]
    io.write_outputs(out, tensors, meta, force=True)
    assert runner.invoke(main, ["seq", str(src), "--skip-existing", "-q"]).exit_code == 0
    plain = runner.invoke(main, ["seq", str(src)])
    assert plain.exit_code == 1 and "use --skip-existing to keep it or --force to overwrite it" in plain.stderr


def test_request_names_what_changes_the_numbers_only(tmp_path):
    src = write_npz(tmp_path / "run.npz", load_case("seq_v2_peep")[0])
    base = GradOptions("seq").key(src)
    assert GradOptions("seq", backend="numba", chunk_steps=3, per_step=True, strict=True).key(src) == base
    assert GradOptions("seq", layout="icfo").key(src) != base
    assert GradOptions("seq", compute_dtype="float64").key(src) != base
    assert GradOptions("seq", weights=str(PEEP)).key(src) != base
    assert output_difference(PEEP, src) == "is not an lstmgrad output"  # an input, not an output


def test_an_output_published_by_another_run_meanwhile_is_kept(tmp_path, monkeypatch):
    # The race of two runs over one file: this one finds no output, computes, and finds one when publishing.
    src = write_npz(tmp_path / "run.npz", load_case("seq_v2_peep")[0])
    out = tmp_path / "run.grads.npz"
    real_write = io.write_outputs

    def other_run_wins(path, tensors, metadata, force=False):
        real_write(path, tensors, metadata, force=force)  # "the other run" publishes first
        return real_write(path, tensors, metadata, force=force)

    monkeypatch.setattr(io, "write_outputs", other_run_wins)
    result = run_grad_file(src, out, GradOptions("seq"))
    assert result.status == "skipped" and result.output == str(out) and is_complete_output(out, src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.grads.npz", "run.npz"]  # no temporary file left


@pytest.mark.slow
def test_two_concurrent_batches_over_the_same_files_both_succeed(tmp_path):
    inputs = _long_inputs(tmp_path / "in", 8, T=1500)
    out = tmp_path / "out"
    cmd = CLI + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--skip-existing", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        finished = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (stdout, stderr) in zip(procs, finished, strict=True):
        assert proc.returncode == 0, stderr
        summary = json.loads(stdout)["summary"]
        assert summary["failed"] == 0 and summary["done"] + summary["skipped"] == len(inputs)
    assert len(_grads(out)) == len(inputs) and all(is_complete_output(Path(p)) for p in _grads(out))
    assert [p for p in out.iterdir() if p.name.endswith(".tmp")] == []


# -- stopping early loses nothing -------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_batch_stopped_by_a_failure_reports_every_output_it_wrote(tmp_path):
    # Workers take files in order, one at a time: the bad third file (it fails at once) is taken only when a worker
    # has finished one of the first two, whatever the machine's load, and the failure stops the batch long before
    # the last of the nine after it can start.
    folder = tmp_path / "in"
    inputs = _long_inputs(folder, 12, T=3000)
    inputs[2].write_bytes(b"not an HDF5 file")
    out = tmp_path / "out"
    proc = subprocess.run(CLI + ["seq", str(folder), "--out-dir", str(out), "--workers", "2", "--json"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    reported = {r["output"] for r in doc["results"] if r["status"] == "ok"}
    assert doc["summary"]["not_run"] > 0, doc["summary"]  # the failure stopped the batch
    assert reported and _grads(out) == reported, (reported, _grads(out))  # those in progress were waited for


# -- Dask: a real scheduler and workers on 127.0.0.1 --------------------------------------------------------------

@contextlib.contextmanager
def dask_cluster(tmp_path: Path, workers: int = 2, preload: Path | None = None):
    """A ``dask scheduler`` and ``workers`` ``dask worker`` processes (no nanny) on loopback:
    yields (address, scheduler process, worker processes); all are killed by pid afterwards."""
    pytest.importorskip("distributed")
    scheduler_file = tmp_path / "scheduler.json"
    procs: list[subprocess.Popen] = []
    log = open(tmp_path / "cluster.log", "ab")  # noqa: SIM115 - closed below, after the processes
    quiet = {"stdout": subprocess.DEVNULL, "stderr": log}
    try:
        scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                      "--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file)],
                                     **quiet)
        procs.append(scheduler)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (scheduler_file.exists() and scheduler_file.stat().st_size):
            time.sleep(0.05)
        address = json.loads(scheduler_file.read_text())["address"]
        extra = ["--preload", str(preload)] if preload else []
        worker_procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads",
                                          "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1", *extra],
                                         **quiet) for _ in range(workers)]
        procs.extend(worker_procs)
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(workers, timeout=60)
        yield address, scheduler, worker_procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        log.close()


def _wait_for_outputs(folder: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_grads(folder)) < count and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:notaport", "bogus://nowhere", "tcp://:8786", "tcp://h:0"])
def test_a_malformed_dask_address_is_a_usage_error_before_connecting(runner, address):
    pytest.importorskip("distributed")
    start = time.monotonic()
    result = runner.invoke(main, ["seq", str(PEEP), "--dask", address, "-q"])
    assert result.exit_code == 2 and f"Error: --dask {address}: " in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 5


def test_a_malformed_dask_timeout_is_a_usage_error(runner):
    pytest.importorskip("distributed")
    result = runner.invoke(main, ["seq", str(PEEP), "--dask", "tcp://127.0.0.1:8786", "-q"],
                           env={"LSTMGRAD_DASK_TIMEOUT": "soon"})
    assert result.exit_code == 2
    assert "Error: LSTMGRAD_DASK_TIMEOUT='soon' is not a time; use seconds or a unit" in result.stderr


@pytest.mark.slow
def test_a_dask_worker_killed_mid_batch_is_retried_and_the_batch_completes(tmp_path):
    inputs = _long_inputs(tmp_path / "in", 16)
    out = tmp_path / "out"
    with dask_cluster(tmp_path) as (address, _scheduler, workers):
        proc = subprocess.Popen(CLI + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--dask", address,
                                       "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_outputs(out, 3, proc)
            os.kill(workers[0].pid, signal.SIGKILL)
            stdout, stderr = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, stderr
    assert stderr == ""
    doc = json.loads(stdout)
    assert doc["summary"]["failed"] == doc["summary"]["lost"] == doc["summary"]["not_run"] == 0
    assert doc["summary"]["done"] + doc["summary"]["skipped"] == len(inputs)
    assert {r["output"] for r in doc["results"]} == _grads(out) and len(_grads(out)) == len(inputs)


KILL_AFTER_WRITING = '''
"""Worker preload: the first task to finish on this worker kills the worker (by its pid) after its output is
written and before its result goes back, as a kill -9 at that moment does."""
import os, signal
from pathlib import Path
import lstmgrad_cli.operations.batch as batch

MARK = Path({mark!r})

if not hasattr(batch, "run_task_unpatched"):  # distributed may import a preload twice, into one namespace
    batch.run_task_unpatched = batch.run_task

    def run_task_then_die(task, *args, **kwargs):
        result = batch.run_task_unpatched(task, *args, **kwargs)
        try:
            MARK.mkdir()  # once per cluster: the task rerun elsewhere must come back
        except FileExistsError:
            return result
        os.kill(os.getpid(), signal.SIGKILL)

    batch.run_task = run_task_then_die
'''


@pytest.mark.slow
def test_a_task_rerun_after_its_worker_died_having_written_is_kept_not_failed(tmp_path):
    inputs = _long_inputs(tmp_path / "in", 6, T=500)
    out = tmp_path / "out"
    preload = tmp_path / "kill_after_writing.py"
    preload.write_text(KILL_AFTER_WRITING.format(mark=str(tmp_path / "killed")))
    with dask_cluster(tmp_path, preload=preload) as (address, _scheduler, _workers):
        proc = subprocess.run(CLI + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--dask", address,
                                     "--json"], capture_output=True, text=True, timeout=240)
    assert (tmp_path / "killed").is_dir(), "no worker was killed"
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    kept = [r for r in doc["results"] if r["status"] == "skipped"]
    assert len(kept) == 1 and kept[0]["notes"] == [
        "already complete, from this input with the same options; kept (--force recomputes it)"]
    assert doc["summary"] == {"done": len(inputs) - 1, "failed": 0, "skipped": 1, "lost": 0, "not_run": 0}
    assert len(_grads(out)) == len(inputs)


@pytest.mark.slow
def test_a_lost_dask_scheduler_ends_the_run_with_one_line_and_the_results_so_far(tmp_path):
    inputs = _long_inputs(tmp_path / "in", 30)
    out = tmp_path / "out"
    env = {**os.environ, "LSTMGRAD_DASK_TIMEOUT": "3s"}  # how long the client tries to reconnect, too
    with dask_cluster(tmp_path) as (address, scheduler, _workers):
        proc = subprocess.Popen(CLI + ["seq", str(tmp_path / "in"), "--out-dir", str(out), "--dask", address,
                                       "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            _wait_for_outputs(out, 3, proc)
            os.kill(scheduler.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        time.sleep(1)  # what the workers were running when the scheduler died may still land
        written = _grads(out)
    assert proc.returncode == 1
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: the Dask cluster at {address} went away"), stderr
    doc = json.loads(stdout)
    summary = doc["summary"]
    assert summary["lost"] >= 1 and summary["not_run"] >= 1 and summary["failed"] == 0
    assert sum(summary.values()) == len(inputs)
    reported = {r["output"] for r in doc["results"] if r["output"]}
    lost = {str(out / Path(r["input"]).name.replace(".h5", ".grads.h5")) for r in doc["results"]
            if r["status"] == "lost"}
    assert all("its worker may still write its output" in r["error"] for r in doc["results"] if r["status"] == "lost")
    assert written - reported <= lost  # every output written is reported, or accounted for as lost


# -- terminals ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0",
                                                                 "PYTHONIOENCODING": ""}],
                         ids=["ascii", "posix-locale"])
def test_a_stdout_that_is_not_utf8_never_crashes(tmp_path, env):
    src = tmp_path / "donn\u00e9es.npz"
    src.write_bytes(PEEP.read_bytes())
    full_env = {k: v for k, v in os.environ.items() if k not in ("LC_ALL", "LANG", "PYTHONIOENCODING")}
    full_env.update({k: v for k, v in env.items() if v})
    for args in (["seq", str(src), "--per-step"], ["inspect", str(src)], ["check", str(src), "--gradcheck"],
                 ["seq", str(src)]):  # the last one: a rerun, kept
        proc = subprocess.run(CLI + args, capture_output=True, env=full_env, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode("ascii", "replace")
        text = proc.stdout.decode("ascii")  # nothing but ASCII reached the terminal
        # The name escaped: as \xe9 where the file system encoding is UTF-8, as the undecodable bytes \udcc3\udca9
        # where the locale makes it ASCII.
        assert "donn\\xe9es" in text or "donn\\udcc3\\udca9es" in text
        assert "Traceback" not in proc.stderr.decode("ascii", "replace")
        if args[0] != "seq" or "--per-step" in args:
            assert " | " in text  # the summary's separator, and the tables' boxes, in ASCII


@pytest.mark.slow
def test_control_characters_in_names_never_reach_a_terminal(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    evil = "evil\x1b]0;PWNED\x07\x1b[2J"
    (folder / f"{evil}.npz").write_bytes(PEEP.read_bytes())
    (folder / f"bad{evil}.npz").write_bytes(b"garbage")
    returncode, seen = run_on_a_terminal(CLI + ["seq", str(folder), "--keep-going", "--layout", "icfo"],
                                         stdout_too=True, columns=200)
    assert returncode == 1
    assert b"\x1b]0;" not in seen and b"\x1b[2J" not in seen and b"\x07" not in seen
    text = seen.decode("utf-8", "replace")
    assert "Error: " in text and "bad" in text
    assert text.count("evil\\x1b]0;PWNED\\x07\\x1b[2J") >= 3  # the error, the warning, the table's heading


@pytest.mark.slow
def test_a_closed_stdout_stops_the_batch_with_one_line(tmp_path):
    inputs = _long_inputs(tmp_path / "in", 30)  # far more than can finish between reading a line and closing
    out = tmp_path / "out"
    proc = subprocess.Popen(CLI + ["seq", str(tmp_path / "in"), "--out-dir", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline()
        proc.stdout.close()  # as `| head -1` does
        stderr = proc.stderr.read().decode()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first.startswith(str(tmp_path / "in" / "run000.h5").encode())
    assert proc.returncode == 1
    assert stderr.startswith("Error: stdout was closed (its reader exited), so the batch stopped: ")
    assert len(stderr.splitlines()) == 1 and "rerun with --skip-existing to finish" in stderr
    written = _grads(out)
    assert 1 <= len(written) < len(inputs) and all(is_complete_output(Path(p)) for p in written)
    assert [p for p in out.iterdir() if p.name.endswith(".tmp")] == []


# -- paths -------------------------------------------------------------------------------------------------------

def test_an_output_that_is_a_directory_is_one_error_line(runner, tmp_path):
    for args in (["seq", str(PEEP), "-o", str(tmp_path)], ["forward", "seq", str(PEEP), "-o", str(tmp_path)]):
        result = runner.invoke(main, args)
        assert result.exit_code == 1
        assert result.stderr == f"Error: {tmp_path}: is a directory; name an output file (.npz, .h5, .hdf5, " \
                                ".safetensors)\n"


# -- one JSON document, one line on stderr, whatever happens -----------------------------------------------------

@pytest.mark.parametrize("args", [["inspect", "{bad}", "--json"], ["check", "{bad}", "-r", "{bad}", "--json"],
                                  ["forward", "seq", "{bad}", "-o", "{out}", "--json"], ["inspect", "{gone}", "--json"],
                                  ["seq", "{bad}", "--bogus-option", "--json"]])
def test_json_prints_one_document_when_a_command_refuses_its_input(runner, tmp_path, args):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"x,y\n1,2\n")
    args = [a.format(bad=bad, gone=tmp_path / "gone.npz", out=tmp_path / "f.npz") for a in args]
    result = runner.invoke(main, args)
    expected_code = 2 if "--bogus-option" in args else 1  # the exit status is the command's, as without --json
    assert result.exit_code == expected_code, result.stderr
    document = json.loads(result.stdout)
    assert document["command"] == args[0] and document["exit_code"] == expected_code
    stderr_error = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert stderr_error == [f"Error: {document['error']}"]  # the same line, still on stderr
    assert not (tmp_path / "f.npz").exists()


@pytest.mark.slow
def test_a_stdout_that_cannot_be_written_is_one_line_after_the_output_was_written(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    src = write_npz(tmp_path / "a.npz", load_case("seq_v2_peep")[0])
    for args in (["--help"], ["seq", "--help"], ["inspect", str(src)], ["seq", str(src), "-o", str(tmp_path / "t.npz")],
                 ["seq", str(src), "-o", str(tmp_path / "j.npz"), "--json"],
                 ["forward", "seq", str(src), "-o", str(tmp_path / "f.npz")]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run(CLI + args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert proc.returncode == 1, (args, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1, (args, proc.stderr)
        assert proc.stderr.startswith("Error: cannot write to stdout: no space left on device"), proc.stderr
    assert is_complete_output(tmp_path / "t.npz") and is_complete_output(tmp_path / "j.npz")  # only the printout
    assert (tmp_path / "f.npz").exists()  # was lost


def test_error_lines_escape_newlines_and_tabs_in_file_names_as_the_tables_do(runner, tmp_path):
    name = tmp_path / "two\nlines\tand tab.npz"
    name.write_bytes(b"not an input")
    shown = str(name).replace("\n", "\\n").replace("\t", "\\t")
    for args in (["seq", str(name)], ["inspect", str(name)], ["seq", str(name), "--json"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 1
        assert result.stderr.startswith(f"Error: {shown}: not an HDF5, NPZ or safetensors file"), result.stderr
        assert len(result.stderr.splitlines()) == 1


# -- Dask: every wait bounded by LSTMGRAD_DASK_TIMEOUT -----------------------------------------------------------

@pytest.mark.parametrize(("address", "says"), [
    ("", "--dask takes the address of a Dask scheduler"),
    ("inproc://somewhere", "inproc:// reaches a scheduler inside the same Python process"),
    ("ucx://127.0.0.1:8786", "ucx:// needs the distributed-ucxx package"),
    ("tls://127.0.0.1:8786", "tls:// needs Dask's TLS settings"),
])
def test_a_dask_address_lstmgrad_cannot_reach_a_scheduler_through_is_a_usage_error(runner, address, says):
    pytest.importorskip("distributed")
    if address.startswith("ucx") and __import__("importlib").util.find_spec("distributed_ucxx"):
        pytest.skip("distributed-ucxx is installed")
    start = time.monotonic()
    result = runner.invoke(main, ["seq", str(PEEP), "--dask", address, "-q"])
    assert result.exit_code == 2 and says in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 5


@contextlib.contextmanager
def _listener(answer: bytes | None):
    """A TCP listener on loopback that answers every connection with ``answer`` (None: never answers, reads on)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        conns = []
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            if answer is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(answer)
        for conn in conns:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"  # (no scheme: tcp://, as Dask takes it)
    finally:
        stop.set()
        thread.join(5)
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize(("answer", "says"), [(None, "it did not answer within 1 s"),
                                              (b"HTTP/1.1 400 Bad Request\r\n\r\n", "does not speak Dask's protocol"),
                                              (b"SSH-2.0-OpenSSH_9.6\r\n" * 8, "does not speak Dask's protocol")])
def test_a_listener_that_is_not_a_dask_scheduler_is_one_line_within_the_timeout(tmp_path, answer, says):
    pytest.importorskip("distributed")
    with _listener(answer) as address:
        start = time.monotonic()
        proc = subprocess.run(CLI + ["seq", str(PEEP), "-o", str(tmp_path / "g.npz"), "--dask", address],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LSTMGRAD_DASK_TIMEOUT": "1s"})
        took = time.monotonic() - start
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"Error: cannot reach the Dask scheduler at tcp://{address}: "), proc.stderr
    assert says in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert took < 30, f"{took:.0f} s"  # (it waited for ever: 90-180 s and counting)
    assert not (tmp_path / "g.npz").exists()


@pytest.mark.slow
def test_dask_workers_get_absolute_paths_and_a_cluster_whose_workers_died_ends_within_the_timeout(tmp_path):
    pytest.importorskip("distributed")
    (tmp_path / "in").mkdir()
    for k in range(3):
        write_npz(tmp_path / "in" / f"s{k}.npz", load_case("seq_v2_peep")[0])
    _long_inputs(tmp_path / "long", 4, T=60_000)
    with dask_cluster(tmp_path, workers=1) as (address, _scheduler, workers):
        # Relative paths, from a folder that is not the workers' working directory.
        relative = subprocess.run(CLI + ["seq", "in", "--out-dir", "out", "--dask", address, "--json"], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120)
        assert relative.returncode == 0, relative.stderr
        doc = json.loads(relative.stdout)
        assert [(r["input"], r["output"], r["status"]) for r in doc["results"]] == [
            (f"in/s{k}.npz", f"out/s{k}.grads.npz", "ok") for k in range(3)]  # named as given
        # Then the cluster's only worker dies: nothing can run what is out, and the run ends after the timeout.
        proc = subprocess.Popen(CLI + ["seq", str(tmp_path / "long"), "--out-dir", str(tmp_path / "long_out"),
                                       "--dask", address, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "LSTMGRAD_DASK_TIMEOUT": "2s"})
        try:
            time.sleep(3)
            workers[0].kill()
            start = time.monotonic()
            stdout, stderr = proc.communicate(timeout=120)
            took = time.monotonic() - start
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 1, stderr
    summary = json.loads(stdout)["summary"]
    assert summary["lost"] >= 1 and summary["done"] + summary["lost"] + summary["not_run"] == 4
    assert "has had no worker for 2 s" in stdout
    assert took < 30, f"{took:.0f} s"  # (it waited for ever)
