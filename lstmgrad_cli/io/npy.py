"""One ``.npy`` stream, parsed without unpickling: an NPZ member or a ``.npy`` file of a directory.

The header is checked (no object arrays, a declared size within the budget and within the bytes
the stream holds) before the data is read, and the data is read in bounded chunks.  A small stream
(at most ``WHOLE_READ`` bytes) is read in one call, and a header as numpy writes it is parsed by a
pattern instead of numpy's ``ast.literal_eval`` (~70 us each, most of the time of reading a batch of
small files); any other header goes to numpy's parser.
"""

from __future__ import annotations

import contextlib
import io
import lzma
import math
import re
import tokenize
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from ._common import READ_CHUNK, Budget, LoadedFile, key_for, native, reason
from .declared import Declared, checked, read_checked
from .lazy import LazyRows, rows_of, worth_leaving

NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_HEADER = 10000  # numpy's own limit for a .npy header it will parse
WHOLE_READ = 1 << 20  # streams up to this size are read in one call
HEADER_READ = 16 + NPY_MAX_HEADER  # the most of a stream its header can take (magic, version, length, text)
# The header numpy writes: {'descr': '<f4', 'fortran_order': False, 'shape': (20, 16, 64), } padded to 64 bytes.
CANONICAL_HEADER = re.compile(r"\{'descr': '([<>|=]?[a-zA-Z]\d{0,4})', 'fortran_order': (True|False), "
                              r"'shape': \(((?:\d{1,18}, )*\d{1,18},?)?\), \} *\n")


class NpyStream:
    """A ``.npy`` stream ``fp`` of ``size`` bytes (a zip ``member`` or a ``file``) whose header has been parsed
    (``shape``, ``dtype``; object arrays refused) and none of whose data has been read yet: ``read()`` reads it,
    once the caller has checked the declaration.  InputFileError for anything wrong with it; the stream's own
    read errors (a zip layer's CRC or decompression errors) propagate for the caller to word."""

    def __init__(self, fp, size: int, key: str, path: Path, container: str = "member"):
        self.key, self.path, self.container = key, path, container
        self.blob = None
        if size <= WHOLE_READ:  # read whole at once (a zip member's CRC is checked on reaching its end)
            self.blob = _read_whole(fp, size, key, path, container)
            fp, size = io.BytesIO(memoryview(self.blob)[:HEADER_READ]), len(self.blob)  # (the header's reads)
        self.fp, self.size = fp, size
        self.shape, self.fortran_order, self.dtype = npy_header(fp, key, path)
        if self.dtype.hasobject:
            raise InputFileError(f"{path}: {key} is a pickled object array (dtype {self.dtype}); "
                                 "lstmgrad never unpickles; refused")
        if self.dtype.itemsize == 0:
            raise InputFileError(f"{path}: {key} has a zero-size dtype ({self.dtype.str}); expected numbers")
        self.start = fp.tell()
        self.verified = False

    def verify(self) -> None:
        """The declared size is what the stream holds after the header (no more, no less)."""
        path, key, container, shape, dtype = self.path, self.key, self.container, self.shape, self.dtype
        nbytes = math.prod(shape) * dtype.itemsize
        available = self.size - self.start
        if nbytes > available:
            raise InputFileError(f"{path}: {key} is truncated: its header declares shape {list(shape)} of {dtype} "
                                 f"= {nbytes} bytes but the {container} holds only {max(available, 0)}")
        if nbytes < available:
            raise InputFileError(f"{path}: {key} has data after the array it declares (shape {list(shape)}); "
                                 f"not a valid .npy {container}")
        self.verified = True

    def read(self) -> np.ndarray:
        """The array, read in bounded chunks (its size verified first)."""
        if not self.verified:
            self.verify()
        path, key, container, shape, dtype = self.path, self.key, self.container, self.shape, self.dtype
        nbytes = math.prod(shape) * dtype.itemsize
        fp = self.fp
        if self.blob is not None:  # the stream's bytes, read whole (and verified: its size, the CRC): no copy
            data = np.frombuffer(self.blob, dtype=np.uint8, count=nbytes, offset=self.start)
        else:
            data = np.empty(nbytes, dtype=np.uint8)
            pos = 0
            view = memoryview(data)
            while pos < nbytes:  # straight into the array, a bounded chunk at a time
                got = fp.readinto(view[pos:pos + min(READ_CHUNK, nbytes - pos)])
                if not got:
                    raise InputFileError(f"{path}: {key} is truncated: {pos} of {nbytes} bytes of data")
                pos += got
            if fp.read(1):  # reading to the end also makes zipfile verify the CRC
                raise InputFileError(f"{path}: {key} has data after the array it declares (shape {list(shape)}); "
                                     f"not a valid .npy {container}")
        try:
            if nbytes == 0:
                array = np.zeros(shape, dtype=dtype)
            else:
                array = data.view(dtype).reshape(shape, order="F" if self.fortran_order else "C")
        except (ValueError, TypeError, MemoryError) as err:
            raise InputFileError(
                f"{path}: {key} cannot be read as {dtype} of shape {list(shape)} ({reason(err)})") from None
        return native(array)


def left_in_file(stream: NpyStream) -> bool:
    """Whether a stream asked for lazily may be left in its file (``LazyNpy``): C-ordered native floats with a time
    axis, too large to have been read whole, large enough to gain from it (``lazy.worth_leaving``)."""
    return (stream.blob is None and not stream.fortran_order and bool(stream.shape) and stream.dtype.kind == "f"
            and stream.dtype.isnative and worth_leaving(stream.shape, stream.dtype))


