"""The protobuf wire format, decoded by hand for the few TensorFlow messages lstmgrad reads.

A message is a sequence of fields ``key = varint(number << 3 | wire type)`` followed by a varint (type 0), 8
bytes (1), a varint length and that many bytes (2: strings, sub-messages, packed repeated numbers) or 4 bytes
(5).  ``fields`` walks one message without copying: a length-delimited value comes back as a ``memoryview``
slice of the record.  Every length is checked against the bytes that are left, so a hostile message can
neither read past its end nor make anything be allocated from a declared size; anything malformed is a
``WireError``.  A record too large to hold in memory is a ``FileSpan`` instead of bytes: the same walk
reads only the bytes it looks at.
(Measured against the protobuf runtime in benchmarks/RESULTS.md: this is fast enough for
the headers it walks, and tensor data is never copied by it.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


class FileSpan:
    """Bytes ``[start, end)`` of an open file, read only where they are looked at: a message too large to hold in
    memory, walked by ``fields`` as a memoryview is.  Indexing reads through a block cache (shared by the spans
    sliced from one another); slicing gives a narrower span and reads nothing; ``bytes()`` reads the span (the
    caller bounds it first).  Valid while the file is open."""

    BLOCK = 1 << 16

    def __init__(self, fd: int, start: int, end: int, cache: list | None = None):
        self.fd, self.start, self.end = fd, start, end
        self._cache = cache if cache is not None else [0, b""]  # [file offset, the bytes read there]

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step != 1:
                raise ValueError("a FileSpan slice has step 1")
            return FileSpan(self.fd, self.start + lo, self.start + max(lo, hi), self._cache)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("FileSpan index out of range")
        pos = self.start + index
        base, block = self._cache
        if not base <= pos < base + len(block):
            block = self._pread(pos, min(self.BLOCK, self.end - pos))
            self._cache[:] = [pos, block]
            base = pos
        return block[pos - base]

    def _pread(self, pos: int, size: int) -> bytes:
        block = os.pread(self.fd, size, pos)
        if len(block) < size:
            raise WireError("the file ends inside the record (truncated while it was read?)")
        return block

    def chunks(self, size: int) -> Iterator[bytes]:
        """The span's bytes, ``size`` at a time."""
        for pos in range(self.start, self.end, size):
            yield self._pread(pos, min(size, self.end - pos))

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks(1 << 24))


def buffer(value):
    """A length-delimited value as something numpy can take a buffer from (a FileSpan is read)."""
    return value if isinstance(value, memoryview | bytes | bytearray) else bytes(value)


def count_varints(value) -> int:
    """How many varints a packed field holds (bytes without the continuation bit), without decoding them."""
    if isinstance(value, FileSpan):
        return sum(count_varints(chunk) for chunk in value.chunks(1 << 20))
    return int(np.count_nonzero(np.frombuffer(value, dtype=np.uint8) < 0x80))


def varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``pos``; at most 10 bytes, never past ``end``."""
    if pos < end and buf[pos] < 0x80:  # one byte: most keys, lengths and small numbers
        return buf[pos], pos + 1
    result = shift = 0
    for k in range(10):
        if pos + k >= end:
            raise WireError("truncated varint")
        byte = buf[pos + k]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos + k + 1
        shift += 7
    raise WireError("varint longer than 10 bytes")


def fields(buf: memoryview, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of each field of the message ``buf[start:end]``.

    The value is an int for varints, ``bytes`` of 8 or 4 for fixed widths, a ``memoryview`` for
    length-delimited fields.  Groups (wire types 3, 4) are refused: no TensorFlow message here uses them.
    """
    if not isinstance(buf, memoryview | bytes | bytearray | FileSpan):
        raise WireError(f"expected a message, got a {type(buf).__name__} (a field of the wrong wire type)")
    end = len(buf) if end is None else end
    pos = start
    while pos < end:
        key, pos = varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == VARINT:
            value, pos = varint(buf, pos, end)
        elif wire == FIXED64:
            if pos + 8 > end:
                raise WireError("truncated 64-bit field")
            value, pos = bytes(buf[pos:pos + 8]), pos + 8
        elif wire == LENGTH:
            length, pos = varint(buf, pos, end)
            if length > end - pos:
                raise WireError(f"field {number} declares {length} bytes, only {end - pos} left")
            value, pos = buf[pos:pos + length], pos + length
        elif wire == FIXED32:
            if pos + 4 > end:
                raise WireError("truncated 32-bit field")
            value, pos = bytes(buf[pos:pos + 4]), pos + 4
        else:
            raise WireError(f"wire type {wire} (groups are not used by these messages)")
        yield number, wire, value


def as_int(wire: int, value) -> int:
    if wire != VARINT:
        raise WireError(f"expected a varint, got wire type {wire}")
    return value


def as_signed(wire: int, value) -> int:
    """An int32/int64 field: negative values are 10-byte two's complement varints."""
    value = as_int(wire, value)
    return value - (1 << 64) if value >= 1 << 63 else value


def as_bytes(wire: int, value) -> memoryview:
    if wire != LENGTH:
        raise WireError(f"expected a length-delimited field, got wire type {wire}")
    return value


def as_text(wire: int, value) -> str:
    return bytes(as_bytes(wire, value)).decode("utf-8", "replace")


def packed_varints(wire: int, value) -> list[int]:
    """A repeated varint field, packed (one length-delimited field) or not (one varint)."""
    if wire == VARINT:
        return [value]
    data = as_bytes(wire, value)
    out, pos = [], 0
    while pos < len(data):
        number, pos = varint(data, pos, len(data))
        out.append(number)
    return out
