"""Reading tensors from HDF5/NPZ files and writing gradient files atomically.

Files are recognised by their first bytes, not their extension.  Only the tensors asked for are
read, so unrelated (or hostile) entries in a file are never touched.  Input files come from other
people's jobs, so every reader here assumes the worst:

* NPZ members are parsed by hand (``.npy`` header first): object arrays are refused from the header
  alone, nothing is ever unpickled, and a member's declared size is checked before anything is
  allocated.  Every member is read to its end so the zip CRC is verified.
* HDF5 links are followed one at a time and never out of the file: external links, dangling soft
  links, virtual datasets and datasets whose raw data lives in external files are refused.
* A tensor whose declared size (shape x itemsize) exceeds the memory limit is refused before it is
  read, with its size in the message.  The limit is half of the physical (or cgroup) memory, or
  ``LSTMGRAD_MAX_TENSOR_BYTES``; it bounds each tensor and the tensors of one file together.
* Anything that goes wrong becomes an ``InputFileError`` naming the file and the tensor.

Outputs go to a temporary file beside the target and are renamed into place only when complete;
an existing file is replaced only with ``force``; an input is never opened for writing.  A failed
write (disk full, permission denied, read-only filesystem, ...) leaves no file behind and raises an
``OutputFileError`` that says what happened.
"""

from __future__ import annotations

import contextlib
import errno
import json
import lzma
import math
import os
import re
import stat
import struct
import tempfile
import tokenize
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputFileError, LstmGradError, OutputFileError

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
# HDF5 allows a user block before the superblock; the signature then sits at 512, 1024, 2048, ...
HDF5_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)

METADATA_KEY = "__lstmgrad__"
OUTPUT_FORMATS = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}

MAX_BYTES_ENV = "LSTMGRAD_MAX_TENSOR_BYTES"
MAX_LINK_DEPTH = 16  # soft links followed in a row (HDF5's own default nesting limit)
NPY_MAX_HEADER = 10000  # numpy's own limit for a .npy header it will parse
READ_CHUNK = 1 << 20

# Everything numpy's .npy parser and the zip/decompression layers raise on bad data.
_NPZ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, lzma.LZMAError, EOFError, OSError, ValueError,
               KeyError, TypeError, IndexError, OverflowError, struct.error, NotImplementedError, RuntimeError,
               SyntaxError, RecursionError, UnicodeError)
# Everything h5py raises on bad data (HDF5 errors arrive as OSError, KeyError, RuntimeError, ...).
_HDF5_ERRORS = (OSError, KeyError, RuntimeError, ValueError, TypeError, IndexError, OverflowError,
                AttributeError, NotImplementedError, UnicodeError)


@dataclass
class LoadedFile:
    """What was read from one input: the tensors asked for, scalar parameters, and what else is there."""

    path: Path
    format: str  # "hdf5" or "npz"
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, tuple[object, str]] = field(default_factory=dict)  # name -> (value, "tensor"|"attribute")
    keys: list[str] = field(default_factory=list)  # every entry of the group, as stored
    errors: dict[str, InputFileError] = field(default_factory=dict)  # with collect_errors: tensor -> why unreadable


