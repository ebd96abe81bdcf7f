"""The BLAS the CPU backends call through ctypes: numpy's OpenBLAS, or MKL or oneDNN where one is faster here.

The numba backend calls the recurrent product from compiled code through this library, and the host
backends run BLAS single-threaded on two threads of their own while the chunk products overlap the
time loop (``XpGradient._run_overlapped``).  Which library (``find()``), once per process:

* ``LSTMGRAD_BLAS=auto`` (the default): where the ``mkl`` wheel (``pip install 'lstmgrad[mkl]'``) or oneDNN's
  (``onednn-cpu-gomp``: ``pip install 'lstmgrad[onednn]'``) is installed beside numpy's OpenBLAS, the one a
  backward pass is fastest on, measured once on this processor and cached (``blas_calibration``: MKL was
  1.1-1.55x faster on an Intel AVX2 machine, twice as slow on an AMD EPYC with AVX-512, where oneDNN ran the
  larger passes 6-9% faster); else the one there is.  ``why_chosen()`` says which and why.
* ``LSTMGRAD_BLAS=openblas``: numpy's OpenBLAS, the library ``np.matmul`` uses.
* ``LSTMGRAD_BLAS=mkl`` or ``onednn``: that library, with a warning and numpy's OpenBLAS when it is not installed.

OpenBLAS and MKL are reached through their 64-bit-integer CBLAS (``cblas_?gemm64_``, ``cblas_?gemm_64``),
oneDNN through ``dnnl_sgemm`` (row-major, its own argument order: ``Blas.sgemm_call``); oneDNN has no float64
product, so float64 passes run on numpy's OpenBLAS with it.  Where no library is found (another BLAS, an
unknown wheel layout), ``find()`` gives None: products are ``np.matmul``, the numba loop stays in Python,
``single_threaded`` and ``stop_spinning_workers`` do nothing, and ``matmul_into`` declines.  Every product of
a backward pass goes through the same library, so the numpy and numba backends agree bit for bit with each.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import re
import sys
import threading
import warnings
from typing import NamedTuple

import numpy as np

BLAS_ENV = "LSTMGRAD_BLAS"
CHOICES = ("auto", "mkl", "onednn", "openblas")
ONEDNN_WHEEL = "onednn-cpu-gomp"  # oneDNN built on GNU OpenMP (the one oneDNN wheel that needs no other runtime)


class Blas(NamedTuple):
    name: str  # "MKL 2026.2.0", "OpenBLAS (numpy's)", "oneDNN 3.2.0"
    sgemm: int  # address of cblas_sgemm (64-bit integer interface), or of dnnl_sgemm (``sgemm_call``)
    dgemm: int  # address of cblas_dgemm
    get_threads: object  # the library's thread count, for the whole process
    set_threads: object
    stop_pool: object  # ends the library's worker threads (started again on demand), or None
    sgemm_call: str = "cblas"  # how ``sgemm`` is called: "cblas", or "dnnl" (oneDNN's dnnl_sgemm)
    prepare: object = None  # called on a thread before its products there (oneDNN: that thread's count), or None


@functools.cache
def numpy_openblas() -> Blas | None:
    """The OpenBLAS inside numpy's wheel (the library ``np.matmul`` uses), or None."""
    found = _numpy_openblas_library()
    if found is None:
        return None
    lib, symbol = found
    gemms = [getattr(lib, symbol(f"cblas_{kind}gemm")) for kind in "sd"]
    get_threads = getattr(lib, symbol("openblas_get_num_threads"))
    set_threads = getattr(lib, symbol("openblas_set_num_threads"))
    stop_pool = getattr(lib, "blas_thread_shutdown_", None)  # OpenBLAS's own fork handler
    if stop_pool is not None:
        stop_pool.restype, stop_pool.argtypes = ctypes.c_int, []
    return _library("OpenBLAS (numpy's)", gemms, get_threads, set_threads, stop_pool)


