"""HDF5 files (h5py), read one link at a time and never out of the file.

External links, dangling soft links, soft-link loops, virtual datasets and datasets whose raw data
lives in external files are refused; a compression filter that is not available is named.  Tensors
asked for lazily come back as ``LazyDataset``s when large enough (``lazy.worth_leaving``), read later a slice of time
steps at a time (what lets an input larger than memory be processed); HDF5 attributes of the group can hold the scalar
parameters.  Every tensor asked for is declared from its dataspace, type, layout and filters, and the
declarations are checked together (declared.py) before any data is read; a dataset over 1 MiB that was
never written (whose values HDF5 would make up from the fill value) is refused.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from ._common import Budget, Format, LoadedFile, human, key_for, native, open_regular, reason, shape_text, worded
from .declared import LARGE, Declared, checked, read_checked
from .lazy import LazyRows, worth_leaving

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
# HDF5 allows a user block before the superblock; the signature then sits at 512, 1024, 2048, ...
HDF5_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)
MAX_LINK_DEPTH = 16  # soft links followed in a row (HDF5's own default nesting limit)
MAX_LINKS = 100_000  # links one group may hold (a file's tensors, a model's layers: thousands at most)

# Everything h5py raises on bad data (HDF5 errors arrive as OSError, KeyError, RuntimeError, ...).
HDF5_ERRORS = (OSError, KeyError, RuntimeError, ValueError, TypeError, IndexError, OverflowError,
               AttributeError, NotImplementedError, UnicodeError)


def sniff(head: bytes) -> bool:
    return any(head[offset:offset + 8] == HDF5_MAGIC for offset in HDF5_OFFSETS)


@contextlib.contextmanager
def open_hdf5_inputs(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None, headers=()):
    """The tensors ``names`` and scalars of ``path``; those in ``lazy`` may stay on disk while the block runs, those
    in ``headers`` are declared only (``LoadedFile.headers``)."""
    with open_hdf5(path) as (fh, h5py):
        loaded = LoadedFile(path, "hdf5", header_only=frozenset(headers))
        with hdf5_errors(path):
            read_open(fh, loaded, list(names), list(scalars), group, h5py, frozenset(lazy), collect_errors, kind)
        yield loaded


class LazyDataset(LazyRows):
    """An HDF5 dataset read by slicing (``lazy.LazyRows``), whose read errors become InputFileError naming file and
    tensor.

    ``read_into`` reads a dataset stored in one contiguous, unfiltered block of a plain file with ``pread`` on the
    file's own descriptor, not through HDF5: h5py holds the GIL while it reads, so a thread reading ahead (the
    backward pass's ``_ReadAhead``) would stall the time loop, while a ``pread`` lets it run (a read beside a loop of
    small products: 0.69 s in sequence, 0.67 s with h5py on a thread, 0.50 s with pread).
    """

    def __init__(self, dataset, key: str, path: Path):
        super().__init__(dataset.shape, dataset.dtype, key, path)
        self._dataset = dataset
        self._raw = _raw_location(dataset, self.size * self.dtype.itemsize)  # (descriptor, offset) or None

    def _read(self, index) -> np.ndarray:
        try:
            return np.asarray(self._dataset[index])
        except MemoryError:
            raise InputFileError(f"{self._path}: {self._key} does not fit in memory") from None
        except HDF5_ERRORS as err:
            raise InputFileError(f"{self._path}: {self._key} cannot be read ({reason(err)})") from None

    def _read_rows(self, lo: int, hi: int, out: np.ndarray) -> None:
        try:
            if self._raw is None:
                self._dataset.read_direct(out, np.s_[lo:hi])
            elif not self._dataset.id.valid:  # the file was closed: its descriptor may belong to another file now
                raise ValueError("the file is closed")
            else:
                self._pread(*self._raw, lo, hi, out)
        except InputFileError:  # _pread's own, already naming file and tensor
            raise
        except MemoryError:
            raise InputFileError(f"{self._path}: {self._key} does not fit in memory") from None
        except HDF5_ERRORS as err:
            raise InputFileError(f"{self._path}: {self._key} cannot be read ({reason(err)})") from None


def _raw_location(dataset, nbytes: int) -> tuple[int, int] | None:
    """(file descriptor, byte offset) of a dataset whose data is one contiguous, unfiltered block inside a plain
    file, which ``pread`` reads as HDF5 would; None for anything else (chunked, filtered, not yet written,
    another file driver, no ``os.preadv``) or for a block that would reach past the file's end."""
    if not hasattr(os, "preadv") or not nbytes:
        return None
    try:
        import h5py  # noqa: PLC0415 - a LazyDataset exists only when h5py is imported

        dcpl = dataset.id.get_create_plist()
        if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_nfilters() or dcpl.get_external_count():
            return None
        if dataset.file.driver != "sec2" or dataset.id.get_storage_size() != nbytes:
            return None
        offset = dataset.id.get_offset()
        fd = dataset.file.id.get_vfd_handle()
        if offset is None or not isinstance(fd, int) or offset + nbytes > os.fstat(fd).st_size:
            return None
    except (*HDF5_ERRORS, MemoryError):
        return None
    return fd, offset


