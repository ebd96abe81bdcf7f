"""The overlapped schedule's two threads held on different CPUs for the pass (backends/cpu_placement.py): which CPUs
each gets, that a real overlapped pass runs them there with the same bits, and that the caller's CPUs come back,
whatever ends the pass.  The pass tests need Linux and two CPUs allowed (this suite's machines have them)."""

from __future__ import annotations

import _thread
import os
import threading

import numpy as np
import pytest
from conftest import consistent_inputs

from lstmgrad_cli.backends import cpu_placement
from lstmgrad_cli.backends._numpy import NumpyBackend
from lstmgrad_cli.backends.conformance import LazyRows
from lstmgrad_cli.spec import SeqTensors

two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="needs Linux and two CPUs allowed")


@pytest.fixture(autouse=True)
def _cpus_given_back():
    """A test that fails with this thread still held must not leave the rest of the suite on one CPU."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    if allowed is not None:
        os.sched_setaffinity(0, allowed)


KW = dict(seq_len_max=20, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float32"), chunk_steps=4)


def test_the_caller_stays_on_its_cpu_and_the_worker_gets_the_others():
    assert cpu_placement.split({0, 1, 2, 3}, 2) == ({0, 1, 2, 3}, {2}, {0, 1, 3})
    assert cpu_placement.split({4, 7}, 7) == ({4, 7}, {7}, {4})


def test_the_worker_keeps_off_the_callers_core_where_another_core_is_allowed():
    assert cpu_placement.split({0, 1, 2, 3}, 0, siblings={0, 2}).worker == {1, 3}
    # only the caller's SMT sibling left: the worker takes it rather than nothing
    assert cpu_placement.split({0, 2}, 0, siblings={0, 2}).worker == {2}


def test_nothing_is_held_with_one_cpu_or_where_the_callers_cpu_is_not_its_own():
    assert cpu_placement.split({3}, 3) is None
    assert cpu_placement.split({0, 1}, 5) is None  # moved meanwhile to a CPU it may no longer use


@two_cpus
def test_this_threads_placement_splits_the_cpus_it_may_use():
    allowed = os.sched_getaffinity(0)
    placement = cpu_placement.for_this_thread()
    assert placement.allowed == allowed
    (here,) = placement.caller
    assert here in allowed and placement.worker and placement.worker <= allowed - {here}


@two_cpus
def test_a_refused_hold_leaves_the_thread_where_it_was():
    allowed = os.sched_getaffinity(0)
    assert not cpu_placement.hold({10**6})  # no such CPU: the kernel refuses
    assert not cpu_placement.hold(set())
    assert os.sched_getaffinity(0) == allowed


class _RowsWhere:
    """An ``x_grad_out`` that records, for each write of its rows, whether the main thread made it and the CPUs
    that thread may use.  Each thread's first write waits until the other's (either may take any x product: this
    way both take one), and rows written by the worker raise ``fail`` where one is given."""

    def __init__(self, shape, fail=None):
        self.shape, self.dtype = shape, np.dtype("float32")
        self.rows, self.seen, self._fail = np.zeros(shape, np.float32), [], fail
        self._wrote = {True: threading.Event(), False: threading.Event()}  # by the main thread, by the worker

    def __setitem__(self, index, rows):
        main = threading.current_thread() is threading.main_thread()
        self.seen.append((main, frozenset(os.sched_getaffinity(0))))
        self._wrote[main].set()
        self._wrote[not main].wait(10)
        if not main and self._fail is not None:
            raise self._fail
        self.rows[index] = rows


class _Interrupted(LazyRows):
    """A time-major input on "disk" whose ``on_read``-th chunk read is stopped by Ctrl-C."""

    def __init__(self, array, on_read):
        super().__init__(array)
        self._reads, self._on_read = 0, on_read

    def read_into(self, lo, hi, out, dest=None):
        self._reads += 1
        if self._reads == self._on_read:
            raise KeyboardInterrupt
        return super().read_into(lo, hi, out, dest)


class _ReadWhere(LazyRows):
    """A time-major input on "disk" (read a chunk at a time on the read-ahead thread) that records the CPUs each
    reading thread may use."""

    def __init__(self, array, seen):
        super().__init__(array)
        self._seen = seen

    def read_into(self, lo, hi, out, dest=None):
        self._seen.append((threading.current_thread() is threading.main_thread(), frozenset(os.sched_getaffinity(0))))
        return super().read_into(lo, hi, out, dest)


@two_cpus
def test_an_overlapped_pass_runs_its_threads_on_different_cpus_and_gives_the_callers_back():
    inputs = consistent_inputs(T=20, B=4, I=3, C=5)
    want = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **KW)
    allowed = os.sched_getaffinity(0)
    out = _RowsWhere(inputs["x"].shape)
    got = NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**inputs), **KW, x_grad_out=out)
    on_main = {cpus for main, cpus in out.seen if main}
    on_worker = {cpus for main, cpus in out.seen if not main}
    assert len(on_main) == 1 and len(on_worker) == 1, out.seen
    (caller,), (worker,) = on_main, on_worker
    assert len(caller) == 1 and caller | worker <= allowed and not caller & worker
    assert os.sched_getaffinity(0) == allowed
    np.testing.assert_array_equal(out.rows, want.x_grad)
    for field in got._fields[1:]:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


class _Waits:
    """An ``x_grad_out`` whose first write, on whichever thread, says so (``writing``) and waits for ``go``."""

    def __init__(self, shape):
        self.shape, self.dtype = shape, np.dtype("float32")
        self.writing, self.go = threading.Event(), threading.Event()

    def __setitem__(self, index, rows):
        self.writing.set()
        self.go.wait(10)


@two_cpus
def test_a_pass_run_while_another_holds_its_threads_leaves_its_own_where_linux_puts_them():
    """Two passes at once (a Dask worker's threads): held, the second's could share a CPU with the first's."""
    inputs = consistent_inputs(T=20, B=4, I=3, C=5)
    allowed = os.sched_getaffinity(0)
    first_out = _Waits(inputs["x"].shape)
    first = threading.Thread(target=lambda: NumpyBackend(overlap=True).block_lstm_grad(
        SeqTensors(**inputs), **KW, x_grad_out=first_out))
    first.start()
    try:
        assert first_out.writing.wait(10)  # the first pass runs, its threads held
        second_out = _RowsWhere(inputs["x"].shape)
        NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**inputs), **KW, x_grad_out=second_out)
        assert {cpus for _, cpus in second_out.seen} == {frozenset(allowed)}
    finally:
        first_out.go.set()
        first.join(10)
    third_out = _RowsWhere(inputs["x"].shape)  # the first has ended: the next pass holds its threads again
    NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**inputs), **KW, x_grad_out=third_out)
    assert len({cpus for _, cpus in third_out.seen}) == 2
    assert os.sched_getaffinity(0) == allowed


