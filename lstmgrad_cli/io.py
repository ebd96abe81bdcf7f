"""Reading tensors from HDF5/NPZ files and writing gradient files atomically.

Files are recognised by their first bytes, not their extension.  Only the tensors asked for are
read, so unrelated (or hostile) entries in a file are never touched.  NPZ is never unpickled.
Outputs go to a temporary file beside the target and are renamed into place only when complete;
an existing file is replaced only with ``force``; an input is never opened for writing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputFileError, OutputFileError

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
# HDF5 allows a user block before the superblock; the signature then sits at 512, 1024, 2048, ...
HDF5_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)

# camelCase names of TensorFlow's Java API, accepted beside the op's snake_case argument names.
CAMEL = {"cs_prev": "csPrev", "h_prev": "hPrev", "cs_grad": "csGrad", "h_grad": "hGrad",
         "seq_len_max": "seqLenMax", "use_peephole": "usePeephole"}
METADATA_KEY = "__lstmgrad__"
OUTPUT_FORMATS = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}


@dataclass
class LoadedFile:
    """What was read from one input: the tensors asked for, scalar parameters, and what else is there."""

    path: Path
    format: str  # "hdf5" or "npz"
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, tuple[object, str]] = field(default_factory=dict)  # name -> (value, "tensor"|"attribute")
    keys: list[str] = field(default_factory=list)  # every entry of the group, as stored


def sniff_format(path: Path) -> str:
    """'hdf5' or 'npz' from the file's content; InputFileError for anything else."""
    try:
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
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a directory, not a file") from None
    except PermissionError:
        raise InputFileError(f"{path}: permission denied") from None
    except OSError as err:
        raise InputFileError(f"{path}: cannot read: {err.strerror or err}") from None
    if not head:
        raise InputFileError(f"{path}: file is empty (0 bytes); expected an HDF5 or NPZ file")
    raise InputFileError(f"{path}: not an HDF5 or NPZ file (it starts with {head!r})")


def _key_for(name: str, keys: Iterable[str], path: Path) -> str | None:
    present = [k for k in (name, CAMEL.get(name)) if k is not None and k in keys]
    if len(present) > 1:
        raise InputFileError(f"{path}: both {present[0]!r} and {present[1]!r} are present; keep one")
    return present[0] if present else None


def read_inputs(path: str | os.PathLike, names: Iterable[str], scalars: Iterable[str] = (),
                group: str | None = None) -> LoadedFile:
    """Read the tensors ``names`` (and scalar parameters ``scalars``) from an HDF5 or NPZ file.

    Names are TF's snake_case argument names; camelCase aliases are accepted.  Missing tensors are
    simply absent from the result (the caller names them all at once); scalars may also come from
    HDF5 attributes of the group.
    """
    path = Path(path)
    fmt = sniff_format(path)
    reader = _read_hdf5 if fmt == "hdf5" else _read_npz
    return reader(path, list(names), list(scalars), group)


def _read_npz(path: Path, names, scalars, group) -> LoadedFile:
    loaded = LoadedFile(path, "npz")
    prefix = f"{group.strip('/')}/" if group else ""
    try:
        archive = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as err:
        raise InputFileError(f"{path}: corrupt or truncated NPZ file ({_reason(err)})") from None
    with archive:
        members = archive.files
        keys = [k[len(prefix):] for k in members if k.startswith(prefix)]
        if group and not keys:
            raise InputFileError(f"{path}: no group {group!r} (no keys start with {prefix!r})")
        loaded.keys = keys
        for name in [*names, *scalars]:
            key = _key_for(name, keys, path)
            if key is None:
                continue
            value = _npz_member(archive, prefix + key, path)
            if name in scalars:
                loaded.scalars[name] = (value, "tensor")
            else:
                loaded.tensors[name] = value
    return loaded


def _npz_member(archive, key: str, path: Path) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as err:
        if "allow_pickle" in str(err) or "Object arrays" in str(err):
            raise InputFileError(f"{path}: {key} is a pickled object array; lstmgrad never unpickles") from None
        raise InputFileError(f"{path}: {key} is not a readable array ({_reason(err)})") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, KeyError) as err:
        raise InputFileError(f"{path}: {key} is corrupt or truncated ({_reason(err)})") from None


