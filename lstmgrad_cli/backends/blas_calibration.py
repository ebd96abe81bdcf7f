"""Which BLAS runs a backward pass's products fastest on this processor: measured once, then cached.

No library is faster everywhere: on the AMD EPYC (AVX-512) machine of issue 42 MKL took twice numpy's OpenBLAS's
time on the larger passes, while on an Intel AVX2 machine it was 1.1-1.55x faster; on that AMD machine oneDNN's
``dnnl_sgemm`` ran the products 8-17% faster than OpenBLAS on one thread.  So when MKL or oneDNN is installed
beside numpy's OpenBLAS and ``LSTMGRAD_BLAS`` is ``auto``, ``decide`` times each on a backward pass
(``measure``: its per-step products on the time loop's thread, its chunk products beside it, as a pass runs
them), alternating them so a busy machine slows all alike, and takes the fastest, another library than numpy's
OpenBLAS only when it is at least ``MARGIN`` faster: numpy's OpenBLAS is loaded anyway, MKL costs ~40 ms and
~1 GB of libraries to load, oneDNN ~10 ms.

The choice is cached in ``cache_dir()/blas-choice.json`` under the processor (model, vendor, the vector
extensions BLAS kernels dispatch on), every installed library's version and this process's cores: any change
measures again.  The measurement takes about 0.5 s a library, once per machine (``lstmgrad backends --check``
does it ahead).
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
MARGIN = 1.05  # another library must take less than 1 / MARGIN of numpy's OpenBLAS's time
MOST_ENTRIES = 32  # machines (and library versions) one cache file remembers

# The pass timed on each library: a middle size (1.8 GFLOP), its products overlapped with the time loop (as large
# passes run: overlap_calibration), and the call pattern of every pass, per-step products included.
SHAPE = (48, 32, 192, 192)  # T, B, I, C
# Vector extensions BLAS libraries choose their kernels by (a new one on the machine measures again).
FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile",
         "asimd", "sve", "sve2")


@dataclass(frozen=True)
class Choice:
    """What ``decide`` chose: ``library`` "mkl", "onednn" or "openblas", and why, in words."""

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


def key(installed: dict, cores: int) -> str:
    """What a cached choice holds for: the processor, the versions of numpy's OpenBLAS and of the other libraries
    ``installed`` (name: version; "mkl", "onednn"), the cores."""
    return json.dumps({"processor": processor(), **installed, "numpy": np.__version__,
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
    seconds = entry.get("seconds")
    if file != CACHE_FILE or (isinstance(seconds, dict) and entry.get("library") in LABELS
                              and {entry["library"], "openblas"} <= seconds.keys()
                              and all(isinstance(v, (int, float)) and v > 0 for v in seconds.values())):
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


LABELS = {"openblas": "numpy's OpenBLAS", "mkl": "MKL", "onednn": "oneDNN"}


def fastest(seconds: dict) -> str:
    """The library of ``seconds`` (by name, "openblas" among them) a pass is fastest on, another than numpy's
    OpenBLAS only when it is at least ``MARGIN`` faster than it."""
    best = min((name for name in seconds if name != "openblas"), key=seconds.get, default="openblas")
    return best if seconds[best] * MARGIN < seconds["openblas"] else "openblas"


def decide(entry_key: str, measure_now, known: dict | None = None) -> Choice:
    """The library for ``entry_key``: ``known`` (what ``cached`` gave), else the ``fastest`` of ``measure_now()``
    (seconds by library name), cached."""
    entry = known
    origin = "cached"
    if entry is None:
        seconds = measure_now()
        entry = {"library": fastest(seconds), "seconds": seconds, "measured": time.strftime("%Y-%m-%d")}
        store(entry_key, entry)
        origin = "measured now"
    seconds, library = entry["seconds"], entry["library"]
    when = f"{origin}, {entry.get('measured', 'undated')}; {cache_dir() / CACHE_FILE}"
    others = sorted((name for name in seconds if name != library), key=seconds.get)
    if library != "openblas":
        runner_up = others[0]
        why = (f"{seconds[runner_up] / seconds[library]:.2f}x faster than {LABELS.get(runner_up, runner_up)} on this "
               f"processor for a backward pass ({when})")
    else:
        best = others[0]  # (a cached entry has another library: ``cached``)
        ratio = seconds["openblas"] / seconds[best]
        why = (f"{LABELS.get(best, best)} is no more than {MARGIN:.2f}x faster here ({ratio:.2f}x), and numpy's "
               f"OpenBLAS costs nothing to load ({when})" if ratio >= 1 else
               f"{1 / ratio:.2f}x faster than {LABELS.get(best, best)} on this processor for a backward pass ({when})")
    return Choice(library, why)
