"""What every reader shares: the loaded-file record, tensor names, the memory budget, messages.

Nothing here opens a file of a particular format; the format modules (npz.py, hdf5.py, npydir.py)
do, and all of them refuse a tensor through ``Budget`` before allocating it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputFileError, LstmGradError
from ..messages import cut

METADATA_KEY = "__lstmgrad__"
MAX_BYTES_ENV = "LSTMGRAD_MAX_TENSOR_BYTES"
READ_CHUNK = 1 << 20


@dataclass
class LoadedFile:
    """What was read from one input: the tensors asked for, scalar parameters, and what else is there."""

    path: Path
    format: str  # a name in io.FORMATS: "hdf5", "npz", "npy-dir", ...
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, tuple[object, str]] = field(default_factory=dict)  # name -> (value, "tensor"|"attribute")
    keys: list[str] = field(default_factory=list)  # every entry of the group, as stored
    errors: dict[str, InputFileError] = field(default_factory=dict)  # with collect_errors: tensor -> why unreadable
    info: dict = field(default_factory=dict)  # what a container format knows besides tensors (tfdbg2: the op run)
    header_only: frozenset = frozenset()  # names to declare and never read (``headers``: inspect's unused entries)
    headers: dict[str, tuple[tuple, np.dtype]] = field(default_factory=dict)  # their (shape, dtype), as declared


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path, label=None, refusal: str = "; refused"):
    """``path`` opened for reading (a binary file object) if it is a regular file.  A FIFO, socket or device is
    refused at once: it is recognised by ``stat`` before opening, and opened with O_NONBLOCK so that one put in
    its place meanwhile cannot block the open (a FIFO's open waits for a writer) before ``fstat`` refuses it."""
    label = label or path
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise InputFileError(f"{label}: is not a regular file ({file_kind(info.st_mode)}){refusal}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{label}: is not a regular file ({file_kind(info.st_mode)}){refusal}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise



@functools.lru_cache(maxsize=1024)  # asked for every tensor name of every file a batch reads
def camel(name: str) -> str:
    """The camelCase spelling of TensorFlow's Java API (cs_prev -> csPrev), accepted beside snake_case."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def key_for(name: str, keys: Iterable[str], path: Path) -> str | None:
    """The key ``name`` has in ``keys``: itself or its camelCase spelling (``camel``); None when neither is there.
    Asked for every name a file may hold, most of them absent: two lookups, nothing built."""
    other = camel(name)
    if name in keys:
        if other != name and other in keys:
            raise InputFileError(f"{path}: both {name!r} and {other!r} are present; keep one")
        return name
    return other if other != name and other in keys else None


def describe_keys(keys: Iterable[str], limit: int = 20, width: int = 60) -> str:
    """Key names for a one-line message: control characters escaped, long names cut (saying so), long lists counted.

    Key names come from the file, so they may hold terminal escape sequences, newlines or thousands
    of characters; messages that list them should use this rather than joining them raw.
    """
    keys = list(keys)
    shown = [cut(key, width) for key in keys[:limit]]
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
    return memory_bytes() // 2


@functools.cache
def memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when that is smaller (containers); read once a process."""
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


def human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} bytes"  # pragma: no cover


MAX_RANK = 32  # dimensions a declared shape may have (numpy allows 64; no tensor lstmgrad reads has more than 3)
MAX_ARRAY_BYTES = (1 << 63) - 1  # the non-zero dimensions times the itemsize: past it numpy has no array, even empty


def shape_text(shape, limit: int = 8) -> str:
    """A declared shape for a message: ``[5, 3, 4]``, or its first dimensions and how many there are."""
    dims = [int(n) for n in list(shape)[:limit + 1]]
    if len(shape) <= limit:
        return str(dims)
    return f"[{', '.join(str(n) for n in dims[:limit])}, ... ({len(shape)} dimensions)]"


class Budget:
    """The bytes a file's tensors may still occupy; refuses a tensor before it is allocated.

    ``kind``: the kind of op ("seq" or "cell") the tensors are read for, when the caller knows it (declared.py
    checks ranks with it); None when it is not known yet.
    """

    def __init__(self, path: Path, kind: str | None = None):
        self.path = path
        self.kind = kind
        self.limit = max_tensor_bytes()
        self.used = 0

    def check_shape(self, key: str, shape: tuple, itemsize: int = 1) -> None:
        """A shape an array of ``itemsize`` could have: not negative, at most ``MAX_RANK`` dimensions, a size numpy
        can represent (even with a dimension 0: numpy refuses [0, 2**62] of float32)."""
        if len(shape) > MAX_RANK:
            raise InputFileError(f"{self.path}: {key} declares {len(shape)} dimensions (shape {shape_text(shape)}); "
                                 f"no tensor has more than {MAX_RANK}; refused")
        if any(n < 0 for n in shape):
            raise InputFileError(f"{self.path}: {key} declares a negative dimension (shape {shape_text(shape)}); "
                                 "refused")
        # (without a dimension 0 the size is the budget's to bound)
        if 0 in shape and math.prod(int(n) for n in shape if n) * max(itemsize, 1) > MAX_ARRAY_BYTES:
            raise InputFileError(f"{self.path}: {key} declares shape {shape_text(shape)}, which no array can have "
                                 "(its dimensions multiply past 2**63 bytes); refused")

    def take(self, key: str, shape: tuple, dtype: np.dtype, what: str = "") -> int:
        self.check_shape(key, shape, dtype.itemsize)
        nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
        if self.used + nbytes > self.limit:
            also = f" on top of {human(self.used)} already read" if self.used else ""
            raise InputFileError(
                f"{self.path}: {key} declares {what}shape {shape_text(shape)} of {dtype_text(dtype)} = "
                f"{human(nbytes)} ({nbytes} bytes){also}, more than the {human(self.limit)} limit ({self.source()}; "
                f"set {MAX_BYTES_ENV} to change it); refused before reading")
        self.used += nbytes
        return nbytes

    def check_slice(self, key: str, shape: tuple, dtype: np.dtype) -> None:
        """A tensor read one time step at a time: one step (``shape[1:]``) must fit in the limit."""
        self.check_shape(key, shape, dtype.itemsize)
        step = math.prod(int(n) for n in shape[1:]) * dtype.itemsize
        if step > self.limit:
            total = math.prod(int(n) for n in shape) * dtype.itemsize
            raise InputFileError(
                f"{self.path}: {key} declares shape {shape_text(shape)} of {dtype_text(dtype)} = {human(total)} "
                f"({total} bytes), and one time step of it ({human(step)}) is more than the {human(self.limit)} "
                f"limit ({self.source()}; set {MAX_BYTES_ENV} to change it); refused before reading")

    @staticmethod
    def source() -> str:
        return MAX_BYTES_ENV if os.environ.get(MAX_BYTES_ENV, "").strip() else "half of this machine's memory"


def dtype_text(dtype: np.dtype) -> str:
    return "object" if dtype.hasobject else str(dtype)


def native(array: np.ndarray) -> np.ndarray:
    """Numbers in this machine's byte order (a file from a big-endian machine is fine)."""
    if array.dtype.kind in "biufc" and not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="))
    return array


@contextlib.contextmanager
def collecting(loaded: LoadedFile, name: str, collect: bool) -> Iterator[None]:
    """With ``collect``, one tensor's InputFileError is recorded instead of ending the read."""
    try:
        yield
    except InputFileError as err:
        if not collect:
            raise
        loaded.errors[name] = err



@contextlib.contextmanager
def worded(path: Path, errors: tuple[type[BaseException], ...], word: Callable[[BaseException], str],
           out_of_memory: str | None = None) -> Iterator[None]:
    """Reading ``path``: each of ``errors`` (the layers below a reader: zipfile, h5py, the OS) becomes one
    InputFileError, ``"{path}: {word(err)}"``, and a MemoryError ``"{path}: {out_of_memory}"``; the package's own
    errors pass as they are."""
    try:
        yield
    except LstmGradError:
        raise
    except MemoryError:
        if out_of_memory is None:
            raise
        raise InputFileError(f"{path}: {out_of_memory}") from None
    except errors as err:
        raise InputFileError(f"{path}: {word(err)}") from None


def reason(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:300] + "..."




# -- JSON documents inside files ------------------------------------------------------------------------

def json_extent(text: bytes, chunk: int = 1 << 18) -> tuple[int, int]:
    """(deepest nesting, values) of a JSON text, counted before a parser builds anything: in linear time and a few
    MB whatever the text (a chunk at a time), from the brackets, commas and colons outside strings (a quote after an
    odd run of backslashes does not end a string).  Values: one, and one more for each comma, each colon (an
    object's value; its key is its comma's or its first) and each container not empty (its first element).  In
    text that is not JSON the numbers are only estimates."""
    depth = deepest = separators = 0
    inside = False  # in a string where the previous chunk ended
    run = 0  # backslashes the previous chunk ended with
    last = 0  # the last character outside strings and whitespace the previous chunk ended with
    for lo in range(0, len(text), chunk):
        u8 = np.frombuffer(text, np.uint8, count=min(chunk, len(text) - lo), offset=lo)
        at = np.arange(len(u8))
        other = np.maximum.accumulate(np.where(u8 == 92, -1, at))  # the last non-backslash at or before each
        before = np.empty(len(u8), np.int64)  # backslashes just before each character
        before[0] = run
        before[1:] = np.where(other[:-1] >= 0, at[:-1] - other[:-1], at[:-1] + 1 + run)
        quotes = np.cumsum((u8 == 34) & (before % 2 == 0)) + inside  # real quotes so far: odd inside a string
        outside = quotes % 2 == 0
        opens = ((u8 == 91) | (u8 == 123)) & outside
        closes = ((u8 == 93) | (u8 == 125)) & outside
        levels = depth + np.cumsum(opens.astype(np.int64) - closes)
        deepest = max(deepest, int(levels.max(initial=0)))
        depth = int(levels[-1])
        separators += int(np.count_nonzero(opens)) + int(np.count_nonzero(((u8 == 44) | (u8 == 58)) & outside))
        significant = u8[outside & ~np.isin(u8, _JSON_SPACE) | (u8 == 34)]  # (a closing quote is outside)
        pairs = np.concatenate(([last], significant))
        separators -= int(np.count_nonzero(np.isin(pairs[:-1], _JSON_OPENS) & np.isin(pairs[1:], _JSON_CLOSES)))
        last = int(pairs[-1])
        inside = bool(quotes[-1] % 2)
        run = len(u8) - 1 - int(other[-1]) if other[-1] >= 0 else run + len(u8)
    return deepest, separators + 1


_JSON_SPACE = np.frombuffer(b" \t\r\n", np.uint8)
_JSON_OPENS, _JSON_CLOSES = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_document(text: bytes, label: str, max_depth: int, max_values: int):
    """The JSON document ``text`` (UTF-8), refused (``"{label} nests ..."``, ``"{label} holds ..."``) before it is
    parsed when it nests deeper than ``max_depth`` (the parser recurses once a level) or holds more than
    ``max_values`` values (what bounds the memory parsing takes: a value is 50 to 100 bytes once parsed, however
    short its text: ``[[], [], ...]``)."""
    deepest, values = json_extent(text)
    if deepest > max_depth:
        raise InputFileError(f"{label} nests {deepest} levels deep (at most {max_depth}); refused before parsing")
    if values > max_values:
        raise InputFileError(f"{label} holds {values} JSON values (at most {max_values}); refused before parsing")
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise InputFileError(f"{label} is not valid JSON ({reason(err)})") from None


@dataclass(frozen=True)
class Format:
    """One input format in ``io.FORMATS``: how to recognise it by content and how to read it.

    ``sniff`` gets the first bytes of a file (``HEAD_BYTES``), or for a directory format the names of
    the directory's entries; ``open(path, names, scalars, group, lazy, collect_errors, kind)`` is a context
    manager yielding the ``LoadedFile``.
    """

    name: str
    description: str  # for messages: "an NPZ file"
    directory: bool
    sniff: object
    open: object
    output_format: str = "npz"  # the format of the default output beside such an input
    listed: bool = True  # named in "not an HDF5, NPZ or ... file" (a Keras archive is a kind of zip, not listed)
    suffixes: tuple[str, ...] = ()  # a file format's names: a folder given as an input gives the files that bear
    in_folders: bool = True  # ... them, unless they are never a run's tensors (a Keras archive is a --weights file)


HEAD_BYTES = 8192 + 8  # enough for HDF5's signature at any of its user-block offsets
