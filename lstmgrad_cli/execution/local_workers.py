"""Local worker processes of a batch (``--workers N``): how they start, and how a signal stops them.

Each is forked from the command where that is safe (``start_method``), else spawned, and runs ``_worker_begins``
first, then the batch's own initializer.  SIGINT and SIGTERM reach every process of a terminal's or a job
scheduler's process group; in a worker they interrupt the file it is on as Ctrl-C does the command, never in
the middle of an import, and a SIGTERM ends the worker a second later (``_worker_signal``).  A worker whose
parent dies (killed) ends too, its temporary files removed (``_watch_parent``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..backends import cpu_blas
from . import interrupts

BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
STOP_SIGNALS = interrupts.STOP_SIGNALS  # the signals the command line catches
# What a worker gets from its parent, whose batch stopped on a signal (pool's interrupt_workers), or from the
# system when its parent died (_watch_parent): a signal of its own, as a worker may ignore SIGINT or SIGTERM.
PARENT_SIGNAL = getattr(signal, "SIGUSR1", None)
HELD_SIGNALS = STOP_SIGNALS + ((PARENT_SIGNAL,) if PARENT_SIGNAL is not None else ())


@contextlib.contextmanager
def pool(workers: int, initializer: Callable[[], None] | None = None, devices: Sequence[str] = ()
               ) -> Iterator[tuple[cf.ProcessPoolExecutor, int]]:
    """A pool of ``workers`` processes, all started, and the BLAS threads each runs (its share of the cores).
    ``initializer`` runs in each after ``_worker_begins``.  With ``devices`` (CUDA devices as
    CUDA_VISIBLE_DEVICES names them), each worker sees one of them, in turn: a GPU backend in it computes there.

    The pool's ``stop_queued()`` says that the batch has stopped: a worker then runs no more of the files it
    was handed than the one in hand (``queued_stopped``), as the pool's queue holds tasks it cannot take back.
    Its ``interrupt_workers()`` interrupts the file each is on, as a stop signal to the whole process group
    would (for a batch stopped by a signal only the command got).  Every worker ends when this process does,
    killed or not (``_watch_parent``).
    """
    import multiprocessing  # noqa: PLC0415 - only parallel runs pay for it

    threads = max(1, (os.cpu_count() or 1) // workers)
    method = start_method()
    context = multiprocessing.get_context(method)
    stopped = context.Event()
    ignored = frozenset(sig for sig in STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN)
    # one device each, in turn: each worker takes the next as it starts (a counter in shared memory: no thread here
    # to feed a queue, as a fork must find none)
    assigned = (tuple(devices), context.Value("i", 0)) if devices else None
    with _thread_env(threads):
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_begins,
                                      initargs=(method == "fork", threads, ignored, initializer, stopped, assigned))
        pool.stop_queued = stopped.set  # (every worker holds ``stopped``: _worker_begins)
        pool.interrupt_workers = lambda: _interrupt(pool)
        with pool:
            with _stop_signals_held():
                _start_all_workers(pool)
            yield pool, threads


def _interrupt(pool: cf.ProcessPoolExecutor) -> None:
    """Send each of the pool's worker processes ``PARENT_SIGNAL``: the file it is on is interrupted."""
    if PARENT_SIGNAL is None:
        return
    for pid in list(getattr(pool, "_processes", None) or ()):
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, PARENT_SIGNAL)


def start_method() -> str:
    """How local workers start: ``"fork"`` (a copy of this process) where that is safe, else ``"spawn"``.

    A spawned worker is a new interpreter that imports numpy and lstmgrad before its first file: ~0.4 s of
    CPU each, which on 2 cores costs a batch of small files most of what its second worker gains.  A forked
    one starts in milliseconds with all of that in place.  Forking is safe only from a process with one
    thread, as a lock another thread holds at that moment stays held in the child for ever: so only on Linux
    (macOS's system libraries refuse it), only with no other Python thread, and only when, after numpy's
    OpenBLAS has ended its idle threads (it starts them again on demand), the system counts one thread in
    this process, so no MKL or OpenMP team, numba thread pool or other library's thread is running.  Not
    after numba is imported either: it sized its thread pool then, and every forked copy would start a pool
    of that size (or fail to, where its threading layer cannot load) instead of its share of the cores.
    """
    if (not sys.platform.startswith("linux") or threading.active_count() != 1 or "numba" in sys.modules
            or "cupy" in sys.modules):  # (CUDA does not survive a fork)
        return "spawn"
    # Ending OpenBLAS's threads assumes no other thread is inside BLAS.  None that Python's threading module
    # knows of runs; one started outside it could (the risk _xp._run_overlapped takes too), and is then
    # counted below, so the workers are spawned.
    cpu_blas.stop_spinning_workers()
    return "fork" if cpu_blas.process_status("Threads") == 1 else "spawn"


