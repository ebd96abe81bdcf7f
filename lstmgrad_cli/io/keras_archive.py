"""Keras model archives (``model.save('m.keras')``) and the model configuration of full-model HDF5 files.

A ``.keras`` file is a zip of ``metadata.json`` (the Keras version), ``config.json`` (the model: every layer's
class and options) and ``model.weights.h5`` (the weights, laid out as ``model.save_weights`` lays them out).

Everything is bounded before it is read: the archive's end record first (an archive declaring more members than a
model has is refused before zipfile reads its directory), then each member's name (one twice is refused: zipfile
would keep one in silence) and sizes (inside the archive, what its method can unpack).  The weights are read by
the HDF5 reader, with all its checks, where they lie: Keras stores model.weights.h5 uncompressed and h5py reads it
from the archive itself (no member name is ever used as a path, nothing is extracted, nothing copied); a
compressed one (an archive zipped again) is inflated into memory up to the end of the HDF5 file it holds (its
superblock says where: bytes after it are never inflated), at most ``MAX_INFLATED_WEIGHTS`` and the memory
budget.  The configuration is a JSON document bounded in bytes, depth and values before it is parsed
(``_common.json_document``), kept in ``LoadedFile.info["keras_model_config"]`` (with ``keras_version`` and
``keras_config_source``) for frameworks/ to read a layer's options from.  An older full-model HDF5 file
(``model.save('m.h5')``) keeps the same in its root attributes ``model_config`` and ``keras_version``
(``hdf5_model_config``), whose lengths are read from their attribute messages before the strings are.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import zipfile
from pathlib import Path

from ..errors import InputFileError, LstmGradError
from ..messages import cut
from . import hdf5, npz
from ._common import Format, human, json_document, max_tensor_bytes, open_regular, reason, worded

MEMBERS = ("metadata.json", "config.json", "model.weights.h5")
MAX_MEMBERS = 1000  # an archive's assets may add a few files; thousands of members is not a model
MAX_CONFIG_BYTES = 16 * 2**20  # a model configuration is kilobytes; one of thousands of layers a few megabytes
MAX_JSON_DEPTH = 200  # layers nested in models nested in wrappers: tens of levels at most
MAX_JSON_VALUES = 500_000  # ~60 a layer; parsed, each takes 50 to 100 bytes
MAX_VERSION_BYTES = 1024  # a keras_version attribute: "2.15.0"
MAX_INFLATED_WEIGHTS = 64 * 2**20  # a compressed model.weights.h5 is inflated into memory up to this
COPY_CHUNK = 1 << 20


def sniff(head: bytes) -> bool:
    """A zip whose first member is one of a Keras archive's (Keras writes metadata.json first); an archive that
    starts otherwise is recognised by its directory (``holds_model``)."""
    if head[:4] != b"PK\x03\x04" or len(head) < 30:
        return False
    name_length = struct.unpack_from("<H", head, 26)[0]
    return head[30:30 + name_length].decode("utf-8", "replace") in MEMBERS


def holds_model(path: Path, head: bytes) -> bool:
    """Whether the zip archive ``path`` (which starts with ``head``) has a Keras archive's config.json and
    model.weights.h5 whatever member comes first (assets, say); False for anything else, never an error (its
    reader says what is wrong).  An archive whose first member is a .npy array is an NPZ: not looked into."""
    if head[:4] == b"PK\x03\x04" and len(head) >= 30:
        name_length = struct.unpack_from("<H", head, 26)[0]
        if head[30:30 + name_length].endswith(b".npy"):
            return False
    try:
        with open_regular(path) as fh:
            count = npz.declared_members(fh, os.fstat(fh.fileno()).st_size)
            if count is None or count > MAX_MEMBERS:
                return False
            with zipfile.ZipFile(fh) as archive:
                return {"config.json", "model.weights.h5"} <= set(archive.namelist())
    except (LstmGradError, *npz.NPZ_ERRORS, MemoryError):
        return False


@contextlib.contextmanager
def open_keras(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None, headers=()):
    """The tensors of the archive's ``model.weights.h5`` (``group`` a layer's group in it), with its configuration
    in ``info``."""
    with model_weights(path) as (weights, config, version):
        with hdf5.open_hdf5_inputs(weights, names, scalars, group, (), collect_errors, kind, headers) as loaded:
            loaded.path, loaded.format = path, "keras"
            loaded.info.update(keras_model_config=config, keras_config_source=f"{path.name} config.json",
                               keras_version=version)
            yield loaded


@contextlib.contextmanager
def model_weights(path: Path):
    """(the archive's model.weights.h5 as a file object h5py reads, its configuration, the Keras version) while the
    block runs.  The file object reads the member where it lies (stored) or from memory (compressed); errors about
    it name the archive: ``m.keras (its model.weights.h5)``."""
    path = Path(path)
    with _archive(path) as (archive, members, fd, size):
        missing = [m for m in ("config.json", "model.weights.h5") if m not in members]
        if missing:
            raise InputFileError(f"{path}: a Keras archive without {' and '.join(missing)}; save the model with "
                                 "model.save('m.keras'), or its weights with model.save_weights('m.weights.h5')")
        config = _json_member(archive, members["config.json"], path)
        metadata = _json_member(archive, members["metadata.json"], path) if "metadata.json" in members else {}
        version = metadata.get("keras_version", "3")
        if not isinstance(version, str) or len(version) > 64:
            raise InputFileError(f"{path}: its metadata.json's keras_version is not a version number")
        with _weights_member(archive, members["model.weights.h5"], path, fd, size) as weights:
            yield weights, config, version


def hdf5_model_config(path: Path) -> tuple[dict, str] | None:
    """(model configuration, Keras version) from a full-model HDF5 file's root attributes; None if it has none.
    Each string's length is known before it is read (a fixed-length string's type says it; a variable-length one's
    attribute message does), and refused past ``MAX_CONFIG_BYTES``."""
    with hdf5.open_hdf5(path) as (fh, h5py), hdf5.hdf5_errors(path):
        if "model_config" not in fh.attrs:
            return None
        text = hdf5.string_attribute(fh, path, "model_config", MAX_CONFIG_BYTES, "a model configuration")
        version = hdf5.string_attribute(fh, path, "keras_version", MAX_VERSION_BYTES, "a version") or b""
    label = f"{path}: its model_config attribute"
    value = json_document(text, label, MAX_JSON_DEPTH, MAX_JSON_VALUES)
    if not isinstance(value, dict):
        raise InputFileError(f"{label} is not a JSON object")
    return value, version.decode("utf-8", "replace")


def keras_major(version: str) -> int:
    """3 for Keras 3 (and unknown versions), 2 for tf.keras / Keras 2 files."""
    head = str(version).strip().split(".")[0]
    return int(head) if head.isdigit() and int(head) < 3 else 3


# -- the archive -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _archive(path: Path):
    """(the open archive, its members by name, the archive's descriptor and size), after the end record's member
    count and every member's name and sizes were checked."""
    with open_regular(path, refusal="; expected a Keras archive") as fh:
        with worded(path, npz.NPZ_ERRORS, lambda err: f"corrupt or truncated Keras archive ({reason(err)})",
                    "corrupt Keras archive (its zip directory does not fit in memory)"):
            size = os.fstat(fh.fileno()).st_size
            count = npz.declared_members(fh, size)
            if count is not None and count > MAX_MEMBERS:
                raise InputFileError(f"{path}: a Keras archive declaring {count} members (a model has 3, and a few "
                                     f"assets; at most {MAX_MEMBERS}); refused before reading its directory")
            archive = zipfile.ZipFile(fh)
        with archive:
            yield archive, _members(archive, path, size), fh.fileno(), size


def _members(archive: zipfile.ZipFile, path: Path, size: int) -> dict[str, zipfile.ZipInfo]:
    """name -> member; a name twice is refused (zipfile and Keras would read one in silence), and so are the
    sizes of a model's members that the archive cannot hold or their method cannot produce."""
    infos = archive.infolist()
    if len(infos) > MAX_MEMBERS:  # (an archive without an end record zipfile could read)
        raise InputFileError(f"{path}: a Keras archive of {len(infos)} members; a model has 3, refused")
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename.removeprefix("./")
        if name in members:
            raise InputFileError(f"{path}: the archive holds {cut(name)} twice (zipfile and Keras would read one in "
                                 "silence); refused")
        members[name] = info
    for name in MEMBERS:
        if name in members:
            _check_sizes(members[name], path, size)
    return members


def _check_sizes(info: zipfile.ZipInfo, path: Path, archive_size: int) -> None:
    """A member's sizes as its directory entry declares them: inside the archive, and what its method can
    unpack (a stored member unpacks to exactly what it packs)."""
    name = info.filename
    if info.flag_bits & 1:
        raise InputFileError(f"{path}: its {name} is an encrypted (password-protected) zip member; refused")
    if info.compress_size > archive_size:
        raise InputFileError(f"{path}: its {name} declares {info.compress_size} bytes of packed data, more than the "
                             f"{archive_size}-byte archive holds; corrupt or truncated")
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise InputFileError(f"{path}: its {name} is stored (not compressed) in {info.compress_size} bytes and "
                             f"declares {info.file_size} bytes; corrupt, refused")
    bound = npz.unpacked_bound(info)
    if bound is not None and info.file_size > bound:
        raise InputFileError(f"{path}: its {name} declares {info.file_size} bytes unpacked from "
                             f"{info.compress_size} packed, more than deflate can produce; corrupt (a zip bomb?)")


def _json_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> dict:
    label = f"{path}: its {info.filename}"
    if info.file_size > MAX_CONFIG_BYTES:
        raise InputFileError(f"{label} declares {human(info.file_size)}, more than a model configuration can be "
                             f"(at most {human(MAX_CONFIG_BYTES)}); refused")
    try:
        with archive.open(info) as fh:
            text = fh.read(MAX_CONFIG_BYTES + 1)
    except (*npz.NPZ_ERRORS, MemoryError) as err:
        raise InputFileError(f"{label} cannot be read ({reason(err)})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise InputFileError(f"{label} inflates past {human(MAX_CONFIG_BYTES)}; refused")
    value = json_document(text, label, MAX_JSON_DEPTH, MAX_JSON_VALUES)
    if not isinstance(value, dict):
        raise InputFileError(f"{label} is not a JSON object")
    return value


class MemberFile(io.RawIOBase):
    """A stored member's bytes, read in place from the archive's descriptor (``pread``): the read-only, seekable
    file h5py reads an HDF5 file from.  Its ``str`` names it for messages: ``m.keras (its model.weights.h5)``."""

    def __init__(self, fd: int, start: int, size: int, label: str):
        super().__init__()
        self._fd, self._start, self._size, self._label = fd, start, size, label
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset}, before the start of {self._label}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self._size - self._pos))
        done = 0
        while done < wanted:
            got = os.preadv(self._fd, [view[done:wanted]], self._start + self._pos + done)
            if not got:
                raise OSError(f"{self._label} ends early (the archive is truncated)")
            done += got
        self._pos += done
        return done

    def __str__(self) -> str:
        return self._label