@functools.cache
def _numpy_openblas_library():
    """(the ctypes library, a function giving a symbol's name in it) of the OpenBLAS inside numpy's wheel, or
    None: the first of its files with the 64-bit-integer gemms and thread counts under one naming."""
    root = os.path.dirname(np.__file__)
    paths = sorted(glob.glob(os.path.join(root + ".libs", "*openblas*")))
    paths += sorted(glob.glob(os.path.join(root, ".dylibs", "*openblas*")))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_")):
            def symbol(name, prefix=prefix, suffix=suffix):
                return f"{prefix}{name}{suffix}"

            needed = ("cblas_sgemm", "cblas_dgemm", "openblas_get_num_threads", "openblas_set_num_threads")
            if all(hasattr(lib, symbol(name)) for name in needed):
                return lib, symbol
    return None


@functools.cache
def _omatcopy(kind: str):
    """numpy's OpenBLAS's ``cblas_?omatcopy`` (``kind`` "s" or "d": a scaled, optionally transposed copy), typed,
    or None."""
    found = _numpy_openblas_library()
    copy = getattr(found[0], found[1](f"cblas_{kind}omatcopy"), None) if found is not None else None
    if copy is not None:
        scalar = ctypes.c_float if kind == "s" else ctypes.c_double
        i64 = ctypes.c_int64
        copy.restype = None
        copy.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, scalar, ctypes.c_void_p, i64, ctypes.c_void_p, i64]
    return copy


def transpose_into(a, out) -> bool:
    """``out[...] = a.T`` in one call of numpy's OpenBLAS (``cblas_?omatcopy``): 0.08 ms for a [256, 1024] float32
    array, where numpy's strided copy takes 0.75 ms.  The values are copied exactly (scaled by 1).  Returns False,
    having done nothing, where it cannot take the arrays as they are (not float32/float64, ``a``'s rows not of
    adjacent elements, ``out`` not C-contiguous and writeable, empty, the library not found)."""
    if (not isinstance(a, np.ndarray) or not isinstance(out, np.ndarray) or a.dtype != out.dtype
            or a.ndim != 2 or out.shape != a.shape[::-1] or not a.size
            or not (out.flags.c_contiguous and out.flags.writeable)):
        return False
    kind = {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}.get(a.dtype)
    layout = _operand(a)
    copy = _omatcopy(kind) if kind is not None else None
    if copy is None or layout is None or layout[0] != _NO_TRANS:
        return False
    rows, cols = a.shape
    copy(_ROW_MAJOR, _TRANS, rows, cols, 1.0, a.ctypes.data, layout[1], out.ctypes.data, rows)
    return True


def _library(name, gemms, get_threads, set_threads, stop_pool) -> Blas:
    """A ``Blas`` of ctypes functions: the gemms as addresses, the thread-count pair typed."""
    get_threads.restype, get_threads.argtypes = ctypes.c_int, []
    set_threads.restype, set_threads.argtypes = None, [ctypes.c_int]
    return Blas(name, *(ctypes.cast(f, ctypes.c_void_p).value for f in gemms), get_threads, set_threads, stop_pool)


def mkl_version() -> str | None:
    """The installed ``mkl`` wheel's version (package metadata only, nothing loaded), or None."""
    return installed_version("mkl")


def installed_version(name: str) -> str | None:
    """The version of the distribution ``name`` installed on ``sys.path`` (the first found, as
    ``importlib.metadata.version`` takes it), from its metadata; None when not installed.

    Every command asks for MKL's; ``importlib.metadata`` would cost it 10-20 ms of imports (email, csv, zipfile).
    The metadata is a ``{name}-{version}.dist-info`` folder's METADATA, or an ``.egg-info`` folder's PKG-INFO (or
    the ``.egg-info`` file itself), the name lower-cased with runs of ``-_.`` as ``_``."""
    wanted = re.sub(r"[-_.]+", "_", name).lower()
    for entry in sys.path:
        try:
            children = os.listdir(entry or ".")
        except OSError:  # (a zip file on the path, or a folder gone)
            continue
        for child in children:
            stem, dot, suffix = child.rpartition(".")
            if suffix not in ("dist-info", "egg-info") or not dot:
                continue
            project = stem.partition("-")[0]
            if re.sub(r"[-_.]+", "_", project).lower() != wanted:
                continue
            where = os.path.join(entry or ".", child)
            if suffix == "dist-info":
                where = os.path.join(where, "METADATA")
            elif os.path.isdir(where):
                where = os.path.join(where, "PKG-INFO")
            version = _metadata_version(where)
            if version is not None:
                return version
    return None


