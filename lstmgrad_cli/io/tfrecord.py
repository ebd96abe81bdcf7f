"""TFRecord files, read one record at a time with both checksums verified.

A record is ``uint64 length``, ``uint32 masked_crc32c(length bytes)``, ``length`` bytes of data and
``uint32 masked_crc32c(data)``, all little-endian, back to back with nothing around them.  A declared
length is checked against the bytes left in the file and the memory budget before the data is read, so
a hostile length allocates nothing.  A record over ``SMALL_RECORD`` bytes is not held in memory: its
checksum is computed a chunk at a time, and its data is a ``protowire.FileSpan`` that reads only the
parts the decoder looks at (a TensorProto's header, not its 80 MB of values).  Only regular files are
opened, never in a way that could block (a FIFO named like a dump file).

CRC-32C comes from the ``google-crc32c`` package (``pip install 'lstmgrad[tfdbg]'``; in C) when it is
installed, else from a table in pure Python: the same numbers, about 10 MB/s.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputFileError, LstmGradError
from ._common import READ_CHUNK, open_regular
from .protowire import FileSpan, WireError

HEADER = 12  # length (8) and its checksum (4)
FOOTER = 4  # the data's checksum
SMALL_RECORD = 4 << 20  # bytes: a record up to this size is read whole; a larger one is read where it is looked at


def _python_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _python_table()


def crc32c_python(data, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) in pure Python, byte by byte from a table; ``crc``: that of the bytes before ``data``."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc32c_function():
    try:
        import google_crc32c  # noqa: PLC0415 - optional (the tfdbg extra): C speed
    except ImportError:
        return crc32c_python
    return lambda data, crc=0: google_crc32c.extend(crc, bytes(data))


crc32c = _crc32c_function()


def mask(crc: int) -> int:
    """TFRecord's checksum of a CRC-32C: rotated right by 15 bits plus a constant."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def masked_crc32c(data) -> int:
    return mask(crc32c(data))


@dataclass(frozen=True)
class Record:
    offset: int  # where the record starts in the file (its length field)
    data: bytes | FileSpan  # a FileSpan for a record over SMALL_RECORD bytes, valid while its file is open


def _open(path: Path, label: str):
    try:
        return open_regular(path, label)
    except LstmGradError:
        raise
    except OSError as err:
        raise InputFileError(f"{label}: cannot read: {err.strerror or err}") from None


def read_records(path: Path, limit: int, label: str | None = None) -> Iterator[Record]:
    """Every record of ``path``, in order; InputFileError for a truncated or corrupt file, or a record
    that declares more than ``limit`` bytes (refused before reading).  A record's FileSpan is valid until
    the next record is asked for."""
    label = label or str(path)
    fh = _open(path, label)
    try:
        size = os.fstat(fh.fileno()).st_size
        offset = 0
        while offset < size:
            yield Record(offset, _read_one(fh, offset, size, limit, label))
            offset = fh.tell()
    finally:
        fh.close()


@contextlib.contextmanager
def open_record(path: Path, offset: int, limit: int, label: str | None = None) -> Iterator[bytes | FileSpan]:
    """The data of the record starting at ``offset`` (read again and checked again), valid while the block runs."""
    label = label or str(path)
    with _open(path, label) as fh:
        try:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(offset)
        except OSError as err:
            raise InputFileError(f"{label}: cannot read: {err.strerror or err}") from None
        yield _read_one(fh, offset, size, limit, label)


def read_record_at(path: Path, offset: int, limit: int, label: str | None = None) -> bytes:
    """The data of the record starting at ``offset`` (read again and checked again), as bytes."""
    with open_record(path, offset, limit, label) as data:
        return bytes(data)


# A dump's last record cut short is most often one TensorFlow is still writing.
STILL_WRITTEN = ("; if TensorFlow may still be writing it, read it after disable_dump_debug_info() or the "
                 "program's end")


def _read_one(fh, offset: int, size: int, limit: int, label: str) -> bytes | FileSpan:
    where = f"{label}: the record at byte {offset}"
    try:
        head = fh.read(HEADER)
        if len(head) < HEADER:
            raise InputFileError(f"{where} is truncated ({size - offset} bytes left of its 12-byte header)"
                                 f"{STILL_WRITTEN}")
        length, length_crc = struct.unpack("<QI", head)
        if masked_crc32c(head[:8]) != length_crc:
            raise InputFileError(f"{where} is corrupt: the checksum of its length does not match")
        left = size - offset - HEADER - FOOTER
        if length > left:
            raise InputFileError(f"{where} declares {length} bytes but the file holds {max(left, 0)} after it "
                                 f"(truncated, or not a TFRecord file){STILL_WRITTEN}")
        if length > limit:
            raise InputFileError(f"{where} declares {length} bytes, more than the {limit}-byte memory limit "
                                 "(LSTMGRAD_MAX_TENSOR_BYTES); refused before reading")
        if length > SMALL_RECORD:
            data, crc = FileSpan(fh.fileno(), offset + HEADER, offset + HEADER + length), 0
            try:
                for chunk in data.chunks(READ_CHUNK):
                    crc = crc32c(chunk, crc)
            except WireError:
                raise InputFileError(f"{where} is truncated{STILL_WRITTEN}") from None
            fh.seek(offset + HEADER + length)
            footer = fh.read(FOOTER)
            if len(footer) < FOOTER:
                raise InputFileError(f"{where} is truncated{STILL_WRITTEN}")
            if mask(crc) != struct.unpack("<I", footer)[0]:
                raise InputFileError(f"{where} is corrupt: the checksum of its {length} bytes of data does not match")
            return data
        data = fh.read(length)
        footer = fh.read(FOOTER)
    except OSError as err:
        raise InputFileError(f"{label}: cannot read: {err.strerror or err}") from None
    if len(data) < length or len(footer) < FOOTER:
        raise InputFileError(f"{where} is truncated{STILL_WRITTEN}")
    if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
        raise InputFileError(f"{where} is corrupt: the checksum of its {length} bytes of data does not match")
    return data
