"""From what size a host pass runs its time loop beside its chunk products on this machine: measured once, cached.

A pass cut into the overlapped schedule's chunks (``_xp.OVERLAP_MIN_FLOPS``: decided by the shape alone, so the
result never depends on the machine) can run those chunks two ways, with the same bits: in sequence, every product
on the library's threads, or overlapped (``XpGradient._run_overlapped``), the time loop on this thread while a
second one does the chunk products, one BLAS thread each.  Which is faster depends on the machine: on the Intel AVX2
machine the overlap was tuned on it paid from ~2e8 flops; on an AMD EPYC VM (AVX-512, 2 vCPUs, ~190 GFLOP/s) it
lost 60% at 8e8 flops (7.0 ms in sequence, 11.4 ms overlapped: the second thread often waits for a core the
scheduler gives it late), tied at 1.3e10 and won 4-12% from 2.7e10.

So ``measure`` times both schedules on the numpy backend, alternating, at a ladder of sizes (``RUNGS``, smallest
first, 1-2 s in all on that VM), in a new interpreter (``measure_fresh``: a process that had just timed MKL for
the BLAS choice ran the sequential schedule 20-35% slower at the small rungs, even after a pause, and took the
overlap from 1.1e9 flops where a fresh one took it from 4.3e9).  The threshold is the smallest rung where the
overlap is at least ``MARGIN`` faster and is so again at the next rung (past the largest rung when there is none
such): one win alone, at a size where the two schedules tie, was often the VM's noise (the same VM a session
later: 16 steps won once by 8% and tied otherwise; 64 steps and more won by 4-18% in every measurement).  It is
cached beside the BLAS choice (``blas_calibration.cache_dir()``) under the processor, the cores, the library the
products go through, numpy's version and this way of measuring (``METHOD``): any change measures again.
``lstmgrad backends --check`` measures ahead.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import blas_calibration, cpu_blas

CACHE_FILE = "overlap-threshold.json"
OVERLAP_ENV = "LSTMGRAD_OVERLAP"  # auto (the measured threshold), on (every chunked pass) or off
MARGIN = 1.03  # the overlap must take less than 1 / MARGIN of the sequential time
# Passes timed, smallest first: T steps of B, I, C = 32, 256, 256 (6.7e7 flops a step).
RUNGS = (16, 32, 64, 128, 256)
ROUNDS = 5  # timed passes of each schedule at a rung (after one untimed)
CHILD_TIMEOUT = 120.0  # seconds the interpreter measuring may take (else it is measured in this process)
# A pause before it starts: worker threads this process left spinning (the BLAS calibration's MKL passes: OpenMP's
# spin up to 0.2 s) take the cores from the sequential schedule's two BLAS threads (once 37x slower at 16 steps).
SETTLE_SECONDS = 0.5
METHOD = 2  # the ladder, the rounds and the rule: a cached threshold measured otherwise is measured again
RUNG_SHAPE = (32, 256, 256)  # B, I, C
BEYOND = 4  # none overlapped faster: the threshold is this many times the largest rung's flops


@dataclass(frozen=True)
class Threshold:
    """Passes of at least ``flops`` run overlapped (on two cores or more); ``why``, in words."""

    flops: float
    why: str


def flops(T: int, B: int, I: int, C: int) -> int:  # noqa: E741
    """A backward pass's matrix-product flops."""
    return 16 * T * B * C * (I + C)


def overlaps(pass_flops: float) -> bool:
    """Whether a pass of ``pass_flops`` (cut into the overlapped schedule's chunks) runs overlapped here: with two
    cores or more for it (the ones this process may use, and as many threads for the library: a worker of a
    batch gets one) and from this machine's threshold (``threshold``, measured once).  ``LSTMGRAD_OVERLAP=on``
    overlaps every one, ``off`` none, without measuring."""
    setting = setting_of_env()
    if setting != "auto":
        return setting == "on"
    if cpu_blas.usable_cores() < 2 or cpu_blas.threads() < 2:
        return False
    return pass_flops >= threshold(cpu_blas.usable_cores()).flops