@contextlib.contextmanager
def open_hdf5(path: Path):
    import h5py  # noqa: PLC0415 - imported when an HDF5 file is actually read

    try:
        fh = h5py.File(path, "r")
    except MemoryError:
        raise InputFileError(f"{path}: corrupt HDF5 file (its metadata does not fit in memory)") from None
    except HDF5_ERRORS as err:
        raise InputFileError(f"{path}: corrupt or truncated HDF5 file ({reason(err)})") from None
    with fh:
        yield fh, h5py


def hdf5_errors(path: Path):
    """h5py's many exception types on a corrupt file -> one InputFileError (a context manager)."""
    return worded(path, HDF5_ERRORS, lambda err: f"corrupt HDF5 file ({reason(err)})",
                  "corrupt HDF5 file (its metadata does not fit in memory)")


def read_open(fh, loaded: LoadedFile, names, scalars, group, h5py, lazy=frozenset(), collect_errors=False,
              kind=None) -> None:
    path = loaded.path
    node = fh
    if group:
        node = walk(fh, fh, group, path, h5py, f"group {group!r}")
        if not isinstance(node, h5py.Group):
            groups = [k for k in group_keys(fh, path, "its root group")[:1000]
                      if fh.get(k, getlink=True).__class__ is h5py.HardLink and isinstance(fh.get(k), h5py.Group)]
            shown = ", ".join(sorted(groups)[:20]) + (" and more" if len(groups) > 20 else "")
            raise InputFileError(f"{path}: no group {group!r} (groups at the root: {shown or 'none'})")
    loaded.keys = group_keys(node, path, f"group {group!r}" if group else "its root group")
    keys = set(loaded.keys)
    scalars = list(scalars)
    listed = {}  # id(owner) -> its attribute names, listed once (each scalar asks)

    def attributes_of(owner) -> list[str]:
        if id(owner) not in listed:
            listed[id(owner)] = attribute_names(owner, path)
        return listed[id(owner)]

    def declare(name: str) -> Declared | None:
        key = key_for(name, keys, path)
        if name in scalars:
            if key is not None:
                if key_for(name, attributes_of(node), path) is not None:
                    raise InputFileError(f"{path}: {name} is both a dataset and an attribute of "
                                         f"{'group ' + repr(group) if group else 'the root group'}; keep one")
                return declare_dataset(fh, node, name, key, path, h5py)
            for owner in (node, fh) if group else (node,):
                akey = key_for(name, attributes_of(owner), path)
                if akey is not None:
                    return declare_attribute(owner, name, akey, path)
            return None
        if (key is None and "/" in name and name.split("/", 1)[0] in keys  # (no HDF5 call for the many absent ones)
                and walk(fh, node, name, path, h5py, name) is not None):
            key = name  # a path inside the group (a Keras weights file's cell/vars/0)
        if key is None:
            return None
        return declare_dataset(fh, node, name, key, path, h5py, lazy=name in lazy)

    declared = checked(loaded, Budget(path, kind), names, scalars, declare)
    read_checked(loaded, declared, scalars, collect_errors, collect_scalars=False)