@two_cpus
def test_the_callers_cpus_come_back_when_the_worker_fails():
    inputs = consistent_inputs(T=20, B=4, I=3, C=5)
    allowed = os.sched_getaffinity(0)
    out = _RowsWhere(inputs["x"].shape, fail=MemoryError("worker failed"))
    with pytest.raises(MemoryError, match="worker failed"):
        NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**inputs), **KW, x_grad_out=out)
    assert any(not main for main, _ in out.seen)
    assert os.sched_getaffinity(0) == allowed


@two_cpus
def test_the_callers_cpus_come_back_when_ctrl_c_stops_the_loop():
    inputs = consistent_inputs(T=20, B=4, I=3, C=5)
    allowed, running = os.sched_getaffinity(0), _thread._count()
    with pytest.raises(KeyboardInterrupt):
        NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**{**inputs, "i": _Interrupted(inputs["i"], 3)}), **KW)
    assert os.sched_getaffinity(0) == allowed
    assert _thread._count() == running  # the worker has ended


@two_cpus
def test_the_read_ahead_thread_of_an_input_on_disk_is_not_held():
    """It starts while the pass holds the caller on one CPU, and takes the CPUs the pass was called with, so that it
    does not share the time loop's."""
    inputs = consistent_inputs(T=20, B=4, I=3, C=5)
    want = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **KW)
    allowed = os.sched_getaffinity(0)
    seen = []
    on_disk = {**inputs, **{name: _ReadWhere(inputs[name], seen) for name in ("i", "cs", "f", "o", "ci", "co")}}
    got = NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**on_disk), **KW)
    read_ahead = [cpus for main, cpus in seen if not main]
    assert read_ahead and all(cpus == allowed for cpus in read_ahead), seen
    assert os.sched_getaffinity(0) == allowed
    for field, have, expected in zip(got._fields, got, want, strict=True):
        np.testing.assert_array_equal(have, expected, err_msg=field)



def test_an_overlapped_pass_keeps_the_step_kernel_on_its_thread():
    """Overlapped, numba's parallel step would contend for the other core, and its threads would start on the one
    CPU the pass holds the caller on, there for the rest of the process: the loop tells the step it has one core
    (the time loop in Python: compiled_loop=False; its kernel may spread from one element on)."""
    _numba = pytest.importorskip("lstmgrad_cli.backends._numba")

    class Told(_numba.NumbaGradient):
        def step(self, *args, **kwargs):
            self.told.append(args[9] if len(args) > 9 else kwargs.get("one_core", False))
            return super().step(*args, **kwargs)

    inputs = consistent_inputs(T=20, B=4, I=3, C=5)
    seen = {}
    for overlap in (True, False):
        gradient = Told(parallel_min_elements=1, compiled_loop=False, overlap=overlap, kernel_min_flops=0)
        gradient.told = []
        gradient.block_lstm_grad(SeqTensors(**inputs), **KW)
        seen[overlap] = set(gradient.told)
    assert seen == {True: {True}, False: {False}}