def setting_of_env() -> str:
    """``LSTMGRAD_OVERLAP``: "auto" (unset, or not one of the three: warned of), "on" or "off"."""
    import warnings  # noqa: PLC0415

    value = os.environ.get(OVERLAP_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        warnings.warn(f"{OVERLAP_ENV}={value!r} is not one of auto, on, off; using auto", stacklevel=3)
        return "auto"
    return value


def describe() -> str:
    """The schedule of this process's host passes, in words (measuring the threshold if it is not known yet)."""
    setting = setting_of_env()
    if setting != "auto":
        return (f"{OVERLAP_ENV}={setting}: time loop beside the products in every pass of "
                f"{_chunked_from():.2g} flops or more" if setting == "on" else
                f"{OVERLAP_ENV}=off: time loop and products in sequence")
    if cpu_blas.usable_cores() < 2 or cpu_blas.threads() < 2:
        return (f"time loop and products in sequence ({cpu_blas.usable_cores()} core(s) usable, "
                f"{cpu_blas.threads()} BLAS thread(s))")
    return threshold(cpu_blas.usable_cores()).why


def _chunked_from() -> float:
    from ._xp import OVERLAP_MIN_FLOPS  # noqa: PLC0415

    return float(OVERLAP_MIN_FLOPS)


def key(cores: int) -> str:
    """What a cached threshold holds for: the processor, the cores, the library products go through, numpy, and the
    way it was measured."""
    return json.dumps({"processor": blas_calibration.processor(), "cores": cores, "blas": cpu_blas.describe(),
                       "numpy": np.__version__, "method": METHOD}, sort_keys=True)


def _won(times: dict[str, float]) -> bool:
    return times["overlapped"] * MARGIN < times["sequential"]


def measure(rungs=RUNGS, rounds: int = ROUNDS) -> dict[int, dict[str, float]]:
    """Median seconds of a pass of each rung's size, in sequence and overlapped, the two alternating after one
    untimed pass each; up the ladder until two rungs in a row where the overlap is ``MARGIN`` faster."""
    from ..spec import LAYOUT_V2, SeqTensors  # noqa: PLC0415
    from ._numpy import NumpyBackend  # noqa: PLC0415

    B, I, C = RUNG_SHAPE  # noqa: E741
    rng = np.random.default_rng(0)
    engines = {"sequential": NumpyBackend(overlap=False), "overlapped": NumpyBackend(overlap=True)}
    found = {}
    for T in rungs:
        shapes = dict(x=(T, B, I), cs_prev=(B, C), h_prev=(B, C), w=(I + C, 4 * C), wci=(C,), wcf=(C,), wco=(C,),
                      b=(4 * C,), i=(T, B, C), cs=(T, B, C), f=(T, B, C), o=(T, B, C), ci=(T, B, C),
                      co=(T, B, C), h=(T, B, C), cs_grad=(T, B, C), h_grad=(T, B, C))
        tensors = SeqTensors(**{n: rng.uniform(-1, 1, s).astype(np.float32) for n, s in shapes.items()})
        seconds = {name: [] for name in engines}
        for round_ in range(rounds + 1):
            for name, backend in (engines.items() if round_ % 2 else reversed(engines.items())):
                start = time.perf_counter()
                backend.block_lstm_grad(tensors, seq_len_max=T, use_peephole=False, layout=LAYOUT_V2,
                                        compute_dtype=np.dtype(np.float32))
                if round_:  # the first round warms up (threads, buffers): not counted
                    seconds[name].append(time.perf_counter() - start)
        found[T] = {name: statistics.median(times) for name, times in seconds.items()}
        if len(found) >= 2 and all(_won(found[r]) for r in list(found)[-2:]):
            break
    return found


def measure_fresh(rungs=RUNGS, rounds: int = ROUNDS, python: str = sys.executable) -> dict[int, dict[str, float]]:
    """``measure`` in a new interpreter (``python``, with this one's import path and environment, told to put the
    products on the library this process chose); in this process when that one fails."""
    env = {**os.environ, cpu_blas.BLAS_ENV: cpu_blas.library()}
    code = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
            "from lstmgrad_cli.backends import overlap_calibration as o; "
            "print(json.dumps(o.measure(tuple(json.loads(sys.argv[2])), int(sys.argv[3]))))")
    time.sleep(SETTLE_SECONDS)
    try:
        done = subprocess.run([python, "-c", code, json.dumps(sys.path), json.dumps(list(rungs)), str(rounds)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=True, env=env)
        found = json.loads(done.stdout.splitlines()[-1])
        return {int(T): {name: float(times[name]) for name in ("sequential", "overlapped")}
                for T, times in found.items()}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError, AttributeError):
        return measure(rungs, rounds)


def decide(seconds: dict[int, dict[str, float]]) -> float:
    """The threshold in flops from ``measure``'s seconds: the smallest rung the overlap won at, and at the next rung
    too (the largest rung: won there), else ``BEYOND`` times the largest rung's size."""
    B, I, C = RUNG_SHAPE  # noqa: E741
    rungs = sorted(seconds)
    for T, after in zip(rungs, [*rungs[1:], None], strict=True):
        if _won(seconds[T]) and (after is None or _won(seconds[after])):
            return float(flops(T, B, I, C))
    return float(BEYOND * flops(max(seconds), B, I, C))


_known: dict[tuple, Threshold] = {}  # this process's thresholds (the machine does not change under it)


def threshold(cores: int, measure_now=measure_fresh) -> Threshold:
    """The cached threshold for this machine, else measured now (``measure_now``) and cached."""
    known = _known.get((cores, cpu_blas.describe(), blas_calibration.cache_dir()))
    if known is not None:
        return known
    entry_key = key(cores)
    entry = _cached(entry_key)
    origin = "cached"
    if entry is None:
        seconds = measure_now()
        entry = {"flops": decide(seconds), "measured": time.strftime("%Y-%m-%d"),
                 "seconds": {str(T): s for T, s in seconds.items()}}
        blas_calibration.store(entry_key, entry, CACHE_FILE)
        origin = "measured now"
    B, I, C = RUNG_SHAPE  # noqa: E741
    largest = max((int(T) for T in entry.get("seconds", {}) if str(T).isdigit()), default=0)
    found = ("faster here from that size" if entry["flops"] <= flops(largest, B, I, C) else
             f"faster here at no size measured, up to {flops(largest, B, I, C):.2g} flops: left to passes "
             f"{BEYOND}x larger")
    made = Threshold(entry["flops"], f"time loop beside the products from {entry['flops']:.2g} flops a pass ({found}: "
                                     f"{origin}, {entry.get('measured', 'undated')}; "
                                     f"{blas_calibration.cache_dir() / CACHE_FILE})")
    _known[(cores, cpu_blas.describe(), blas_calibration.cache_dir())] = made
    return made


def _cached(entry_key: str) -> dict | None:
    entry = blas_calibration.cached(entry_key, CACHE_FILE)
    if entry is not None and isinstance(entry.get("flops"), (int, float)) and entry["flops"] >= 0:
        return entry
    return None
