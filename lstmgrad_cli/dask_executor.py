"""Tasks on a Dask distributed cluster as a ``concurrent.futures`` executor that loses no output.

A task handed to Dask cannot be stopped once a worker runs it: cancelling it only drops its result,
while the worker goes on and writes its output.  So this executor hands out at most two tasks per
worker thread, one running and one ready to start (the cluster's thread count, refreshed as workers
come and go), and keeps the rest here, where cancelling them is final.  Every task handed out has
started or is about to: after a stop the batch waits for those and reports them, and no output
appears that the run does not list.

A worker that dies is Dask's to handle (it reruns the task elsewhere; an output the first attempt
already finished is kept, see ``provenance``).  A scheduler that is lost, or a connection that
drops for good, ends every task handed out with ``SchedulerLost`` (their workers may still write
them) and every task kept here with ``NotStarted``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from functools import partial

from .errors import InvalidOptionError, LstmGradError
from .messages import Message, Param

TIMEOUT_VARIABLE = "LSTMGRAD_DASK_TIMEOUT"
DEFAULT_TIMEOUT = "10s"
SLOTS_REFRESH_SECONDS = 1.0  # how often the cluster's thread count is asked for, at most
HANDED_OUT_PER_THREAD = 2  # tasks handed to the cluster per worker thread: one running, one ready to start
FETCH_THREADS = 4  # results fetched side by side


class SchedulerLost(LstmGradError):
    """A task handed to a Dask scheduler that was lost before the task's result came back."""


class NotStarted(LstmGradError):
    """A task never handed out: the scheduler was lost first."""


def check_address(address: str) -> None:
    """Refuse a malformed scheduler address (InvalidOptionError) before connecting to it."""
    from distributed.comm import registry  # noqa: PLC0415 - the optional dask extra
    from distributed.comm.addressing import parse_address, parse_host_port  # noqa: PLC0415

    scheme, location = parse_address(address, strict=False)
    try:
        registry.get_backend(scheme)
    except ValueError:
        known = ", ".join(f"{name}://" for name in sorted(registry.backends))
        raise InvalidOptionError(Message.format("{}: unknown protocol {}; use one of {}", Param("dask", address),
                                                repr(scheme), known)) from None
    if scheme in ("tcp", "tls", "ws", "wss"):
        try:
            host, port = parse_host_port(location, 8786)
        except ValueError:
            raise InvalidOptionError(Message.format("{}: the port must be a number, as in tcp://host:8786",
                                                    Param("dask", address))) from None
        if not host:
            raise InvalidOptionError(Message.format("{}: no host; give one, as in tcp://host:8786",
                                                    Param("dask", address)))
        if not 0 < port < 65536:
            raise InvalidOptionError(Message.format("{}: port {} is out of range (1 to 65535)", Param("dask", address),
                                                    port))


def connect_timeout() -> float:
    """Seconds to wait for the scheduler: ``LSTMGRAD_DASK_TIMEOUT`` (10s, 1m, 30 ...), checked before connecting."""
    from dask.utils import parse_timedelta  # noqa: PLC0415 - the optional dask extra

    text = os.environ.get(TIMEOUT_VARIABLE, DEFAULT_TIMEOUT)
    try:
        seconds = parse_timedelta(text.strip(), default="s")
    except (ValueError, KeyError, TypeError):
        seconds = None
    if seconds is None or not seconds > 0:
        raise InvalidOptionError(f"{TIMEOUT_VARIABLE}={text!r} is not a time; use seconds or a unit, as in 10s or 2m")
    return float(seconds)


def check_options(address: str) -> float:
    """Everything about running on ``address`` that can be checked without connecting: the package, the address,
    ``LSTMGRAD_DASK_TIMEOUT`` (returned, in seconds).  InvalidOptionError for a malformed one."""
    try:
        import distributed  # noqa: F401, PLC0415 - optional (the dask extra)
    except ImportError:
        raise LstmGradError(Message.format("{} needs the distributed package: pip install 'lstmgrad[dask]'",
                                           Param("dask"))) from None
    check_address(address)
    return connect_timeout()


