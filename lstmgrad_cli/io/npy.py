"""One ``.npy`` stream, parsed without unpickling: an NPZ member or a ``.npy`` file of a directory.

The header is checked (no object arrays, a declared size within the budget and within the bytes
the stream holds) before the data is read, and the data is read in bounded chunks.
"""

from __future__ import annotations

import lzma
import tokenize
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from ._common import READ_CHUNK, Budget, native, reason

NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_HEADER = 10000  # numpy's own limit for a .npy header it will parse


def read_npy(fp, size: int, key: str, path: Path, budget: Budget, container: str = "member") -> np.ndarray:
    """The array of a ``.npy`` stream ``fp`` of ``size`` bytes (a zip ``member`` or a ``file``); InputFileError
    for anything wrong with it.

    The stream's own read errors (a zip layer's CRC or decompression errors) propagate for the
    caller to word.
    """
    shape, fortran_order, dtype = npy_header(fp, key, path)
    if dtype.hasobject:
        raise InputFileError(f"{path}: {key} is a pickled object array (dtype {dtype}); "
                             "lstmgrad never unpickles; refused")
    if dtype.itemsize == 0:
        raise InputFileError(f"{path}: {key} has a zero-size dtype ({dtype.str}); expected numbers")
    nbytes = budget.take(key, shape, dtype)
    available = size - fp.tell()
    if nbytes > available:
        raise InputFileError(f"{path}: {key} is truncated: its header declares shape {list(shape)} of {dtype} "
                             f"= {nbytes} bytes but the {container} holds only "
                             f"{max(available, 0)}")
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
                             f"not a valid .npy {container}")
    try:
        if nbytes == 0:
            array = np.zeros(shape, dtype=dtype)
        else:
            array = data.view(dtype).reshape(shape, order="F" if fortran_order else "C")
    except (ValueError, TypeError, MemoryError) as err:
        raise InputFileError(
            f"{path}: {key} cannot be read as {dtype} of shape {list(shape)} ({reason(err)})") from None
    return native(array)


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
