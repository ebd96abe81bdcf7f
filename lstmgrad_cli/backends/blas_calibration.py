"""Which BLAS runs a backward pass's products faster on this processor: measured once, then cached.

MKL is not faster everywhere: on the AMD EPYC (AVX-512) machine of issue 42 it took twice numpy's OpenBLAS's
time on the larger passes, while on an Intel AVX2 machine it was 1.1-1.55x faster.  So when both libraries are
installed and ``LSTMGRAD_BLAS`` is ``auto``, ``decide`` times both on a backward pass (``measure``: its per-step
products on the time loop's thread, its chunk products beside it, as a pass runs them), alternating them so a
busy machine slows both alike, and takes MKL only when it is at least ``MKL_MARGIN`` faster: numpy's OpenBLAS
is loaded anyway, MKL costs ~40 ms and ~1 GB of libraries to load.

The choice is cached in ``cache_dir()/blas-choice.json`` under the processor (model, vendor, the vector
extensions BLAS kernels dispatch on), both libraries' versions and this process's cores: any change measures
again.  The measurement takes about 0.5 s, once per machine (``lstmgrad backends --check`` does it ahead).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE_ENV = "LSTMGRAD_CACHE_DIR"
CACHE_FILE = "blas-choice.json"
SCHEMA = 1
MKL_MARGIN = 1.05  # MKL must take less than 1 / MKL_MARGIN of OpenBLAS's time
MOST_ENTRIES = 32  # machines (and library versions) one cache file remembers

# The pass timed on each library: a middle size (1.8 GFLOP), its products overlapped with the time loop (as large
# passes run: overlap_calibration), and the call pattern of every pass, per-step products included.
SHAPE = (48, 32, 192, 192)  # T, B, I, C
# Vector extensions BLAS libraries choose their kernels by (a new one on the machine measures again).
FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile",
         "asimd", "sve", "sve2")


@dataclass(frozen=True)
class Choice:
    """What ``decide`` chose: ``library`` "mkl" or "openblas", and why, in words."""

    library: str
    why: str


def cache_dir() -> Path:
    """``$LSTMGRAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/lstmgrad``, else ``~/.cache/lstmgrad``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lstmgrad"


def processor() -> dict:
    """The processor's model, vendor and the BLAS-relevant vector extensions it has (Linux's /proc/cpuinfo; the
    platform's words elsewhere: on Linux ``platform.processor()`` runs ``uname -p``, ~10 ms of every start)."""
    info = {"model": "", "vendor": "", "flags": []}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    info["model"] = value.strip()
                elif key == "vendor_id":
                    info["vendor"] = value.strip()
                elif key in ("flags", "Features"):
                    have = set(value.split())
                    info["flags"] = [flag for flag in FLAGS if flag in have]
                    break
    except OSError:
        pass
    if not info["model"]:
        import platform  # noqa: PLC0415

        info["model"] = platform.processor() or platform.machine()
    return info


def key(mkl_version: str, cores: int) -> str:
    """What a cached choice holds for: the processor, both libraries' versions, the cores."""
    return json.dumps({"processor": processor(), "mkl": mkl_version, "numpy": np.__version__,
                       "openblas": _openblas_version(), "cores": cores}, sort_keys=True)


def _openblas_version() -> str | None:
    try:
        return str(np.show_config(mode="dicts")["Build Dependencies"]["blas"].get("version"))
    except Exception:  # noqa: BLE001 - informational
        return None