def _metadata_version(path: str) -> str | None:
    """The ``Version:`` of a core metadata file (its header ends at the first empty line), or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                if key.strip().lower() == "version":
                    return value.strip()
    except OSError:
        return None
    return None


# MKL's fatal errors (a library it cannot load: a memory limit, a broken install) print to stdout and exit the
# process unless a handler is set; with one, the failing call returns without computing.  lstmgrad's handler
# records them (``mkl_fatal_error``): MKL is tried once when chosen (``_mkl_starts``) and every pass checks it
# after (``check_mkl``).
_FatalHandler = ctypes.CFUNCTYPE(None, ctypes.c_int)
_mkl_fatal_errors: list[int] = []


def mkl_fatal_error(code: int) -> None:
    """Record a fatal error MKL met (``code``, MKL's reason): the call it met it in returned without computing, so
    from now on every pass on MKL fails (``check_mkl``) rather than give a wrong result.  MKL calls this through the
    exit handler lstmgrad sets when it tries MKL.  A program that sets MKL's exit handler itself (replacing
    lstmgrad's) passes MKL's errors on here; the test suite calls it to stand for a failure MKL cannot be made to
    have on purpose."""
    _mkl_fatal_errors.append(int(code))


_on_mkl_fatal = _FatalHandler(mkl_fatal_error)  # kept alive for the process: MKL holds the pointer
_mkl_failure: list[str] = []  # why MKL was not chosen, for the warning


@functools.cache
def mkl() -> Blas | None:
    """MKL's single dynamic library (``mkl_rt``) from the ``mkl`` wheel, or None when absent or unloadable
    (why, in ``_mkl_failure``)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("mkl")
    except PackageNotFoundError:
        return None
    short = address_space_short()
    if short is not None:
        _mkl_failure.append(short)
        return None
    names = ("libmkl_rt.so", "libmkl_rt.", "mkl_rt.")  # Linux, macOS, Windows
    paths = sorted(str(f.locate()) for f in dist.files or () if f.name.startswith(names))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            gemms = [lib.cblas_sgemm_64, lib.cblas_dgemm_64]
            get_threads, set_threads = lib.MKL_Get_Max_Threads, lib.MKL_Set_Num_Threads
            set_handler = lib.mkl_set_exit_handler
        except (OSError, AttributeError) as err:
            _mkl_failure.append(" ".join(str(err).split()))
            continue
        set_handler.restype, set_handler.argtypes = ctypes.c_int, [_FatalHandler]
        blas = _library(f"MKL {dist.version}", gemms, get_threads, set_threads, None)
        failure = _mkl_starts(blas, set_handler)
        if failure is None:
            return blas
        _mkl_failure.append(failure)
    return None


class _OpenMPThreads:
    """oneDNN's thread count, kept for the whole process as OpenBLAS and MKL keep theirs.

    GNU OpenMP keeps it per thread: a thread that has not set it runs its products on every core.  So the count
    set here is applied to each thread before its products (``apply``, the ``Blas.prepare`` of oneDNN): the
    overlapped schedule's second thread, and each thread of a Dask worker, then run on the count set."""

    def __init__(self, runtime):
        self._get, self._set = runtime.omp_get_max_threads, runtime.omp_set_num_threads
        self._get.restype, self._get.argtypes = ctypes.c_int, []
        self._set.restype, self._set.argtypes = None, [ctypes.c_int]
        self.count = self._get()

    def get(self) -> int:
        return self.count

    def set(self, count: int) -> None:
        self.count = count
        self._set(count)

    def apply(self) -> None:
        if self._get() != self.count:
            self._set(self.count)


class _DnnlVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int)]


_onednn_failure: list[str] = []  # why oneDNN did not load, for the warning


def onednn_version() -> str | None:
    """The installed oneDNN wheel's version (package metadata only, nothing loaded), or None."""
    return installed_version(ONEDNN_WHEEL)


