"""Keras model archives (``model.save('m.keras')``) and the model configuration of full-model HDF5 files.

A ``.keras`` file is a zip of ``metadata.json`` (the Keras version), ``config.json`` (the model: every layer's
class and options) and ``model.weights.h5`` (the weights, laid out as ``model.save_weights`` lays them out).  The
weights are read by the HDF5 reader, with all its checks, from a private temporary copy of that one member: no
member name is ever used as a path, the copy stops at the size the member declares (and at the memory budget),
and it is removed when the read is done.  The configuration is a bounded JSON document kept in
``LoadedFile.info["keras_model_config"]`` (with ``keras_version`` and ``keras_config_source``), for frameworks/
to read a layer's options from.  An older full-model HDF5 file (``model.save('m.h5')``) keeps the same in its
root attributes ``model_config`` and ``keras_version`` (``hdf5_model_config``).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import zipfile
from pathlib import Path

from ..errors import InputFileError, LstmGradError
from . import hdf5
from ._common import Format, human, max_tensor_bytes, reason

MEMBERS = ("metadata.json", "config.json", "model.weights.h5")
MAX_MEMBERS = 1000  # an archive's assets may add a few files; thousands of members is not a model
MAX_CONFIG_BYTES = 64 * 2**20  # a model configuration is kilobytes; a large model's a few megabytes
MAX_JSON_DEPTH = 200  # layers nested in models nested in wrappers: tens of levels at most
COPY_CHUNK = 1 << 20


def sniff(head: bytes) -> bool:
    """A zip whose first member is one of a Keras archive's (Keras writes metadata.json first)."""
    if head[:4] != b"PK\x03\x04" or len(head) < 30:
        return False
    name_length = struct.unpack_from("<H", head, 26)[0]
    return head[30:30 + name_length].decode("utf-8", "replace") in MEMBERS


@contextlib.contextmanager
def open_keras(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None):
    """The tensors of the archive's ``model.weights.h5`` (``group`` a layer's group in it), with its configuration
    in ``info``."""
    with model_weights(path) as (weights, config, version, relabel):
        with hdf5.open_hdf5_inputs(weights, names, scalars, group, (), collect_errors, kind) as loaded:
            loaded.path, loaded.format = path, "keras"
            loaded.info.update(keras_model_config=config, keras_config_source=f"{path.name} config.json",
                               keras_version=version)
            loaded.errors = {n: relabel(e) for n, e in loaded.errors.items()}
            yield loaded


@contextlib.contextmanager
def model_weights(path: Path):
    """(a private copy of the archive's model.weights.h5, its configuration, the Keras version, and a function that
    says an error about the copy of the archive) while the block runs; the copy is removed after it."""
    path = Path(path)
    label = f"{path} (its model.weights.h5)"
    with _archive(path) as archive:
        members = {info.filename: info for info in archive.infolist()}
        missing = [m for m in ("config.json", "model.weights.h5") if m not in members]
        if missing:
            raise InputFileError(f"{path}: a Keras archive without {' and '.join(missing)}; save the model with "
                                 "model.save('m.keras'), or its weights with model.save_weights('m.weights.h5')")
        config = _json_member(archive, members["config.json"], path)
        metadata = _json_member(archive, members["metadata.json"], path) if "metadata.json" in members else {}
        with tempfile.TemporaryDirectory(prefix="lstmgrad-keras-") as tmp:
            weights = Path(tmp) / "model.weights.h5"
            _copy_member(archive, members["model.weights.h5"], weights, path)

            def relabel(err: InputFileError) -> InputFileError:
                return _relabel(err, weights, label)

            try:
                yield weights, config, str(metadata.get("keras_version", "3")), relabel
            except InputFileError as err:
                raise relabel(err) from None


def hdf5_model_config(path: Path) -> tuple[dict, str] | None:
    """(model configuration, Keras version) from a full-model HDF5 file's root attributes; None if it has none."""
    with hdf5.open_hdf5(path) as (fh, _h5py), hdf5.hdf5_errors(path):
        if "model_config" not in fh.attrs:
            return None
        text = fh.attrs["model_config"]
        version = fh.attrs.get("keras_version", b"")
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
    version = version.decode("utf-8", "replace") if isinstance(version, bytes) else str(version)
    if len(text) > MAX_CONFIG_BYTES:
        raise InputFileError(f"{path}: its model_config attribute is {human(len(text))}, more than a model "
                             "configuration can be; refused")
    return _parse(text, path, "model_config attribute"), version


def keras_major(version: str) -> int:
    """3 for Keras 3 (and unknown versions), 2 for tf.keras / Keras 2 files."""
    head = str(version).strip().split(".")[0]
    return int(head) if head.isdigit() and int(head) < 3 else 3


# -- the archive -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _archive(path: Path):
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RecursionError, MemoryError) as err:
        raise InputFileError(f"{path}: corrupt or truncated Keras archive ({reason(err)})") from None
    with archive:
        if len(archive.infolist()) > MAX_MEMBERS:
            raise InputFileError(f"{path}: a Keras archive of {len(archive.infolist())} members; a model has 3, "
                                 "refused")
        yield archive


def _json_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> dict:
    if info.file_size > MAX_CONFIG_BYTES:
        raise InputFileError(f"{path}: its {info.filename} declares {human(info.file_size)}, more than a model "
                             "configuration can be; refused")
    try:
        with archive.open(info) as fh:
            text = fh.read(MAX_CONFIG_BYTES + 1)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError) as err:
        raise InputFileError(f"{path}: cannot read its {info.filename} ({reason(err)})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise InputFileError(f"{path}: its {info.filename} inflates past {human(MAX_CONFIG_BYTES)}; refused")
    return _parse(text.decode("utf-8", "replace"), path, info.filename)


def _parse(text: str, path: Path, what: str) -> dict:
    depth = deepest = 0
    for char in text:  # the nesting, counted before json builds anything (its parser recurses per level)
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    if deepest > MAX_JSON_DEPTH:
        raise InputFileError(f"{path}: its {what} nests {deepest} levels deep; a model configuration is not, refused")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise InputFileError(f"{path}: its {what} is not valid JSON ({reason(err)})") from None
    if not isinstance(value, dict):
        raise InputFileError(f"{path}: its {what} is not a JSON object")
    return value


def _copy_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, path: Path) -> None:
    """The member's bytes into ``target``, never more than it declares nor than the memory budget allows."""
    limit = min(info.file_size, max(max_tensor_bytes(), 1))
    if info.file_size > limit:
        raise InputFileError(f"{path}: its model.weights.h5 declares {human(info.file_size)}, more than the "
                             f"{human(limit)} limit; refused before reading")
    written = 0
    try:
        with archive.open(info) as src, open(target, "wb") as dst:
            while chunk := src.read(COPY_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise InputFileError(f"{path}: its model.weights.h5 inflates past the {info.file_size} bytes it "
                                         "declares; refused")
                dst.write(chunk)
    except LstmGradError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError) as err:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise InputFileError(f"{path}: cannot read its model.weights.h5 ({reason(err)})") from None


def _relabel(err: InputFileError, weights: Path, label: str) -> InputFileError:
    """An error about the private copy, said of the archive."""
    return InputFileError(str(err).replace(str(weights), label))


FORMAT = Format("keras", "a Keras model archive (.keras)", False, sniff, open_keras, "npz", listed=False,
                suffixes=(".keras",), in_folders=False)
