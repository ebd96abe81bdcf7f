"""NPZ files (numpy's ``savez``): a zip archive of ``.npy`` members, read without ``np.load``.

Members are parsed by hand (``npy.py``): object arrays are refused from the header alone, nothing
is ever unpickled, and every member asked for is declared before any is inflated: its zip entry's sizes
(what the compression method can hold), then its ``.npy`` header (declared.py: the budget, the rank, the
shapes against one another).  Every member is read to its end so the zip CRC is verified.  A name twice
is refused.  A group is a key prefix (``lstm/x.npy``).
"""

from __future__ import annotations

import contextlib
import io
import lzma
import os
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from . import crc32
from ._common import Format, LoadedFile, describe_keys, open_regular, reason, worded
from .npy import LazyNpy, NpyStream, left_in_file, read_npy_tensors

ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
MAX_MEMBERS = 100_000  # members an archive may hold (zipfile's directory of them takes ~50 MB)
_EOCD, _ZIP64_LOCATOR = 22, 20  # bytes of the end-of-directory record and of the zip64 locator before it
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
def open_npz(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None, headers=()):
    """The tensors ``names`` and scalars of ``path``; large stored members of those in ``lazy`` are left in the
    file while the block runs (``LazyMember``: read a slice of time steps at a time, their CRC-32 checked once every
    byte was read; at the block's end the bytes no one read are read to check it), the others read into memory."""
    with contextlib.ExitStack() as kept:
        loaded = read_npz(path, list(names), list(scalars), group, collect_errors, kind, headers, frozenset(lazy),
                          kept)
        yield loaded
        for value in loaded.tensors.values():
            if isinstance(value, LazyMember):
                value.verify()


def read_npz(path: Path, names, scalars, group, collect_errors=False, kind=None, headers=(), lazy=frozenset(),
             kept: contextlib.ExitStack | None = None) -> LoadedFile:
    """The file's tensors in memory; with ``kept`` (the caller's ExitStack, which then keeps the file open), large
    stored members of the tensors ``lazy`` as ``LazyMember``s."""
    loaded = LoadedFile(path, "npz", header_only=frozenset(headers))
    prefix = f"{group.strip('/')}/" if group else ""
    with worded(path, NPZ_ERRORS, lambda err: f"corrupt or truncated NPZ file ({reason(err)})",
                "corrupt NPZ file (its zip directory does not fit in memory)"), contextlib.ExitStack() as opened:
        fh = opened.enter_context(open_regular(path, refusal="; expected an NPZ file"))
        archive_size = os.fstat(fh.fileno()).st_size
        count = declared_members(fh, archive_size)
        if count is not None and count > MAX_MEMBERS:  # zipfile would hold ~500 bytes for each
            raise InputFileError(f"{path}: the archive declares {count} members, more than the {MAX_MEMBERS} an "
                                 "input may hold; refused before reading its directory")
        with zipfile.ZipFile(fh) as archive:
            _read_members(archive, fh, _members(archive, path), archive_size, loaded, prefix, group, names,
                          scalars, collect_errors, kind, lazy if kept is not None else frozenset())
        if kept is not None and any(isinstance(v, LazyMember) for v in loaded.tensors.values()):
            kept.push(opened.pop_all())  # the lazy members read from fh until the caller's block ends
    return loaded


def declared_members(fh, size: int) -> int | None:
    """The member count a zip archive's end-of-directory record declares (its zip64 record's, when it has one);
    None when there is no such record (zipfile then says what is wrong)."""
    tail = min(size, _EOCD + _ZIP64_LOCATOR)  # the record and a zip64 locator: an archive without a comment
    fh.seek(size - tail)
    data = fh.read(tail)
    if data[-_EOCD:-_EOCD + 4] != b"PK\x05\x06":  # a comment follows the record: up to 64 KiB of it
        tail = min(size, _EOCD + 0xFFFF + _ZIP64_LOCATOR)
        fh.seek(size - tail)
        data = fh.read(tail)
    pos = data.rfind(b"PK\x05\x06")
    if pos < 0 or pos + _EOCD > len(data):
        return None
    count = struct.unpack_from("<H", data, pos + 10)[0]
    locator = pos - _ZIP64_LOCATOR
    if locator >= 0 and data[locator:locator + 4] == b"PK\x06\x07":
        offset = struct.unpack_from("<Q", data, locator + 8)[0]
        if offset + 56 <= size:
            fh.seek(offset)
            record = fh.read(56)
            if record[:4] == b"PK\x06\x06":
                count = max(count, struct.unpack_from("<Q", record, 32)[0])
    fh.seek(0)
    return count