@functools.cache
def onednn() -> Blas | None:
    """oneDNN's library (``libdnnl``) from the ``onednn-cpu-gomp`` wheel, or None when absent or unloadable (why,
    in ``_onednn_failure``).  Its float32 products are ``dnnl_sgemm``; its float64 ones numpy's OpenBLAS's."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(ONEDNN_WHEEL)
    except PackageNotFoundError:
        return None
    own = numpy_openblas()
    if own is None:
        _onednn_failure.append("numpy's OpenBLAS, which its float64 products need, is not reachable")
        return None
    paths = sorted(str(f.locate()) for f in dist.files or () if f.name.startswith("libdnnl.so"))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            runtime = ctypes.CDLL("libgomp.so.1")  # loaded already, as libdnnl needs it
            sgemm, version = lib.dnnl_sgemm, lib.dnnl_version
        except (OSError, AttributeError) as err:
            _onednn_failure.append(" ".join(str(err).split()))
            continue
        version.restype = ctypes.POINTER(_DnnlVersion)
        number = version().contents
        threads = _OpenMPThreads(runtime)
        blas = Blas(f"oneDNN {number.major}.{number.minor}.{number.patch}", ctypes.cast(sgemm, ctypes.c_void_p).value,
                    own.dgemm, threads.get, threads.set, None, "dnnl", threads.apply)
        a = np.arange(1.0, 5.0, dtype=np.float32).reshape(2, 2)
        out = np.zeros((2, 2), np.float32)
        try:
            gemm_on(blas, a, a, out)
        except BlasError as err:
            _onednn_failure.append(str(err))
            continue
        if np.array_equal(out, a @ a):
            return blas
        _onednn_failure.append("it failed a first product")
    return None


# What loading MKL may map beyond what the process has: its libraries (mkl_rt, the core, a threading layer, an
# interface and the kernels for this CPU: ~250 MB) with room to spare, and for each of its OpenMP threads a
# stack (8 MB) and the heap arena glibc reserves for a new thread (64 MB).
MKL_ADDRESS_SPACE = 640 * 2**20
MKL_THREAD_ADDRESS_SPACE = 72 * 2**20


def address_space_short() -> str | None:
    """Why MKL must not be loaded under this process's address-space limit (``ulimit -v``, RLIMIT_AS), or None.

    Out of address space part way through starting, MKL's OpenMP runtime can deadlock while it formats its own
    error message, spinning where no signal but SIGKILL reaches it; loaded with less room than it may map, it is
    not tried at all.  Nothing is checked where there is no limit or the process's size cannot be read."""
    try:
        import resource  # noqa: PLC0415 - Unix only

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, AttributeError, OSError, ValueError):
        return None
    used = _virtual_size()
    if limit == resource.RLIM_INFINITY or used is None:
        return None
    need = MKL_ADDRESS_SPACE + MKL_THREAD_ADDRESS_SPACE * _mkl_threads()
    left = max(limit - used, 0)
    if left >= need:
        return None
    return (f"the address-space limit (ulimit -v) leaves {left >> 20} MB to map, and MKL may need {need >> 20} MB; "
            "raise the limit to use MKL")


def _mkl_threads() -> int:
    """The threads MKL will start: its thread variables when set (local workers get their share so), else one per
    core this process may use."""
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        try:
            count = int(os.environ.get(var, "").split(",")[0])
        except ValueError:
            continue
        if count > 0:
            return count
    return usable_cores()


def _virtual_size() -> int | None:
    """The bytes this process has mapped (Linux's VmSize), or None when it cannot be read."""
    kib = process_status("VmSize")
    return None if kib is None else kib * 1024


