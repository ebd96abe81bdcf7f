"""Ctrl-C and SIGTERM at any moment of a batch, as real processes: the batch stops, reports every output it wrote
(the closing table, the --json document), prints no traceback and leaves no temporary file; its workers end with
it, even when it is killed.  And where in the code a stop signal may land (execution/interrupts.py), in this process.

Each round sends one signal at a random moment from the command's first line (once it catches signals: its
imports and plan included) to well into the batch.  ``make test`` runs a few rounds;
``LSTMGRAD_SIGNAL_ROUNDS=50`` (``make signals``) runs the issue's fifty per case.  Every process started here is
ended by pid; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import consistent_inputs, write_h5

from lstmgrad_cli.execution import interrupts
from lstmgrad_cli.io.provenance import is_complete_output

CLI = [sys.executable, "-m", "lstmgrad_cli"]
ROUNDS = int(os.environ.get("LSTMGRAD_SIGNAL_ROUNDS", "2"))
LATEST_SIGNAL = 1.5  # seconds from the command's first line: its imports, its plan, then some hundred files
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory) -> Path:
    """400 small files (~15 ms each): a batch a signal finds in any of its phases."""
    folder = tmp_path_factory.mktemp("signals") / "in"
    folder.mkdir()
    first = write_h5(folder / "run0000.h5", consistent_inputs(T=20, B=4, I=8, C=8))
    for k in range(1, 400):
        shutil.copyfile(first, folder / f"run{k:04d}.h5")
    return folder


@pytest.fixture(scope="module")
def long_inputs(tmp_path_factory) -> Path:
    """Four files that take many seconds each (~8 s here: many small time steps, the forward pass run first, as
    they hold no activations)."""
    folder = tmp_path_factory.mktemp("long") / "in"
    folder.mkdir()
    T, B, I, C = 150_000, 2, 2, 4  # noqa: N806, E741
    rng = np.random.default_rng(0)

    def r(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    tensors = {"x": r(T, B, I), "cs_prev": r(B, C), "h_prev": r(B, C), "w": r(I + C, 4 * C), "wci": r(C),
               "wcf": r(C), "wco": r(C), "b": r(4 * C), "cs_grad": r(T, B, C), "h_grad": r(T, B, C)}
    first = write_h5(folder / "run0.h5", tensors)
    for k in range(1, 4):
        shutil.copyfile(first, folder / f"run{k}.h5")
    return folder


def _catching(pid: int, timeout: float = 30) -> None:
    """Wait until the command catches SIGTERM: its own code runs (a signal before that finds the interpreter
    starting, as for any Python program)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as fh:
                caught = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.002)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ended(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still alive after up to ``seconds`` (they are killed, so none outlives the test)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    alive = [p for p in pids if _alive(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _round(inputs: Path, out: Path, sig: int, when: float, extra: list[str], group: bool = False) -> dict:
    """One batch over ``inputs`` with --json, sent ``sig`` ``when`` seconds after it starts; what it left."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(CLI + ["seq", str(inputs), "--out-dir", str(out), "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # (where it hangs, if it does)
    try:
        _catching(proc.pid)
        time.sleep(when)
        workers = _children(proc.pid)
        sent = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGABRT)  # every process's threads' stacks, on stderr
            _, stderr = proc.communicate(timeout=30)
            raise AssertionError(f"no end 60 s after {signal.Signals(sig).name} at {when:.2f} s:\n"
                                 f"{stderr[-6000:]}") from None
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    return {"code": proc.returncode, "stdout": stdout, "stderr": stderr, "took": took, "left": left,
            "orphans": _ended(workers, 5), "outputs": [out / name for name in left if not name.startswith(".")]}


def _check_stopped(run: dict, sig: int) -> None:
    """What every stopped batch must leave: its exit status, one JSON document reporting every output there,
    complete outputs only, no temporary file, no traceback, no worker alive."""
    where = f"stderr:\n{run['stderr'][-2000:]}"
    assert run["code"] == 128 + sig, where
    assert "Traceback" not in run["stderr"] and "Exception ignored" not in run["stderr"], where
    assert [name for name in run["left"] if name.endswith(".tmp")] == [], where
    assert run["orphans"] == [], "worker processes outlived the command"
    document = json.loads(run["stdout"])  # one document, whatever the moment
    reported = {Path(r["output"]).name for r in document.get("results", ())
                if r.get("output") and r["status"] in ("ok", "skipped")}
    assert {p.name for p in run["outputs"]} == reported, where  # every output written is reported, and only those
    assert all(is_complete_output(p) for p in run["outputs"])
    if "results" in document:
        assert document["interrupted"] == signal.Signals(sig).name
    else:  # stopped before the batch began: the error document
        assert document["error"] == f"interrupted ({signal.Signals(sig).name})" and run["outputs"] == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_signal_at_any_moment_stops_the_batch_and_reports_every_output(small_inputs, tmp_path, sig, workers):
    rng = random.Random(f"{sig}-{workers}-{ROUNDS}")
    extra = ["--workers", str(workers)] if workers > 1 else []
    for _ in range(ROUNDS):
        run = _round(small_inputs, tmp_path / "out", sig, rng.uniform(0.0, LATEST_SIGNAL), extra)
        _check_stopped(run, sig)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_to_the_whole_process_group_stops_the_batch_cleanly(small_inputs, tmp_path, workers):
    # A terminal's Ctrl-C reaches the workers too (and each gets its parent's word as well: both are taken).
    rng = random.Random(f"group-{workers}-{ROUNDS}")
    extra = ["--workers", str(workers)] if workers > 1 else []
    for _ in range(ROUNDS):
        run = _round(small_inputs, tmp_path / "out", signal.SIGINT, rng.uniform(0.3, LATEST_SIGNAL), extra,
                     group=True)
        _check_stopped(run, signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_signal_to_the_command_alone_interrupts_the_files_in_hand(long_inputs, tmp_path, workers):
    # Files that take many seconds each: the signal interrupts them (in the workers too, which the command tells),
    # rather than waiting for them to end.  (The bound is loose: a file takes far longer than it.)
    extra = ["--workers", str(workers)] if workers > 1 else []
    run = _round(long_inputs, tmp_path / "out", signal.SIGTERM, 1.0, extra)
    _check_stopped(run, signal.SIGTERM)
    assert run["outputs"] == []
    assert run["took"] < 4, f"took {run['took']:.1f} s to stop"
    document = json.loads(run["stdout"])
    assert document["summary"]["not_run"] + document["summary"]["failed"] == 4
    assert all(r["error"].endswith(": interrupted") for r in document["results"])


@pytest.mark.slow
def test_workers_end_when_the_command_is_killed(small_inputs, long_inputs, tmp_path):
    # SIGKILL leaves the command no time to do anything: its workers hear of it from the system (a parent-death
    # signal), interrupt their files, remove the temporary files their parent will never publish, and end.
    for inputs, when in ((long_inputs, 1.0), (small_inputs, 0.8)):
        run = _round(inputs, tmp_path / "out", signal.SIGKILL, when, ["--workers", "2"])
        assert run["code"] == -signal.SIGKILL
        assert run["orphans"] == [], "worker processes outlived the command"
        assert [name for name in run["left"] if name.endswith(".tmp")] == []
        assert all(is_complete_output(p) for p in run["outputs"])


# -- where a stop signal lands (execution/interrupts.py), in this process ---------------------------------------

@pytest.fixture
def signalled():
    """A real SIGINT to this process, handled by interrupts' handler with its own record of signals (given back
    after); ``signal.raise_signal`` runs the handler before it returns, so it lands where the test sends it."""
    with interrupts.caught(signals=(signal.SIGINT,)):
        yield lambda: signal.raise_signal(signal.SIGINT)


def test_a_signal_outside_an_interruptible_block_is_only_recorded(signalled):
    with interrupts.deferred():
        signalled()  # no KeyboardInterrupt here: the batch's bookkeeping runs whole
        assert interrupts.pending()
        assert interrupts.requested() and not interrupts.pending()  # the batch acts on it at its next boundary
    signalled()
    with pytest.raises(KeyboardInterrupt), interrupts.interruptible():  # one not acted on: the next block stops
        raise AssertionError("not begun")


def test_a_held_block_runs_whole_and_raises_at_its_end(signalled):
    done = []
    with pytest.raises(KeyboardInterrupt), interrupts.interruptible():
        with interrupts.held():
            signalled()
            done.append("held")
        done.append("after")
    assert done == ["held"] and not interrupts.pending()


def test_a_committed_block_is_not_interrupted_and_leaves_the_signal_to_the_caller(signalled):
    with interrupts.deferred():
        with interrupts.interruptible():
            interrupts.commit()  # its output is handed over: its result must be reported
            signalled()
            finished = True
        assert finished and interrupts.requested()


def test_a_report_after_a_stop_is_interrupted_by_a_new_signal_only(signalled):
    signalled()
    with interrupts.deferred(), interrupts.interruptible(new_only=True):
        printed = True  # the closing table of a batch the first signal stopped
    assert printed
    with pytest.raises(KeyboardInterrupt), interrupts.deferred(), interrupts.interruptible(new_only=True):
        signalled()


DROPPED = """
import os, signal, sys, time
from lstmgrad_cli.execution import interrupts

class Lands:
    def __del__(self):  # where Python drops a KeyboardInterrupt ("Exception ignored in ...")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)

with interrupts.caught():
    try:
        with interrupts.interruptible():
            Lands()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted", interrupts.received())
"""


def test_an_interrupt_python_drops_is_not_printed_and_lands_in_the_code_that_follows(tmp_path):
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["interrupted", f"[{int(signal.SIGINT)}]"]  # once, not counted twice
    assert done.stderr == ""