def _start_all_workers(pool: cf.ProcessPoolExecutor) -> None:
    """Start every worker process now, before the first task.

    With the spawn method the pool starts workers inside ``submit``, one per task handed out, while its
    manager thread watches them.  If a worker dies meanwhile (killed), the manager tears the pool down
    while ``submit`` adds a worker to it (CPython 3.11): the manager crashed on the changed worker
    table, a worker it never stopped was waited for forever, or starting one failed on a pipe it had
    just closed.  Started up front, the workers are all known before the manager runs.  This uses
    the pool's own start-up method (``_launch_processes``, which it calls itself for the fork
    method); where a Python lacks it, workers start on demand as before.
    """
    launch = getattr(pool, "_launch_processes", None)
    if launch is not None:
        launch()
        # And the manager now, as the pool's first submit would: without it, a pool that ends before its first
        # task (a Ctrl-C as it starts) sends its workers no word to end, and the exiting command waits on them.
        manage = getattr(pool, "_start_executor_manager_thread", None)
        if manage is not None:
            manage()


@contextlib.contextmanager
def _thread_env(threads: int) -> Iterator[None]:
    """BLAS thread variables for worker processes started inside this block (they inherit the env)."""
    saved = {var: os.environ.get(var) for var in BLAS_THREAD_VARS}
    os.environ.update({var: str(threads) for var in BLAS_THREAD_VARS})
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and PARENT_SIGNAL blocked in this thread meanwhile, and so in the worker processes it starts,
    until each has its handlers (_worker_begins): one that arrives while a worker starts is neither taken by the
    handler a fork copied nor a traceback from a half-started interpreter.  Here it waits, and is delivered
    after."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _fresh_handler(sig: int):
    """What a new interpreter handles ``sig`` with (one of STOP_SIGNALS, not ignored)."""
    return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL


def _worker_begins(forked: bool, threads: int, ignored: frozenset[int], initializer: Callable[[], None] | None,
                   stopped=None, assigned=None) -> None:
    """First in every local worker process, which starts with the stop signals blocked (_stop_signals_held).

    A forked worker is first made what a spawned one starts as: its parent's handlers go (Ctrl-C raises
    KeyboardInterrupt, SIGTERM ends it) but for a signal the parent ignored (``ignored``: a new interpreter
    keeps an ignored signal ignored), and the BLAS libraries its parent loaded run ``threads`` threads each (a
    spawned worker reads the count from the environment when it loads them: _thread_env).  Then
    ``initializer`` runs, and a stop signal that came meanwhile reaches the handlers it left in place.
    ``stopped``: the pool's Event that says the batch has stopped (``queued_stopped``); ``assigned``: the CUDA
    devices and the count of workers that took one, this one taking the next before anything here can start CUDA."""
    _state.batch_stopped = stopped
    if assigned is not None:
        devices, taken = assigned
        with taken.get_lock():
            os.environ["CUDA_VISIBLE_DEVICES"] = devices[taken.value % len(devices)]
            taken.value += 1
    if forked:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else _fresh_handler(sig))
        cpu_blas.set_thread_counts(threads)
        # Setting the count started numpy's OpenBLAS's threads again (the fork had ended them); with a count of
        # one nothing wakes them, but first they spin, on the core another worker uses.  No thread runs BLAS yet.
        cpu_blas.stop_spinning_workers()
    if initializer is not None:
        initializer()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


# -- in a worker process -----------------------------------------------------------------------------------------

@dataclass
class _WorkerState:
    """Where a local worker process stands (module state of that process); the stop signals themselves are
    interrupts.py's."""

    in_task: bool = False  # a task runs (interruptible_task)
    ending: bool = False  # a SIGTERM came, or the parent is gone: the process ends within a second
    orphaned: bool = False  # the parent is gone: nothing will publish this worker's outputs
    parent: int | None = None  # the parent's pid, while this worker watches it
    on_orphan: dict = field(default_factory=dict)  # what to clean up were the parent to die (note_output)
    batch_stopped: object = None  # the pool's Event: the batch has stopped (its stop_queued(): pool)


_state = _WorkerState()


def queued_stopped() -> bool:
    """In a local worker process: whether the batch has stopped (the pool's ``stop_queued``: ``pool``), so that
    files it was handed beyond the one in hand are not run."""
    return _state.batch_stopped is not None and _state.batch_stopped.is_set()


def catch_stop_signals() -> None:
    """In a local worker process: SIGINT and SIGTERM (unless ignored) and ``PARENT_SIGNAL`` stop it as
    ``_worker_signal`` says, raising KeyboardInterrupt only inside a task (interrupts.py); the worker ends when
    its parent does (``_watch_parent``)."""
    if PARENT_SIGNAL is not None:
        signal.signal(PARENT_SIGNAL, signal.SIG_DFL)  # caught even where the command was started ignoring it
    interrupts.catch(HELD_SIGNALS, _worker_signal)
    _watch_parent()