def group_keys(group, path: Path, what: str) -> list[str]:
    """The names of a group's links, counted before they are listed (HDF5 keeps the count: no link is read)."""
    count = len(group)
    if count > MAX_LINKS:
        raise InputFileError(f"{path}: {what} holds {count} links (at most {MAX_LINKS}: a file's tensors or a "
                             "model's layers are thousands at most); refused before listing them")
    return list(group.keys())


def walk(fh, start, target: str, path: Path, h5py, what: str, depth: int = 0):
    """The object at ``target`` (relative to ``start``), following links one at a time, never out of the file.

    Returns None when nothing is there; refuses external links, dangling soft links, soft-link loops
    and link types HDF5 plugins define.
    """
    if depth > MAX_LINK_DEPTH:
        raise InputFileError(f"{path}: {what}: more than {MAX_LINK_DEPTH} soft links in a row (a loop?); refused")
    current = fh if target.startswith("/") else start
    readonly = fh.mode == "r"  # (as h5py opens a file's datasets)
    for part in (p for p in target.split("/") if p and p != "."):
        if not isinstance(current, h5py.Group):
            return None
        hard = _hard_linked(current, part, h5py, readonly)
        if hard is not None:
            current = hard
            continue
        link = current.get(part, getlink=True)  # one link name: the link itself, following nothing
        if link is None:  # (h5py asks whether the name is there first)
            return None
        if isinstance(link, h5py.ExternalLink):
            raise InputFileError(f"{path}: {what} is an external link to {link.filename!r}:{link.path!r} "
                                 "(data outside this file); refused")
        if isinstance(link, h5py.SoftLink):
            obj = walk(fh, current, link.path, path, h5py, what, depth + 1)
            if obj is None:
                raise InputFileError(f"{path}: {what} is a soft link to {link.path!r}, which does not exist "
                                     "in this file (a dangling link); refused")
            current = obj
        elif isinstance(link, h5py.HardLink):
            current = current[part]
        else:
            raise InputFileError(f"{path}: {what} is a {type(link).__name__} (not a hard or soft link); refused")
    return current


def _hard_linked(group, part: str, h5py, readonly: bool):
    """The dataset or group that the hard link ``part`` of ``group`` names, as ``group[part]`` gives it, through h5py's
    low-level calls: a file's every tensor is looked up, and ``group.get(part, getlink=True)`` then ``group[part]``
    took three times as long (~50 against ~16 us).  None for anything else (another kind of link, none, another
    kind of object), which ``walk`` then looks up as before."""
    try:
        name = part.encode("utf-8")  # as h5py encodes a name
        links = group.id.links
        if not links.exists(name) or links.get_info(name).type != h5py.h5l.TYPE_HARD:
            return None
        oid = h5py.h5o.open(group.id, name)
        kind = h5py.h5i.get_type(oid)
    except HDF5_ERRORS:  # anything unusual (a name HDF5 cannot take, a damaged link): walk's own lookup says what
        return None
    if kind == h5py.h5i.DATASET:
        return h5py.Dataset(oid, readonly=readonly)
    if kind == h5py.h5i.GROUP:
        return h5py.Group(oid)
    return None


UNWRITTEN_LIMIT = 1 << 20  # bytes: an unwritten dataset larger than this is refused (its data would be made up)


