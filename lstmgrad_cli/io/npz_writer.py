"""NPZ outputs written in one pass: the zip archive of ``.npy`` members that ``np.savez`` makes, without its costs.

``np.savez`` opens each member through ``zipfile`` as a stream: per member a ``ZipInfo``, a zip64 extra field,
buffered header writes, a seek back to patch the sizes and CRC.  For the nine small gradients of a small file
that is ~0.6 ms; the archive written here, each member's ``.npy`` header (numpy's own ``write_array_header_1_0``),
its bytes and their CRC-32 joined in one list of writes, takes ~0.35 ms (benchmarks/RESULTS.md, tenth session).

The archive is plain zip: stored (uncompressed) members, no data descriptors, no extra fields, and the DOS
epoch (1980-01-01) as every member's time, so the same gradients give the same bytes.  Archives that would
need zip64 (a member or the whole past ``ZIP64_FROM`` bytes, or more members than the classic directory
counts) are left to ``np.savez``.  ``np.load``, ``zipfile`` and lstmgrad's reader (npz.py) read both alike.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Mapping

import numpy as np

ZIP64_FROM = 0x7FFF_FFFF  # archive bytes from which np.savez (zip64) writes it: well below the classic 4 GiB limit
_MAX_MEMBERS = 0xFFFF  # what the classic end-of-directory record counts
_DOS_EPOCH_TIME, _DOS_EPOCH_DATE = 0, (1 << 5) | 1  # 00:00:00 of 1980-01-01 (month 1, day 1; years from 1980)
_VERSION = 20  # "2.0": what a stored member needs
_MADE_BY = (3 << 8) | _VERSION  # on Unix: the file attributes below are a mode
_STORED = 0  # the compression method: none
_UTF8_NAME = 1 << 11  # the flag that says a member's name is UTF-8 (set for a name that is not ASCII, as zipfile does)
_LOCAL = struct.Struct("<4s5H3L2H")  # signature, version needed, flags, method, time, date, crc, sizes, name, extra
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # also version made by, comment, disk, attributes, local header offset
_END = struct.Struct("<4s4H2LH")  # disk numbers, entries here and in all, directory size and offset, comment
_FILE_ATTRIBUTES = 0o100644 << 16  # a regular file, rw-r--r-- (what unzip restores)


def write_npz(fh, arrays: Mapping[str, np.ndarray], zip64_from: int = ZIP64_FROM) -> None:
    """Write ``arrays`` to the buffered binary file ``fh`` as an uncompressed NPZ archive (``np.savez(fh, **arrays)``'s
    contents: member ``<name>.npy`` for each).  Object arrays are refused (ValueError), as ``allow_pickle=False``
    would.  An archive of ``zip64_from`` bytes or more, or of more members than the classic directory counts, is
    written by ``np.savez``."""
    members = []
    total = 0
    for name, value in arrays.items():
        array = np.asarray(value)
        if not array.flags.c_contiguous:  # (the rare array that is not: written in C order, as a copy)
            array = array.copy(order="C")
        if array.dtype.hasobject:
            raise ValueError(f"{name}: object arrays are not written (they would need pickling)")
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
        data = array.reshape(-1).view(np.uint8)  # (a 1-D byte view of any shape, empty or not)
        members.append(((name + ".npy").encode(), 0 if name.isascii() else _UTF8_NAME, header.getvalue(), data))
        total += _LOCAL.size + _CENTRAL.size + 2 * len(members[-1][0]) + len(members[-1][2]) + data.size
    if total + _END.size >= zip64_from or len(members) > _MAX_MEMBERS:
        np.savez(fh, **arrays)
        return
    parts, directory, offset = [], [], 0
    for name, flags, header, data in members:
        crc = zlib.crc32(data, zlib.crc32(header))
        size = len(header) + data.size
        parts += [_LOCAL.pack(b"PK\x03\x04", _VERSION, flags, _STORED, _DOS_EPOCH_TIME, _DOS_EPOCH_DATE,
                              crc, size, size, len(name), 0), name, header, data]
        directory += [_CENTRAL.pack(b"PK\x01\x02", _MADE_BY, _VERSION, flags, _STORED, _DOS_EPOCH_TIME,
                                    _DOS_EPOCH_DATE, crc, size, size, len(name), 0, 0, 0, 0, _FILE_ATTRIBUTES,
                                    offset), name]
        offset += _LOCAL.size + len(name) + size
    directory_size = sum(len(part) for part in directory)
    parts += directory
    parts.append(_END.pack(b"PK\x05\x06", 0, 0, len(members), len(members), directory_size, offset, 0))
    for part in parts:
        fh.write(part)
