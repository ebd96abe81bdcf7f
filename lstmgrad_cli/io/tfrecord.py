"""TFRecord files, read one record at a time with both checksums verified.

A record is ``uint64 length``, ``uint32 masked_crc32c(length bytes)``, ``length`` bytes of data and
``uint32 masked_crc32c(data)``, all little-endian, back to back with nothing around them.  A declared
length is checked against the bytes left in the file and the memory budget before the data is read, so
a hostile length allocates nothing.

CRC-32C comes from the ``google-crc32c`` package (``pip install 'lstmgrad[tfdbg]'``; in C) when it is
installed, else from a table in pure Python: the same numbers, about 10 MB/s.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputFileError

HEADER = 12  # length (8) and its checksum (4)
FOOTER = 4  # the data's checksum


def _python_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _python_table()


def crc32c_python(data) -> int:
    """CRC-32C (Castagnoli) in pure Python, byte by byte from a table."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc32c_function():
    try:
        import google_crc32c  # noqa: PLC0415 - optional (the tfdbg extra): C speed
    except ImportError:
        return crc32c_python
    return lambda data: google_crc32c.value(bytes(data))


crc32c = _crc32c_function()


def masked_crc32c(data) -> int:
    """TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    offset: int  # where the record starts in the file (its length field)
    data: bytes


def read_records(path: Path, limit: int, label: str | None = None) -> Iterator[Record]:
    """Every record of ``path``, in order; InputFileError for a truncated or corrupt file, or a record
    that declares more than ``limit`` bytes (refused before reading)."""
    label = label or str(path)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed in finally, across the generator's yields
    except OSError as err:
        raise InputFileError(f"{label}: cannot read: {err.strerror or err}") from None
    try:
        size = os.fstat(fh.fileno()).st_size
        offset = 0
        while offset < size:
            yield Record(offset, _read_one(fh, offset, size, limit, label))
            offset = fh.tell()
    finally:
        fh.close()


def read_record_at(path: Path, offset: int, limit: int, label: str | None = None) -> bytes:
    """The data of the record starting at ``offset`` (read again and checked again)."""
    label = label or str(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(offset)
            return _read_one(fh, offset, size, limit, label)
    except OSError as err:
        raise InputFileError(f"{label}: cannot read: {err.strerror or err}") from None


# A dump's last record cut short is most often one TensorFlow is still writing.
STILL_WRITTEN = ("; if TensorFlow may still be writing it, read it after disable_dump_debug_info() or the "
                 "program's end")


def _read_one(fh, offset: int, size: int, limit: int, label: str) -> bytes:
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
        data = fh.read(length)
        footer = fh.read(FOOTER)
    except OSError as err:
        raise InputFileError(f"{label}: cannot read: {err.strerror or err}") from None
    if len(data) < length or len(footer) < FOOTER:
        raise InputFileError(f"{where} is truncated{STILL_WRITTEN}")
    if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
        raise InputFileError(f"{where} is corrupt: the checksum of its {length} bytes of data does not match")
    return data