def process_status(field: str) -> int | None:
    """The number a field of ``/proc/self/status`` gives (``Threads``, ``VmSize`` in KiB), or None when it cannot
    be read (not Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mkl_starts(blas: Blas, set_handler) -> str | None:
    """Make MKL load everything it loads on first use (its threading layer, the kernels for this CPU) now, its
    messages kept off stdout; None when it did and computes right, else what it said."""
    a = np.arange(1.0, 5.0).reshape(2, 2)
    expected = a @ a
    with _stdout_captured() as said:
        set_handler(_on_mkl_fatal)  # loads MKL's core library already
        blas.get_threads()
        results = []
        for dtype, address in ((np.float32, blas.sgemm), (np.float64, blas.dgemm)):
            x, out = a.astype(dtype), np.zeros((2, 2), dtype)
            _gemm(address, dtype)(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, 2, 2, 2, 1.0, x.ctypes.data, 2, x.ctypes.data, 2,
                                  0.0, out.ctypes.data, 2)
            results.append(out)
    if not _mkl_fatal_errors and all(np.array_equal(out, expected) for out in results):
        return None
    for line in said[0].splitlines():  # "INTEL oneMKL ERROR: /.../libmkl_def.so.3: failed to map segment ..."
        if "ERROR:" in line:
            words = line.split("ERROR:", 1)[1].split()
            return " ".join(os.path.basename(w) if os.sep in w else w for w in words).rstrip(".")
    return "it failed a first product"


@contextlib.contextmanager
def _stdout_captured():
    """What C code writes to file descriptor 1 meanwhile, as ``[text]`` after the block (not on stdout)."""
    import sys  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    said = [""]
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        yield said
        return
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield said
        finally:
            libc.fflush(None)  # C's buffered stdout, into the sink before it is put back
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        said[0] = sink.read(4096).decode("utf-8", "replace")


def check_mkl() -> None:
    """Raise BackendUnavailableError when MKL has reported a fatal error since it was chosen: its calls then
    return without computing, so a result computed meanwhile is wrong and must not be used."""
    if _mkl_fatal_errors and on_mkl():
        from ..errors import BackendUnavailableError  # noqa: PLC0415

        raise BackendUnavailableError("MKL failed during the computation (it could not load a library it needs: a "
                                      "memory limit?); nothing was written; LSTMGRAD_BLAS=openblas avoids it")


def choice(warn: bool = True) -> str:
    """``LSTMGRAD_BLAS``, lower-cased; an unknown value counts as ``auto`` (with a warning when ``warn``)."""
    value = os.environ.get(BLAS_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        if warn:
            warnings.warn(f"{BLAS_ENV}={value!r} is not one of {', '.join(CHOICES)}; using auto", stacklevel=3)
        return "auto"
    return value


_FIND_LOCK = threading.Lock()  # the first products may come from several threads at once


@functools.cache
def find() -> Blas | None:
    """The library every host product goes through, chosen once per process (module docstring)."""
    with _FIND_LOCK:
        return _choose()


_using: list[Blas] = []  # inside using(): the library every product goes through meanwhile


@contextlib.contextmanager
def using(blas: Blas):
    """Every host product of this process on ``blas`` meanwhile, whatever ``find()`` chose: for timing the two
    libraries on the same passes (``blas_calibration``).  numba's compiled loop keeps the library it was built
    with."""
    _using.append(blas)
    try:
        yield
    finally:
        _using.pop()


def current() -> Blas | None:
    """The library products go through now: ``using()``'s, else ``find()``'s."""
    return _using[-1] if _using else find()


_why: list[str] = []  # why find() chose its library, in words (why_chosen)


# The libraries LSTMGRAD_BLAS may name besides numpy's OpenBLAS: (its wheel's version, the library loaded, why it did
# not load, its name in words, the extra that installs it).
_OTHERS = {"mkl": (lambda: mkl_version(), lambda: mkl(), _mkl_failure, "MKL", "mkl"),
           "onednn": (lambda: onednn_version(), lambda: onednn(), _onednn_failure, "oneDNN", "onednn")}


def other_libraries() -> dict[str, str]:
    """The libraries besides numpy's OpenBLAS installed here (wheel metadata only, nothing loaded), by name
    ("mkl", "onednn"): their versions."""
    versions = {name: other[0]() for name, other in _OTHERS.items()}
    return {name: version for name, version in versions.items() if version is not None}


def _choose() -> Blas | None:
    wanted = choice()
    own = numpy_openblas()
    _why.clear()
    if wanted == "openblas":
        _why.append(f"{BLAS_ENV}=openblas")
        return own
    if wanted in _OTHERS:
        found = _OTHERS[wanted][1]()
        if found is not None:
            _why.append(f"{BLAS_ENV}={wanted}")
            return found
        _, _, failure, label, extra = _OTHERS[wanted]
        if failure:
            warnings.warn(f"{label} does not load here ({failure[-1]}); using numpy's OpenBLAS", stacklevel=3)
            _why.append(f"{label} does not load here ({failure[-1]})")
        else:
            warnings.warn(f"{BLAS_ENV}={wanted}, but {label} is not installed or does not load "
                          f"(pip install 'lstmgrad[{extra}]'); using numpy's OpenBLAS", stacklevel=3)
            _why.append(f"{BLAS_ENV}={wanted}, but {label} is not installed")
        return own
    installed = other_libraries()
    if own is None:  # nothing to measure against: the first other library that loads
        found = next((blas for blas in (_OTHERS[name][1]() for name in installed) if blas is not None), None)
        _why.append("numpy's OpenBLAS is not reachable here")
        return found
    if installed:
        return _measured_choice(own, installed)
    _why.append("neither MKL nor oneDNN is installed (pip install 'lstmgrad[mkl]' or 'lstmgrad[onednn]' adds one)")
    return own


def _measured_choice(own: Blas, installed: dict) -> Blas:
    """``auto`` with other libraries installed: the one a backward pass is fastest on here (``blas_calibration``:
    measured once, cached; a library a cached choice does not take is never loaded)."""
    from . import blas_calibration  # noqa: PLC0415 - only with another library installed

    entry_key = blas_calibration.key(installed, usable_cores())
    known = blas_calibration.cached(entry_key)
    if known is not None and known["library"] == "openblas":
        _why.append(blas_calibration.decide(entry_key, None, known).why)
        return own
    # Loaded one at a time, the cached choice only where there is one: a library that does not load (an
    # address-space limit, say) leaves the others unloaded, nothing measured or cached, and numpy's OpenBLAS.
    loaded = {}
    for name in [known["library"]] if known is not None else installed:
        blas = _OTHERS[name][1]()
        if blas is None:
            _, _, failure, label, _ = _OTHERS[name]
            reason = failure[-1] if failure else "it failed a first product"
            warnings.warn(f"{label} does not load here ({reason}); using numpy's OpenBLAS", stacklevel=4)
            _why.append(f"{label} does not load here ({reason})")
            return own
        loaded[name] = blas
    decided = blas_calibration.decide(entry_key, lambda: blas_calibration.measure({**loaded, "openblas": own}, using),
                                      known)
    _why.append(decided.why)
    return own if decided.library == "openblas" else loaded[decided.library]


def why_chosen() -> str:
    """Why ``find()`` took its library, in words ("LSTMGRAD_BLAS=openblas", a measurement on this processor, ...)."""
    find()
    return _why[-1] if _why else "no BLAS library was found: products are numpy.matmul"


def describe() -> str:
    """The library ``find()`` gives, by name (for versions and provenance: loaded to be sure, as MKL may not load)."""
    blas = find()
    return blas.name if blas is not None else "numpy.matmul"


def on_mkl() -> bool:
    """Whether the host products go through MKL."""
    return describe().startswith("MKL")


def library() -> str:
    """The ``LSTMGRAD_BLAS`` value naming the library ``find()`` gives ("mkl", "onednn" or "openblas"): for a process
    that must compute on the same one."""
    name = describe()
    return "mkl" if name.startswith("MKL") else "onednn" if name.startswith("oneDNN") else "openblas"


def version_note() -> str:
    """``" with MKL <version>"`` (or oneDNN's) when the host products go through MKL or oneDNN, else ``""``: for
    backend versions, which the outputs record (the last bits of a result depend on the BLAS)."""
    return f" with {describe()}" if library() != "openblas" else ""


_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


class BlasError(RuntimeError):
    """A product the library refused (oneDNN's status: out of memory, say); its output is not to be used."""


@functools.cache
def _gemm(address: int, dtype):
    """ctypes ``cblas_?gemm`` at ``address``, for float32 or float64 (it releases the GIL while it runs)."""
    real = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, i32, i32, i32, i64, i64, i64, real, ptr, i64, ptr, i64, real, ptr, i64)
    return proto(address)


_DNNL_SGEMM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char, ctypes.c_char, *[ctypes.c_int64] * 3, ctypes.c_float,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                               ctypes.c_void_p, ctypes.c_int64)


