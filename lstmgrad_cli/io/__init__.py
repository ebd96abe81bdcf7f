"""Reading tensors from input files and directories, and writing gradient files atomically.

Inputs are recognised by their content, not their name: each format module declares how to sniff
its own (``FORMATS``, a table like the backend registry) and how to read it.  Only the tensors
asked for are read, so unrelated (or hostile) entries are never touched.  Input files come from
other people's jobs, so every reader assumes the worst:

* nothing is ever unpickled; ``.npy`` data (NPZ members, ``.npy`` files) is parsed by hand;
* every tensor asked for is declared (shape and dtype, from the file's own header) before any is read,
  and the declarations are checked (declared.py): the size against the memory limit, with its size in
  the message (half of the physical or cgroup memory, or ``LSTMGRAD_MAX_TENSOR_BYTES``; it bounds each
  tensor and one input's tensors together), the rank against what the op can use, and the shapes
  against one another;
* only regular files are opened, never in a way that could block (a FIFO named like an input);
* HDF5 links are followed one at a time and never out of the file;
* anything that goes wrong becomes an ``InputFileError`` naming the file and the tensor.

Writing (output.py, atomic.py): a temporary file beside the target, renamed into place only when complete;
an existing file is replaced only with ``force``; an input is never opened for writing.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import InputFileError
from ..messages import cut
from . import hdf5, keras_archive, npydir, npz, safetensors, tfdbg
from ._common import (
    HEAD_BYTES,
    MAX_BYTES_ENV,
    METADATA_KEY,
    Format,
    LoadedFile,
    camel,
    describe_keys,
    file_kind,
    max_tensor_bytes,
    open_regular,
    worded,
)
from .atomic import (
    Handoff,
    InterruptedInPlace,
    directories_synced_at_end,
    handed_to_parent,
    os_reason,
    publish_handed,
    published_behind,
    remove_left_behind,
    remove_temporaries_of,
)
from .hdf5 import HDF5_MAGIC, HDF5_OFFSETS, LazyDataset
from .lazy import LazyRows
from .npy import NPY_MAGIC
from .output import (
    OUTPUT_FORMATS,
    check_output,
    default_output_path,
    open_hdf5_output,
    output_format,
    write_metadata,
    write_outputs,
)

__all__ = [
    "FORMATS", "HDF5_MAGIC", "HDF5_OFFSETS", "MAX_BYTES_ENV", "METADATA_KEY", "OUTPUT_FORMATS", "Format", "Handoff",
    "InterruptedInPlace", "LazyDataset", "LazyRows", "LoadedFile", "camel", "check_output", "default_output",
    "describe_keys", "directories_synced_at_end", "handed_to_parent", "input_directory_format", "max_tensor_bytes",
    "open_hdf5_output", "open_inputs", "output_format", "publish_handed", "published_behind", "read_inputs",
    "read_metadata", "remove_left_behind", "remove_temporaries_of", "sniff_format", "write_metadata", "write_outputs",
]

# Every input format, in the order they are tried.  File formats are told apart by their first bytes;
# directory formats by the names of the directory's entries.
# A Keras archive before HDF5: it stores model.weights.h5 uncompressed, so HDF5's signature may sit at one of the
# offsets HDF5 looks at (512 ... 8192) inside the zip.
FORMATS: dict[str, Format] = {f.name: f for f in (keras_archive.FORMAT, hdf5.FORMAT, npz.FORMAT, safetensors.FORMAT,
                                                   tfdbg.FORMAT, npydir.FORMAT)}

_os_reason = os_reason  # the name tests and older callers use


def _file_formats() -> str:
    """"HDF5 or NPZ file", from the table (for "not an ..." and "expected an ..." messages)."""
    names = [f.description.removeprefix("an ").removeprefix("a ").removesuffix(" file")
             for f in FORMATS.values() if not f.directory and f.listed]
    return (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]) + " file"


def input_directory_format(path: str | os.PathLike) -> str | None:
    """The format of a directory that is itself one input (a directory of .npy files, ...), else None."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    return next((f.name for f in FORMATS.values() if f.directory and f.sniff(names)), None)


def _unreadable(err: BaseException) -> str:
    """Why an input could not be opened, in words."""
    if isinstance(err, FileNotFoundError):
        return "no such file"
    if isinstance(err, IsADirectoryError):
        return "is a directory, not a file"
    if isinstance(err, PermissionError):
        return "permission denied"
    return f"cannot read: {os_reason(err) if isinstance(err, OSError) else err}"


def sniff_format(path: str | os.PathLike) -> str:
    """The name of ``path``'s format in ``FORMATS``, from its content; InputFileError for anything else.

    Only regular files and directories are opened: a FIFO, socket or device would block or never end.
    """
    path = Path(path)
    expected = f"expected an {_file_formats()}"
    with worded(path, (OSError, ValueError), _unreadable):  # ValueError: an embedded NUL byte in the path
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            found = input_directory_format(path)
            if found is not None:
                return found
            kinds = ", ".join(f.description for f in FORMATS.values() if f.directory)
            raise InputFileError(f"{path}: is a directory, not a file (nor {kinds})")
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{path}: is not a regular file ({file_kind(info.st_mode)}); {expected}")
        with open_regular(path, refusal=f"; {expected}") as fh:  # (never blocks, whatever is put there meanwhile)
            head = fh.read(HEAD_BYTES)
    for fmt in FORMATS.values():
        if not fmt.directory and fmt.sniff(head):
            if fmt.name == "npz" and keras_archive.holds_model(path, head):  # a Keras archive whose first member is
                return "keras"  # not one of its three (assets/...): its directory says what it is
            return fmt.name
    if not head:
        raise InputFileError(f"{path}: file is empty (0 bytes); {expected}")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):  # a pickle's first opcode
        raise InputFileError(f"{path}: is a Python pickle (a PyTorch .pt file?), and lstmgrad never unpickles; "
                             "save the tensors with safetensors instead: "
                             "safetensors.torch.save_file(model.state_dict(), 'model.safetensors')")
    if head.startswith(NPY_MAGIC):
        raise InputFileError(
            f"{path}: is a single .npy array, and lstmgrad needs all of the op's tensors together: put them in "
            "one directory as x.npy, cs_prev.npy, h_prev.npy, ... (one file per tensor, named after it) and give "
            "the directory, or save them into one file with np.savez(path, x=x, cs_prev=cs_prev, ...)")
    raise InputFileError(f"{path}: not an {_file_formats()} (it starts with {head[:8]!r})")