def _members(archive: zipfile.ZipFile, path: Path) -> dict[str, zipfile.ZipInfo]:
    """key -> member: numpy's convention, "x.npy" is the array "x" and other members keep their full name.  A key
    twice is refused (zipfile and np.load would keep the last in silence)."""
    members: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        if not info.filename or info.filename.endswith("/"):  # directories (is_dir() fails on a blank name)
            continue
        key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        if key in members:
            twice = info.filename if info.filename == members[key].filename else (
                f"{members[key].filename} and {info.filename}")
            raise InputFileError(f"{path}: the archive holds {describe_keys([twice])} twice (numpy would keep one in "
                                 "silence); refused")
        members[key] = info
    return members


def _read_members(archive, fh, members, archive_size, loaded, prefix, group, names, scalars, collect_errors,
                  kind, lazy=frozenset()):
    path = loaded.path
    if any(k == "data.pkl" or k.endswith("/data.pkl") for k in members):
        raise InputFileError(f"{path}: {TORCH_FILE}")
    if {"config.json", "model.weights.h5"} <= members.keys():
        raise InputFileError(f"{path}: {KERAS_ARCHIVE}")
    keys = {k[len(prefix):]: None for k in members if k.startswith(prefix)}
    if group and not keys:
        raise InputFileError(f"{path}: no group {group!r} (no keys start with {prefix!r})")
    loaded.keys = list(keys)

    def open_stream(key: str, opened: contextlib.ExitStack):
        stored = prefix + key
        stream = _open_member(archive, fh, members[stored], stored, path, archive_size, opened)
        return stored, stream, lambda: _guarded(stream.read, stored, path)

    def lazy_read(name: str, stored: str, stream: NpyStream):
        """How to leave the member in the file (None: it is read into memory)."""
        info = members[stored]
        if name not in lazy or info.compress_type != zipfile.ZIP_STORED or not left_in_file(stream):
            return None
        return lambda: _guarded(lambda: LazyMember(fh, info, stream, stored, path), stored, path)

    read_npy_tensors(loaded, keys, open_stream, names, scalars, collect_errors, kind, lazy_read)
    return loaded


def _open_member(archive: zipfile.ZipFile, fh, info: zipfile.ZipInfo, key: str, path: Path, archive_size: int,
                 streams: contextlib.ExitStack) -> NpyStream:
    """One ``.npy`` member, its header parsed, after what its zip entry declares was checked: sizes a deflate
    stream can hold (a zip bomb whose entry claims more is refused from the entry alone) inside the archive.
    A stored member (``np.savez``'s) is read from ``fh`` straight into its array (``StoredMember``)."""
    if info.flag_bits & 1:
        raise InputFileError(f"{path}: {key} is an encrypted (password-protected) zip member; refused")
    if info.compress_size > archive_size:
        raise InputFileError(f"{path}: {key} declares {info.compress_size} bytes of packed data, more than the "
                             f"{archive_size}-byte archive holds; corrupt or truncated")
    bound = unpacked_bound(info)
    if bound is not None and info.file_size > bound:
        raise InputFileError(f"{path}: {key} declares {info.file_size} bytes unpacked from {info.compress_size} "
                             f"packed, more than {_METHODS[info.compress_type][0]} can hold; corrupt (a zip bomb?)")
    if info.compress_type == zipfile.ZIP_STORED:
        return _guarded(lambda: NpyStream(io.BufferedReader(StoredMember(fh, info, archive_size), STORED_HEAD),
                                          info.file_size, key, path), key, path)
    return _guarded(lambda: NpyStream(streams.enter_context(archive.open(info)), info.file_size, key, path),
                    key, path)