def cached(entry_key: str, file: str = CACHE_FILE) -> dict | None:
    """The cached entry for ``entry_key`` in ``file`` (a choice of library: valid as one), or None (none, or an
    unreadable cache: measured again)."""
    try:
        entries = json.loads((cache_dir() / file).read_text())["entries"]
        entry = entries.get(entry_key) if isinstance(entries, dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(entry, dict):
        return None
    if file != CACHE_FILE or (entry.get("library") in ("mkl", "openblas") and isinstance(entry.get("seconds"), dict)):
        return entry
    return None


def store(entry_key: str, entry: dict, file: str = CACHE_FILE) -> None:
    """Add ``entry`` to the cache ``file`` (written whole to a temporary file, then renamed: concurrent processes
    each leave a whole file); a cache that cannot be written is left alone."""
    folder = cache_dir()
    path = folder / file
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())["entries"]
            entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError, KeyError, TypeError):
            entries = {}
        entries.pop(entry_key, None)
        entries[entry_key] = entry
        entries = dict(list(entries.items())[-MOST_ENTRIES:])
        temporary = folder / f".{file}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps({"schema": SCHEMA, "entries": entries}, indent=1))
        os.replace(temporary, path)
    except OSError:
        pass


def measure(libraries: dict, using, rounds: int = 3) -> dict[str, float]:
    """Each library's time for one backward pass of ``SHAPE`` on the numpy backend (the best of ``rounds``, the
    libraries alternating, after one untimed pass each), every product on it (``using(blas)``)."""
    from ..spec import LAYOUT_V2, SeqTensors  # noqa: PLC0415
    from ._numpy import NumpyBackend  # noqa: PLC0415

    T, B, I, C = SHAPE  # noqa: E741
    rng = np.random.default_rng(0)
    shapes = dict(x=(T, B, I), cs_prev=(B, C), h_prev=(B, C), w=(I + C, 4 * C), wci=(C,), wcf=(C,), wco=(C,),
                  b=(4 * C,), i=(T, B, C), cs=(T, B, C), f=(T, B, C), o=(T, B, C), ci=(T, B, C), co=(T, B, C),
                  h=(T, B, C), cs_grad=(T, B, C), h_grad=(T, B, C))
    tensors = SeqTensors(**{name: rng.uniform(-1, 1, shape).astype(np.float32) for name, shape in shapes.items()})
    backend = NumpyBackend(overlap=True)  # (set: the overlap's own threshold is measured on the chosen library)
    best = dict.fromkeys(libraries, float("inf"))
    for round_ in range(rounds + 1):
        for name, blas in libraries.items():
            with using(blas):
                start = time.perf_counter()
                backend.block_lstm_grad(tensors, seq_len_max=T, use_peephole=False, layout=LAYOUT_V2,
                                        compute_dtype=np.dtype(np.float32))
                seconds = time.perf_counter() - start
            if round_:  # the first round warms each library up (threads, buffers, kernels): not counted
                best[name] = min(best[name], seconds)
    return best


def decide(entry_key: str, measure_now, known: dict | None = None) -> Choice:
    """MKL or numpy's OpenBLAS for ``entry_key``: ``known`` (what ``cached`` gave), else ``measure_now()`` (seconds
    by library name), cached."""
    entry = known
    origin = "cached"
    if entry is None:
        seconds = measure_now()
        library = "mkl" if seconds["mkl"] * MKL_MARGIN < seconds["openblas"] else "openblas"
        entry = {"library": library, "seconds": seconds, "measured": time.strftime("%Y-%m-%d")}
        store(entry_key, entry)
        origin = "measured now"
    seconds = entry["seconds"]
    ratio = seconds["openblas"] / seconds["mkl"] if entry["library"] == "mkl" else seconds["mkl"] / seconds["openblas"]
    other = "numpy's OpenBLAS" if entry["library"] == "mkl" else "MKL"
    why = (f"{ratio:.2f}x faster than {other} on this processor for a backward pass ({origin}, "
           f"{entry.get('measured', 'undated')}; {cache_dir() / CACHE_FILE})" if ratio >= 1 else
           f"MKL is no more than {MKL_MARGIN:.2f}x faster here ({ratio:.2f}x), and numpy's OpenBLAS costs nothing "
           f"to load ({origin}, {entry.get('measured', 'undated')}; {cache_dir() / CACHE_FILE})")
    return Choice(entry["library"], why)