class InflatedFile(io.BytesIO):
    """A compressed member's bytes, inflated into memory; its ``str`` names it for messages."""

    def __init__(self, data: bytes, label: str):
        super().__init__(data)
        self._label = label

    def __str__(self) -> str:
        return self._label


@contextlib.contextmanager
def _weights_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path, fd: int, archive_size: int):
    label = f"{path} (its model.weights.h5)"
    if info.compress_type == zipfile.ZIP_STORED:
        start = _data_start(fd, info, path, archive_size)
        member = MemberFile(fd, start, info.compress_size, label)
    else:
        member = InflatedFile(_inflated(archive, info, path), label)
    with member:
        yield member


def _data_start(fd: int, info: zipfile.ZipInfo, path: Path, archive_size: int) -> int:
    """Where a stored member's bytes begin: after its local header, which must name it as the directory does
    (zipfile's own check when it opens a member)."""
    try:
        head = os.pread(fd, 30, info.header_offset)
        local_name = os.pread(fd, struct.unpack_from("<H", head, 26)[0], info.header_offset + 30) if (
            len(head) == 30) else b""
    except OSError as err:
        raise InputFileError(f"{path}: cannot read its {info.filename} ({reason(err)})") from None
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise InputFileError(f"{path}: its {info.filename} has no local header where the directory says; corrupt")
    name_length, extra_length = struct.unpack_from("<HH", head, 26)
    start = info.header_offset + 30 + name_length + extra_length
    if local_name not in (info.orig_filename.encode("utf-8", "replace"), info.orig_filename.encode("cp437", "replace")):
        raise InputFileError(f"{path}: its {info.filename}'s local header names another member; corrupt")
    if start + info.compress_size > archive_size:
        raise InputFileError(f"{path}: its {info.filename} ends past the end of the archive; truncated")
    return start