def declare_dataset(fh, node, name: str, key: str, path: Path, h5py, lazy: bool = False) -> Declared:
    """The dataset at ``key`` as it declares itself (dataspace, type, layout, filters), refused for anything
    lstmgrad does not read; its data is read by the declaration's ``read``."""
    obj = walk(fh, node, key, path, h5py, key)
    if not isinstance(obj, h5py.Dataset):
        kind = "group" if isinstance(obj, h5py.Group) else type(obj).__name__.lower()
        raise InputFileError(f"{path}: {key} is a {kind}, not a dataset")
    dcpl = obj.id.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.VIRTUAL:
        raise InputFileError(f"{path}: {key} is a virtual dataset (data from other files); refused")
    if dcpl.get_external_count():
        raw = dcpl.get_external(0)[0].decode("utf-8", "replace")
        raise InputFileError(f"{path}: {key} keeps its data in an external raw file ({raw!r}); refused")
    check_filters(dcpl, key, path)
    shape, dtype = obj.shape, obj.dtype
    if shape is None:
        raise InputFileError(f"{path}: {key} has no data (an HDF5 null dataspace); expected an array")
    if dtype.hasobject:
        raise InputFileError(f"{path}: {key} has a variable-length or reference type ({type_text(obj)}); "
                             "expected a numeric array")
    if layout == h5py.h5d.CHUNKED:  # a chunk is decompressed whole: a huge chunk is a memory bomb too
        chunks = dcpl.get_chunk()
        chunk_bytes = math.prod(chunks) * dtype.itemsize
        budget = Budget(path)
        if chunk_bytes > budget.limit:
            budget.take(key, chunks, dtype, what="chunks of ")
    lazy = lazy and len(shape) >= 1 and dtype.isnative and dtype.kind == "f" and worth_leaving(shape, dtype)
    return Declared(name, key, tuple(shape), dtype, lambda: _read_dataset(obj, key, path, lazy, shape, dtype),
                    lazy=lazy)


