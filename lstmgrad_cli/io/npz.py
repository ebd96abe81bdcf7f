"""NPZ files (numpy's ``savez``): a zip archive of ``.npy`` members, read without ``np.load``.

Members are parsed by hand (``npy.py``): object arrays are refused from the header alone, nothing
is ever unpickled, and a member's declared size is checked before anything is allocated.  Every
member is read to its end so the zip CRC is verified.  A group is a key prefix (``lstm/x.npy``).
"""

from __future__ import annotations

import contextlib
import lzma
import struct
import zipfile
import zlib
from pathlib import Path

from ..errors import InputFileError, LstmGradError
from ._common import Budget, Format, LoadedFile, collecting, key_for, reason
from .npy import read_npy

ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
TORCH_FILE = ("is a PyTorch file (torch.save writes a pickle, and lstmgrad never unpickles); save the tensors with "
              "safetensors instead: safetensors.torch.save_file(model.state_dict(), 'model.safetensors')")
KERAS_ARCHIVE = ("is a Keras model archive (model.save('m.keras')); its weights are the model.weights.h5 inside it: "
                 "give that file (unzip it), or save them with model.save_weights('m.weights.h5')")

# Everything numpy's .npy parser and the zip/decompression layers raise on bad data.
NPZ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, lzma.LZMAError, EOFError, OSError, ValueError,
              KeyError, TypeError, IndexError, OverflowError, struct.error, NotImplementedError, RuntimeError,
              SyntaxError, RecursionError, UnicodeError)


def sniff(head: bytes) -> bool:
    return head[:4] in ZIP_MAGICS


@contextlib.contextmanager
def open_npz(path: Path, names, scalars, group=None, lazy=(), collect_errors=False):
    """NPZ files are always read into memory (``lazy`` does not apply)."""
    yield read_npz(path, list(names), list(scalars), group, collect_errors)


def read_npz(path: Path, names, scalars, group, collect_errors=False) -> LoadedFile:
    loaded = LoadedFile(path, "npz")
    prefix = f"{group.strip('/')}/" if group else ""
    try:
        archive = zipfile.ZipFile(path)
    except MemoryError:
        raise InputFileError(f"{path}: corrupt NPZ file (its zip directory does not fit in memory)") from None
    except NPZ_ERRORS as err:
        raise InputFileError(f"{path}: corrupt or truncated NPZ file ({reason(err)})") from None
    with archive:
        members: dict[str, zipfile.ZipInfo] = {}
        for info in archive.infolist():
            if not info.filename or info.filename.endswith("/"):  # directories (is_dir() fails on a blank name)
                continue
            # numpy's convention: "x.npy" is the array "x"; other members keep their full name.
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            members[key] = info
        if any(k == "data.pkl" or k.endswith("/data.pkl") for k in members):
            raise InputFileError(f"{path}: {TORCH_FILE}")
        if {"config.json", "model.weights.h5"} <= members.keys():
            raise InputFileError(f"{path}: {KERAS_ARCHIVE}")
        keys = [k[len(prefix):] for k in members if k.startswith(prefix)]
        if group and not keys:
            raise InputFileError(f"{path}: no group {group!r} (no keys start with {prefix!r})")
        loaded.keys = keys
        budget = Budget(path)
        for name in [*names, *scalars]:
            with collecting(loaded, name, collect_errors):
                key = key_for(name, keys, path)
                if key is None:
                    continue
                value = _member(archive, members[prefix + key], prefix + key, path, budget)
                if name in scalars:
                    loaded.scalars[name] = (value, "tensor")
                else:
                    loaded.tensors[name] = value
    return loaded


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, path: Path, budget: Budget):
    """One ``.npy`` member: header checked (no objects, size within budget) before its data is read."""
    try:
        with archive.open(info) as fp:
            return read_npy(fp, info.file_size, key, path, budget)
    except LstmGradError:
        raise
    except MemoryError:
        raise InputFileError(f"{path}: {key} does not fit in memory") from None
    except RuntimeError as err:
        if "encrypted" in str(err):
            raise InputFileError(f"{path}: {key} is an encrypted (password-protected) zip member; refused") from None
        raise InputFileError(f"{path}: {key} is corrupt or truncated ({reason(err)})") from None
    except NPZ_ERRORS as err:
        raise InputFileError(f"{path}: {key} is corrupt or truncated ({reason(err)})") from None


FORMAT = Format("npz", "an NPZ file", False, sniff, open_npz, "npz")
