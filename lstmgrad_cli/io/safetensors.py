"""safetensors files (``pip install 'lstmgrad[safetensors]'``), read and written through the package's numpy API.

A file is an 8-byte little-endian header length, a JSON header (``{name: {dtype, shape, data_offsets}}`` and an
optional ``__metadata__`` of strings), then the raw data.  Before the package reads anything, the header is
checked here: its length against a bound and the file, its nesting and values (counted before the JSON is parsed),
every dtype against a whitelist, every shape and offset pair against the data area (inside it, no overlap,
exactly the shape's size), and the tensors asked for as every reader's are (declared.py: the memory budget,
ranks, shapes against one another).  A group is a key prefix: a PyTorch
state_dict's module path (``encoder.rnn`` selects ``encoder.rnn.weight_ih_l0``) or a ``/`` path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import InputFileError, LstmGradError
from ..messages import cut
from ._common import METADATA_KEY, Budget, Format, LoadedFile, collecting, json_extent, key_for, open_regular, reason
from .declared import Declared, checked

SUFFIX = ".safetensors"
MAX_HEADER = 16 * 2**20  # thousands of tensors' entries; the package itself allows 100 MiB
MAX_DEPTH = 8  # a header is {name: {..., "shape": [...], "data_offsets": [...]}}: nothing nests deeper
MAX_VALUES = 1_200_000  # ~12 a tensor; parsed, each takes 50 to 100 bytes
DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def sniff(head: bytes) -> bool:
    """An 8-byte header length that fits what was read, then the JSON header's opening brace."""
    if len(head) < 10:
        return False
    length = struct.unpack("<Q", head[:8])[0]
    return 2 <= length <= MAX_HEADER and head[8:9] == b"{"


def read_header(path: Path) -> tuple[dict, dict, int]:
    """(tensors: name -> (dtype, shape, begin, end), metadata, start of the data area), every entry checked."""
    try:
        with open_regular(path, refusal="; expected a safetensors file") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise InputFileError(f"{path}: truncated safetensors file ({size} bytes)")
            length = struct.unpack("<Q", head)[0]
            if length > MAX_HEADER or length > size - 8:
                raise InputFileError(f"{path}: its safetensors header declares {length} bytes; the file holds "
                                     f"{size - 8} after the length (limit {MAX_HEADER}); refused")
            raw = fh.read(length)
    except OSError as err:
        raise InputFileError(f"{path}: cannot read: {err.strerror or err}") from None
    depth, values = json_extent(raw)
    if depth > MAX_DEPTH:  # before parsing: the JSON parser recurses once per level
        raise InputFileError(f"{path}: its safetensors header is not a table of tensors (nested {depth} deep)")
    if values > MAX_VALUES:
        raise InputFileError(f"{path}: its safetensors header holds {values} JSON values (at most {MAX_VALUES}: "
                             f"{MAX_VALUES // 12} tensors); refused before parsing")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise InputFileError(f"{path}: its safetensors header is not valid JSON ({reason(err)})") from None
    if not isinstance(header, dict):
        raise InputFileError(f"{path}: its safetensors header is not a table of tensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputFileError(f"{path}: its safetensors __metadata__ is not a table of strings")
    data_size = size - 8 - length
    tensors, spans = {}, []
    for name, entry in header.items():
        tensors[name] = _entry(path, name, entry, data_size)
        spans.append((tensors[name][2], tensors[name][3], name))
    previous_end, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < previous_end:
            raise InputFileError(f"{path}: {name} overlaps {previous} in the data area; refused")
        previous_end, previous = max(previous_end, end), name
    return tensors, metadata, 8 + length


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice")
    return dict(pairs)


def _entry(path: Path, name: str, entry, data_size: int) -> tuple:
    if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"}:
        raise InputFileError(f"{path}: {name}: not a tensor entry of a safetensors header")
    dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype_name not in DTYPES:
        raise InputFileError(f"{path}: {name} has dtype {str(dtype_name)[:20]!r}; lstmgrad reads "
                             f"{', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InputFileError(f"{path}: {name} has a malformed shape {str(shape)[:60]}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in offsets)):
        raise InputFileError(f"{path}: {name} has malformed data_offsets {str(offsets)[:60]}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise InputFileError(f"{path}: {name} lies at bytes {begin}..{end} of a data area of {data_size} bytes "
                             "(truncated file?); refused")
    dtype = np.dtype(DTYPES[dtype_name])
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise InputFileError(f"{path}: {name} holds {end - begin} bytes for shape {shape} of {dtype} "
                             f"({math.prod(shape) * dtype.itemsize} bytes); corrupt")
    return dtype, tuple(shape), begin, end