def _read_dataset(obj, key: str, path: Path, lazy: bool, shape: tuple, dtype: np.dtype):
    """The dataset's values (a ``LazyDataset`` when ``lazy``), once its declaration (``shape``, ``dtype``) passed
    the checks."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > UNWRITTEN_LIMIT and not obj.id.get_storage_size():
        raise InputFileError(f"{path}: {key} declares shape {shape_text(shape)} of {dtype} = {human(nbytes)} "
                             "but not one byte of it was ever written (an unallocated HDF5 dataset: its values would "
                             "all be made up from the fill value); refused")
    if lazy:
        return LazyDataset(obj, key, path)  # read later, a slice of time steps at a time
    try:
        return native(np.asarray(obj[()]))
    except MemoryError:
        raise InputFileError(f"{path}: {key} does not fit in memory") from None
    except HDF5_ERRORS as err:
        raise InputFileError(f"{path}: {key} cannot be read ({reason(err)})") from None


def check_filters(dcpl, key: str, path: Path) -> None:
    """Name a compression filter this HDF5 cannot run (HDF5's own message only says a plugin is missing)."""
    from h5py import h5z  # noqa: PLC0415

    for index in range(dcpl.get_nfilters()):
        code, _flags, _values, name = dcpl.get_filter(index)
        if not h5z.filter_avail(code):
            label = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
            label = f" ({label!r})" if label else ""
            raise InputFileError(f"{path}: {key} is compressed with HDF5 filter {code}{label}, which is not "
                                 "available here; install its plugin (e.g. the hdf5plugin package)")


def declare_attribute(owner, name: str, akey: str, path: Path) -> Declared:
    """An attribute of ``owner`` holding a scalar parameter, declared from its dataspace and type (a string's
    length from its attribute message: at most ``declared.LARGE``, what validation reads to say what it is)."""
    attrs = owner.attrs

    def read():
        try:
            strings = vlen_strings(owner, akey, path, LARGE) if attrs.get_id(akey).dtype.hasobject else None
            if strings is not None:  # (read from the heap here: HDF5 can loop forever on a corrupt one)
                return np.asarray(strings[0].decode("utf-8", "replace"))
            return native(np.asarray(attrs[akey]))
        except MemoryError:
            raise InputFileError(f"{path}: attribute {akey} does not fit in memory") from None
        except HDF5_ERRORS as err:
            raise InputFileError(f"{path}: attribute {akey} cannot be read ({reason(err)})") from None

    try:
        attr = attrs.get_id(akey)
        shape, dtype = attr.shape, attr.dtype
    except MemoryError:
        raise InputFileError(f"{path}: attribute {akey} does not fit in memory") from None
    except HDF5_ERRORS as err:
        raise InputFileError(f"{path}: attribute {akey} cannot be read ({reason(err)})") from None
    if dtype.hasobject:  # a string (or another variable-length value): small, and validation says what it is
        size = attribute_bytes(owner, akey, path)
        if (size if size is not None else _size(path)) > LARGE:
            said = human(size) if size is not None else "a length lstmgrad cannot find before reading it"
            raise InputFileError(f"{path}: attribute {akey} is a string of {said}, more than a parameter can be; "
                                 "refused before reading it")
    if shape is None or dtype.hasobject:
        shape, dtype = (), np.dtype(np.uint8)
    return Declared(name, f"attribute {akey}", tuple(shape), dtype, read, origin="attribute")


def attribute_names(owner, path) -> list[str]:
    """The names of an object's attributes, counted before they are listed."""
    count = len(owner.attrs)
    if count > MAX_LINKS:
        raise InputFileError(f"{path}: {owner.name} holds {count} attributes (at most {MAX_LINKS}); refused before "
                             "listing them")
    return list(owner.attrs.keys())


def type_text(obj) -> str:
    import h5py  # noqa: PLC0415

    dtype = obj.dtype
    if h5py.check_string_dtype(dtype) is not None:
        return "variable-length strings"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable-length sequences"
    if h5py.check_ref_dtype(dtype) is not None:
        return "object references"
    return "objects"


# -- attributes, measured before they are read ----------------------------------------------------------------

MAX_HEADER_CHUNKS = 64  # object header chunks followed (continuations) looking for an attribute message


def string_attribute(node, path, name: str, limit: int, what: str) -> bytes | None:
    """The string attribute ``name`` of ``node`` (None if it has none), read once its length is known to be at most
    ``limit`` (a fixed-length string's type says it; a variable-length one's attribute message does, and its bytes
    are then read from the global heap here: ``vlen_strings``); ``what`` says in messages what it should be ("a
    model configuration")."""
    import h5py  # noqa: PLC0415

    if name not in node.attrs:
        return None
    attr = node.attrs.get_id(name)
    if h5py.check_string_dtype(attr.dtype) is None or attr.shape is None or math.prod(attr.shape) != 1:
        raise InputFileError(f"{path}: its {name} attribute is not a string")
    strings = vlen_strings(node, name, path, limit) if attr.dtype.hasobject else None
    if strings is not None:
        return strings[0]
    length = attribute_bytes(node, name, path)
    if length is None:  # (where its length is not found, the string cannot be longer than the file)
        size = _size(path)
        if size > limit:
            raise InputFileError(f"{path}: its {name} attribute is a variable-length string whose length lstmgrad "
                                 "cannot find before reading it (it is in HDF5's dense attribute storage), in a file "
                                 f"of {human(size)}: it could be more than {what} can be (at most {human(limit)}); "
                                 "refused")
    elif length > limit:
        raise InputFileError(f"{path}: its {name} attribute is {human(length)}, more than {what} can be (at most "
                             f"{human(limit)}); refused before reading it")
    value = node.attrs[name]
    return value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)


