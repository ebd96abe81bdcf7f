"""Registry of compute backends.

Built-in backends are a small table of strings (module path, the libraries they need, an install
hint); third-party backends come from the entry-point group ``lstmgrad.backends``.  Nothing is
imported until a backend is used: availability is decided with ``importlib.util.find_spec``, so
``lstmgrad --help`` and ``lstmgrad backends`` never import numba or cupy.

A backend is an object meeting ``contract.Backend`` (``name``, ``version``, and ``block_lstm_grad`` with every
argument the ops pass); ``conformance.check`` says whether one does, and ``lstmgrad backends --check`` runs it on
every installed backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from functools import cache

from ..errors import BackendUnavailableError, InvalidArgumentError, UnknownBackendError

ENTRY_POINT_GROUP = "lstmgrad.backends"
ENV_VAR = "LSTMGRAD_BACKEND"
DEFAULT = "numpy"
AUTO_ORDER = ("cupy", "numba", "numpy")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    target: str  # "module:attribute" of a class or factory returning the backend object
    requires: tuple[str, ...] = ()  # importable top-level modules it needs
    hint: str = ""  # how to install what it needs
    source: str = "built-in"
    version: str | None = None  # a plugin's distribution version (built-ins: their library's)


BUILTIN = (
    BackendSpec("numpy", "lstmgrad_cli.backends._numpy:NumpyBackend", ("numpy",)),
    BackendSpec("numba", "lstmgrad_cli.backends._numba:NumbaBackend", ("numba",),
                "pip install 'lstmgrad[numba]'"),
    BackendSpec("cupy", "lstmgrad_cli.backends._cupy:CupyBackend", ("cupy",),
                "pip install 'lstmgrad[cuda]' (CUDA 13) or 'lstmgrad[cuda12]', and a CUDA GPU"),
)


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str  # why not, with the install hint; empty when available
    version: str | None  # version of the library it runs on, when installed
    source: str


BUILTIN_BY_NAME = {spec.name: spec for spec in BUILTIN}


@cache
def registry() -> dict[str, BackendSpec]:
    """Built-ins first, then entry points; a broken or clashing plugin is a warning, not a crash."""
    import importlib.metadata  # noqa: PLC0415 - scanning installed distributions costs tens of ms

    specs = dict(BUILTIN_BY_NAME)
    try:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as err:  # noqa: BLE001 - broken metadata must not break the tool
        warnings.warn(f"could not read the {ENTRY_POINT_GROUP} entry points: {err}", RuntimeWarning, stacklevel=2)
        return specs
    for ep in entry_points:
        if ep.name in specs:
            warnings.warn(f"backend plugin {ep.name!r} ({ep.value}) ignored: the name is taken by "
                          f"the {specs[ep.name].source} backend", RuntimeWarning, stacklevel=2)
            continue
        if ":" not in ep.value:
            warnings.warn(f"backend plugin {ep.name!r} ignored: its target {ep.value!r} is not "
                          "'module:attribute'", RuntimeWarning, stacklevel=2)
            continue
        dist = getattr(ep, "dist", None)
        dist_name, dist_version = getattr(dist, "name", None), getattr(dist, "version", None)
        specs[ep.name] = BackendSpec(ep.name, ep.value, source=f"plugin ({dist_name or ep.value})",
                                     version=dist_version)
    return specs


def refresh() -> None:
    """Forget the registry, loaded backends and what was found of the installed libraries (after installing a plugin
    or a library, and in tests)."""
    registry.cache_clear()
    _load.cache_clear()
    _probed.clear()
    _library_version.cache_clear()
    _auto_choice.cache_clear()
    _auto_note.cache_clear()


_DISTRIBUTIONS = {"cupy": ("cupy-cuda13x", "cupy-cuda12x")}  # what provides a module under another name (the extras')


@cache
def _library_version(module: str) -> str | None:
    """Version of the distribution that provides ``module`` (cupy comes as cupy-cuda13x, ...), once a process: read
    from the metadata of the distribution named like it or in ``_DISTRIBUTIONS`` (``cpu_blas.installed_version``,
    without importlib.metadata, whose imports cost ~40 ms), else found by importlib.metadata."""
    from . import cpu_blas  # noqa: PLC0415 - (numpy's and MKL's versions are read the same way)

    for distribution in (module, *_DISTRIBUTIONS.get(module, ())):
        found = cpu_blas.installed_version(distribution)
        if found is not None:
            return found
    import importlib.metadata  # noqa: PLC0415

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        pass
    for dist in importlib.metadata.packages_distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _missing(spec: BackendSpec) -> list[str]:
    return [m for m in spec.requires if importlib.util.find_spec(m) is None]


def _plugin_missing(spec: BackendSpec) -> str | None:
    """Why a plugin's module cannot be found (top-level package only: nothing is imported)."""
    module = spec.target.partition(":")[0]
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"plugin module {module!r} is not installed"


