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

from ..errors import InvalidOptionError, LstmGradError
from ..messages import Message, Param
from . import interrupts

TIMEOUT_VARIABLE = "LSTMGRAD_DASK_TIMEOUT"
DEFAULT_TIMEOUT = "10s"
SLOTS_REFRESH_SECONDS = 1.0  # how often the cluster's thread count is asked for, at most
HANDED_OUT_PER_THREAD = 2  # tasks handed to the cluster per worker thread: one running, one ready to start
FETCH_THREADS = 4  # results fetched side by side


class SchedulerLost(LstmGradError):
    """A task handed to a Dask scheduler that was lost before the task's result came back (``lost``)."""


MAY_STILL_WRITE = "its worker may still write its output"


def lost(why: str) -> SchedulerLost:
    """A task lost with its scheduler, however that was seen: its Dask worker publishes its own output, and may
    still be running it, whatever the scheduler did, so every such message says so."""
    return SchedulerLost(f"{why}; {MAY_STILL_WRITE}")


class NotStarted(LstmGradError):
    """A task never handed out: the scheduler was lost first."""


def check_address(address: str) -> str:
    """The scheduler address to connect to (``host:port`` is ``tcp://host:port``, as Dask takes it); a malformed one,
    or one lstmgrad cannot reach a scheduler through, refused (InvalidOptionError) before connecting."""
    from distributed.comm import registry  # noqa: PLC0415 - the optional dask extra
    from distributed.comm.addressing import parse_address, parse_host_port  # noqa: PLC0415

    if not address.strip():
        raise InvalidOptionError(Message.format("{} takes the address of a Dask scheduler, as in tcp://host:8786; "
                                                "it was empty", Param("dask")))
    if "://" not in address:
        address = f"tcp://{address}"  # Dask's default protocol
    scheme, location = parse_address(address, strict=False)
    try:
        registry.get_backend(scheme)
    except ValueError:
        known = ", ".join(f"{name}://" for name in sorted(registry.backends) if name not in UNREACHABLE)
        raise InvalidOptionError(Message.format("{}: unknown protocol {}; use one of {}", Param("dask", address),
                                                repr(scheme), known)) from None
    why = _unreachable(scheme)
    if why is not None:
        raise InvalidOptionError(Message.format("{}: {}", Param("dask", address), why))
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
    return address


# Protocols Dask knows that lstmgrad cannot reach a scheduler through as it is (why: _unreachable).
UNREACHABLE = ("inproc",)


def _unreachable(scheme: str) -> str | None:
    """Why a scheduler cannot be reached over ``scheme`` from here, or None."""
    import importlib.util  # noqa: PLC0415

    if scheme == "inproc":
        return ("inproc:// reaches a scheduler inside the same Python process, and lstmgrad runs none; give the "
                "scheduler's tcp:// address")
    if scheme == "ucx" and importlib.util.find_spec("distributed_ucxx") is None:
        return "ucx:// needs the distributed-ucxx package, which is not installed here; give a tcp:// address"
    if scheme in ("tls", "wss"):
        import dask  # noqa: PLC0415

        if not dask.config.get("distributed.comm.tls.ca-file", None):
            return (f"{scheme}:// needs Dask's TLS settings (distributed.comm.tls.ca-file and the client's cert and "
                    "key in Dask's configuration), and none are set; set them, or give a tcp:// address")
    return None


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


def check_options(address: str) -> tuple[str, float]:
    """Everything about running on ``address`` that can be checked without connecting: the package, the address,
    ``LSTMGRAD_DASK_TIMEOUT``.  The address to connect to and the timeout in seconds; InvalidOptionError for a
    malformed one."""
    try:
        import distributed  # noqa: F401, PLC0415 - optional (the dask extra)
    except ImportError:
        raise LstmGradError(Message.format("{} needs the distributed package: pip install 'lstmgrad[dask]'",
                                           Param("dask"))) from None
    return check_address(address), connect_timeout()


@contextlib.contextmanager
def dask_executor(address: str) -> Iterator[DaskExecutor]:
    """A connected ``DaskExecutor``; the address and timeout are checked first, distributed's own log kept quiet
    (lstmgrad reports what goes wrong in its results).  Connecting takes at most the timeout (twice: the
    scheduler is asked who it is first, then the client registers), whatever answers, or does not."""
    address, timeout = check_options(address)
    with _quiet_logger("distributed"):
        _check_scheduler(address, timeout)
        client = _connected_client(address, timeout)
        executor = DaskExecutor(client, address, timeout)
        try:
            yield executor
        finally:
            executor.shutdown(wait=False)
            _in_thread(lambda: client.close(timeout=timeout), timeout + 1)  # a lost scheduler: nothing left to tell


def _check_scheduler(address: str, timeout: float) -> None:
    """Ask ``address`` who it is, within ``timeout`` seconds; LstmGradError unless a Dask scheduler answers."""
    import asyncio  # noqa: PLC0415

    from distributed.comm import connect  # noqa: PLC0415 - optional (the dask extra)

    async def identity():
        comm = await asyncio.wait_for(connect(address, timeout=timeout), timeout)
        try:
            await asyncio.wait_for(comm.write({"op": "identity", "reply": True}), timeout)
            return await asyncio.wait_for(comm.read(), timeout)
        finally:
            comm.abort()

    unreachable = f"cannot reach the Dask scheduler at {address}"
    try:
        reply = asyncio.run(identity())
    except TimeoutError:
        raise LstmGradError(f"{unreachable}: it did not answer within {timeout:g} s ({TIMEOUT_VARIABLE}); is a Dask "
                            "scheduler listening there?") from None
    except OSError as err:
        raise LstmGradError(f"{unreachable}: {' '.join(str(err).split()) or type(err).__name__}") from None
    except Exception as err:  # noqa: BLE001 - what answered does not speak Dask's protocol
        raise LstmGradError(f"{unreachable}: what answers there does not speak Dask's protocol (it sent what "
                            f"cannot be read: {type(err).__name__}); is it a Dask scheduler's address?") from None
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        what = reply.get("type") if isinstance(reply, dict) else type(reply).__name__
        raise LstmGradError(f"{unreachable}: what answers there is not a Dask scheduler ({what!s:.40})")


