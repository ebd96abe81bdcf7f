"""Writing gradient files: atomically, never over an existing file without ``force``, never into an input.

Outputs go to a temporary file beside the target, are flushed to disk and renamed into place only
when complete.  A failed write (disk full, permission denied, read-only filesystem, ...) leaves no
file behind and raises an ``OutputFileError`` that says what happened.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import OutputExistsError, OutputFileError
from ._common import METADATA_KEY, reason

OUTPUT_FORMATS = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5", ".safetensors": "safetensors"}
EXTENSIONS = {"npz": ".npz", "hdf5": ".h5", "safetensors": ".safetensors"}  # the default extension of each


def output_format(path: Path) -> str:
    fmt = OUTPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise OutputFileError(f"{path}: unknown output extension {path.suffix!r}; use .npz, .h5, .hdf5 or "
                              ".safetensors")
    return fmt


def default_output_path(input_path: Path, fmt: str) -> Path:
    """``<stem>.grads.<ext>`` beside the input, in the output format ``fmt`` ("npz", "hdf5", "safetensors")."""
    suffix = input_path.suffix.lower()
    ext = suffix if OUTPUT_FORMATS.get(suffix) == fmt else EXTENSIONS[fmt]
    stem = input_path.name[: -len(input_path.suffix)] if OUTPUT_FORMATS.get(suffix) else input_path.name
    return input_path.with_name(f"{stem}.grads{ext}")


def check_output(path: Path, force: bool, inputs: Iterable[Path] = ()) -> str:
    """Refuse, before any work, an output that could not or must not be written; returns its format."""
    with contextlib.suppress(OSError):
        if path.is_dir():
            raise OutputFileError(f"{path}: is a directory; name an output file (.npz, .h5, .hdf5, .safetensors)")
    fmt = output_format(path)
    try:
        for source in inputs:
            if _same_file(path, source):
                raise OutputFileError(f"{path}: output path is the input file; choose another output")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise OutputFileError(f"{path}: output directory {parent} does not exist")
        if path.exists() and not force:
            raise OutputExistsError(f"{path}: already exists; use --force to overwrite")
    except OSError as err:  # e.g. a name longer than the file system allows
        raise OutputFileError(f"{path}: cannot write there: {os_reason(err)}") from None
    return fmt


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_outputs(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, object],
                  force: bool = False) -> Path:
    """Write ``tensors`` (in order) and provenance ``metadata`` atomically to ``path`` (.npz/.h5/.hdf5/.safetensors).

    The data goes to a temporary file beside ``path``, is flushed to disk, and is renamed into place
    only when complete.  On any failure the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    with _atomic_file(path, force) as tmp:
        fmt = output_format(path)
        if fmt == "npz":
            with open(tmp.fd, "wb", closefd=False) as fh:
                _write_npz(fh, tensors, metadata)
        elif fmt == "safetensors":
            from .safetensors import write_safetensors  # noqa: PLC0415 - the optional package, when asked

            write_safetensors(tmp.path, tensors, metadata)
        else:
            with _hdf5_writer(tmp.path) as out:
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
    with _atomic_file(path, force) as tmp, _hdf5_writer(tmp.path) as out:
        yield out


def write_metadata(out, metadata: Mapping[str, object]) -> None:
    """Provenance as one root attribute of an open HDF5 output, a JSON document under ``__lstmgrad__`` (as in NPZ
    and safetensors outputs): attributes named like the op's parameters would read as inputs."""
    out.attrs[METADATA_KEY] = json.dumps(dict(metadata), sort_keys=True, default=str)


class _Temporary(NamedTuple):
    """A temporary output: its path, and the descriptor ``_atomic_file`` keeps open on it."""

    path: Path
    fd: int


_deferred_syncs: list[set[Path]] = []  # directories_synced_at_end: the directories each open block will sync


@contextlib.contextmanager
def directories_synced_at_end() -> Iterator[set[Path]]:
    """Within the block, outputs' directories are fsynced once each when it ends instead of after every file
    (a batch's outputs share a few).  Each file's data is still fsynced before it is renamed into place, so an
    output that exists is complete; the block's end makes the new names durable.  Yields the set of
    directories, to which a caller adds those of outputs written by other processes."""
    directories: set[Path] = set()
    _deferred_syncs.append(directories)
    try:
        yield directories
    finally:
        _deferred_syncs.remove(directories)
        for directory in directories:
            _fsync_dir(directory)


@contextlib.contextmanager
def _atomic_file(path: Path, force: bool) -> Iterator[_Temporary]:
    """A temporary file beside ``path`` for the block to fill (by name, or through its open descriptor ``fd``);
    fsynced and renamed into place after.

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
        yield _Temporary(tmp, fd)
        os.fsync(fd)  # the file's data, however it was written (by name too: the same file)
        _publish(tmp, path, force)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, RuntimeError) and _errno_in(err) is not None:  # h5py's way of saying EFBIG/ENOSPC
            err = OSError(_errno_in(err), str(err))
        if isinstance(err, OSError) and (err.errno is not None or _errno_in(err) is not None):
            raise OutputFileError(f"{path}: cannot write: {os_reason(err)}; nothing was written") from None
        raise  # not the file system's (a library that failed to load while computing): as it is
    with contextlib.suppress(OSError):
        os.close(fd)
    if _deferred_syncs:
        _deferred_syncs[-1].add(parent)
    else:
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
    return f"{path}: cannot create a file in {parent}: {os_reason(err)}"


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
        raise OutputExistsError(f"{path}: already exists; use --force to overwrite") from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if path.exists():
            raise OutputExistsError(f"{path}: already exists; use --force to overwrite") from None
        os.replace(tmp, path)  # filesystems without hard links
        return
    tmp.unlink()


_HDF5_ERRNO = re.compile(r"errno\s*=\s*(\d+)")


def _errno_in(err: BaseException) -> int | None:
    """The C errno an h5py error carries only in its message (``errno = 28``), if any."""
    match = _HDF5_ERRNO.search(str(err))
    return int(match.group(1)) if match else None


def os_reason(err: OSError) -> str:
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
    return err.strerror or reason(err)


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