def _product(blas: Blas, dtype):
    """``blas``'s gemm for ``dtype``, called as ``cblas_?gemm`` is (row-major order first) whichever way the library
    takes it; oneDNN's refusals raise ``BlasError``."""
    if dtype != np.float32 or blas.sgemm_call == "cblas":
        return _gemm(blas.sgemm if dtype == np.float32 else blas.dgemm, dtype)
    return _dnnl_product(blas.sgemm, blas.prepare, blas.name)


@functools.cache
def _dnnl_product(address: int, prepare, name: str):
    """``dnnl_sgemm`` at ``address`` as ``_product`` gives it: this thread's count set first (``prepare``)."""
    sgemm = _DNNL_SGEMM(address)

    def dnnl(order, trans_a, trans_b, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc):  # noqa: ARG001 - row-major
        prepare()
        status = sgemm(b"T" if trans_a == _TRANS else b"N", b"T" if trans_b == _TRANS else b"N", M, N, K, alpha, a, lda,
                       b, ldb, beta, c, ldc)
        if status:
            raise BlasError(f"{name} refused a product of {M}x{K} by {K}x{N} (status {status}: "
                            f"{'out of memory' if status == 1 else 'invalid arguments'})")

    return dnnl


def _operand(a):
    """(transpose flag, leading dimension) of a 2-D array BLAS reads in place, or None: rows (or, transposed,
    columns) of adjacent elements, a whole number of elements apart and no closer than their length (a block of
    columns of a C-contiguous array, say)."""
    if a.flags.c_contiguous:
        return _NO_TRANS, max(a.shape[1], 1)
    if a.flags.f_contiguous:
        return _TRANS, max(a.shape[0], 1)
    return _strided(a, 0, _NO_TRANS) or _strided(a, 1, _TRANS)


