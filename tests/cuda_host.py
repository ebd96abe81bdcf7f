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
    subprocess.run([cc, *kernels.HOST_OPTIONS, "-fPIC", "-shared", "-Wall", "-Werror", str(src), "-o", str(lib), "-lm"],
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

    def __init__(self, calls: list | None = None, blocks: int = 3, row_groups: int | None = None):
        self._lib = library()
        self.calls = [] if calls is None else calls
        self.blocks = blocks
        self.row_groups = row_groups  # None: as ``_cupy_kernels.loop_grid`` splits the step over ``blocks``

    def step(self, name, n, params, args) -> None:
        assert int(args[0]) == n
        self._call(name, name, params, args)

    def loop_grid(self, B, C, dtype):
        """As the device's launcher, for a device of ``blocks`` multiprocessors with ample shared memory; with
        ``row_groups`` set, that many groups of rows, the columns over the rest of the blocks."""
        return kernels.loop_grid(B, C, dtype, self.blocks, 2**40, self.row_groups)

    def loop(self, name, batch, columns, params, args, barrier) -> None:
        named = {pname: value for (_, pname), value in zip(params, args, strict=True)}
        grid = self.loop_grid(batch, columns, named["carried_h"].dtype)
        assert 1 <= grid.row_groups <= batch and grid.blocks // grid.row_groups <= columns
        assert isinstance(barrier, DeviceArray) and barrier.shape == (2,) and barrier.dtype == np.uint32
        self._call(name, f"{name}_host", (*params, ("int", "row_groups"), ("int", "blocks")),
                   (*args, grid.row_groups, grid.blocks))

    def _call(self, name, symbol, params, args) -> None:
        function = getattr(self._lib, symbol)
        function.restype = None
        function.argtypes = [_C_TYPES.get(ctype, ctypes.c_void_p) for ctype, _ in params]
        values = []
        for (ctype, pname), value in zip(params, args, strict=True):
            if ctype in _C_TYPES:
                values.append(int(value))
                continue
            assert isinstance(value, DeviceArray) and value.flags.c_contiguous, pname  # (never a host array)
            assert value.dtype.itemsize == {"f16": 2, "f32": 4, "f64": 8}[name.rsplit("_", 1)[1]], pname
            assert ctype.startswith("const") or value.flags.writeable, pname
            values.append(value.ctypes.data)
        function(*values)
        self.calls.append(name)


# The array-module functions the shared code may use: all of them exist in cupy with numpy's meaning.
CUPY_COMMON = ("zeros", "empty", "add", "subtract", "multiply", "matmul", "ascontiguousarray", "asarray", "ndarray",
               # ... and those the layer engine and the forward op use (layers/, ops/forward.py)
               "zeros_like", "ones_like", "arange", "concatenate", "where", "maximum", "minimum", "clip", "tanh",
               "exp", "abs", "swapaxes")


class Stream:
    """A copy stream of the stand-in device: the copies given it (``DeviceArray.set``/``get`` with ``stream=``) run
    only when an event recorded after them, or the stream, is synchronised, as a GPU's may run any time until then:
    a host buffer reused before its copy is done shows in the copied data.  ``eager`` (a class made by
    ``fake_cupy(eager_copies=True)``): each copy runs as it is given instead, as early as a GPU may run it (what it
    waits for has run: ``wait_event`` runs that at once), so a buffer still to be read that it overwrites shows."""

    eager = False

    def __init__(self, non_blocking=False):
        self.pending: list = []
        self.done = 0  # copies run so far

    def record(self):
        return Event(self, self.done + len(self.pending))

    def run_until(self, count: int) -> None:
        while self.done < count:
            self.pending.pop(0)()
            self.done += 1

    def synchronize(self) -> None:
        self.run_until(self.done + len(self.pending))

    def wait_event(self, event) -> None:
        event.synchronize()  # (what this stream runs later runs after it anyway)


class Event:
    def __init__(self, stream: Stream, count: int):
        self.stream, self.count = stream, count

    def synchronize(self) -> None:
        self.stream.run_until(self.count)


class DeviceArray(np.ndarray):
    """An array in the stand-in device's memory: numpy's, marked so that ``asarray`` takes it without a copy and
    ``asnumpy`` copies it back (as cupy does with its arrays).  ``host_operands`` (a list, on the class made by
    ``fake_cupy(strict=...)``): where a ufunc is given a host array beside a device one (cupy refuses those), the
    ufunc's name is appended.  ``set`` and ``get`` copy from and to host arrays as cupy's do, on a ``Stream`` when
    given one (``copied`` records them)."""

    host_operands = None
    copied = None

    def set(self, arr, stream=None):
        assert type(arr) is np.ndarray and arr.shape == self.shape and arr.dtype == self.dtype
        self._record("in", arr)
        self._on(stream, lambda: np.copyto(self.view(np.ndarray), arr))

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            out = np.empty(self.shape, self.dtype)
        assert type(out) is np.ndarray and out.shape == self.shape and out.dtype == self.dtype
        self._record("out", out)
        self._on(stream, lambda: np.copyto(out, self.view(np.ndarray)))
        if blocking and stream is not None:
            stream.synchronize()
        return out

    def _record(self, way, arr):
        if self.copied is not None:
            self.copied.append((way, arr.dtype, arr.shape))

    @staticmethod
    def _on(stream, copy):
        if stream is None:
            copy()
        else:
            stream.pending.append(copy)
            if stream.eager:
                stream.synchronize()

    def __setitem__(self, index, value):
        if self.host_operands is not None and type(value) is np.ndarray and value.ndim:
            self.host_operands.append("__setitem__")  # (cupy takes no host array there either)
        super().__setitem__(index, value)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if self.host_operands is not None and any(
                type(a) is np.ndarray and a.ndim for a in (*inputs, *kwargs.get("out", ()))):
            self.host_operands.append(ufunc.__name__)
        plain = [a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in kwargs["out"])
        result = getattr(ufunc, method)(*plain, **kwargs)
        return _on_device(result, type(self))


def _on_device(value, kind=DeviceArray):
    """A numpy result as the stand-in device's array (tuples of them too); scalars as they are."""
    if isinstance(value, tuple):
        return tuple(_on_device(v, kind) for v in value)
    return value.view(kind) if isinstance(value, np.ndarray) else value


def fake_cupy(available: bool = True, free_bytes: int = 2**40, copies: list | None = None,
              copied: list | None = None, host_operands: list | None = None, eager_copies: bool = False,
              queued_current: bool = False):
    """numpy as the cupy module: only ``CUPY_COMMON``, each returning the stand-in device's arrays
    (``DeviceArray``); ``asarray`` copies a host array to "the device" (appending "in" to ``copies``, and
    ("in", dtype, shape) to ``copied``) and takes a device array as it is; ``asnumpy`` copies a device array back
    ("out") and returns a host array as it is; a device with ``free_bytes`` of free memory.  ``host_operands``: a
    list receiving the name of every ufunc given a host array beside a device one (cupy raises there).
    ``eager_copies``: copy streams that run each copy as it is given (``Stream``); ``queued_current``: a current
    stream whose copies wait until they are waited for (as copy streams' do)."""
    copied = [] if copied is None else copied
    kind = type("DeviceArray", (DeviceArray,), {"host_operands": host_operands, "copied": copied})
    fake = types.SimpleNamespace(**{name: _device_function(getattr(np, name), kind) for name in CUPY_COMMON})
    fake.ndarray = kind
    fake.__version__ = "0.0-host"
    fake.is_available = lambda: available
    copies = [] if copies is None else copies

    def to_device(a):
        if isinstance(a, DeviceArray):
            return a
        a = np.asarray(a)
        copies.append("in")
        copied.append(("in", a.dtype, a.shape))
        return np.array(a, copy=True).view(kind)

    def to_host(a):
        if not isinstance(a, DeviceArray):
            return a
        copies.append("out")
        copied.append(("out", a.dtype, a.shape))
        return np.array(a, copy=True, subok=False)

    fake.asarray, fake.asnumpy = to_device, to_host
    device = types.SimpleNamespace(mem_info=(free_bytes, 2 * free_bytes))
    # the current stream: the stand-in's kernels and ufuncs run at once, so copies given it do too (in its order),
    # unless ``queued_current``: they wait there until an event after them is waited for (a host buffer refilled
    # before its copy ran shows in the copied data)
    current = type("Stream", (Stream,), {"eager": not queued_current})()
    streams = type("Stream", (Stream,), {"eager": eager_copies})
    fake.cuda = types.SimpleNamespace(Device=lambda: device, Stream=streams, get_current_stream=lambda: current,
                                      alloc_pinned_memory=bytearray)  # (host memory standing in for pinned)
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_bytes=lambda: 0)
    return fake


def _device_function(function, kind):
    def on_device(*args, **kwargs):
        return _on_device(function(*args, **kwargs), kind)
    return on_device


def cupy_backend(calls: list | None = None, loop: str | None = "steps", blocks: int = 3, pinned: bool = False,
                 copy_setting: str | None = None, **device):
    """The cupy backend run on the host with its own kernels (``HostLauncher``), its time loop a chunk's steps
    one by one, the persistent loop kernel in ``blocks`` blocks, or as the backend chooses ("auto"; None: as
    LSTMGRAD_CUPY_LOOP says); host arrays copied by ``asarray``/``asnumpy``, or ``pinned`` through staging
    buffers (host memory standing in for pinned memory), or as ``copy_setting`` says (``LSTMGRAD_CUPY_COPIES``'s
    settings); ``device``: ``fake_cupy``'s."""
    from lstmgrad_cli.backends._cupy import CupyBackend

    return CupyBackend(cp=fake_cupy(**device), launcher=HostLauncher(calls, blocks), loop=loop,
                       copies=copy_setting or ("pinned" if pinned else "pageable"), pinned_empty=np.empty)