class StoredMember(io.RawIOBase):
    """A stored (uncompressed) member of the zip archive open as ``fh``, read from the file straight into the
    caller's buffer (``readinto``: the array), where zipfile's stream copies the bytes twice on the way, ~0.3 ms of
    every small file a batch reads.  What ``ZipFile.open`` checks is checked here, as it checks it: the local
    header's signature, its name against the directory's (decoded as its own flags say), the directory's flags
    for patched data and strong encryption; then, as zipfile's stream reads, the member's bytes (the smaller of its
    stored and unpacked sizes) within the archive, and its CRC-32 once the last is read (a large member's summed on
    a thread behind the reads: ``CRC_BEHIND_BYTES``).  The errors are zipfile's, so they are worded alike."""

    def __init__(self, fh, info: zipfile.ZipInfo, archive_size: int):
        super().__init__()
        self._fh, self._name = fh, info.filename
        fh.seek(info.header_offset)
        header = fh.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise zipfile.BadZipFile("Truncated file header")
        if header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile("Bad magic number for file header")
        flags, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        name = fh.read(name_length)
        if info.flag_bits & _PATCHED:
            raise NotImplementedError("compressed patched data (flag bit 5)")
        if info.flag_bits & _STRONG_ENCRYPTION:
            raise NotImplementedError("strong encryption (flag bit 6)")
        if name.decode("utf-8" if flags & _UTF8_NAME else "cp437") != info.orig_filename:
            raise zipfile.BadZipFile(f"File name in directory {info.orig_filename!r} and header {name!r} differ.")
        self._pos = self._start = self.start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        self._end = self._start + min(info.compress_size, info.file_size)
        if self._end > archive_size:
            raise EOFError(f"the member's data ends at byte {self._end} of a {archive_size}-byte archive")
        self._crc, self._expected_crc = 0, info.CRC
        self._behind = _Crc32() if self._end - self._start >= CRC_BEHIND_BYTES else None  # (a large member)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos - self._start

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._end - self._pos)
        if n <= 0:
            return 0
        self._fh.seek(self._pos)
        got = self._fh.readinto(view[:n])
        if not got:
            raise EOFError(f"the archive ends inside {self._name}")
        if self._behind is None:
            self._crc = zlib.crc32(view[:got], self._crc)
        else:
            self._behind.add(view[:got])
        self._pos += got
        if self._pos == self._end:
            if self._behind is not None:
                self._crc = self._behind.value()
                self._behind.close()
            if self._crc != self._expected_crc:
                raise zipfile.BadZipFile(f"Bad CRC-32 for file {self._name!r}")
        return got

    def close(self) -> None:
        if self._behind is not None:
            self._behind.close()
        super().close()


class LazyMember(LazyNpy):
    """A stored ``.npy`` member of a zip archive left in the file (``npy.LazyNpy``: rows read with ``pread`` from
    the archive's descriptor, in any order).  The CRC-32 of each row range read for the first time is summed as it
    is read, and the pieces' are joined in file order (``crc32.combine``) once every row was read: a mismatch is the
    error an eager read gives, raised then (``verify()`` reads the rows no one read and raises it at the latest: the
    backward pass's caller asks before anything is written, through ``nonfinite()``)."""

    def __init__(self, fh, info: zipfile.ZipInfo, stream: NpyStream, key: str, path: Path):
        member = stream.fp.raw  # the StoredMember under the stream's read buffer
        super().__init__(fh.fileno(), member.start + stream.start, stream, key, path, lambda: fh.closed)
        self._name = info.filename
        header = os.pread(self._fd, stream.start, member.start)  # the .npy header: the CRC-32's first bytes
        if len(header) != stream.start:
            raise EOFError(f"the archive ends inside {info.filename}")
        self._header_crc, self._expected_crc = zlib.crc32(header), info.CRC
        self._pieces: dict[int, tuple[int, int]] = {}  # first row -> (end row, CRC-32 of those rows)
        self._checked = False

    def _first_read(self, lo: int, hi: int, rows: np.ndarray) -> None:
        self._pieces[lo] = (hi, zlib.crc32(memoryview(np.ascontiguousarray(rows)).cast("B")))

    def _tally(self, rows: tuple[int, int], value: np.ndarray) -> None:
        super()._tally(rows, value)
        if self._counted == [(0, self.shape[0])] and not self._checked:
            self._check_crc()

    def _check_crc(self) -> None:
        with self._lock:
            crc = self._header_crc
            for lo in sorted(self._pieces):
                hi, piece = self._pieces[lo]
                crc = crc32.combine(crc, piece, (hi - lo) * self._row_bytes)
            if crc != self._expected_crc:
                raise InputFileError(f"{self._path}: {self._key} is corrupt or truncated (Bad CRC-32 for file "
                                     f"{self._name!r})")  # (the words of an eager read's zipfile error)
            self._checked = True

    def nonfinite(self, block_bytes: int = 64 * 2**20) -> int:
        """``LazyRows.nonfinite``, the CRC-32 checked then (again, if a read raised its error before)."""
        count = super().nonfinite(block_bytes)
        if not self._checked:
            self._check_crc()
        return count

    def verify(self) -> None:
        """Read the rows no one read (their NaN/Inf counted), so the CRC-32 is checked: InputFileError if wrong."""
        self.nonfinite()