def _strided(a, axis: int, flag: int):
    """(flag, leading dimension) where ``a``'s other axis has adjacent elements and ``axis`` steps whole lines of at
    least that axis's length, else None."""
    size = a.itemsize
    line, step = a.strides[axis], a.strides[1 - axis]
    if step != size or line % size or line // size < max(a.shape[1 - axis], 1):
        return None
    return flag, line // size


def gemm_on(blas: Blas, a, b, out) -> None:
    """``out = a @ b`` (float32 or float64, 2-D, operands C- or F-contiguous, ``out`` C-contiguous) on ``blas``."""
    (M, K), N = a.shape, b.shape[1]
    layout_a, layout_b = _operand(a), _operand(b)
    gemm = _product(blas, out.dtype.type)
    gemm(_ROW_MAJOR, layout_a[0], layout_b[0], M, N, K, 1.0, a.ctypes.data, layout_a[1], b.ctypes.data, layout_b[1],
         0.0, out.ctypes.data, max(N, 1))


def matmul_into(a, b, out, accumulate: bool) -> bool:
    """``out = a @ b`` or, with ``accumulate``, ``out += a @ b`` in one ``cblas_?gemm`` call.

    Accumulating this way needs no ``[M, N]`` temporary and no separate addition pass.  The arrays may be blocks
    of columns of larger ones (``_operand``).  Returns False, having done nothing, where BLAS cannot take them as
    they are (no library found, not one float32/float64 dtype, not 2-D, an operand BLAS cannot read in place,
    ``out`` not row after row and writeable, an empty product); the caller then uses numpy.
    """
    blas = current()
    dtype = out.dtype if isinstance(out, np.ndarray) else None
    if (blas is None or dtype not in (np.float32, np.float64)
            or not all(isinstance(m, np.ndarray) and m.dtype == dtype and m.ndim == 2 for m in (a, b))
            or out.ndim != 2 or not out.flags.writeable
            or a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1])):
        return False
    layout_a, layout_b, layout_out = _operand(a), _operand(b), _operand(out)
    if layout_a is None or layout_b is None or layout_out is None or layout_out[0] != _NO_TRANS:
        return False
    (M, K), N = a.shape, b.shape[1]
    if min(M, N, K) == 0:  # BLAS returns at once; numpy's rules for empty products apply
        return False
    gemm = _product(blas, dtype.type)
    gemm(_ROW_MAJOR, layout_a[0], layout_b[0], M, N, K, 1.0, a.ctypes.data, layout_a[1],
         b.ctypes.data, layout_b[1], 1.0 if accumulate else 0.0, out.ctypes.data, layout_out[1])
    return True


def matmul(a, b, out):
    """``out = a @ b`` on host arrays through ``find()``'s library, so every product of a pass uses one BLAS.

    With numpy's own OpenBLAS chosen this is ``np.matmul`` (the same library, less call overhead);
    otherwise ``matmul_into``, or ``np.matmul`` where that declines.
    """
    blas = current()
    if blas is None or blas is numpy_openblas() or not matmul_into(a, b, out, accumulate=False):
        np.matmul(a, b, out=out)


def _libraries() -> list[Blas]:
    """``find()``'s library and numpy's OpenBLAS (once when they are the same)."""
    chosen, own = current(), numpy_openblas()
    return [blas for blas in (chosen, own if own is not chosen else None) if blas is not None]


