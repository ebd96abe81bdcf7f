"""A directory of ``.npy`` files, one tensor per file (``x.npy``, ``cs_prev.npy``, ...): one input.

Many dump scripts save tensors this way (``np.save(f"{name}.npy", value)``).  The tensor's name is
the file's stem; a group is a subdirectory, and the directory given may then hold nothing but subdirectories
(``run/`` with ``--group step3``: ``sniff_group``).  Each file is parsed as NPZ members are (``npy.py``):
never unpickled, every header declared and checked (declared.py) before any data is read.
Only regular files are read (a FIFO or device named ``x.npy`` is refused); other files are ignored.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path, PurePosixPath

from ..errors import InputFileError
from ..messages import cut
from ._common import Format, LoadedFile, open_regular, reason, worded
from .npy import LazyNpy, NpyStream, left_in_file, read_npy_tensors
from .tfdbg import sniff as _is_dump

SUFFIX = ".npy"
# A directory holding these is a batch of inputs, not one input made of .npy files.
_BATCH_SUFFIXES = (".npz", ".h5", ".hdf5", ".safetensors")


def sniff(names: list[str]) -> bool:
    """A directory of .npy files (and no NPZ/HDF5 files, which would make it a batch of inputs)."""
    lower = [n.lower() for n in names]
    return any(n.endswith(SUFFIX) for n in lower) and not any(n.endswith(_BATCH_SUFFIXES) for n in lower)


def sniff_group(path: str | os.PathLike, group: str | None) -> bool:
    """Whether ``path`` read with ``group`` is one directory of .npy files whose tensors sit in the subdirectory
    ``group``, though ``path`` holds no input of its own: no .npy file, none of the files that make a directory
    a batch (.npz, .h5, ...) and no TensorFlow debug dump.  Without a group such a directory is a batch of its
    subdirectories (docs/batches.md), which is all ``io.sniff_format``, given the path alone, can say of it.
    """
    if not group:
        return False
    try:
        names = os.listdir(path)
        inner = os.listdir(Path(path) / group.strip("/"))  # (a group leaving the directory: the read refuses it)
    except (OSError, ValueError):  # ValueError: an embedded NUL byte
        return False
    lower = [n.lower() for n in names]
    if any(n.endswith((SUFFIX, *_BATCH_SUFFIXES)) for n in lower) or _is_dump(names):
        return False
    return sniff(inner)


def input_format(path: str | os.PathLike, group: str | None = None) -> str:
    """``io.sniff_format(path)``, knowing the group: a directory that is one input through its ``group``
    subdirectory (``sniff_group``) is a directory of .npy files."""
    if sniff_group(path, group):
        return FORMAT.name
    from . import sniff_format  # (io imports this module)

    return sniff_format(path)


@contextlib.contextmanager
def open_npy_dir(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None, headers=()):
    """The tensors ``names`` and scalars of the directory ``path``; large files of those in ``lazy`` are left on disk
    while the block runs (``npy.LazyNpy``: read a slice of time steps at a time), the others read into memory."""
    with contextlib.ExitStack() as kept:
        yield read_npy_dir(path, list(names), list(scalars), group, collect_errors, kind, headers, frozenset(lazy),
                           kept)


def read_npy_dir(path: Path, names, scalars, group=None, collect_errors=False, kind=None, headers=(),
                 lazy=frozenset(), kept: contextlib.ExitStack | None = None) -> LoadedFile:
    """The directory's tensors in memory; with ``kept`` (the caller's ExitStack, which then keeps their files open),
    large files of the tensors ``lazy`` as ``LazyNpy``s."""
    loaded = LoadedFile(path, "npy-dir", header_only=frozenset(headers))
    folder = path / _group_path(path, group) if group else path
    try:
        entries = sorted(os.listdir(folder))
    except FileNotFoundError:
        raise InputFileError(f"{path}: no group {group!r} (no subdirectory {group!r})") from None
    except NotADirectoryError:
        raise InputFileError(f"{path}: group {group!r} is not a directory") from None
    except OSError as err:
        raise InputFileError(f"{path}: cannot list {folder}: {err.strerror or reason(err)}") from None
    files: dict[str, str] = {}
    for entry in entries:
        if entry.lower().endswith(SUFFIX):
            key = entry[:-len(SUFFIX)]
            if key in files:  # x.npy and x.NPY: one tensor twice
                raise InputFileError(f"{path}: both {cut(files[key])} and {cut(entry)} hold {cut(key)}; keep one")
            files[key] = entry
    loaded.keys = list(files)

    def open_stream(key: str, opened: contextlib.ExitStack):
        stream = _open_file(folder / files[key], key, path, opened)
        return key, stream, lambda: _guarded(stream.read, key, path)

    def lazy_read(name: str, key: str, stream: NpyStream):
        """How to leave the file on disk (None: it is read into memory)."""
        if kept is None or name not in lazy or not left_in_file(stream):
            return None

        def leave() -> LazyNpy:
            fd = os.dup(stream.fp.fileno())  # (the stream's own file is closed once the tensors are read)
            closed = []
            kept.callback(os.close, fd)
            kept.callback(closed.append, True)  # (run first: the flag is up before the descriptor goes)
            return LazyNpy(fd, stream.start, stream, key, path, lambda: bool(closed))
        return lambda: _guarded(leave, key, path)

    read_npy_tensors(loaded, files, open_stream, names, scalars, collect_errors, kind, lazy_read)
    return loaded


def _group_path(path: Path, group: str) -> PurePosixPath:
    """A subdirectory, never outside the input directory."""
    relative = PurePosixPath(group.strip("/"))
    if any(part == ".." for part in relative.parts):
        raise InputFileError(f"{path}: group {group!r} leaves the directory; refused")
    return relative


def _open_file(file: Path, key: str, path: Path, opened: contextlib.ExitStack) -> NpyStream:
    """One .npy file, its header parsed; only a regular file is opened, and never in a way that could block."""
    def parse():
        fp = opened.enter_context(open_regular(file, f"{path}: {key}{SUFFIX}"))
        return NpyStream(fp, os.fstat(fp.fileno()).st_size, key, path, container="file")
    return _guarded(parse, key, path)


def _guarded(action, key: str, path: Path):
    def word(err: BaseException) -> str:
        if isinstance(err, PermissionError):
            return f"{key}{SUFFIX}: permission denied"
        return f"{key}{SUFFIX} cannot be read ({reason(err)})"
    with worded(path, (OSError, EOFError, ValueError), word, f"{key} does not fit in memory"):
        return action()


FORMAT = Format("npy-dir", "a directory of .npy files", True, sniff, open_npy_dir, "npz")