class LazyDataset:
    """An HDF5 dataset read by slicing, whose read errors become InputFileError naming file and tensor.

    Has what the gradient code uses of an array: ``shape``, ``ndim``, ``dtype``, ``size`` and
    slicing along the first axis.  Valid while the ``open_inputs`` block that made it runs.
    """

    def __init__(self, dataset, key: str, path: Path):
        self._dataset, self._key, self._path = dataset, key, path
        self.shape, self.dtype = tuple(dataset.shape), dataset.dtype
        self.ndim, self.size = len(self.shape), int(math.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        try:
            return np.asarray(self._dataset[index])
        except MemoryError:
            raise InputFileError(f"{self._path}: {self._key} does not fit in memory") from None
        except _HDF5_ERRORS as err:
            raise InputFileError(f"{self._path}: {self._key} cannot be read ({_reason(err)})") from None


def sniff_format(path: Path) -> str:
    """'hdf5' or 'npz' from the file's content; InputFileError for anything else.

    Only regular files are opened: a FIFO, socket or device would block or never end.
    """
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise InputFileError(f"{path}: is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{path}: is not a regular file ({_file_kind(info.st_mode)}); "
                                 "expected an HDF5 or NPZ file")
        with open(path, "rb") as fh:
            head = fh.read(8)
            if head == HDF5_MAGIC:
                return "hdf5"
            if head[:4] in ZIP_MAGICS:
                return "npz"
            for offset in HDF5_OFFSETS[1:]:
                fh.seek(offset)
                if fh.read(8) == HDF5_MAGIC:
                    return "hdf5"
    except InputFileError:
        raise
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a directory, not a file") from None
    except PermissionError:
        raise InputFileError(f"{path}: permission denied") from None
    except (OSError, ValueError) as err:  # ValueError: an embedded NUL byte in the path
        raise InputFileError(f"{path}: cannot read: {_os_reason(err) if isinstance(err, OSError) else err}") from None
    if not head:
        raise InputFileError(f"{path}: file is empty (0 bytes); expected an HDF5 or NPZ file")
    raise InputFileError(f"{path}: not an HDF5 or NPZ file (it starts with {head!r})")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def camel(name: str) -> str:
    """The camelCase spelling of TensorFlow's Java API (cs_prev -> csPrev), accepted beside snake_case."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _key_for(name: str, keys: Iterable[str], path: Path) -> str | None:
    present = [k for k in dict.fromkeys((name, camel(name))) if k in keys]
    if len(present) > 1:
        raise InputFileError(f"{path}: both {present[0]!r} and {present[1]!r} are present; keep one")
    return present[0] if present else None


def describe_keys(keys: Iterable[str], limit: int = 20, width: int = 60) -> str:
    """Key names for a one-line message: control characters escaped, long names cut, long lists counted.

    Key names come from the file, so they may hold terminal escape sequences, newlines or thousands
    of characters; messages that list them should use this rather than joining them raw.
    """
    keys = list(keys)
    shown = []
    for key in keys[:limit]:
        text = key if key.isprintable() else repr(key)[1:-1]
        shown.append(text if len(text) <= width else f"{text[:width - 3]}...")
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return (", ".join(shown) + more) or "nothing"


# -- memory limit -------------------------------------------------------------------------------

def max_tensor_bytes() -> int:
    """Bytes one input file's tensors may occupy: ``LSTMGRAD_MAX_TENSOR_BYTES``, else half the memory."""
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if text:
        match = re.fullmatch(r"(\d+)\s*([kKmMgGtT]?)(i?[bB])?", text)
        if not match:
            raise LstmGradError(f"{MAX_BYTES_ENV}={text!r}: expected a byte count such as 1000000 or 512M")
        return int(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")
    return _memory_bytes() // 2


def _memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when that is smaller (containers)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(limit_file).read_text().strip()
            if text.isdigit() and 0 < int(text) < total:
                total = int(text)
    return total


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} bytes"  # pragma: no cover


class _Budget:
    """The bytes a file's tensors may still occupy; refuses a tensor before it is allocated."""

    def __init__(self, path: Path):
        self.path = path
        self.limit = max_tensor_bytes()
        self.used = 0

    def take(self, key: str, shape: tuple, dtype: np.dtype, what: str = "") -> int:
        if any(int(n) < 0 for n in shape):
            raise InputFileError(f"{self.path}: {key} declares a negative dimension (shape {list(shape)}); refused")
        nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
        if self.used + nbytes > self.limit:
            source = MAX_BYTES_ENV if os.environ.get(MAX_BYTES_ENV, "").strip() else "half of this machine's memory"
            also = f" on top of {_human(self.used)} already read" if self.used else ""
            raise InputFileError(
                f"{self.path}: {key} declares {what}shape {list(shape)} of {_dtype_text(dtype)} = {_human(nbytes)} "
                f"({nbytes} bytes){also}, more than the {_human(self.limit)} limit ({source}; set {MAX_BYTES_ENV} "
                f"to change it); refused before reading")
        self.used += nbytes
        return nbytes

    def check_slice(self, key: str, shape: tuple, dtype: np.dtype) -> None:
        """A tensor read one time step at a time: one step (``shape[1:]``) must fit in the limit."""
        if any(int(n) < 0 for n in shape):
            raise InputFileError(f"{self.path}: {key} declares a negative dimension (shape {list(shape)}); refused")
        step = math.prod(int(n) for n in shape[1:]) * dtype.itemsize
        if step > self.limit:
            total = math.prod(int(n) for n in shape) * dtype.itemsize
            source = MAX_BYTES_ENV if os.environ.get(MAX_BYTES_ENV, "").strip() else "half of this machine's memory"
            raise InputFileError(
                f"{self.path}: {key} declares shape {list(shape)} of {_dtype_text(dtype)} = {_human(total)} "
                f"({total} bytes), and one time step of it ({_human(step)}) is more than the {_human(self.limit)} "
                f"limit ({source}; set {MAX_BYTES_ENV} to change it); refused before reading")


def _dtype_text(dtype: np.dtype) -> str:
    return "object" if dtype.hasobject else str(dtype)


def _native(array: np.ndarray) -> np.ndarray:
    """Numbers in this machine's byte order (a file from a big-endian machine is fine)."""
    if array.dtype.kind in "biufc" and not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="))
    return array


# -- reading ------------------------------------------------------------------------------------

def read_inputs(path: str | os.PathLike, names: Iterable[str], scalars: Iterable[str] = (),
                group: str | None = None, collect_errors: bool = False) -> LoadedFile:
    """Read the tensors ``names`` (and scalar parameters ``scalars``) from an HDF5 or NPZ file.

    Names are TF's snake_case argument names; camelCase aliases are accepted.  Missing tensors are
    simply absent from the result (the caller names them all at once); scalars may also come from
    HDF5 attributes of the group.  Raises InputFileError, and nothing else, for a bad file; with
    ``collect_errors`` a tensor that cannot be read is recorded in ``errors`` and the rest are read
    (one open file, one memory budget: what ``lstmgrad inspect`` needs).
    """
    with open_inputs(path, names, scalars, group, collect_errors=collect_errors) as loaded:
        return loaded


@contextlib.contextmanager
def open_inputs(path: str | os.PathLike, names: Iterable[str], scalars: Iterable[str] = (), group: str | None = None,
                lazy: Iterable[str] = (), collect_errors: bool = False) -> Iterator[LoadedFile]:
    """``read_inputs`` that may leave tensors on disk while the block runs.

    Tensors named in ``lazy`` that are HDF5 datasets come back as ``LazyDataset``s, read later by
    slicing (a chunk of time steps at a time), after the same safety checks as an eager read; they
    do not count against the memory limit, which is what lets an input larger than memory be
    processed.  NPZ files, and big-endian HDF5 data, are always read into memory.
    """
    path = Path(path)
    if sniff_format(path) == "npz":
        yield _read_npz(path, list(names), list(scalars), group, collect_errors)
        return
    with _open_hdf5(path) as (fh, h5py):
        loaded = LoadedFile(path, "hdf5")
        with _hdf5_errors(path):
            _read_hdf5_open(fh, loaded, list(names), list(scalars), group, h5py, frozenset(lazy), collect_errors)
        yield loaded


def _read_npz(path: Path, names, scalars, group, collect_errors=False) -> LoadedFile:
    loaded = LoadedFile(path, "npz")
    prefix = f"{group.strip('/')}/" if group else ""
    try:
        archive = zipfile.ZipFile(path)
    except MemoryError:
        raise InputFileError(f"{path}: corrupt NPZ file (its zip directory does not fit in memory)") from None
    except _NPZ_ERRORS as err:
        raise InputFileError(f"{path}: corrupt or truncated NPZ file ({_reason(err)})") from None
    with archive:
        members: dict[str, zipfile.ZipInfo] = {}
        for info in archive.infolist():
            if not info.filename or info.filename.endswith("/"):  # directories (is_dir() fails on a blank name)
                continue
            # numpy's convention: "x.npy" is the array "x"; other members keep their full name.
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            members[key] = info
        keys = [k[len(prefix):] for k in members if k.startswith(prefix)]
        if group and not keys:
            raise InputFileError(f"{path}: no group {group!r} (no keys start with {prefix!r})")
        loaded.keys = keys
        budget = _Budget(path)
        for name in [*names, *scalars]:
            with _collecting(loaded, name, collect_errors):
                key = _key_for(name, keys, path)
                if key is None:
                    continue
                value = _npz_member(archive, members[prefix + key], prefix + key, path, budget)
                if name in scalars:
                    loaded.scalars[name] = (value, "tensor")
                else:
                    loaded.tensors[name] = value
    return loaded


def _npz_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, path: Path, budget: _Budget) -> np.ndarray:
    """One ``.npy`` member: header checked (no objects, size within budget) before its data is read."""
    try:
        with archive.open(info) as fp:
            shape, fortran_order, dtype = _npy_header(fp, key, path)
            if dtype.hasobject:
                raise InputFileError(f"{path}: {key} is a pickled object array (dtype {dtype}); "
                                     "lstmgrad never unpickles; refused")
            if dtype.itemsize == 0:
                raise InputFileError(f"{path}: {key} has a zero-size dtype ({dtype.str}); expected numbers")
            nbytes = budget.take(key, shape, dtype)
            available = info.file_size - fp.tell()
            if nbytes > available:
                raise InputFileError(f"{path}: {key} is truncated: its header declares shape {list(shape)} of {dtype} "
                                     f"= {nbytes} bytes but the member holds only {max(available, 0)}")
            data = np.empty(nbytes, dtype=np.uint8)
            pos = 0
            while pos < nbytes:
                chunk = fp.read(min(READ_CHUNK, nbytes - pos))
                if not chunk:
                    raise InputFileError(f"{path}: {key} is truncated: {pos} of {nbytes} bytes of data")
                data[pos:pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                pos += len(chunk)
            if fp.read(1):  # reading to the end also makes zipfile verify the CRC
                raise InputFileError(f"{path}: {key} has data after the array it declares (shape {list(shape)}); "
                                     "not a valid .npy member")
    except LstmGradError:
        raise
    except MemoryError:
        raise InputFileError(f"{path}: {key} does not fit in memory") from None
    except RuntimeError as err:
        if "encrypted" in str(err):
            raise InputFileError(f"{path}: {key} is an encrypted (password-protected) zip member; refused") from None
        raise InputFileError(f"{path}: {key} is corrupt or truncated ({_reason(err)})") from None
    except _NPZ_ERRORS as err:
        raise InputFileError(f"{path}: {key} is corrupt or truncated ({_reason(err)})") from None
    try:
        if nbytes == 0:
            array = np.zeros(shape, dtype=dtype)
        else:
            array = data.view(dtype).reshape(shape, order="F" if fortran_order else "C")
    except (ValueError, TypeError, MemoryError) as err:
        raise InputFileError(
            f"{path}: {key} cannot be read as {dtype} of shape {list(shape)} ({_reason(err)})") from None
    return _native(array)


def _npy_header(fp, key: str, path: Path):
    """(shape, fortran_order, dtype) of a .npy stream, parsed without unpickling anything."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
    except ValueError:
        raise InputFileError(f"{path}: {key} is not a numpy array (the zip member is not a .npy file)") from None
    impl = getattr(getattr(np.lib, "_format_impl", fmt), "_read_array_header", None)
    if version not in ((1, 0), (2, 0)) and impl is None:
        raise InputFileError(f"{path}: {key} uses .npy format version {version}, which this numpy cannot read")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # headers written by Python 2 numpy warn; they are still fine
            if version == (1, 0):
                return fmt.read_array_header_1_0(fp, max_header_size=NPY_MAX_HEADER)
            if version == (2, 0):
                return fmt.read_array_header_2_0(fp, max_header_size=NPY_MAX_HEADER)
            return impl(fp, version, max_header_size=NPY_MAX_HEADER)
    except (zipfile.BadZipFile, zlib.error, lzma.LZMAError, OSError, EOFError):
        raise  # the zip layer's own errors: reported by the caller as corrupt or truncated
    except (SyntaxError, tokenize.TokenError):
        raise InputFileError(f"{path}: {key} has a corrupt .npy header (its text is not a Python literal)") from None
    except Exception as err:  # noqa: BLE001 - parsing untrusted text: any failure is a bad header
        raise InputFileError(f"{path}: {key} has a corrupt .npy header ({_reason(err)})") from None


@contextlib.contextmanager
def _open_hdf5(path: Path):
    import h5py  # noqa: PLC0415 - imported when an HDF5 file is actually read

    try:
        fh = h5py.File(path, "r")
    except MemoryError:
        raise InputFileError(f"{path}: corrupt HDF5 file (its metadata does not fit in memory)") from None
    except _HDF5_ERRORS as err:
        raise InputFileError(f"{path}: corrupt or truncated HDF5 file ({_reason(err)})") from None
    with fh:
        yield fh, h5py


@contextlib.contextmanager
def _hdf5_errors(path: Path):
    """h5py's many exception types on a corrupt file -> one InputFileError."""
    try:
        yield
    except LstmGradError:
        raise
    except MemoryError:
        raise InputFileError(f"{path}: corrupt HDF5 file (its metadata does not fit in memory)") from None
    except _HDF5_ERRORS as err:
        raise InputFileError(f"{path}: corrupt HDF5 file ({_reason(err)})") from None


def _read_hdf5_open(fh, loaded: LoadedFile, names, scalars, group, h5py, lazy=frozenset(),
                    collect_errors=False) -> None:
    path = loaded.path
    node = fh
    if group:
        node = _hdf5_walk(fh, fh, group, path, h5py, f"group {group!r}")
        if not isinstance(node, h5py.Group):
            groups = sorted(k for k in fh.keys() if fh.get(k, getlink=True).__class__ is h5py.HardLink
                            and isinstance(fh.get(k), h5py.Group))
            raise InputFileError(f"{path}: no group {group!r} (groups at the root: {', '.join(groups) or 'none'})")
    loaded.keys = list(node.keys())
    budget = _Budget(path)
    for name in names:
        with _collecting(loaded, name, collect_errors):
            key = _key_for(name, loaded.keys, path)
            if key is not None:
                loaded.tensors[name] = _hdf5_dataset(fh, node, key, path, h5py, budget, lazy=name in lazy)
    for name in scalars:
        key = _key_for(name, loaded.keys, path)
        if key is not None:
            loaded.scalars[name] = (_hdf5_dataset(fh, node, key, path, h5py, budget), "tensor")
            continue
        for attrs in (node.attrs, fh.attrs) if group else (node.attrs,):
            akey = _key_for(name, list(attrs.keys()), path)
            if akey is not None:
                loaded.scalars[name] = (_hdf5_attribute(attrs, akey, path, budget), "attribute")
                break


@contextlib.contextmanager
def _collecting(loaded: LoadedFile, name: str, collect: bool) -> Iterator[None]:
    """With ``collect``, one tensor's InputFileError is recorded instead of ending the read."""
    try:
        yield
    except InputFileError as err:
        if not collect:
            raise
        loaded.errors[name] = err


def _hdf5_walk(fh, start, target: str, path: Path, h5py, what: str, depth: int = 0):
    """The object at ``target`` (relative to ``start``), following links one at a time, never out of the file.

    Returns None when nothing is there; refuses external links, dangling soft links, soft-link loops
    and link types HDF5 plugins define.
    """
    if depth > MAX_LINK_DEPTH:
        raise InputFileError(f"{path}: {what}: more than {MAX_LINK_DEPTH} soft links in a row (a loop?); refused")
    current = fh if target.startswith("/") else start
    for part in (p for p in target.split("/") if p and p != "."):
        if not isinstance(current, h5py.Group):
            return None
        if part not in current:  # one link name: checks the link itself, following nothing
            return None
        link = current.get(part, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            raise InputFileError(f"{path}: {what} is an external link to {link.filename!r}:{link.path!r} "
                                 "(data outside this file); refused")
        if isinstance(link, h5py.SoftLink):
            obj = _hdf5_walk(fh, current, link.path, path, h5py, what, depth + 1)
            if obj is None:
                raise InputFileError(f"{path}: {what} is a soft link to {link.path!r}, which does not exist "
                                     "in this file (a dangling link); refused")
            current = obj
        elif isinstance(link, h5py.HardLink):
            current = current[part]
        else:
            raise InputFileError(f"{path}: {what} is a {type(link).__name__} (not a hard or soft link); refused")
    return current


def _hdf5_dataset(fh, node, key: str, path: Path, h5py, budget: _Budget, lazy: bool = False):
    obj = _hdf5_walk(fh, node, key, path, h5py, key)
    if not isinstance(obj, h5py.Dataset):
        kind = "group" if isinstance(obj, h5py.Group) else type(obj).__name__.lower()
        raise InputFileError(f"{path}: {key} is a {kind}, not a dataset")
    if obj.is_virtual:
        raise InputFileError(f"{path}: {key} is a virtual dataset (data from other files); refused")
    dcpl = obj.id.get_create_plist()
    if dcpl.get_external_count():
        raw = dcpl.get_external(0)[0].decode("utf-8", "replace")
        raise InputFileError(f"{path}: {key} keeps its data in an external raw file ({raw!r}); refused")
    _check_filters(dcpl, key, path)
    shape, dtype = obj.shape, obj.dtype
    if shape is None:
        raise InputFileError(f"{path}: {key} has no data (an HDF5 null dataspace); expected an array")
    if dtype.hasobject:
        raise InputFileError(f"{path}: {key} has a variable-length or reference type ({_hdf5_type(obj)}); "
                             "expected a numeric array")
    if obj.chunks is not None:  # a chunk is decompressed whole: a huge chunk is a memory bomb too
        chunk_bytes = math.prod(obj.chunks) * dtype.itemsize
        if chunk_bytes > budget.limit:
            budget.take(key, obj.chunks, dtype, what="chunks of ")
    if lazy and len(shape) >= 1 and dtype.isnative and dtype.kind == "f":
        budget.check_slice(key, shape, dtype)
        return LazyDataset(obj, key, path)  # read later, a slice of time steps at a time
    budget.take(key, shape, dtype)
    try:
        return _native(np.asarray(obj[()]))
    except MemoryError:
        raise InputFileError(f"{path}: {key} does not fit in memory") from None
    except _HDF5_ERRORS as err:
        raise InputFileError(f"{path}: {key} cannot be read ({_reason(err)})") from None


def _check_filters(dcpl, key: str, path: Path) -> None:
    """Name a compression filter this HDF5 cannot run (HDF5's own message only says a plugin is missing)."""
    from h5py import h5z  # noqa: PLC0415

    for index in range(dcpl.get_nfilters()):
        code, _flags, _values, name = dcpl.get_filter(index)
        if not h5z.filter_avail(code):
            label = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
            label = f" ({label!r})" if label else ""
            raise InputFileError(f"{path}: {key} is compressed with HDF5 filter {code}{label}, which is not "
                                 "available here; install its plugin (e.g. the hdf5plugin package)")


def _hdf5_attribute(attrs, akey: str, path: Path, budget: _Budget) -> np.ndarray:
    try:
        attr = attrs.get_id(akey)
        shape, dtype = attr.shape, attr.dtype
        if shape is not None and not dtype.hasobject:
            budget.take(f"attribute {akey}", shape, dtype)
        return _native(np.asarray(attrs[akey]))
    except LstmGradError:
        raise
    except MemoryError:
        raise InputFileError(f"{path}: attribute {akey} does not fit in memory") from None
    except _HDF5_ERRORS as err:
        raise InputFileError(f"{path}: attribute {akey} cannot be read ({_reason(err)})") from None


def _hdf5_type(obj) -> str:
    import h5py  # noqa: PLC0415

    dtype = obj.dtype
    if h5py.check_string_dtype(dtype) is not None:
        return "variable-length strings"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable-length sequences"
    if h5py.check_ref_dtype(dtype) is not None:
        return "object references"
    return "objects"


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:300] + "..."


# -- output -------------------------------------------------------------------------------------

def output_format(path: Path) -> str:
    fmt = OUTPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise OutputFileError(f"{path}: unknown output extension {path.suffix!r}; use .npz, .h5 or .hdf5")
    return fmt


def default_output(input_path: Path, input_format: str) -> Path:
    """``<stem>.grads.<ext>`` beside the input, in the input's format."""
    suffix = input_path.suffix.lower()
    ext = suffix if OUTPUT_FORMATS.get(suffix) == input_format else (".npz" if input_format == "npz" else ".h5")
    stem = input_path.name[: -len(input_path.suffix)] if OUTPUT_FORMATS.get(suffix) else input_path.name
    return input_path.with_name(f"{stem}.grads{ext}")


def check_output(path: Path, force: bool, inputs: Iterable[Path] = ()) -> str:
    """Refuse, before any work, an output that could not or must not be written; returns its format."""
    fmt = output_format(path)
    try:
        for source in inputs:
            if _same_file(path, source):
                raise OutputFileError(f"{path}: output path is the input file; choose another output")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise OutputFileError(f"{path}: output directory {parent} does not exist")
        if path.is_dir():
            raise OutputFileError(f"{path}: is a directory")
        if path.exists() and not force:
            raise OutputFileError(f"{path}: already exists; use --force to overwrite")
    except OSError as err:  # e.g. a name longer than the file system allows
        raise OutputFileError(f"{path}: cannot write there: {_os_reason(err)}") from None
    return fmt


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_outputs(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, object],
                  force: bool = False) -> Path:
    """Write ``tensors`` (in order) and provenance ``metadata`` atomically to ``path`` (.npz/.h5/.hdf5).

    The data goes to a temporary file beside ``path``, is flushed to disk, and is renamed into place
    only when complete.  On any failure the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    with _atomic_file(path, force) as tmp:
        if output_format(path) == "npz":
            with open(tmp, "wb") as fh:
                _write_npz(fh, tensors, metadata)
        else:
            with _hdf5_writer(tmp) as out:
                for name, value in tensors.items():
                    out.create_dataset(name, data=value)
                write_metadata(out, metadata)
    return path


@contextlib.contextmanager
def open_hdf5_output(path: str | os.PathLike, force: bool = False) -> Iterator[object]:
    """An open HDF5 output for the block to fill (datasets written chunk by chunk), published
    atomically when the block ends, exactly as ``write_outputs`` does; on any failure nothing stays."""
    path = Path(path)
    if output_format(path) != "hdf5":
        raise OutputFileError(f"{path}: streaming output needs an .h5 or .hdf5 file")
    with _atomic_file(path, force) as tmp, _hdf5_writer(tmp) as out:
        yield out


def write_metadata(out, metadata: Mapping[str, object]) -> None:
    """Provenance as root attributes of an open HDF5 output."""
    for key, value in metadata.items():
        out.attrs[key] = "" if value is None else value


@contextlib.contextmanager
def _atomic_file(path: Path, force: bool) -> Iterator[Path]:
    """A temporary file beside ``path`` for the block to fill; fsynced and renamed into place after.

    On any failure the temporary file is removed and ``path`` is untouched.
    """
    output_format(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        # A short prefix: a target name near NAME_MAX must not fail only because of the temporary name.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=parent)
    except OSError as err:
        raise OutputFileError(_create_failure(path, parent, err)) from None
    tmp = Path(tmp_name)
    try:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        os.close(fd)
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        _publish(tmp, path, force)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, RuntimeError) and _errno_in(err) is not None:  # h5py's way of saying EFBIG/ENOSPC
            err = OSError(_errno_in(err), str(err))
        if isinstance(err, OSError):
            raise OutputFileError(f"{path}: cannot write: {_os_reason(err)}; nothing was written") from None
        raise
    _fsync_dir(parent)


def _create_failure(path: Path, parent: Path, err: OSError) -> str:
    if err.errno == errno.ENOENT:
        return f"{path}: output directory {parent} does not exist"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{path}: permission denied: cannot create a file in {parent}"
    if err.errno == errno.EROFS:
        return f"{path}: {parent} is on a read-only file system"
    if err.errno == errno.ENOTDIR:
        return f"{path}: {parent} is not a directory"
    return f"{path}: cannot create a file in {parent}: {_os_reason(err)}"


def _umask() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every filesystem lets a directory be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(tmp: Path, path: Path, force: bool) -> None:
    if force:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if the target appeared meanwhile: never clobber without --force
    except FileExistsError:
        raise OutputFileError(f"{path}: already exists; use --force to overwrite") from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if path.exists():
            raise OutputFileError(f"{path}: already exists; use --force to overwrite") from None
        os.replace(tmp, path)  # filesystems without hard links
        return
    tmp.unlink()


_HDF5_ERRNO = re.compile(r"errno\s*=\s*(\d+)")


def _errno_in(err: BaseException) -> int | None:
    """The C errno an h5py error carries only in its message (``errno = 28``), if any."""
    match = _HDF5_ERRNO.search(str(err))
    return int(match.group(1)) if match else None


def _os_reason(err: OSError) -> str:
    code = err.errno
    if code is None:  # h5py's OSErrors carry the C errno only in their message
        code = _errno_in(err)
    if code == errno.ENOSPC:
        return "no space left on device"
    if code == errno.EDQUOT:
        return "disk quota exceeded"
    if code == errno.EFBIG:
        return "file too large (file size limit reached)"
    if code == errno.EROFS:
        return "read-only file system"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if code is not None and err.errno is None:
        return os.strerror(code)
    return err.strerror or _reason(err)


def _write_npz(fh, tensors, metadata) -> None:
    arrays = dict(tensors)
    arrays[METADATA_KEY] = np.array(json.dumps(dict(metadata), sort_keys=True))
    np.savez(fh, **arrays)


@contextlib.contextmanager
def _hdf5_writer(target: Path):
    """An HDF5 file open for writing; write errors (disk full) surface as exceptions, never at a silent close."""
    import h5py  # noqa: PLC0415

    out = h5py.File(target, "w", track_order=True)
    try:
        yield out
        out.flush()  # a write error (disk full) surfaces here as an exception, not silently at close
    except BaseException:
        # Closing after a failed write fails again (h5py raises RuntimeError from close); the first error counts.
        with contextlib.suppress(Exception):
            out.close()
        raise
    try:
        out.close()
    except RuntimeError as err:  # h5py reports some write failures (EFBIG, ENOSPC) only when closing
        raise OSError(_errno_in(err), str(err)) from None


def read_metadata(path: str | os.PathLike) -> dict:
    """The provenance an output file carries (NPZ metadata entry or HDF5 root attributes)."""
    path = Path(path)
    if sniff_format(path) == "npz":
        loaded = read_inputs(path, [], [METADATA_KEY])
        if METADATA_KEY not in loaded.scalars:
            return {}
        try:
            return json.loads(str(loaded.scalars[METADATA_KEY][0]))
        except ValueError:
            raise InputFileError(f"{path}: its {METADATA_KEY} entry is not valid JSON") from None
    import h5py  # noqa: PLC0415

    try:
        with h5py.File(path, "r") as fh:
            return {k: (v.item() if hasattr(v, "item") else v) for k, v in fh.attrs.items()}
    except _HDF5_ERRORS as err:
        raise InputFileError(f"{path}: corrupt HDF5 file ({_reason(err)})") from None
