"""Where a stop signal (Ctrl-C's SIGINT, SIGTERM) may interrupt the code it lands in.

Python's own handler raises KeyboardInterrupt wherever the main thread is when a signal comes: between the
creation of a temporary file and the code that would remove it, between an output's rename and the line that
records it, inside a ``__del__`` (where Python drops it with an "Exception ignored" traceback, and the signal is
lost).  The command line and its local worker processes handle the stop signals with ``catch`` instead, which
raises KeyboardInterrupt only where that is safe:

* inside an ``interruptible()`` block (a file being computed, a wait for other processes, printing), and not
  once it has ``commit()``-ed (a file whose output is handed over to be put in place: it finishes instead);
* never inside a ``held()`` block (a few lines that must run whole, such as creating a temporary file and
  recording it), whose end raises it instead, nor in a ``deferred()`` one (a batch's bookkeeping between files);
* never in the middle of an import (a module cut short stays half made).

Elsewhere a signal is only recorded: the code acts on it at its next boundary (``requested``, a batch's
``stop()``), and a block that becomes interruptible raises it as it begins.  A KeyboardInterrupt that Python
dropped all the same (in a ``__del__``) is not printed, and is delivered again to the code that follows.

Without ``catch`` (lstmgrad used as a library) the blocks change nothing and signals are Python's business.
The state is that of the main thread (the one signal handlers run in); blocks entered in another thread (a
Dask worker's, the publishing thread) are that thread's own and never raise anything.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Regions(threading.local):
    """The blocks open in this thread: for each, whether a signal may raise KeyboardInterrupt in it."""

    def __init__(self) -> None:
        self.stack: list[bool] = []
        self.kinds: list[str] = []


class _Received:
    """The stop signals this process has got since ``catch``, and how many of them were acted on (raised as a
    KeyboardInterrupt, or taken by ``requested``/``take``)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.acted = 0
        self.catching = False
        self.redelivering = False
        self.acted_before_raise = 0
        self.on_signal: Callable[[int], None] | None = None
        self.previous_hook = None  # sys.unraisablehook before catch


_regions = _Regions()
_received = _Received()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raising_here() -> bool:
    return _in_main_thread() and bool(_regions.stack) and _regions.stack[-1]


def pending() -> bool:
    """Whether a stop signal has come that nothing has acted on yet."""
    return len(_received.signals) > _received.acted


def received() -> list[int]:
    """The stop signals got since ``catch`` (in order)."""
    return list(_received.signals)


def requested() -> bool:
    """Whether a stop signal has come since ``catch``; the ones so far count as acted on (the caller stops)."""
    take()
    return bool(_received.signals)


def take() -> None:
    """The stop signals so far are acted on: a block that becomes interruptible no longer raises for them."""
    _received.acted = len(_received.signals)


def _raise_now() -> None:
    _received.acted_before_raise = _received.acted
    take()
    raise KeyboardInterrupt


def _raise_if_pending() -> None:
    if pending() and _raising_here() and _received.catching:
        _raise_now()


class _Block:
    """A block in which signals raise (``raising``) or wait."""

    __slots__ = ("kind", "raising", "new_only", "depth")

    def __init__(self, kind: str, raising: bool, new_only: bool = False) -> None:
        self.kind, self.raising, self.new_only = kind, raising, new_only

    def __enter__(self) -> None:
        stack, kinds = _regions.stack, _regions.kinds
        self.depth = depth = len(stack)
        try:
            if self.new_only:
                take()
            stack.append(False)
            kinds.append(self.kind)
            if self.raising:
                if not self.new_only and pending() and _received.catching and _in_main_thread():
                    _raise_now()  # signalled before it began: it is interrupted as it begins
                stack[-1] = True  # the last step (no call follows: a handler cannot run before the block begins)
        except BaseException:
            del stack[depth:]  # not begun, so not to be ended either
            del kinds[depth:]
            raise

    def __exit__(self, *exc) -> None:
        del _regions.stack[self.depth:]
        del _regions.kinds[self.depth:]
        if exc[0] is None or not issubclass(exc[0], KeyboardInterrupt):
            _raise_if_pending()  # one that waited for the block's end, where the enclosing block lets it raise


def interruptible(new_only: bool = False) -> _Block:
    """A block a stop signal interrupts (KeyboardInterrupt), also one that came before it began and was not acted
    on (the caller then has nothing to clean up); with ``new_only``, only one that comes once it has begun (the
    report of a batch that stopped on a signal: a second one interrupts it)."""
    return _Block("interruptible", True, new_only)