def default_output(input_path: Path, input_format: str) -> Path:
    """``<stem>.grads.<ext>`` beside the input, in the input's format (NPZ for formats lstmgrad does not write)."""
    return default_output_path(input_path, FORMATS[input_format].output_format)


def read_inputs(path: str | os.PathLike, names: Iterable[str], scalars: Iterable[str] = (),
                group: str | None = None, collect_errors: bool = False, kind: str | None = None,
                headers: Iterable[str] = ()) -> LoadedFile:
    """Read the tensors ``names`` (and scalar parameters ``scalars``) from an input of any format.

    Names are TF's snake_case argument names; camelCase aliases are accepted.  Missing tensors are
    simply absent from the result (the caller names them all at once); scalars may also come from
    HDF5 attributes of the group.  Raises InputFileError, and nothing else, for a bad input; with
    ``collect_errors`` a tensor that cannot be read is recorded in ``errors`` and the rest are read
    (one open file, one memory budget: what ``lstmgrad inspect`` needs).  Every tensor is declared and checked
    before any is read (declared.py); ``kind`` ("seq" or "cell"), when the caller knows it, words rank errors.
    The entries ``headers`` are declared and never read: their (shape, dtype) are in ``LoadedFile.headers``.
    """
    with open_inputs(path, names, scalars, group, collect_errors=collect_errors, kind=kind, headers=headers) as loaded:
        return loaded


@contextlib.contextmanager
def open_inputs(path: str | os.PathLike, names: Iterable[str], scalars: Iterable[str] = (), group: str | None = None,
                lazy: Iterable[str] = (), collect_errors: bool = False,
                input_format: str | None = None, kind: str | None = None,
                headers: Iterable[str] = ()) -> Iterator[LoadedFile]:
    """``read_inputs`` that may leave tensors on disk while the block runs (``input_format``: what
    ``npydir.input_format`` said of ``path`` and ``group``, when the caller has asked it already).

    Tensors named in ``lazy`` that are HDF5 datasets, or large stored members of an NPZ file or large files of a
    directory of .npy files, come back as ``LazyRows`` (``LazyDataset``, ``npz.LazyMember``, ``npy.LazyNpy``), read
    later by slicing (a chunk of time steps at a time), after the same safety checks as an eager read; they do not
    count against the memory limit, which is what lets an input larger than memory be processed.  Other formats,
    small or compressed NPZ members, small .npy files and big-endian data are always read into memory.
    """
    path, names = Path(path), list(names)
    fmt = FORMATS[input_format or npydir.input_format(path, group)]  # (the group may make a directory one input)
    with fmt.open(path, list(names), list(scalars), group, frozenset(lazy), collect_errors, kind,
                  headers=[h for h in headers if h not in names]) as loaded:
        yield loaded


MAX_METADATA_BYTES = 1 << 20  # an lstmgrad output's provenance: a few hundred bytes


def read_metadata(path: str | os.PathLike) -> dict:
    """The provenance an lstmgrad output carries (the ``__lstmgrad__`` JSON of an NPZ entry, an HDF5 root attribute
    or safetensors metadata; older HDF5 outputs kept it as separate root attributes); {} if none."""
    path = Path(path)
    if sniff_format(path) != "hdf5":
        loaded = read_inputs(path, [], [METADATA_KEY])
        if METADATA_KEY not in loaded.scalars:
            return {}
        try:
            return json.loads(str(loaded.scalars[METADATA_KEY][0]))
        except ValueError:
            raise InputFileError(f"{path}: its {METADATA_KEY} entry is not valid JSON") from None
    with hdf5.open_hdf5(path) as (fh, _h5py), hdf5.hdf5_errors(path):
        names = hdf5.attribute_names(fh, path)
        if METADATA_KEY in names:
            text = hdf5.string_attribute(fh, path, METADATA_KEY, MAX_METADATA_BYTES, "lstmgrad's provenance")
            try:
                return json.loads(text.decode("utf-8", "replace"))
            except ValueError:
                raise InputFileError(f"{path}: its {METADATA_KEY} attribute is not valid JSON") from None
        older = {}  # an older output: one attribute each, every one small (measured before it is read)
        for key in names:
            size = hdf5.attribute_bytes(fh, key, path)
            if size is None or size > MAX_METADATA_BYTES:
                raise InputFileError(f"{path}: its {cut(key)} attribute is more than lstmgrad's provenance can be; "
                                     "refused before reading it")
            if fh.attrs.get_id(key).dtype.hasobject:  # a string: read from the heap, not by HDF5
                text = hdf5.string_attribute(fh, path, key, MAX_METADATA_BYTES, "lstmgrad's provenance") or b""
                older[key] = text.decode("utf-8", "replace")
                continue
            value = fh.attrs[key]
            older[key] = value.item() if hasattr(value, "item") else value
        return older