def _read_hdf5(path: Path, names, scalars, group) -> LoadedFile:
    import h5py  # noqa: PLC0415 - imported when an HDF5 file is actually read

    loaded = LoadedFile(path, "hdf5")
    try:
        fh = h5py.File(path, "r")
    except OSError as err:
        raise InputFileError(f"{path}: corrupt or truncated HDF5 file ({_reason(err)})") from None
    with fh:
        node = fh
        if group:
            link = fh.get(group, getlink=True)
            if link is None or not isinstance(fh.get(group), h5py.Group):
                groups = sorted(k for k, v in fh.items() if isinstance(v, h5py.Group))
                raise InputFileError(f"{path}: no group {group!r} (groups at the root: {', '.join(groups) or 'none'})")
            node = fh[group]
        loaded.keys = list(node.keys())
        for name in names:
            key = _key_for(name, loaded.keys, path)
            if key is not None:
                loaded.tensors[name] = _hdf5_dataset(node, key, path, h5py)
        for name in scalars:
            key = _key_for(name, loaded.keys, path)
            if key is not None:
                loaded.scalars[name] = (_hdf5_dataset(node, key, path, h5py), "tensor")
                continue
            for attrs in (node.attrs, fh.attrs) if group else (node.attrs,):
                akey = _key_for(name, list(attrs.keys()), path)
                if akey is not None:
                    loaded.scalars[name] = (np.asarray(attrs[akey]), "attribute")
                    break
    return loaded


def _hdf5_dataset(node, key: str, path: Path, h5py) -> np.ndarray:
    link = node.get(key, getlink=True)
    if isinstance(link, h5py.ExternalLink):
        raise InputFileError(f"{path}: {key} is an external link to {link.filename}:{link.path}; refused")
    obj = node.get(key)
    if not isinstance(obj, h5py.Dataset):
        raise InputFileError(f"{path}: {key} is a {type(obj).__name__.lower()}, not a dataset")
    if obj.is_virtual:
        raise InputFileError(f"{path}: {key} is a virtual dataset (data from other files); refused")
    try:
        return np.asarray(obj[()])
    except (OSError, ValueError, TypeError) as err:
        raise InputFileError(f"{path}: {key} cannot be read ({_reason(err)})") from None


def _reason(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


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
    return fmt


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_outputs(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, object],
                  force: bool = False) -> Path:
    """Write ``tensors`` (in order) and provenance ``metadata`` atomically to ``path`` (.npz/.h5/.hdf5)."""
    path = Path(path)
    fmt = output_format(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as err:
        raise OutputFileError(f"{path}: cannot write: {_os_reason(err)}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if fmt == "npz":
            with open(tmp, "wb") as fh:
                _write_npz(fh, tensors, metadata)
        else:
            _write_hdf5(tmp, tensors, metadata)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        _publish(tmp, path, force)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError):
            raise OutputFileError(f"{path}: cannot write: {_os_reason(err)}") from None
        raise
    return path


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


def _os_reason(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return "no space left on device"
    if err.errno == errno.EDQUOT:
        return "disk quota exceeded"
    if err.errno == errno.EFBIG:
        return "file too large"
    return err.strerror or str(err)


def _write_npz(fh, tensors, metadata) -> None:
    arrays = dict(tensors)
    arrays[METADATA_KEY] = np.array(json.dumps(dict(metadata), sort_keys=True))
    np.savez(fh, **arrays)


def _write_hdf5(target: Path, tensors, metadata) -> None:
    import h5py  # noqa: PLC0415

    with h5py.File(target, "w", track_order=True) as out:
        for name, value in tensors.items():
            out.create_dataset(name, data=value)
        for key, value in metadata.items():
            out.attrs[key] = "" if value is None else value


def read_metadata(path: str | os.PathLike) -> dict:
    """The provenance an output file carries (NPZ metadata entry or HDF5 root attributes)."""
    path = Path(path)
    if sniff_format(path) == "npz":
        with np.load(path, allow_pickle=False) as archive:
            return json.loads(str(archive[METADATA_KEY])) if METADATA_KEY in archive.files else {}
    import h5py  # noqa: PLC0415

    with h5py.File(path, "r") as fh:
        return {k: (v.item() if hasattr(v, "item") else v) for k, v in fh.attrs.items()}
