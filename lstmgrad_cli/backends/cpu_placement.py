"""The overlapped schedule's two threads held on different CPUs for the pass (Linux).

The overlapped schedule (``_xp.XpGradient._run_overlapped``) runs a pass on two threads that hand work to each other
many times (Python's GIL, the schedule's condition).  Linux wakes a thread on its waker's CPU when the CPU it last
ran on does not look free, and on a virtual machine a vCPU idle for a while does not (its host has descheduled it).
After a pause the two threads then share one CPU, and go on sharing it while the other vCPU stays idle.  On a
2-vCPU AMD EPYC VM (benchmarks/RESULTS.md, fifteenth session), two threads of fixed work started after a 0.3 s pause
shared one CPU in 10-11 of every 12 slices and took 17-19 ms, against 11-13 ms held on different CPUs; an
overlapped pass at 50,32,128,128 took 11-13 ms after a pause against 6 ms back to back, and 7.6-9.1 ms held apart.

So for the pass the calling thread is held on the CPU it is on, and the worker on the others (not that CPU's SMT
siblings, where others remain); the caller's CPUs are given back after, and a thread the pass starts meanwhile
(an input's read-ahead) takes the caller's CPUs from before.  One pass of the process at a time holds its threads
(``claim``): two at once on other threads (a Dask worker's, say) could be held on one CPU where Linux would spread
them.  Where that cannot be done (one CPU allowed, not Linux, the call refused) nothing is held and the pass runs as
before.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import NamedTuple


class Placement(NamedTuple):
    """CPUs for one overlapped pass: ``allowed``, the calling thread's before it (given back after); ``caller``
    and ``worker``, disjoint subsets of it."""

    allowed: frozenset[int]
    caller: frozenset[int]
    worker: frozenset[int]


def split(cpus, here: int, siblings=frozenset()) -> Placement | None:
    """The caller on ``here``, the worker on the rest of ``cpus`` less ``here``'s ``siblings`` (unless that leaves
    none); None where ``here`` is not one of ``cpus`` or it is the only one."""
    cpus = frozenset(cpus)
    if here not in cpus or len(cpus) < 2:
        return None
    others = cpus - {here}
    return Placement(cpus, frozenset({here}), (others - frozenset(siblings)) or others)


def allowed() -> frozenset[int] | None:
    """The CPUs the calling thread may use; None where that is not known."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux, or refused
        return None


def for_this_thread() -> Placement | None:
    """``split`` of the calling thread's CPUs, at the one it runs on now; None where that is not known."""
    cpus, here = allowed(), _current_cpu()
    return None if cpus is None or here is None else split(cpus, here, _siblings(here))


_claim = threading.Lock()
_claimed = False  # a pass holds its threads now


def claim() -> Placement | None:
    """``for_this_thread()`` for an overlapped pass, or None where another pass of this process holds its threads
    now; ``release`` it on the same thread."""
    global _claimed
    with _claim:
        if _claimed:
            return None
        placement = for_this_thread()
        _claimed = placement is not None
        return placement


def release(placement: Placement) -> None:
    """Give the calling thread its CPUs from before (``placement.allowed``), and another pass the claim."""
    global _claimed
    hold(placement.allowed)
    with _claim:
        _claimed = False


def hold(cpus) -> bool:
    """Keep the calling thread on ``cpus`` (it moves there at once); False where that is refused."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError, ValueError):
        return False
    return True


@functools.cache
def _sched_getcpu():
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


def _current_cpu() -> int | None:
    getcpu = _sched_getcpu()
    cpu = getcpu() if getcpu is not None else -1
    return cpu if cpu >= 0 else None


@functools.cache
def _siblings(cpu: int) -> frozenset[int]:
    """The CPUs sharing ``cpu``'s core (SMT), from sysfs ("0,32" or "0-1"); none where it cannot be read."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
        found = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            found.update(range(int(lo), int(hi or lo) + 1))
    except (OSError, ValueError):
        return frozenset()
    return frozenset(found)