@contextlib.contextmanager
def dask_executor(address: str) -> Iterator[DaskExecutor]:
    """A connected ``DaskExecutor``; the address and timeout are checked first, distributed's own log kept quiet
    (lstmgrad reports what goes wrong in its results)."""
    timeout = check_options(address)
    from distributed import Client  # noqa: PLC0415 - optional (the dask extra)

    with _quiet_logger("distributed"):
        try:
            client = Client(address, timeout=timeout, set_as_default=False)
        except (OSError, TimeoutError) as err:
            raise LstmGradError(f"cannot reach the Dask scheduler at {address}: {err}") from None
        executor = DaskExecutor(client, address)
        try:
            yield executor
        finally:
            executor.shutdown(wait=False)
            with contextlib.suppress(Exception):  # a lost scheduler: closing has nothing left to tell
                client.close(timeout=timeout)


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Nothing from logger ``name`` or its children reaches its handlers (distributed configures its own, with a
    level per child logger) while the block runs."""
    handlers = logging.getLogger(name).handlers
    levels = [handler.level for handler in handlers]
    for handler in handlers:
        handler.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for handler, level in zip(handlers, levels, strict=True):
            handler.setLevel(level)


class DaskExecutor(cf.Executor):
    """``client.submit`` as an executor that hands the cluster at most two tasks per worker thread."""

    def __init__(self, client, address: str = ""):
        self._client = client
        self._address = address or str(getattr(client, "scheduler", ""))
        self._lock = threading.Lock()
        self._waiting: collections.deque = collections.deque()  # (future, fn, args, kwargs) not handed out
        self._handed_out = 0
        self._threads = 1
        self._threads_checked = -float("inf")
        self._lost = False
        self._shutdown = False
        self._fetchers = cf.ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="lstmgrad-dask-fetch")

    def submit(self, fn, /, *args, **kwargs) -> cf.Future:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future: cf.Future = cf.Future()
        with self._lock:
            self._waiting.append((future, fn, args, kwargs))
        self._hand_out()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for future, *_ in waiting:
            future.cancel()
        self._fetchers.shutdown(wait=wait)

    def _hand_out(self) -> None:
        slots = self._slots()
        with self._lock:
            while self._waiting and (self._lost or self._handed_out < HANDED_OUT_PER_THREAD * slots):
                future, fn, args, kwargs = self._waiting.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled while it waited here: it never runs
                if self._lost:
                    future.set_exception(NotStarted(f"not started: the Dask scheduler at {self._address} was lost"))
                    continue
                try:
                    task = self._client.submit(fn, *args, pure=False, **kwargs)
                except Exception as err:  # noqa: BLE001 - a client that closed meanwhile: this task's failure
                    future.set_exception(err)
                    continue
                self._handed_out += 1
                task.add_done_callback(partial(self._finished, future))

    def _slots(self) -> int:
        """Worker threads in the cluster (at least one, so a cluster still starting gets its first task)."""
        now = time.monotonic()
        if now - self._threads_checked >= SLOTS_REFRESH_SECONDS and not self._lost:
            self._threads_checked = now
            with contextlib.suppress(Exception):  # the scheduler unreachable: the last count stands
                info = self._client.scheduler_info(n_workers=0)
                self._threads = max(1, int(info.get("total_threads") or 0))
        return self._threads

    def _finished(self, future: cf.Future, task) -> None:
        """In distributed's one callback thread: hand out the next task (a place is free), then fetch
        this one's result in a thread of our own, so results come back side by side, not one after another."""
        with self._lock:
            self._handed_out -= 1
        self._hand_out()
        try:
            self._fetchers.submit(self._fetch, future, task)
        except RuntimeError:  # shut down meanwhile: fetch it here
            self._fetch(future, task)

    def _fetch(self, future: cf.Future, task) -> None:
        """Pass a finished Dask future's outcome to ours."""
        if task.status == "cancelled":
            self._lost = True
            future.set_exception(SchedulerLost(f"lost with the Dask scheduler at {self._address}; its worker may "
                                               "still write its output"))
        else:
            try:
                future.set_result(task.result())
            except cf.CancelledError:  # lost while fetching the result
                self._lost = True
                future.set_exception(SchedulerLost(f"lost with the Dask scheduler at {self._address}"))
            except OSError as err:  # the connection to its worker dropped while fetching the result
                reason = " ".join(str(err).split()) or type(err).__name__
                future.set_exception(SchedulerLost(f"its result could not be fetched from its worker ({reason})"))
            except BaseException as err:  # noqa: BLE001 - the task's error (KilledWorker, ...) is its outcome
                future.set_exception(err)
        if self._lost:
            self._hand_out()  # what still waits here will never start: say so now