_held: list[tuple[Blas, int]] = []  # inside counts_held(): each library and the count to put back at its end
_single = threading.Lock()  # guards the two below
_single_users = 0  # single_threaded() blocks running now, on any thread
_single_previous: list[tuple[Blas, int]] = []  # the counts the first of them found, put back when the last ends


@contextlib.contextmanager
def single_threaded():
    """Run BLAS calls on one thread each meanwhile: ``find()``'s library and numpy's OpenBLAS.

    Each keeps one thread count for the whole process: it is set once, and put back when the last block running,
    on any thread, ends (two passes at once on two threads: the second finds the count at 1), or inside
    ``counts_held()`` only when that block ends.  numpy's OpenBLAS is set too when MKL is chosen, for the
    products numpy does itself (``matmul_into`` declines float16, for one).
    """
    global _single_users
    if _held:
        _set_counts((blas, 1) for blas, _ in _held)
        yield
        return
    with _single:
        if not _single_users:
            _single_previous[:] = [(blas, blas.get_threads()) for blas in _libraries()]
        _single_users += 1
        _set_counts((blas, 1) for blas, _ in _single_previous)
    try:
        yield
    finally:
        with _single:
            _single_users -= 1
            if not _single_users:
                _set_counts(_single_previous)


@contextlib.contextmanager
def counts_held():
    """Meanwhile ``single_threaded()`` leaves the libraries at one thread instead of putting their counts back,
    a pass that wants threads sets them again (``threads_for_pass``), and the counts are put back once, when
    this block ends.

    For a batch of small files in one process: putting numpy's OpenBLAS back to its count after every
    file starts its threads again, which then spin for ~0.1 s on the other core against the next file
    (300 files of 20,16,64,64: 4.7 -> 3.8 s wall, 9.0 -> 3.9 s of CPU).
    """
    if _held:  # already inside one
        yield
        return
    _held.extend((blas, blas.get_threads()) for blas in _libraries())
    try:
        yield
    finally:
        _set_counts(_held)
        _held.clear()


def set_thread_counts(count: int) -> None:
    """Every library's thread count to ``count`` (a forked worker process, whose libraries were loaded, and read
    their counts from the environment, before the fork)."""
    _set_counts((blas, count) for blas in _libraries())


def _set_counts(counts) -> None:
    """Each library's count where it differs: setting numpy's OpenBLAS, even to the count it has, starts its
    worker threads again, which spin for a while against other work (a forked worker's one core: _worker_begins).
    """
    for blas, count in counts:
        if blas.get_threads() != count:
            blas.set_threads(count)


@contextlib.contextmanager
def _held_counts():
    """Inside ``counts_held()``: the libraries at their own counts for a pass that wants threads."""
    _set_counts(_held)
    yield


def threads() -> int:
    """The threads the products' library gives a pass that wants threads: its own count (OPENBLAS_NUM_THREADS and
    the like set it; a batch's worker gets its share of the cores), the one ``counts_held()`` puts back."""
    blas = current()
    if blas is None:
        return usable_cores()
    return next((count for held, count in _held if held is blas), None) or blas.get_threads()


SMALL_PASS_FLOPS = 2 * 10**8  # a backward pass below this takes a few ms: its products gain nothing from threads


def threads_for_pass(T: int, B: int, I: int, C: int):  # noqa: E741
    """``single_threaded()`` for a backward pass of this shape below ``SMALL_PASS_FLOPS`` and the work around it
    (checks, summaries), else nothing: the products of a small pass are too small to gain from threads, while
    the threads they wake go on spinning for ~0.1-0.2 s after each call, against the caller's next work (the
    next file of a batch, the next call of a loop) on the same cores."""
    if 16 * T * B * C * (I + C) < SMALL_PASS_FLOPS:
        return single_threaded()
    return _held_counts() if _held else contextlib.nullcontext()


def stop_spinning_workers():
    """End numpy's OpenBLAS's idle worker threads, which spin for ~0.1 s after each threaded call.

    OpenBLAS starts them again on demand.  Only call this when no other thread can be inside BLAS,
    and after setting the thread count (setting it starts them again).
    """
    blas = numpy_openblas()
    if blas is not None and blas.stop_pool is not None:
        blas.stop_pool()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