def attribute_bytes(node, name: str, path) -> int | None:
    """The bytes the attribute ``name`` of ``node`` holds, known before it is read: its type's size times its
    elements, and for variable-length strings the lengths their attribute message records (HDF5 reads the strings
    themselves to tell them); None where those are not found (attributes in dense storage, other variable-length
    types)."""
    import h5py  # noqa: PLC0415

    attr = node.attrs.get_id(name)
    count = math.prod(attr.shape) if attr.shape is not None else 0
    if not attr.dtype.hasobject:
        return count * attr.dtype.itemsize
    if h5py.check_string_dtype(attr.dtype) is None:
        return None
    refs = _heap_refs(node, name, path)
    return None if refs is None else sum(length for length, _, _ in refs)


def vlen_strings(node, name: str, path, limit: int) -> list[bytes] | None:
    """The strings of the variable-length string attribute ``name``, read from the global heap where its attribute
    message says they are, in a walk bounded by the heap collection's own size, and only when they hold at most
    ``limit`` bytes in all: what HDF5 would read, without HDF5 (which loops forever on a heap object of size 0).
    None where the message is not found; InputFileError for a heap that does not hold what the message says."""
    refs = _heap_refs(node, name, path)
    if refs is None or sum(length for length, _, _ in refs) > limit:
        return None
    offsets, lengths = node.file.id.get_create_plist().get_sizes()
    strings = []
    with _raw_bytes(path) as read:
        base = _base(read)
        for length, collection, index in refs:
            data = _heap_object(lambda at, n: read(base + at, n), collection, index, lengths)
            if data is None or len(data) < length:
                raise InputFileError(f"{path}: its {name} attribute's string is not in the file's global heap where "
                                     "its attribute message says; corrupt")
            strings.append(data[:length])
    return strings


MAX_HEAP_OBJECTS = 1 << 20  # objects looked at in one global heap collection, at most


def _heap_object(read, collection: int, index: int, lengths: int) -> bytes | None:
    """Object ``index`` of the global heap collection at ``collection`` ("GCOL", version, its size, then objects:
    index, reference count, reserved, size, data padded to 8 bytes); None when it is not there."""
    head = read(collection, 8 + lengths)
    if len(head) < 8 + lengths or head[:4] != b"GCOL":
        return None
    end = collection + int.from_bytes(head[8:8 + lengths], "little")
    at = collection + 8 + lengths
    for _ in range(MAX_HEAP_OBJECTS):
        if at + 8 + lengths > end:
            return None
        header = read(at, 8 + lengths)
        found, size = struct.unpack_from("<H", header, 0)[0], int.from_bytes(header[8:8 + lengths], "little")
        if found == 0 or at + 8 + lengths + size > end:  # (object 0 is the collection's free space)
            return None
        if found == index:
            return read(at + 8 + lengths, size)
        at += 8 + lengths + (size + 7) // 8 * 8
    return None


def _heap_refs(node, name: str, path) -> list[tuple[int, int, int]] | None:
    """(length, heap collection address, object index) of each string of a variable-length string attribute, from
    its attribute message in the object header of ``node``; None where it is not found."""
    import h5py  # noqa: PLC0415

    try:
        offsets, lengths = node.file.id.get_create_plist().get_sizes()
        address = h5py.h5o.get_info(node.id).addr
        with _raw_bytes(path) as read:
            base = _base(read)
            return _message_refs(lambda at, n: read(base + at, n), address, offsets, lengths, name.encode())
    except (OSError, ValueError, IndexError, struct.error, KeyError):
        return None


def _base(read) -> int:
    """Where the file's HDF5 superblock, and so its address 0, is (after a user block)."""
    return next((o for o in HDF5_OFFSETS if read(o, 8) == HDF5_MAGIC), 0)


@contextlib.contextmanager
def _raw_bytes(path):
    """``read(offset, count)`` of the bytes of the file h5py opened (a path, or a file object: an archive's member)."""
    if hasattr(path, "readinto"):
        def read(at: int, count: int) -> bytes:
            path.seek(at)
            return path.read(count)
        yield read
    else:
        with open_regular(path) as fh:
            yield lambda at, count: os.pread(fh.fileno(), count, at)