# A stored member this large has its CRC-32 computed on a thread of its own, behind the reads of its next bytes
# (zlib lets go of the GIL): a 0.53 GB file of 19 members (200,128,512,512) was read in 165-178 ms instead of 228 ms
# on 2 cores (np.load: 247-282 ms), the CRC-32 having been 0.14 s of it (benchmarks/RESULTS.md).
CRC_BEHIND_BYTES = 8 * 2**20
CRC_BEHIND_PIECE = 64 * 2**10  # read straight into the array (smaller ones may be a read buffer's, reused after)
CRC_BEHIND_BATCH = 8 * 2**20  # bytes handed to the thread at once


class _Crc32:
    """The CRC-32 of the bytes given to ``add``, in order: pieces of ``CRC_BEHIND_PIECE`` or more (the caller's
    array, which nothing writes again) are summed by a thread while the next ones are read, in batches; ``value()``
    waits for them.  Smaller pieces, and every piece once no thread could start, are summed at once."""

    def __init__(self):
        self._value, self._behind = 0, True
        self._pool = self._future = None
        self._queued, self._queued_bytes = [], 0

    def add(self, piece: memoryview) -> None:
        if self._behind and len(piece) >= CRC_BEHIND_PIECE:
            self._queued.append(piece)
            self._queued_bytes += len(piece)
            if self._queued_bytes >= CRC_BEHIND_BATCH:
                self._hand_over()
        else:
            self._value = zlib.crc32(piece, self.value())

    def _hand_over(self) -> None:
        pieces, self._queued, self._queued_bytes = self._queued, [], 0
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - large members only

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lstmgrad-crc")
        try:
            self._future = self._pool.submit(_crc_after, self._future, self._value, pieces)
        except RuntimeError:  # no thread can start (a tight ulimit -v): summed here
            self._value = _crc_after(self._future, self._value, pieces)
            self._future, self._behind = None, False

    def value(self) -> int:
        """The CRC-32 of everything added so far."""
        if self._queued:
            self._hand_over()
        if self._future is not None:
            self._value, self._future = self._future.result(), None
        return self._value

    def close(self) -> None:
        """End the thread (after what it has been handed: it reads the caller's array, which outlives it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _crc_after(previous, start: int, pieces) -> int:
    """The CRC-32 of ``pieces`` after ``previous`` (the future of the batch before: done, the thread runs them in
    order) or, without one, after ``start``."""
    crc = previous.result() if previous is not None else start
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


STORED_HEAD = 4096  # a stored member's first bytes, read at once (the .npy header's small reads come from them)
_LOCAL_HEADER = struct.Struct("<4x2xH18xHH")  # a member's local header: its flags, name and extra lengths
_PATCHED, _STRONG_ENCRYPTION, _UTF8_NAME = 1 << 5, 1 << 6, 1 << 11


# compression method -> (its name, the most it can expand: unpacked bytes per packed byte, and a constant)
_METHODS = {zipfile.ZIP_STORED: ("a stored member", 1, 0), zipfile.ZIP_DEFLATED: ("deflate", 1032, 64)}


def unpacked_bound(info: zipfile.ZipInfo) -> int | None:
    """The most bytes a member of this method and packed size can unpack to (None: a method without a bound here;
    deflate's longest match, 258 bytes, costs at least 2 bits: 1032 to 1)."""
    if info.compress_type not in _METHODS:
        return None
    _, ratio, extra = _METHODS[info.compress_type]
    return info.compress_size * ratio + extra


def _guarded(action, key: str, path: Path):
    """``action()``, with the zip and decompression layers' errors worded as one member's."""
    def word(err: BaseException) -> str:
        if isinstance(err, RuntimeError) and "encrypted" in str(err):
            return f"{key} is an encrypted (password-protected) zip member; refused"
        return f"{key} is corrupt or truncated ({reason(err)})"
    with worded(path, NPZ_ERRORS, word, f"{key} does not fit in memory"):
        return action()


FORMAT = Format("npz", "an NPZ file", False, sniff, open_npz, "npz", suffixes=(".npz",))