class LazyNpy(LazyRows):
    """A ``.npy`` stream's data left in its file (``lazy.LazyRows``): rows read with ``pread`` from the descriptor
    ``fd``, the first row at byte ``offset``, while ``closed()`` is false."""

    def __init__(self, fd: int, offset: int, stream: NpyStream, key: str, path: Path, closed):
        super().__init__(stream.shape, stream.dtype, key, path)
        self._fd, self._offset, self._closed = fd, offset, closed

    def _read(self, index) -> np.ndarray:
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        rows = rows_of(first, self.shape[0])
        if rows is None and isinstance(first, slice) and first.step in (None, 1):
            rows = (0, 0)  # an empty range of rows: nothing to read
        if rows is None:  # any other index: of the whole array
            return self[:][index]
        lo, hi = rows
        out = np.empty((hi - lo, *self.shape[1:]), dtype=self.dtype)
        if hi > lo:
            self._read_rows(lo, hi, out)
        if isinstance(first, int | np.integer):
            return out[0][rest]
        return out[(slice(None), *rest)] if rest else out

    def _read_rows(self, lo: int, hi: int, out: np.ndarray) -> None:
        if self._closed():  # its descriptor may belong to another file now
            raise InputFileError(f"{self._path}: {self._key} cannot be read (the file was closed)")
        self._pread(self._fd, self._offset, lo, hi, out)


def _read_whole(fp, size: int, key: str, path: Path, container: str) -> bytearray:
    """A stream of at most ``WHOLE_READ`` bytes (its ``size``), read whole into a bytearray the array is then a
    view of (writable, so no copy)."""
    blob = bytearray(size + 1)
    view, got = memoryview(blob), 0
    while got <= size:
        n = fp.readinto(view[got:])
        if not n:
            break
        got += n
    del view
    if got > size:
        raise InputFileError(f"{path}: {key} holds more bytes than its {container} size; not a valid .npy "
                             f"{container}")
    del blob[got:]
    return blob


def read_npy(fp, size: int, key: str, path: Path, budget: Budget, container: str = "member") -> np.ndarray:
    """The array of a ``.npy`` stream, its declared size taken from ``budget`` before it is read."""
    stream = NpyStream(fp, size, key, path, container)
    budget.take(key, stream.shape, stream.dtype)
    return stream.read()


def npy_header(fp, key: str, path: Path):
    """(shape, fortran_order, dtype) of a .npy stream, parsed without unpickling anything."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
    except ValueError:
        raise InputFileError(f"{path}: {key} is not a numpy array (not in .npy format)") from None
    impl = getattr(getattr(np.lib, "_format_impl", fmt), "_read_array_header", None)
    if version not in ((1, 0), (2, 0)) and impl is None:
        raise InputFileError(f"{path}: {key} uses .npy format version {version}, which this numpy cannot read")
    if version in ((1, 0), (2, 0), (3, 0)):  # (3.0: 2.0's layout, UTF-8 text; numpy's reader would take any length)
        length_bytes = fp.read(2 if version == (1, 0) else 4)
        length = int.from_bytes(length_bytes, "little")
        if len(length_bytes) in (2, 4) and length <= NPY_MAX_HEADER:
            header = fp.read(length)
            parsed = _canonical_header(header) if len(header) == length else None
            if parsed is not None:
                return parsed
            fp = io.BytesIO(length_bytes + header)  # numpy's parser, for its checks and messages
        else:
            fp = io.BytesIO(length_bytes)
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
        raise InputFileError(f"{path}: {key} has a corrupt .npy header ({reason(err)})") from None


def _canonical_header(header: bytes):
    """(shape, fortran_order, dtype) of a header exactly as numpy writes it, or None for any other."""
    match = CANONICAL_HEADER.fullmatch(header.decode("latin1"))
    if match is None:
        return None
    descr, fortran, dims = match.groups()
    try:
        dtype = np.dtype(descr)
    except TypeError:
        return None  # numpy's parser words the error
    shape = tuple(int(d) for d in dims.split(",") if d.strip()) if dims else ()
    return shape, fortran == "True", dtype


def read_npy_tensors(loaded: LoadedFile, keys, open_stream, names, scalars, collect_errors: bool, kind,
                     lazy_read=None) -> None:
    """The tensors ``names`` (and ``scalars``) of a container of .npy streams, each declared from its header before
    any is read (``declared.checked``), then read.  ``open_stream(key, opened)`` gives the name stored, the key's
    NpyStream (entered into the ExitStack ``opened``) and how to read it; every stream is closed at the end.
    ``lazy_read(name, stored, stream)``, when given, says how to leave a tensor in its file (a ``lazy.LazyRows``),
    or None to read it into memory."""
    path = loaded.path
    with contextlib.ExitStack() as opened:
        def declare(name: str) -> Declared | None:
            key = key_for(name, keys, path)
            if key is None:
                return None
            stored, stream, read = open_stream(key, opened)
            left = lazy_read(name, stored, stream) if lazy_read is not None else None
            return Declared(name, stored, stream.shape, stream.dtype, left or read, lazy=left is not None,
                            verify=stream.verify)

        read_checked(loaded, checked(loaded, Budget(path, kind), names, scalars, declare), scalars, collect_errors)