def note_output(path, remove_temporaries: Callable[[str, int], None]) -> None:
    """A task of this worker writes ``path``: were its parent to die, ``remove_temporaries(directory, pid)`` removes
    this worker's temporary files beside it."""
    directory = os.path.dirname(os.fspath(path)) or "."
    _state.on_orphan[directory] = remove_temporaries


@contextlib.contextmanager
def interruptible_task() -> Iterator[None]:
    """A task in a local worker process: a stop signal during it raises KeyboardInterrupt there (until its output
    is handed over: interrupts.commit); one got before it and not yet taken, or a worker ending, raises at once.
    The caller calls ``interrupt_taken`` once it has cleaned up after a KeyboardInterrupt."""
    with interrupts.interruptible():
        _state.in_task = True
        try:
            if _state.ending:
                raise KeyboardInterrupt
            yield
        finally:
            _state.in_task = False


def interrupt_taken() -> None:
    """A KeyboardInterrupt reached the task's caller, which has cleaned up: the signals got so far are acted on,
    and the next task runs (also where the interrupt came as the task ended).  An orphaned worker ends here."""
    _state.in_task = False
    interrupts.take()
    if _state.orphaned:
        _end_orphan()


def _worker_signal(signum) -> None:
    """What a stop signal does in a local worker process besides interrupting its task (interrupts.py: during a
    task, not in an import, nor once its output is handed over; else the next task is interrupted as it starts,
    so a worker waiting for work never dies of it with a traceback).

    SIGTERM also ends the process, a second later: time for an interrupted task's result to go back, and for
    a parent that got it too to stop handing out work and shut the pool down, which ends an idle worker
    cleanly (dying at once, it would break the pool: "worker process failed" for the files still out).  Every
    task it gets meanwhile is interrupted as it starts.  The pool itself ends its workers with SIGTERM when one
    has died (it may have died holding the lock of the queue the others wait on) and waits for them to go.

    ``PARENT_SIGNAL`` comes from the parent, whose batch stopped on a signal of its own (``pool``'s
    ``interrupt_workers``), or from the system when the parent died (``_watch_parent``): then the worker ends,
    its task interrupted, and removes the temporary files its parent will never publish."""
    if signum == signal.SIGTERM and not _state.ending:
        signal.signal(signum, signal.SIG_DFL)
        _end_soon(lambda: os.kill(os.getpid(), signum))
    if _state.parent is not None and not _state.orphaned and os.getppid() != _state.parent:
        _state.orphaned = True
        if not _state.in_task:  # nothing to unwind (waiting for work, or sending a result to no one)
            _end_orphan()
        _end_soon(_end_orphan)  # (a task unwinds first, its own temporary file removed: interrupt_taken)


def _end_soon(end) -> None:
    _state.ending = True  # every task it is still handed is interrupted as it starts
    timer = threading.Timer(1.0, end)
    timer.daemon = True
    timer.start()


def _watch_parent() -> None:
    """Make the worker hear of its parent's death: on Linux the system sends ``PARENT_SIGNAL`` then (prctl's
    PR_SET_PDEATHSIG); elsewhere, or where that fails, a thread looks at the parent's pid four times a second.
    A worker whose parent died already ends at once."""
    _state.parent = os.getppid()
    if not _parent_death_signal():
        watcher = threading.Thread(target=_poll_parent, name="lstmgrad-parent-watch", daemon=True)
        with contextlib.suppress(RuntimeError):  # no thread can start (a tight ulimit -v): not watched
            watcher.start()
    if os.getppid() != _state.parent or _state.parent == 1:  # died before it was watched
        _state.orphaned = True
        _end_orphan()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _parent_death_signal() -> bool:
    """Ask Linux to send ``PARENT_SIGNAL`` to this process when its parent ends; whether it took."""
    if not sys.platform.startswith("linux") or PARENT_SIGNAL is None:
        return False
    try:
        import ctypes  # noqa: PLC0415 - only where it applies

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(PARENT_SIGNAL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _poll_parent() -> None:
    import _thread  # noqa: PLC0415

    while os.getppid() == _state.parent:
        time.sleep(0.25)
    _thread.interrupt_main(PARENT_SIGNAL if PARENT_SIGNAL is not None else signal.SIGINT)


def _end_orphan() -> None:
    """End a worker whose parent is gone, with the temporary files of its outputs removed (those it handed over,
    which no one will publish now, and one it was writing)."""
    for directory, remove_temporaries in list(_state.on_orphan.items()):
        remove_temporaries(directory, os.getpid())
    os._exit(1)
