"""Registry of compute backends.

Built-in backends are a small table of strings (module path, the libraries they need, an install
hint); third-party backends come from the entry-point group ``lstmgrad.backends``.  Nothing is
imported until a backend is used: availability is decided with ``importlib.util.find_spec``, so
``lstmgrad --help`` and ``lstmgrad backends`` never import numba or cupy.

A backend is any object with a ``name``, a ``version`` and the method
``block_lstm_grad(tensors, *, seq_len_max, use_peephole, layout, compute_dtype, chunk_steps=None,
return_dgates=False)`` taking and returning host numpy arrays (see ``_numpy.NumpyBackend``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache

from ..errors import BackendUnavailableError, UnknownBackendError

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


@lru_cache(maxsize=None)
def registry() -> dict[str, BackendSpec]:
    """Built-ins first, then entry points; a broken or clashing plugin is a warning, not a crash."""
    specs = {spec.name: spec for spec in BUILTIN}
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
        dist = getattr(ep.dist, "name", None) if getattr(ep, "dist", None) else None
        specs[ep.name] = BackendSpec(ep.name, ep.value, source=f"plugin ({dist or ep.value})")
    return specs


def refresh() -> None:
    """Forget the registry and loaded backends (after installing a plugin, and in tests)."""
    registry.cache_clear()
    _load.cache_clear()


def _library_version(module: str) -> str | None:
    """Version of the distribution that provides ``module`` (cupy comes as cupy-cuda13x, ...)."""
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


def status(name: str) -> BackendStatus:
    """Whether a backend can be used, without importing optional libraries."""
    spec = _spec(name)
    missing = _missing(spec)
    version = _library_version(spec.requires[0]) if spec.requires and not missing else None
    if missing:
        reason = f"needs {', '.join(missing)}" + (f": {spec.hint}" if spec.hint else "")
        return BackendStatus(name, False, reason, None, spec.source)
    if name == "cupy" and not _cuda_usable():
        return BackendStatus(name, False, "cupy is installed but no CUDA device is usable", version, spec.source)
    return BackendStatus(name, True, "", version, spec.source)


def statuses() -> list[BackendStatus]:
    return [status(name) for name in registry()]


def _cuda_usable() -> bool:
    try:
        import cupy  # noqa: PLC0415 - only when asked about cupy

        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - any failure means not usable
        return False


def _spec(name: str) -> BackendSpec:
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
        for candidate in AUTO_ORDER:
            if candidate in registry() and status(candidate).available:
                return candidate
        return DEFAULT
    _spec(chosen)
    return chosen


def get_backend(backend=None):
    """A backend object from a name, an object (returned as is), or None for the default."""
    if backend is not None and not isinstance(backend, str):
        return backend
    return _load(resolve_name(backend))


@lru_cache(maxsize=None)
def _load(name: str):
    spec = _spec(name)
    state = status(name)
    if not state.available:
        raise BackendUnavailableError(f"backend {name!r} is not available: {state.reason}")
    module_name, _, attr = spec.target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
        return factory()
    except BackendUnavailableError:
        raise
    except Exception as err:  # noqa: BLE001 - a broken backend is reported, not a traceback
        hint = f" ({spec.hint})" if spec.hint else ""
        raise BackendUnavailableError(f"backend {name!r} failed to load: {err}{hint}") from err