def _connected_client(address: str, timeout: float):
    """A distributed Client connected to ``address``, made within ``timeout`` seconds (its own wait for the
    scheduler's welcome has no end of its own)."""
    from distributed import Client  # noqa: PLC0415 - optional (the dask extra)

    made: list = []

    def connect() -> None:
        try:
            made.append(Client(address, timeout=timeout, set_as_default=False))
        except BaseException as err:  # noqa: BLE001 - raised below, in the caller's thread
            made.append(err)

    if not _in_thread(connect, timeout + 1):
        raise LstmGradError(f"cannot reach the Dask scheduler at {address}: it did not welcome a client within "
                            f"{timeout:g} s ({TIMEOUT_VARIABLE})")
    if isinstance(made[0], (OSError, TimeoutError)):
        raise LstmGradError(f"cannot reach the Dask scheduler at {address}: {made[0]}")
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _in_thread(work, seconds: float) -> bool:
    """Run ``work`` in a daemon thread and wait at most ``seconds`` (where a stop signal interrupts the wait);
    whether it finished (if not, it is left to end with the process)."""
    thread = threading.Thread(target=work, name="lstmgrad-dask-connect", daemon=True)
    thread.start()
    with interrupts.interruptible():
        thread.join(seconds)
    return not thread.is_alive()


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

    def __init__(self, client, address: str = "", timeout: float | None = None):
        self._client = client
        self._address = address or str(getattr(client, "scheduler", ""))
        self._lock = threading.Lock()
        self._waiting: collections.deque = collections.deque()  # (future, fn, args, kwargs) not handed out
        self._handed_out = 0
        self._handed: dict = {}  # the Dask future of each task handed out -> ours
        self._threads = 1
        self._threads_checked = -float("inf")
        self._lost = False
        self._shutdown = False
        self._fetchers = cf.ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="lstmgrad-dask-fetch")
        self._timeout = timeout
        self._watched = threading.Event()  # set: the watch ends
        if timeout is not None:
            threading.Thread(target=self._watch, name="lstmgrad-dask-watch", daemon=True).start()

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
        self._watched.set()
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
                self._handed[task] = future
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
            self._handed.pop(task, None)
        self._hand_out()
        try:
            self._fetchers.submit(self._fetch, future, task)
        except RuntimeError:  # shut down meanwhile: fetch it here
            self._fetch(future, task)

    def _watch(self) -> None:
        """While tasks are handed out, ask the scheduler every second how many workers it has; when it has had none,
        or has not answered, for the timeout, no result will come: every task still out, or waiting here, ends
        (``SchedulerLost``, ``NotStarted``), so that no wait of the batch outlasts the timeout."""
        last_seen = time.monotonic()  # when the cluster last had a worker (or nothing was out)
        while not self._watched.wait(SLOTS_REFRESH_SECONDS):
            if self._lost or not self._handed:
                last_seen = time.monotonic()
                continue
            workers = self._workers()
            if workers:
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > self._timeout:
                why = ("has had no worker" if workers == 0 else "has not answered") + \
                    f" for {self._timeout:g} s ({TIMEOUT_VARIABLE})"
                self._give_up(why)
                return

    def _workers(self) -> int | None:
        """How many workers the scheduler has now (None: it did not answer within the timeout)."""
        try:
            info = self._client.sync(self._client.scheduler.identity, n_workers=-1, callback_timeout=self._timeout)
        except Exception:  # noqa: BLE001 - unreachable, timed out, closed
            return None
        return len(info.get("workers") or {}) if isinstance(info, dict) else None

    def _give_up(self, why: str) -> None:
        """End every task handed out (``SchedulerLost``: its worker, if any, may still write) and every one waiting."""
        self._lost = True
        with self._lock:
            handed, self._handed = dict(self._handed), {}
        for task, future in handed.items():
            with contextlib.suppress(Exception):
                task.release()
            if not future.done():
                with contextlib.suppress(cf.InvalidStateError):
                    future.set_exception(lost(f"no result: the Dask scheduler at {self._address} {why}"))
        self._hand_out()

    def _fetch(self, future: cf.Future, task) -> None:
        """Pass a finished Dask future's outcome to ours (unless the watch gave up on it: ``_give_up``)."""
        if future.done():
            return
        if task.status == "cancelled":
            self._lost = True
            future.set_exception(lost(f"lost with the Dask scheduler at {self._address}"))
        else:
            try:
                future.set_result(task.result())
            except cf.CancelledError:  # lost while fetching the result
                self._lost = True
                future.set_exception(lost(f"lost with the Dask scheduler at {self._address}"))
            except OSError as err:  # the connection to its worker dropped while fetching the result
                reason = " ".join(str(err).split()) or type(err).__name__
                future.set_exception(lost(f"its result could not be fetched from its worker ({reason})"))
            except BaseException as err:  # noqa: BLE001 - the task's error (KilledWorker, ...) is its outcome
                future.set_exception(err)
        if self._lost:
            self._hand_out()  # what still waits here will never start: say so now