def status(name: str, probe_device: bool = True) -> BackendStatus:
    """Whether a backend can be used, without importing optional libraries.

    For cupy, ``probe_device`` asks a child process whether a CUDA device is usable.
    """
    spec = _spec(name)
    if spec.source != "built-in":
        why = _plugin_missing(spec)
        return BackendStatus(name, why is None, why or "", spec.version, spec.source)
    missing = _missing(spec)
    version = _library_version(spec.requires[0]) if spec.requires and not missing else None
    if missing:
        reason = f"needs {', '.join(missing)}" + (f": {spec.hint}" if spec.hint else "")
        return BackendStatus(name, False, reason, None, spec.source)
    if name == "cupy" and probe_device:
        why = _cuda_unusable()
        if why is not None:
            return BackendStatus(name, False, f"cupy is installed but no CUDA device is usable: {why}", version,
                                 spec.source)
    return BackendStatus(name, True, "", version, spec.source)


def statuses() -> list[BackendStatus]:
    return [status(name) for name in registry()]


# Whether cupy finds a device needs ``import cupy`` (slow, and it initialises CUDA), so the listing and
# ``auto`` ask a child process once; the backend itself checks again in-process when it loads.  The child prints
# why not: cupy's words for a missing or too old driver ("CUDA driver version is insufficient for CUDA runtime
# version"), or that there is no device.
_CUDA_CHECK = """
import sys
try:
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
except Exception as err:
    print(str(err).split(": ", 1)[-1] or type(err).__name__)
    sys.exit(3)
if count < 1:
    print("the driver finds no CUDA device")
    sys.exit(3)
print(count)
"""
CUDA_CHECK_TIMEOUT = 60.0


def _cuda_unusable() -> str | None:
    """Why cupy cannot use a CUDA device here (asked of a child process, unless Linux shows no NVIDIA driver at
    all), or None when it can."""
    return _cuda_probe()[1]


_probed: list[tuple[int, str | None]] = []  # this process's answer (``refresh`` forgets it)


def _cuda_probe(fresh: bool = False) -> tuple[int, str | None]:
    """(the CUDA devices cupy finds, why it can use none: None when it can): asked of a child process once a boot
    (``cuda_probe``), and kept for this process; ``fresh``: asked again, whatever was kept."""
    if not _probed or fresh:
        if no_nvidia_driver():
            answer = (0, "no NVIDIA driver is loaded (Linux shows no /proc/driver/nvidia)")
        else:
            answer = cuda_probe(_ask_child, probe_key(), fresh)
        _probed[:] = [answer]
    return _probed[0]


PROBE_FILE = "cuda-probe.json"  # beside the BLAS choice (blas_calibration.cache_dir)


def cuda_probe(ask, key: str | None, fresh: bool = False) -> tuple[int, str | None]:
    """What ``ask()`` says of cupy's devices ((count, why unusable or None), and whether that is an answer to keep:
    a timeout is not), kept under ``key`` (``probe_key``: this boot, its driver, cupy, CUDA_VISIBLE_DEVICES) so
    that later commands of the boot do not ask again: a child importing cupy costs ~1 s of every command that
    asks, ``--backend auto`` included.  ``key`` None: asked every time; ``fresh``: asked, and kept."""
    from . import blas_calibration  # noqa: PLC0415 - (its cache folder and files)

    if key is not None and not fresh:
        known = blas_calibration.cached(key, PROBE_FILE)
        if known is not None and isinstance(known.get("devices"), int) and isinstance(known.get("why"), str | None):
            return known["devices"], known["why"]
    devices, why, definite = ask()
    if key is not None and definite:
        blas_calibration.store(key, {"devices": devices, "why": why}, PROBE_FILE)
    return devices, why