def _size(path) -> int:
    if hasattr(path, "readinto"):
        return path.seek(0, os.SEEK_END)
    return os.path.getsize(path)


def _message_refs(read, address: int, offsets: int, lengths: int, name: bytes) -> list | None:
    """``_heap_refs`` of attribute ``name``'s message in the object header at ``address`` (versions 1 and 2, its
    continuation chunks too); None when it is not there."""
    head = read(address, 16)
    chunks = []
    if head[:4] == b"OHDR":  # version 2: "OHDR", version, flags, [times], [phase change], size of chunk 0
        flags = head[5]
        at = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        width = 1 << (flags & 3)
        chunks.append((address + at + width, int.from_bytes(read(address + at, width), "little"), 2, flags))
    elif head[:1] == b"\x01":  # version 1: version, reserved, messages, reference count, header size, padding
        chunks.append((address + 16, struct.unpack_from("<I", head, 8)[0], 1, 0))
    else:
        return None
    seen = 0
    while chunks and seen < MAX_HEADER_CHUNKS:
        start, size, version, flags = chunks.pop(0)
        seen += 1
        data, at = read(start, size), 0
        while at < len(data):
            if version == 1:  # type (2 bytes), size (2), flags, 3 reserved
                if at + 8 > len(data):
                    break
                kind, length = struct.unpack_from("<HH", data, at)
                body, at = data[at + 8:at + 8 + length], at + 8 + length
            else:  # type (1 byte), size (2), flags, [creation order (2)]
                extra = 2 if flags & 0x04 else 0
                if at + 4 + extra > len(data):
                    break
                kind, length = data[at], struct.unpack_from("<H", data, at + 1)[0]
                body, at = data[at + 4 + extra:at + 4 + extra + length], at + 4 + extra + length
            if kind == 0x10:  # a continuation: the next chunk's address and length
                where = int.from_bytes(body[:offsets], "little")
                span = int.from_bytes(body[offsets:offsets + lengths], "little")
                chunks.append((where + 4, span - 8, 2, flags) if version == 2 else (where, span, 1, 0))
            elif kind == 0x0C:
                found = _string_refs(body, name, offsets)
                if found is not None:
                    return found
    return None


def _string_refs(body: bytes, name: bytes, offsets: int) -> list | None:
    """The (length, collection, index) of each string of a variable-length string attribute message named ``name``
    (None: another attribute).  Its data is, for each element, the string's length and where the global heap keeps
    it: the collection's address and the object's index."""
    version = body[0]
    name_size, type_size, space_size = struct.unpack_from("<HHH", body, 2)
    at = 8 if version in (1, 2) else 9

    def padded(n):  # (version 1 pads each part to 8 bytes)
        return (n + 7) // 8 * 8 if version == 1 else n

    if body[at:at + name_size].rstrip(b"\0") != name:
        return None
    at += padded(name_size)
    datatype, at = body[at:at + type_size], at + padded(type_size)
    space, at = body[at:at + space_size], at + padded(space_size)
    if datatype[0] & 0x0F != 9 or datatype[1] & 0x0F != 1:  # not a variable-length string
        return None
    rank, dims_at = space[1], (8 if space[0] == 1 else 4)
    count = 0 if space[0] == 2 and space[3] == 2 else math.prod(  # (a null dataspace holds nothing)
        int.from_bytes(space[dims_at + k * 8:dims_at + (k + 1) * 8], "little") for k in range(rank))
    step = 4 + offsets + 4
    if count > MAX_HEAP_OBJECTS or at + count * step > len(body):
        return None
    return [(struct.unpack_from("<I", body, at + k * step)[0],
             int.from_bytes(body[at + k * step + 4:at + k * step + 4 + offsets], "little"),
             struct.unpack_from("<I", body, at + k * step + 4 + offsets)[0]) for k in range(count)]


FORMAT = Format("hdf5", "an HDF5 file", False, sniff, open_hdf5_inputs, "hdf5", suffixes=(".h5", ".hdf5"))