def deferred() -> _Block:
    """A block no stop signal interrupts: it is recorded for the code to act on (``requested``), or raised when
    the block ends into an interruptible one."""
    return _Block("deferred", False)


def held() -> _Block:
    """A few lines that must run whole (create a file and record it, hand an output over): a stop signal that
    comes meanwhile is raised when the block ends, where the enclosing block lets it."""
    return _Block("held", False)


def commit() -> None:
    """The innermost interruptible block is no longer interrupted: its work is handed over and must finish (an
    output given to be put in place, whose result must then be reported).  Its end raises no signal either."""
    stack = _regions.stack
    for position in range(len(stack) - 1, -1, -1):
        if _regions.kinds[position] == "interruptible":
            stack[position] = False
            return


def _handler(signum: int, frame) -> None:
    """The handler of the stop signals while ``catch`` is in effect."""
    if _received.redelivering:  # one Python dropped, delivered again (_dropped): counted already
        _received.redelivering = False
    else:
        _received.signals.append(signum)
        if _received.on_signal is not None:
            _received.on_signal(signum)
    if _raising_here():
        if not _importing(frame) and not _in_hook(frame):
            _raise_now()
        _redeliver(signum)  # once the import is done, or the hook (where it would be dropped) has returned


def _importing(frame) -> bool:
    """Whether the code at ``frame`` runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _in_hook(frame) -> bool:
    """Whether the code at ``frame`` runs inside ``_dropped`` (where a KeyboardInterrupt would be printed)."""
    while frame is not None:
        if frame.f_code is _dropped.__code__:
            return True
        frame = frame.f_back
    return False


def _dropped(unraisable) -> None:
    """``sys.unraisablehook`` meanwhile: a KeyboardInterrupt Python could not raise (a ``__del__``, a weakref
    callback) is not printed, and its signal is delivered again a moment later (``_redeliver``), to land in the
    code that follows."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        (_received.previous_hook or sys.__unraisablehook__)(unraisable)
        return
    if not _received.signals or not _in_main_thread():
        return
    _received.acted = _received.acted_before_raise  # not acted on after all
    _redeliver(_received.signals[-1])


REDELIVER_SECONDS = 0.02


def _redeliver(signum: int) -> None:
    """Deliver ``signum`` to the main thread again, from a thread of its own a moment from now (from the hook
    itself, the handler would run inside the hook, and its KeyboardInterrupt be dropped again)."""
    def deliver() -> None:
        if not pending():  # acted on meanwhile
            return
        _received.redelivering = True
        try:
            _thread.interrupt_main(signum)
        except (ValueError, RuntimeError, OverflowError):
            _received.redelivering = False

    timer = threading.Timer(REDELIVER_SECONDS, deliver)
    timer.daemon = True
    with contextlib.suppress(RuntimeError):  # no thread can start: it waits for the code's next boundary
        timer.start()


@contextlib.contextmanager
def caught(signals: Iterable[int] = STOP_SIGNALS, on_signal: Callable[[int], None] | None = None,
           restore: bool = True) -> Iterator[None]:
    """Meanwhile, ``signals`` (each one that is not ignored: a command started with SIGINT ignored keeps it so)
    raise KeyboardInterrupt only where this module says; ``on_signal(signum)`` is called first for each.
    ``restore``: the handlers are put back at the end (not for a process that ends there: a signal that comes as
    it ends is then recorded, not a traceback).  Only in the main thread; elsewhere it changes nothing."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _handler) for sig in signals if signal.getsignal(sig) != signal.SIG_IGN}
    saved = (_received.signals, _received.acted, _received.catching, _received.on_signal, _received.previous_hook)
    _received.signals, _received.acted, _received.catching, _received.on_signal = [], 0, True, on_signal
    _received.previous_hook = sys.unraisablehook
    sys.unraisablehook = _dropped
    try:
        yield
    finally:
        if restore:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sys.unraisablehook = _received.previous_hook
            (_received.signals, _received.acted, _received.catching, _received.on_signal,
             _received.previous_hook) = saved


_for_good: list = []  # catch's blocks, never ended


def catch(signals: Iterable[int] = STOP_SIGNALS, on_signal: Callable[[int], None] | None = None) -> None:
    """``caught`` for the rest of the process (a local worker)."""
    _regions.stack.clear()  # (a forked process starts with the blocks its parent's thread was in)
    _regions.kinds.clear()
    block = caught(signals, on_signal, restore=False)
    block.__enter__()
    _for_good.append(block)
