"""The cupy backend's kernels built for the host: the very text cupy compiles for a GPU (``_cupy_kernels.source``),
compiled here by the C compiler with ``-ffp-contract=off`` and run through ctypes, one element after another.

``HostLauncher`` runs them for ``CupyGradient``/``CupyBackend`` as the device launcher does (a loop kernel's blocks
take their turns at each step's phases), and ``cupy_backend()`` is the whole cupy backend on the host: its kernels
so built, and for the cupy module numpy with only the functions cupy has too (``CUPY_COMMON``).  The suite runs
the backend's own code, arithmetic and argument lists included, on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sysconfig
import tempfile
import types
from pathlib import Path

import numpy as np

from lstmgrad_cli.backends import _cupy_kernels as kernels

_C_TYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int}


def compiler() -> str | None:
    """The C compiler Python was built with (or cc, gcc), when one is on this machine."""
    configured = (sysconfig.get_config_var("CC") or "").split()
    for candidate in (configured[:1] or []) + ["cc", "gcc", "clang"]:
        if shutil.which(candidate):
            return candidate
    return None


def compile_host(directory: Path) -> Path:
    """``_cupy_kernels.source()`` built as a shared library in ``directory``; CalledProcessError with the compiler's
    messages when it does not build."""
    cc = compiler()
    assert cc is not None, "no C compiler"
    src = directory / "lstmgrad_kernels.c"
    src.write_text(kernels.source())
    lib = directory / "lstmgrad_kernels.so"
    subprocess.run([cc, *kernels.HOST_OPTIONS, "-fPIC", "-shared", "-Wall", "-Werror", str(src), "-o", str(lib)],
                   check=True, capture_output=True, text=True)
    return lib


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels built once per test session (in a temporary folder removed at exit)."""
    directory = Path(tempfile.mkdtemp(prefix="lstmgrad-host-kernels-"))
    try:
        return ctypes.CDLL(str(compile_host(directory)))
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # (the loaded library stays mapped)


class HostLauncher:
    """Runs the kernels of the host build as ``CupyGradient`` launches them on a device: ``step`` one element after
    another, ``loop`` as ``blocks`` blocks taking their turns at each step's two phases (the device's grid barrier
    between them).  Appends each kernel's name to ``calls``."""

    def __init__(self, calls: list | None = None, blocks: int = 3):
        self._lib = library()
        self.calls = [] if calls is None else calls
        self.blocks = blocks

    def step(self, name, n, params, args) -> None:
        assert int(args[0]) == n
        self._call(name, name, params, args)

    def loop(self, name, columns, params, args) -> None:
        blocks = max(1, min(self.blocks, columns))
        self._call(name, f"{name}_host", (*params, ("int", "blocks")), (*args, blocks))

    def _call(self, name, symbol, params, args) -> None:
        function = getattr(self._lib, symbol)
        function.restype = None
        function.argtypes = [_C_TYPES.get(ctype, ctypes.c_void_p) for ctype, _ in params]
        values = []
        for (ctype, pname), value in zip(params, args, strict=True):
            if ctype in _C_TYPES:
                values.append(int(value))
                continue
            assert isinstance(value, np.ndarray) and value.flags.c_contiguous, pname
            assert value.dtype.itemsize == {"f16": 2, "f32": 4, "f64": 8}[name.rsplit("_", 1)[1]], pname
            assert ctype.startswith("const") or value.flags.writeable, pname
            values.append(value.ctypes.data)
        function(*values)
        self.calls.append(name)


# The array-module functions the shared code may use: all of them exist in cupy with numpy's meaning.
CUPY_COMMON = ("zeros", "empty", "add", "subtract", "multiply", "matmul", "ascontiguousarray")


def fake_cupy(available: bool = True, free_bytes: int = 2**40, copies: list | None = None):
    """numpy as the cupy module: only ``CUPY_COMMON``, copies for ``asarray``/``asnumpy`` (to and from "the
    device", each appended to ``copies``), and a device with ``free_bytes`` of free memory."""
    fake = types.SimpleNamespace(**{name: getattr(np, name) for name in CUPY_COMMON})
    fake.__version__ = "0.0-host"
    fake.is_available = lambda: available
    copies = [] if copies is None else copies

    def copy(direction):
        def to(a):
            copies.append(direction)
            return np.array(a, copy=True)
        return to

    fake.asarray, fake.asnumpy = copy("in"), copy("out")
    device = types.SimpleNamespace(mem_info=(free_bytes, 2 * free_bytes))
    fake.cuda = types.SimpleNamespace(Device=lambda: device)
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_bytes=lambda: 0)
    return fake


def cupy_backend(calls: list | None = None, loop: str = "steps", blocks: int = 3, **device):
    """The cupy backend run on the host with its own kernels (``HostLauncher``), its time loop a chunk's steps
    one by one or the persistent loop kernel in ``blocks`` blocks; ``device``: ``fake_cupy``'s."""
    from lstmgrad_cli.backends._cupy import CupyBackend

    return CupyBackend(cp=fake_cupy(**device), launcher=HostLauncher(calls, blocks), loop=loop)