def _inflated(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> bytes:
    """A compressed model.weights.h5, inflated up to the end of the HDF5 file it holds (never past what it
    declares, nor past ``MAX_INFLATED_WEIGHTS``)."""
    try:
        with archive.open(info) as src:
            data = bytearray(src.read(min(info.file_size, 4096)))
            end = min(info.file_size, _hdf5_end(bytes(data)) or info.file_size)
            limit = min(MAX_INFLATED_WEIGHTS, max_tensor_bytes())
            if end > limit:
                raise InputFileError(
                    f"{path}: its model.weights.h5 declares {human(end)}, more than the {human(limit)} limit on a "
                    "compressed member, which lstmgrad inflates in memory (Keras stores it uncompressed, read where it "
                    f"lies): extract it (unzip {path.name} model.weights.h5) and give that file")
            while len(data) < end and (chunk := src.read(min(COPY_CHUNK, end - len(data)))):
                data += chunk
    except LstmGradError:
        raise
    except (*npz.NPZ_ERRORS, MemoryError) as err:
        raise InputFileError(f"{path}: its model.weights.h5 cannot be read ({reason(err)})") from None
    return bytes(data)


def _hdf5_end(head: bytes) -> int | None:
    """The end of the HDF5 file whose superblock ``head`` starts with (its base plus end-of-file address), or None
    when it is not one this reads (the signature elsewhere, an unknown version)."""
    if head[:8] != hdf5.HDF5_MAGIC or len(head) < 16:
        return None
    version = head[8]
    if version in (0, 1):
        offsets, at = head[13], 24 if version == 0 else 28
    elif version in (2, 3):
        offsets, at = head[9], 12
    else:
        return None
    if offsets not in (2, 4, 8) or len(head) < at + 3 * offsets:
        return None
    base, _, eoa = (int.from_bytes(head[at + k * offsets:at + (k + 1) * offsets], "little") for k in range(3))
    return base + eoa if eoa != (1 << 8 * offsets) - 1 else None


FORMAT = Format("keras", "a Keras model archive (.keras)", False, sniff, open_keras, "npz", listed=False,
                suffixes=(".keras",), in_folders=False)
