"""Writing gradient files (NPZ, HDF5, safetensors): atomically, never over an existing file without ``force``,
never into an input.

Outputs go to a temporary file beside the target, are flushed to disk and renamed into place only
when complete (atomic.py).  A failed write (disk full, permission denied, read-only filesystem, ...)
leaves no file behind and raises an ``OutputFileError`` that says what happened.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from ..errors import OutputFileError
from ._common import METADATA_KEY
from .atomic import atomic_file, exists_error, os_reason, synced_behind
from .hdf5_writer import hdf5_writer, signals_held
from .npz_writer import write_npz

OUTPUT_MARK = ".grads."  # in every default output's name (<stem>.grads.<ext>): never taken for an input
OUTPUT_FORMATS = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5", ".safetensors": "safetensors"}
EXTENSIONS = {"npz": ".npz", "hdf5": ".h5", "safetensors": ".safetensors"}  # the default extension of each
SYNC_EVERY_SECONDS = 0.25  # how often a large streamed output is flushed to disk as it is written


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
    return input_path.with_name(f"{stem}{OUTPUT_MARK[:-1]}{ext}")


def check_output(path: Path, force: bool, inputs: Iterable[Path] = (), others: Mapping[str, Path] | None = None) -> str:
    """Refuse, before any work, an output that could not or must not be written; returns its format.

    An output that is (or would replace) an input, ``inputs`` or one of ``others`` (what else the run reads, by
    what the user calls it: ``{"the weights file": path}``), is refused even with ``force``: the same path, a
    hard link or a symbolic link to it."""
    with contextlib.suppress(OSError):
        if path.is_dir():
            raise OutputFileError(f"{path}: is a directory; name an output file (.npz, .h5, .hdf5, .safetensors)")
    fmt = output_format(path)
    try:
        for source in inputs:
            if _same_file(path, source):
                raise OutputFileError(f"{path}: output path is the input file; choose another output")
        for what, source in (others or {}).items():
            if _same_file(path, Path(source)):
                raise OutputFileError(f"{path}: output path is {what} ({source}), an input of this run; choose "
                                      "another output")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise OutputFileError(f"{path}: output directory {parent} does not exist")
        if path.exists() and not force:
            raise exists_error(path)
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
    fmt = output_format(path)
    with atomic_file(path, force) as tmp:
        if fmt == "npz":
            with open(tmp.fd, "wb", closefd=False) as fh:
                _write_npz(fh, tensors, metadata)
        elif fmt == "safetensors":
            from .safetensors import write_safetensors  # noqa: PLC0415 - the optional package, when asked

            with open(tmp.fd, "wb", closefd=False) as fh:
                write_safetensors(fh, tensors, metadata)
        else:
            with hdf5_writer(tmp) as out:
                for name, value in tensors.items():
                    out.create_dataset(name, data=value)
                write_metadata(out, metadata)
    return path


@contextlib.contextmanager
def open_hdf5_output(path: str | os.PathLike, force: bool = False, large: bool = False) -> Iterator[object]:
    """An open HDF5 output for the block to fill (datasets written chunk by chunk), published
    atomically when the block ends, exactly as ``write_outputs`` does; on any failure nothing stays.
    A ``large`` output (one the block takes seconds to write) is flushed to disk as it is written."""
    path = Path(path)
    if output_format(path) != "hdf5":
        raise OutputFileError(f"{path}: streaming output needs an .h5 or .hdf5 file")
    with atomic_file(path, force) as tmp, \
            (synced_behind(tmp.fd, SYNC_EVERY_SECONDS) if large else contextlib.nullcontext()), \
            hdf5_writer(tmp) as out:
        yield out


def write_metadata(out, metadata: Mapping[str, object]) -> None:
    """Provenance as one root attribute of an open HDF5 output, a JSON document under ``__lstmgrad__`` (as in NPZ
    and safetensors outputs): attributes named like the op's parameters would read as inputs."""
    text = json.dumps(dict(metadata), sort_keys=True, default=str)
    with signals_held():  # (HDF5 may write through the output's Python file object meanwhile: hdf5_writer)
        out.attrs[METADATA_KEY] = text


def _write_npz(fh, tensors, metadata) -> None:
    arrays = dict(tensors)
    arrays[METADATA_KEY] = np.array(json.dumps(dict(metadata), sort_keys=True))
    write_npz(fh, arrays)