@contextlib.contextmanager
def open_safetensors(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None, headers=()):
    yield read_safetensors(path, list(names), list(scalars), group, collect_errors, kind, headers)


def read_safetensors(path: Path, names, scalars, group=None, collect_errors=False, kind=None,
                     headers=()) -> LoadedFile:
    tensors, metadata, _ = read_header(path)
    loaded = LoadedFile(path, "safetensors", header_only=frozenset(headers))
    if group:
        prefix = group.strip("./")
        keys = {}
        for k in tensors:
            if k.startswith(prefix) and k[len(prefix):len(prefix) + 1] in (".", "/"):
                name = k[len(prefix) + 1:]
                if name in keys:  # rnn.weight_ih_l0 and rnn/weight_ih_l0: one name under the group, twice
                    raise InputFileError(f"{path}: both {cut(keys[name])} and {cut(k)} are {cut(name)} under group "
                                         f"{cut(repr(group))}; keep one")
                keys[name] = k
        if not keys:
            raise InputFileError(f"{path}: no group {group!r} (no key starts with {prefix + '.'!r} or "
                                 f"{prefix + '/'!r})")
    else:
        keys = {k: k for k in tensors}
    loaded.keys = list(keys)
    if METADATA_KEY in metadata:
        loaded.keys.append(METADATA_KEY)

    def declare(name: str) -> Declared | None:
        if name == METADATA_KEY and METADATA_KEY in metadata:
            return Declared(name, name, (), np.dtype(np.uint8), lambda: np.array(metadata[METADATA_KEY]))
        key = key_for(name, keys, path)
        if key is None:
            return None
        dtype, shape, _, _ = tensors[keys[key]]
        if name in scalars and shape == (1,):  # safetensors' numpy API saves a 0-d array with shape [1]
            shape = ()
        return Declared(name, key, shape, dtype, lambda: None)  # (read below, all through one safe_open)

    wanted = []
    for name, entry in checked(loaded, Budget(path, kind), names, scalars, declare).items():
        with collecting(loaded, name, collect_errors):
            if isinstance(entry, InputFileError):
                raise entry
            if name == METADATA_KEY:
                loaded.scalars[name] = (entry.read(), "tensor")
            else:
                wanted.append((name, keys[entry.key]))
    if wanted:
        for name, value in _read_with_package(path, wanted, collect_errors, loaded).items():
            if name in scalars:
                loaded.scalars[name] = (value.reshape(()) if value.shape == (1,) else value, "tensor")
            else:
                loaded.tensors[name] = value
    return loaded


def _read_with_package(path: Path, wanted, collect_errors, loaded) -> dict:
    try:
        from safetensors import SafetensorError, safe_open  # noqa: PLC0415 - optional (the safetensors extra)
    except ImportError:
        raise InputFileError(f"{path}: reading safetensors files needs the safetensors package: pip install "
                             "'lstmgrad[safetensors]'") from None
    out = {}
    try:
        with safe_open(str(path), framework="numpy") as fh:
            for name, key in wanted:
                with collecting(loaded, name, collect_errors):
                    try:
                        out[name] = np.array(fh.get_tensor(key))
                    except (SafetensorError, ValueError, OSError) as err:
                        raise InputFileError(f"{path}: {key} cannot be read ({reason(err)})") from None
    except LstmGradError:
        raise
    except MemoryError:
        raise InputFileError(f"{path}: does not fit in memory") from None
    except (SafetensorError, ValueError, OSError) as err:
        raise InputFileError(f"{path}: corrupt safetensors file ({reason(err)})") from None
    return out


def write_safetensors(fh, tensors: dict, metadata: dict) -> None:
    """The tensors as a safetensors file, written to ``fh`` (the temporary file atomic_file fsyncs and renames: the
    package's own save_file would replace that file by a new one, created 0600, which the fsync would miss)."""
    try:
        from safetensors.numpy import save  # noqa: PLC0415 - optional (the safetensors extra)
    except ImportError:
        raise LstmGradError("writing safetensors files needs the safetensors package: pip install "
                            "'lstmgrad[safetensors]'") from None
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    fh.write(save(arrays, metadata={METADATA_KEY: json.dumps(dict(metadata), sort_keys=True)}))


FORMAT = Format("safetensors", "a safetensors file", False, sniff, open_safetensors, "safetensors",
                suffixes=(".safetensors",))