def probe_key() -> str | None:
    """What a device probe's answer holds for: this boot (Linux's boot id), the NVIDIA driver loaded, the cupy
    installed (where, and when it was written), this interpreter and CUDA_VISIBLE_DEVICES; None where the boot
    cannot be told (then nothing is kept)."""
    import json  # noqa: PLC0415

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        spec = importlib.util.find_spec("cupy")
        cupy = None if spec is None or not spec.origin else [spec.origin, os.stat(spec.origin).st_mtime_ns]
    except (OSError, ValueError, ImportError):
        return None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            driver = f.readline().strip()
    except OSError:
        driver = "/dev/dxg" if os.path.exists("/dev/dxg") else None
    return json.dumps({"boot": boot, "driver": driver, "cupy": cupy, "python": sys.executable,
                       "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, sort_keys=True)


def _ask_child() -> tuple[int, str | None, bool]:
    """(devices, why unusable, whether to keep the answer): a child process imports cupy and counts them."""
    import subprocess  # noqa: PLC0415 - only when cupy is asked about (~4 ms of every command's start)

    try:
        proc = subprocess.run([sys.executable, "-c", _CUDA_CHECK], capture_output=True, text=True,
                              timeout=CUDA_CHECK_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return 0, f"asking cupy took over {CUDA_CHECK_TIMEOUT:.0f} s", False
    except (OSError, subprocess.SubprocessError) as err:
        return 0, f"cupy could not be asked ({err})", False
    if proc.returncode == 0:
        said = proc.stdout.split()
        return (int(said[-1]) if said and said[-1].isdigit() else 1), None, True
    said = " ".join(proc.stdout.split())[:300]
    return 0, said or f"cupy could not start (exit {proc.returncode})", proc.returncode == 3


def visible_devices() -> list[str]:
    """The CUDA devices a batch's local workers are spread over, one each in turn, as CUDA_VISIBLE_DEVICES names
    them: its own entries where it is set (an empty one: none), else 0, 1, ... for each device cupy finds here."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [entry.strip() for entry in given.split(",") if entry.strip()]
    return [str(k) for k in range(_cuda_probe()[0])]


def no_nvidia_driver() -> bool:
    """Whether this is Linux with no NVIDIA kernel driver loaded (nor WSL's GPU device): then no process here can
    use a CUDA device, and nothing needs to start one to find out (~1 s for a child importing cupy)."""
    if not sys.platform.startswith("linux"):
        return False
    return not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/dxg"))


def _spec(name: str) -> BackendSpec:
    if name in BUILTIN_BY_NAME:  # no need to scan the installed distributions for a built-in
        return BUILTIN_BY_NAME[name]
    specs = registry()
    if name not in specs:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join([*specs, 'auto'])}"
        )
    return specs[name]


def resolve_name(name: str | None = None) -> str:
    """``name`` > $LSTMGRAD_BACKEND > numpy; ``auto`` picks cupy, then numba, then numpy."""
    chosen = name or os.environ.get(ENV_VAR) or DEFAULT
    if chosen == "auto":
        return _auto_choice()
    _spec(chosen)
    return chosen


@cache
def _auto_choice() -> str:
    """The first of ``AUTO_ORDER`` usable here (built-ins: no plugin takes their names), asked once a process: a
    batch asks for every file."""
    return next((candidate for candidate in AUTO_ORDER if status(candidate).available), DEFAULT)


def auto_note(name: str | None = None) -> str | None:
    """What ``auto`` passed over (a backend installed but unusable here, such as cupy without a usable GPU) and
    took instead, in words; None when ``name`` does not resolve through ``auto`` or nothing was passed over."""
    if (name or os.environ.get(ENV_VAR) or DEFAULT) != "auto":
        return None
    return _auto_note()


@cache
def _auto_note() -> str | None:
    chosen = resolve_name("auto")
    passed = [status(c) for c in AUTO_ORDER[:AUTO_ORDER.index(chosen)]]
    unusable = [s for s in passed if s.version is not None and not s.available]  # installed, not usable
    if not unusable:
        return None
    return "; ".join(f"backend auto: {s.reason}; used {chosen}" for s in unusable)


# DLPack's device types of memory a CUDA kernel reads: kDLCUDA, kDLCUDAManaged.
_DLPACK_CUDA = (2, 13)


def on_gpu(value) -> bool:
    """Whether ``value`` is an array in GPU memory: a cupy array, or anything with ``__cuda_array_interface__`` or a
    DLPack CUDA device (a numba device array, a torch CUDA tensor), which the cupy backend takes without a copy."""
    try:
        if hasattr(value, "__cuda_array_interface__"):
            return True
        device = getattr(value, "__dlpack_device__", None)
        return device is not None and int(device()[0]) in _DLPACK_CUDA
    except Exception:  # noqa: BLE001 - torch refuses the interface for a tensor that requires grad
        return True if hasattr(value, "__dlpack__") and "cuda" in str(getattr(value, "device", "")) else False


def gpu_array(value):
    """A GPU array (``on_gpu``) as a cupy array over the same memory."""
    import cupy  # noqa: PLC0415 - only for arrays already on a GPU

    if isinstance(value, cupy.ndarray):
        return value
    if hasattr(value, "__dlpack__") and type(value).__module__ != "numpy":  # a host array is copied (asarray)
        return cupy.from_dlpack(value)
    return cupy.asarray(value)


def backend_for_arrays(arrays: dict, backend=None):
    """The backend object computing ``arrays``: ``backend`` (a name, an object, None for the default), or, for arrays
    on a GPU and no backend named, cupy; a backend that computes host arrays is refused for GPU arrays."""
    on_device = [name for name, a in arrays.items() if on_gpu(a)]
    if not on_device:
        return get_backend(backend)
    chosen = get_backend(backend if backend is not None else "cupy")
    if not takes_gpu_arrays(chosen):
        raise host_backend_refused(on_device[0], chosen)
    return chosen


def host_backend_refused(name: str, backend) -> InvalidArgumentError:
    """The error for a tensor on a GPU given to a backend that computes host arrays."""
    return InvalidArgumentError(f"{name} is on a GPU, and the {backend.name} backend computes host arrays: compute "
                                "with backend cupy, or copy the tensors to the host")


def placed(backend, arrays: dict) -> dict:
    """``arrays`` where ``backend`` computes: copied to its device for a GPU backend that can copy them there
    (``to_device``), else as they are (the host backends; arrays already on a device)."""
    to_device = getattr(backend, "to_device", None) if takes_gpu_arrays(backend) else None
    if to_device is None:
        return arrays
    return {name: a if a is None or on_gpu(a) else to_device(a) for name, a in arrays.items()}


def on_host(backend, values):
    """``values`` (a tuple of arrays, or a NamedTuple of them) as numpy arrays: each copied back from ``backend``'s
    device (``to_host``) where ``placed`` put it there."""
    to_host = getattr(backend, "to_host", None) if takes_gpu_arrays(backend) else None
    if to_host is None:
        return values
    return type(values)(*(to_host(a) if on_gpu(a) else a for a in values))


def takes_gpu_arrays(backend) -> bool:
    """Whether a backend object computes arrays that are on a GPU (the cupy backend; a plugin saying so with a
    ``gpu_arrays = True`` attribute)."""
    return bool(getattr(backend, "gpu_arrays", False))


def get_backend(backend=None):
    """A backend object from a name, an object (returned as is), or None for the default."""
    if backend is not None and not isinstance(backend, str):
        return backend
    name = resolve_name(backend)
    try:
        return _load(name)
    except BackendUnavailableError:
        if name != "cupy" or (backend or os.environ.get(ENV_VAR) or DEFAULT) != "auto" or no_nvidia_driver():
            raise
    # auto took cupy on what this boot's probe said, and cupy finds no device now: asked afresh, chosen again
    _cuda_probe(fresh=True)
    return _load(resolve_name(backend))


@cache
def _load(name: str):
    spec = _spec(name)
    missing = _missing(spec) if spec.source == "built-in" else []
    if missing:  # (the library version that status() also looks up is not needed here)
        raise BackendUnavailableError(f"backend {name!r} is not available: needs {', '.join(missing)}"
                                      + (f": {spec.hint}" if spec.hint else ""))
    if spec.source != "built-in" and _plugin_missing(spec):
        raise BackendUnavailableError(f"backend {name!r} is not available: {_plugin_missing(spec)}")
    module_name, _, attr = spec.target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
        return factory()
    except BackendUnavailableError:
        raise
    except Exception as err:  # noqa: BLE001 - a broken backend is reported, not a traceback
        hint = f" ({spec.hint})" if spec.hint else ""
        raise BackendUnavailableError(f"backend {name!r} failed to load: {err}{hint}") from err
