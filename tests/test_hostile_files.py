"""Hostile and broken input files (issue 6): each is refused with one clear line and exit 1.

Every case builds a real file (h5py, zipfile, numpy's .npy writer) that breaks in one specific
way, then checks three layers:

* the library (``io.read_inputs``) raises ``InputFileError`` whose message names the file, the
  tensor and what is wrong;
* the command (click's runner) exits 1 with exactly one ``Error: ...`` line, writes no output
  and leaves the input byte-for-byte untouched;
* a real ``lstmgrad`` subprocess does the same without crashing or hanging (all cases at once).

CASES below is also the source of the README table of bad inputs.
"""

from __future__ import annotations

import contextlib
import io as bytes_io
import os
import pickle
import struct
import subprocess
import sys
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import bombs
import h5py
import numpy as np
import pytest
from conftest import content_digest, load_case

from lstmgrad_cli import io
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import InputFileError

LSTMGRAD = [sys.executable, "-m", "lstmgrad_cli"]


# -- builders of valid and broken files -----------------------------------------------------------

def valid_inputs() -> dict[str, np.ndarray]:
    inputs, _, _ = load_case("seq_v2_peep")
    return inputs


def npy_bytes(array: np.ndarray) -> bytes:
    buf = bytes_io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(array), allow_pickle=True)
    return buf.getvalue()


def npy_header(shape, descr: str, fortran: bool = False) -> bytes:
    buf = bytes_io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"shape": shape, "fortran_order": fortran, "descr": descr})
    return buf.getvalue()


def write_zip(path: Path, members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def npz_with(path: Path, replace: dict[str, bytes] | None = None, drop: tuple = (), compression=zipfile.ZIP_STORED,
             extra: dict[str, bytes] | None = None) -> Path:
    """The valid seq case as an NPZ, with some members replaced by raw ``.npy`` bytes."""
    members = {f"{k}.npy": npy_bytes(v) for k, v in valid_inputs().items() if k not in drop}
    members.update({f"{k}.npy": v for k, v in (replace or {}).items()})
    members.update(extra or {})
    return write_zip(path, members, compression)


def h5_with(path: Path, edit=None, group: str | None = None) -> Path:
    """The valid seq case as HDF5; ``edit(node, file)`` then replaces what it likes."""
    with h5py.File(path, "w") as fh:
        node = fh.create_group(group) if group else fh
        for key, value in valid_inputs().items():
            node.create_dataset(key, data=value)
        if edit is not None:
            edit(node, fh)
    return path


def replace_dataset(name: str, make):
    def edit(node, fh):
        del node[name]
        make(node, name, fh)
    return edit


class _Payload:
    """Unpickling this runs a shell command: proof that nothing is ever unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def pickle_bomb(tmp: Path) -> bytes:
    array = np.empty(1, dtype=object)
    array[0] = _Payload(tmp / "PWNED")
    return npy_bytes(array)


def _central_dir_patch(path: Path, offset: int, fmt: str, value) -> None:
    """Overwrite a field in every central-directory entry (zipfile trusts these)."""
    data = bytearray(path.read_bytes())
    pos = data.find(b"PK\x01\x02")
    while pos != -1:
        struct.pack_into(fmt, data, pos + offset, value)
        pos = data.find(b"PK\x01\x02", pos + 4)
    path.write_bytes(bytes(data))


def _member_data_offset(path: Path, member: str) -> int:
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def corrupt_deflate(path: Path) -> Path:
    npz_with(path, replace={"x": npy_bytes(np.linspace(0, 1, 60, dtype=np.float32).reshape(5, 3, 4))},
             compression=zipfile.ZIP_DEFLATED)
    start = _member_data_offset(path, "x.npy")
    data = bytearray(path.read_bytes())
    for i in range(start + 2, start + 40):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))
    return path


def bad_crc(path: Path) -> Path:
    npz_with(path)
    start = _member_data_offset(path, "x.npy")
    data = bytearray(path.read_bytes())
    data[start + 140] ^= 0xFF  # inside the float data, after the 128-byte header
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_large_stored_member_is_checked_whole_wherever_a_byte_of_it_flipped(tmp_path, where):
    """A stored member of 8 MiB or more has its CRC-32 summed on a thread behind the reads (npz.CRC_BEHIND_BYTES):
    read intact it is the array written; a byte flipped in its first, middle or last batch is the CRC error."""
    from lstmgrad_cli.io.npz import CRC_BEHIND_BYTES

    big = np.arange(6 * 2**20, dtype=np.float32).reshape(2**20, 6)  # 24 MiB: three batches handed to the thread
    assert big.nbytes >= CRC_BEHIND_BYTES
    path = write_zip(tmp_path / "big.npz", {"x.npy": npy_bytes(big)})
    np.testing.assert_array_equal(io.read_inputs(path, ["x"], []).tensors["x"], big)
    data = bytearray(path.read_bytes())
    data[_member_data_offset(path, "x.npy") + 128 + int(where * (big.nbytes - 1))] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(InputFileError, match=r"x is corrupt or truncated \(Bad CRC-32"):
        io.read_inputs(path, ["x"], [])


def _local_header_patch(path: Path, member: str, offset: int, fmt: str, value) -> Path:
    """Overwrite a field of one member's local header (read for a stored member's data, where it starts)."""
    with zipfile.ZipFile(path) as zf:
        at = zf.getinfo(member).header_offset
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at + offset, value)
    path.write_bytes(bytes(data))
    return path


def local_name_differs(path: Path) -> Path:
    npz_with(path)
    return _local_header_patch(path, "x.npy", 30, "<1s", b"y")  # the local header says "y.npy"


def local_magic_broken(path: Path) -> Path:
    npz_with(path)
    return _local_header_patch(path, "x.npy", 0, "<4s", b"PK\x07\x08")


def data_past_the_end(path: Path) -> Path:
    npz_with(path)
    return _local_header_patch(path, "x.npy", 28, "<H", 0xFFFF)  # an extra field that runs the data off the end


def stored_sizes_differ(path: Path) -> Path:
    npz_with(path)
    _central_dir_patch(path, 24, "<I", 100)  # the stored member's unpacked size: not its stored size
    return path


def unsupported_method(path: Path) -> Path:
    npz_with(path)
    _central_dir_patch(path, 10, "<H", 99)  # compression method 99 (AES): not supported
    return path


def encrypted(path: Path) -> Path:
    npz_with(path)
    _central_dir_patch(path, 8, "<H", 1)  # general-purpose flag bit 0: encrypted
    return path


def zip_bomb(path: Path) -> Path:
    """x.npy declares 40 MB of float32 and really holds it, deflated to ~40 kB."""
    inputs = valid_inputs()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, value in inputs.items():
            if key != "x":
                zf.writestr(f"{key}.npy", npy_bytes(value))
        with zf.open("x.npy", "w") as member:
            member.write(npy_header((10, 1000, 1000), "<f4"))
            zeros = bytes(1 << 20)
            for _ in range(40):
                member.write(zeros[: min(1 << 20, 40_000_000)])
    return path


def other_h5(tmp: Path) -> Path:
    return h5_with(tmp / "other.h5", group="lstm")


def external_link(path: Path) -> Path:
    target = other_h5(path.parent)
    link = h5py.ExternalLink(str(target), "/lstm/x")
    return h5_with(path, replace_dataset("x", lambda n, k, f: n.__setitem__(k, link)))


def external_link_to_fifo(path: Path) -> Path:
    fifo = path.parent / "pipe.h5"
    os.mkfifo(fifo)  # opening it would block forever: proof the link is never followed
    return h5_with(path, replace_dataset("x", lambda n, k, f: n.__setitem__(k, h5py.ExternalLink(str(fifo), "/x"))))


def group_is_external(path: Path) -> Path:
    target = other_h5(path.parent)
    with h5py.File(path, "w") as fh:
        fh["lstm"] = h5py.ExternalLink(str(target), "/lstm")
    return path


def soft_through_external(path: Path) -> Path:
    target = other_h5(path.parent)

    def edit(node, fh):
        fh["elsewhere"] = h5py.ExternalLink(str(target), "/lstm")
        del node["x"]
        node["x"] = h5py.SoftLink("/elsewhere/x")
    return h5_with(path, edit)


def virtual_dataset(path: Path) -> Path:
    target = other_h5(path.parent)

    def make(node, key, fh):
        layout = h5py.VirtualLayout(shape=(5, 3, 4), dtype="f4")
        layout[:] = h5py.VirtualSource(str(target), "/lstm/x", shape=(5, 3, 4))
        node.create_virtual_dataset(key, layout)
    return h5_with(path, replace_dataset("x", make))


def external_raw(path: Path) -> Path:
    raw = path.parent / "raw.bin"
    raw.write_bytes(np.ones(60, dtype="f4").tobytes())
    return h5_with(path, replace_dataset(
        "x", lambda n, k, f: n.create_dataset(k, shape=(5, 3, 4), dtype="f4", external=[(str(raw), 0, 240)])))


def huge_dataset(path: Path) -> Path:
    return h5_with(path, replace_dataset(
        "x", lambda n, k, f: n.create_dataset(k, shape=(100_000, 100_000, 100_000), dtype="f4", chunks=(1, 1, 1000))))


def chunk_bomb(path: Path) -> Path:
    return h5_with(path, replace_dataset(
        "x", lambda n, k, f: n.create_dataset(k, data=np.zeros((5, 3, 4), "f4"), maxshape=(None, 3, 4),
                                              chunks=(400_000, 3, 4), compression="gzip")))


def corrupt_gzip(path: Path) -> Path:
    h5_with(path, replace_dataset("x", lambda n, k, f: n.create_dataset(
        k, data=np.linspace(0, 1, 60, dtype="f4").reshape(5, 3, 4), chunks=(5, 3, 4), compression="gzip")))
    with h5py.File(path, "r") as fh:
        info = fh["x"].id.get_chunk_info(0)
    data = bytearray(path.read_bytes())
    for i in range(info.byte_offset, info.byte_offset + info.size):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def unknown_filter(path: Path) -> Path:
    def make(node, key, fh):
        ds = node.create_dataset(key, shape=(5, 3, 4), dtype="f4", chunks=(5, 3, 4), compression=32123,
                                 allow_unknown_filter=True)
        ds.id.write_direct_chunk((0, 0, 0), np.ones(60, "f4").tobytes())
    return h5_with(path, replace_dataset("x", make))


def truncated_h5(path: Path) -> Path:
    h5_with(path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return path


def unicode_and_long_keys(path: Path) -> Path:
    """Valid tensors stored only under exotic names; the op's names are missing."""
    arrays = {("ключ-x-" + "é" * 20): np.zeros(3, "f4"), "k" * 5000: np.zeros(3, "f4"), "\u202ertl": np.ones(2, "f4")}
    np.savez(path, **arrays)
    return path


def unicode_and_long_keys_h5(path: Path) -> Path:
    with h5py.File(path, "w") as fh:
        fh["ключ-" + "ü" * 50] = np.zeros(3, "f4")
        fh["k" * 5000] = np.zeros(3, "f4")
    return path


def too_many_members(path: Path) -> Path:
    """The valid case whose zip64 end record declares a million members (zipfile would parse them all)."""
    bombs.write_members(path, bombs.valid_members())
    data = bytearray(path.read_bytes())
    eocd = data.rfind(b"PK\x05\x06")
    entries, cd_size, cd_offset = 10**6, *struct.unpack_from("<II", data, eocd + 12)
    zip64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, cd_size, cd_offset)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd, 1)
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, cd_size, cd_offset, 0)
    path.write_bytes(bytes(data[:eocd]) + zip64 + locator + end)
    return path


def h5_unwritten(path: Path) -> Path:
    """x declares 4.8 MB and was never written (no other tensor to contradict it)."""
    with h5py.File(path, "w") as fh:
        fh.create_dataset("x", shape=(100_000, 3, 4), dtype="f4")
    return path


def npy_dir_with_fifo(folder: Path) -> Path:
    folder.mkdir()
    for key, value in valid_inputs().items():
        if key != "x":
            np.save(folder / f"{key}.npy", value)
    os.mkfifo(folder / "x.npy")  # opening it to read would wait for a writer
    return folder


@dataclass(frozen=True)
class Case:
    id: str
    what: str  # README wording: the bad input
    build: object  # (path) -> path
    fragment: str  # expected in the message
    suffix: str = ".npz"
    args: tuple = ()
    env: tuple = ()  # extra environment (name, value) pairs


CASES = [
    Case("empty", "0-byte file", lambda p: (p.write_bytes(b""), p)[1], "file is empty (0 bytes)"),
    Case("text", "not HDF5 or NPZ (text)", lambda p: (p.write_text("x,y\n1,2\n"), p)[1],
         "not an HDF5, NPZ or safetensors file"),
    Case("fifo", "a named pipe (would block)", lambda p: (os.mkfifo(p), p)[1],
         "fifo.npz: is not a regular file (a named pipe)"),
    Case("npz-truncated", "NPZ cut in half",
         lambda p: (p.write_bytes(npz_with(p).read_bytes()[:3000]), p)[1], "corrupt or truncated NPZ"),
    Case("npz-magic-only", "NPZ: zip signature and nothing else",
         lambda p: (p.write_bytes(b"PK\x03\x04" + b"\0" * 20), p)[1], "corrupt or truncated NPZ"),
    Case("npz-pickle", "NPZ member: pickled object array (payload runs a shell command)",
         lambda p: npz_with(p, replace={"x": pickle_bomb(p.parent)}), "x is a pickled object array"),
    Case("npz-not-array", "NPZ member that is not a .npy array",
         lambda p: npz_with(p, replace={"x": b"just some text, not an array"}), "x is not a numpy array"),
    Case("npz-bad-header", "NPZ member: .npy header that is not a dict",
         lambda p: npz_with(p, replace={"x": b"\x93NUMPY\x01\x00\x10\x00" + b"[1, 2, 3]      \n"}),
         "x has a corrupt .npy header (Header is not a dictionary"),
    Case("npz-header-cut", "NPZ member: .npy header length cuts the dict short",
         lambda p: npz_with(p, replace={"x": b"\x93NUMPY\x01\x00\x20\x00" + npy_header((5, 3, 4), "<f4")[10:]}),
         "x has a corrupt .npy header (its text is not a Python literal)"),
    Case("npz-negative-dim", "NPZ member: negative dimension in the header",
         lambda p: npz_with(p, replace={"x": npy_header((5, -3, 4), "<f4")}), "x declares a negative dimension"),
    Case("npz-huge-declared", "NPZ member: header declares 4 EB (data absent)",
         lambda p: npz_with(p, replace={"x": npy_header((1_000_000,) * 3, "<f4")}),
         "x declares shape [1000000, 1000000, 1000000] of float32 = 3.5 EiB (4000000000000000000 bytes)"),
    Case("npz-short-data", "NPZ member: header declares more data than the member holds",
         lambda p: npz_with(p, replace={"x": npy_header((5, 3, 4), "<f4") + b"\0" * 17}),
         "x is truncated: its header declares shape [5, 3, 4] of float32 = 240 bytes but the member holds only 17"),
    Case("npz-trailing", "NPZ member: data after the array",
         lambda p: npz_with(p, replace={"x": npy_bytes(np.zeros((5, 3, 4), "f4")) + b"surprise"}),
         "x has data after the array"),
    Case("npz-zip-bomb", "NPZ member: 40 MB of zeros deflated to 40 kB, limit 1 MiB",
         zip_bomb, "more than the 1.0 MiB limit (LSTMGRAD_MAX_TENSOR_BYTES",
         env=(("LSTMGRAD_MAX_TENSOR_BYTES", "1M"),)),
    Case("npz-bad-deflate", "NPZ member: deflate stream that fails to decompress", corrupt_deflate,
         "x is corrupt or truncated"),
    Case("npz-bad-crc", "NPZ member: flipped data byte (CRC mismatch)", bad_crc,
         "x is corrupt or truncated (Bad CRC-32"),
    Case("npz-local-name", "NPZ member: its local header names another member", local_name_differs,
         "x is corrupt or truncated (File name in directory 'x.npy' and header b'y.npy' differ"),
    Case("npz-local-magic", "NPZ member: its local header's signature is wrong", local_magic_broken,
         "x is corrupt or truncated (Bad magic number for file header"),
    Case("npz-data-past-end", "NPZ member: its local header puts the data past the end", data_past_the_end,
         "x is corrupt or truncated (the member's data ends at byte"),
    Case("npz-stored-sizes", "NPZ member: stored, with an unpacked size short of its stored size",
         stored_sizes_differ, "x is corrupt or truncated (Bad CRC-32 for file 'x.npy')"),
    Case("npz-method-99", "NPZ member: unsupported compression method", unsupported_method,
         "compression method is not supported"),
    Case("npz-encrypted", "NPZ member: encrypted", encrypted, "x is an encrypted (password-protected) zip member"),
    Case("npz-unicode-long-keys", "NPZ: only unicode / 5000-character key names", unicode_and_long_keys,
         "missing tensors x, cs_prev"),
    Case("h5-truncated", "HDF5 cut in half", truncated_h5, "corrupt or truncated HDF5 file", suffix=".h5"),
    Case("h5-magic-only", "HDF5 signature and nothing else",
         lambda p: (p.write_bytes(io.HDF5_MAGIC + b"\xff" * 40), p)[1], "corrupt or truncated HDF5 file", suffix=".h5"),
    Case("h5-external-link", "HDF5: x is an external link to another file", external_link,
         "x is an external link to", suffix=".h5"),
    Case("h5-external-fifo", "HDF5: x is an external link to a named pipe", external_link_to_fifo,
         "x is an external link to", suffix=".h5"),
    Case("h5-group-external", "HDF5: --group is an external link", group_is_external,
         "group 'lstm' is an external link", suffix=".h5", args=("--group", "lstm")),
    Case("h5-dangling-soft", "HDF5: x is a soft link to a missing path",
         lambda p: h5_with(p, replace_dataset("x", lambda n, k, f: n.__setitem__(k, h5py.SoftLink("/nowhere/x")))),
         "x is a soft link to '/nowhere/x', which does not exist in this file", suffix=".h5"),
    Case("h5-soft-loop", "HDF5: soft links in a loop",
         lambda p: h5_with(p, replace_dataset("x", lambda n, k, f: (n.__setitem__(k, h5py.SoftLink("/y")),
                                                                    n.__setitem__("y", h5py.SoftLink("/x"))))),
         "soft links in a row", suffix=".h5"),
    Case("h5-soft-via-external", "HDF5: soft link whose path passes through an external link", soft_through_external,
         "x is an external link to", suffix=".h5"),
    Case("h5-virtual", "HDF5: x is a virtual dataset (data in another file)", virtual_dataset,
         "x is a virtual dataset", suffix=".h5"),
    Case("h5-external-raw", "HDF5: x keeps its raw data in an external file", external_raw,
         "x keeps its data in an external raw file", suffix=".h5"),
    Case("h5-huge", "HDF5: x declares 4 PB (never written, file is tiny)", huge_dataset,
         "x declares shape [100000, 100000, 100000] of float32 = 3.6 PiB (4000000000000000 bytes)", suffix=".h5"),
    Case("h5-chunk-bomb", "HDF5: 240-byte dataset stored in 19 MB chunks, limit 1 MiB", chunk_bomb,
         "x declares chunks of shape [400000, 3, 4]", suffix=".h5", env=(("LSTMGRAD_MAX_TENSOR_BYTES", "1M"),)),
    Case("h5-bad-gzip", "HDF5: gzip chunk that fails to decompress", corrupt_gzip, "x cannot be read", suffix=".h5"),
    Case("h5-unknown-filter", "HDF5: compressed with a filter that is not installed", unknown_filter,
         "x is compressed with HDF5 filter 32123", suffix=".h5"),
    Case("h5-vlen", "HDF5: x is variable-length strings",
         lambda p: h5_with(p, replace_dataset("x", lambda n, k, f: n.create_dataset(
             k, data=np.array(["a", "b"], dtype=h5py.string_dtype())))),
         "x has a variable-length or reference type (variable-length strings)", suffix=".h5"),
    Case("h5-null", "HDF5: x has a null dataspace",
         lambda p: h5_with(p, replace_dataset("x", lambda n, k, f: n.__setitem__(k, h5py.Empty("f4")))),
         "x has no data (an HDF5 null dataspace)", suffix=".h5"),
    Case("h5-group-not-dataset", "HDF5: x is a group",
         lambda p: h5_with(p, replace_dataset("x", lambda n, k, f: n.create_group(k))),
         "x is a group, not a dataset", suffix=".h5"),
    Case("h5-datatype-not-dataset", "HDF5: x is a named (committed) datatype",
         lambda p: h5_with(p, replace_dataset("x", lambda n, k, f: n.__setitem__(k, np.dtype("<f4")))),
         "x is a datatype, not a dataset", suffix=".h5"),
    Case("h5-unicode-long-keys", "HDF5: only unicode / 5000-character names", unicode_and_long_keys_h5,
         "missing tensors x, cs_prev", suffix=".h5"),
    # issue 34: declared before read
    Case("npz-duplicate", "NPZ: x.npy twice (np.load keeps the last)", bombs.npz_duplicate_members,
         "the archive holds x.npy twice (numpy would keep one in silence); refused"),
    Case("npz-sizes-lie", "NPZ member: its entry claims 2 GB unpacked from 82 bytes", bombs.npz_declared_sizes_bomb,
         "x declares 2000000128 bytes unpacked from 82 packed, more than deflate can hold"),
    Case("npz-million-members", "NPZ: the zip64 end record declares a million members", too_many_members,
         "the archive declares 1000000 members, more than the 100000 an input may hold"),
    Case("npz-rank-bomb", "NPZ member: seq_len_max of 16M zeros (64 MB deflated to 64 kB)",
         lambda p: bombs.npz_member_bomb(p, shape=(16_000_000,)),
         "`seq_len_max_tensor` must be rank 0 but is rank 1 (shape [16000000]); refused before reading"),
    Case("npz-shape-bomb", "NPZ member: x of [5, 1M, 1] zeros beside a batch of 3",
         lambda p: bombs.npz_member_bomb(p, "x", (5, 1 << 20, 1), "<f4"),
         "x declares shape [5, 1048576, 1] of float32 = 20.0 MiB, but the file's other tensors make it [5, 3, 1]"),
    Case("h5-gzip-rank-bomb", "HDF5: seq_len_max of 16M zeros, gzip", lambda p: bombs.h5_gzip_bomb(
        p, "seq_len_max", (16_000_000,), 1 << 18), "`seq_len_max_tensor` must be rank 0 but is rank 1", suffix=".h5"),
    Case("h5-unwritten", "HDF5: x declares 4.8 MB and was never written", h5_unwritten,
         "x declares shape [100000, 3, 4] of float32 = 4.6 MiB but not one byte of it was ever written", suffix=".h5"),
    Case("npydir-sparse", "directory of .npy files: seq_len_max.npy a sparse 3 GB file",
         lambda p: bombs.npy_dir_sparse(p), "`seq_len_max_tensor` must be rank 0 but is rank 1 (shape [750000000])",
         suffix=""),
    Case("npydir-fifo", "directory of .npy files: x.npy a named pipe", npy_dir_with_fifo,
         "x.npy: is not a regular file (a named pipe)", suffix=""),
]
IDS = [c.id for c in CASES]
# Cases whose complaint comes after reading (validation in operations/grad.py), not from io.read_inputs.
NOT_IO = {"npz-unicode-long-keys", "h5-unicode-long-keys"}


def build(case: Case, tmp_path: Path) -> Path:
    return case.build(tmp_path / f"hostile-{case.id}{case.suffix}")


@contextlib.contextmanager
def fifo_watchdog(directory: Path, seconds: float = 10.0):
    """If a reader blocks on a FIFO under ``directory``, open its other end after ``seconds``.

    The blocked read then sees end-of-file, so a regression fails the test instead of hanging it.
    """
    done = threading.Event()

    def release():
        if done.wait(seconds):
            return
        for fifo in (p for p in directory.rglob("*") if p.is_fifo()):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and its digest (FIFOs and directories by kind)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_fifo():
            out[str(p)] = "fifo"
        elif p.is_file():
            out[str(p)] = content_digest(p)
        else:
            out[str(p)] = "dir"
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_library_refuses_with_a_precise_message(case, tmp_path, monkeypatch):
    for name, value in case.env:
        monkeypatch.setenv(name, value)
    path = build(case, tmp_path)
    group = case.args[1] if case.args[:1] == ("--group",) else None
    if case.id in NOT_IO:
        loaded = io.read_inputs(path, ["x", "cs_prev"], group=group)
        assert loaded.tensors == {} and len(loaded.keys) == 3 - (case.suffix == ".h5")
        return
    with pytest.raises(InputFileError) as info, fifo_watchdog(tmp_path):
        io.read_inputs(path, ["x", "cs_prev", "h_prev", "w"], ["seq_len_max", "use_peephole"], group=group)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and message.count(str(path)) == 1, message
    assert case.fragment in message, message
    assert "\n" not in message


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_command_exits_1_with_one_line_and_no_output(case, tmp_path, runner, monkeypatch):
    for name, value in case.env:
        monkeypatch.setenv(name, value)
    path = build(case, tmp_path)
    out = tmp_path / "out" / "grads.npz"
    out.parent.mkdir()
    before = snapshot(tmp_path)
    with fifo_watchdog(tmp_path):
        result = runner.invoke(main, ["seq", str(path), "-o", str(out), *case.args])
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert case.fragment in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before  # input untouched, no output, no temporary file left
    assert not (tmp_path / "PWNED").exists()


def test_pickle_payload_is_live_but_never_runs(tmp_path, runner):
    """The payload really would run if unpickled (so the test above can fail)."""
    path = npz_with(tmp_path / "evil.npz", replace={"x": pickle_bomb(tmp_path)})
    runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz")])
    assert not (tmp_path / "PWNED").exists()
    with np.load(path, allow_pickle=True) as archive:
        archive["x"]
    assert (tmp_path / "PWNED").exists()


# The real-process sweep takes ~0.5 s of CPU per file; by default it covers the cases most likely to
# crash or hang a process (every case with LSTMGRAD_FUZZ_EXAMPLES set, as `make fuzz` does).
SUBPROCESS_CASES = {"fifo", "npz-pickle", "npz-huge-declared", "h5-external-fifo", "h5-huge", "h5-bad-gzip",
                    "npz-rank-bomb", "npydir-fifo"}


@pytest.mark.slow
def test_cases_in_a_real_subprocess(tmp_path):
    """The real command, one process per file, all at once: exit 1, one line, no hang, no crash."""
    everything = bool(os.environ.get("LSTMGRAD_FUZZ_EXAMPLES"))
    jobs = []
    for case in (c for c in CASES if everything or c.id in SUBPROCESS_CASES):
        work = tmp_path / case.id
        work.mkdir()
        path = build(case, work)
        out = work / "out" / "grads.npz"
        out.parent.mkdir()
        jobs.append((case, path, out, work, snapshot(work)))

    def run(job):
        case, path, out, _, _ = job
        env = {**os.environ, **dict(case.env), "NO_COLOR": "1"}
        env.pop("LSTMGRAD_BACKEND", None)
        return subprocess.run([*LSTMGRAD, "seq", str(path), "-o", str(out), *case.args], capture_output=True,
                              text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(run, jobs))
    for (case, path, _, work, before), proc in zip(jobs, results, strict=True):
        assert proc.returncode == 1, (case.id, proc.returncode, proc.stderr)
        assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, (case.id, proc.stderr)
        assert case.fragment in proc.stderr and str(path) in proc.stderr, (case.id, proc.stderr)
        assert proc.stdout == "", case.id
        assert snapshot(work) == before, case.id
        assert not (work / "PWNED").exists()


# -- files that look odd but are fine -------------------------------------------------------------

def test_soft_link_inside_the_file_is_followed(tmp_path):
    def edit(node, fh):
        fh.create_group("store")["x_data"] = node["x"][()]
        del node["x"]
        node["x"] = h5py.SoftLink("/store/x_data")
    path = h5_with(tmp_path / "soft.h5", edit)
    loaded = io.read_inputs(path, ["x"])
    np.testing.assert_array_equal(loaded.tensors["x"], valid_inputs()["x"])


def test_extra_hostile_members_are_never_touched(tmp_path, runner):
    """A pickled member, a broken member and odd names beside valid tensors: the run succeeds."""
    path = npz_with(tmp_path / "mixed.npz", extra={"evil.npy": pickle_bomb(tmp_path), "broken.npy": b"\x93NUMPY",
                                                   "ключ" * 100 + ".npy": npy_bytes(np.zeros(2)),
                                                   "notes.txt": b"hello"})
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz"), "-q"])
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "PWNED").exists()


def test_directory_is_refused_by_the_reader(tmp_path):
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(InputFileError, match="is a directory, not a file"):
        io.read_inputs(tmp_path / "d.npz", ["x"])


def test_character_device_is_refused_without_reading(tmp_path):
    with pytest.raises(InputFileError, match=r"not a regular file \(a character device\)"):
        io.read_inputs("/dev/zero", ["x"])


def test_limit_is_half_of_memory_by_default(monkeypatch):
    monkeypatch.delenv(io.MAX_BYTES_ENV, raising=False)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < io.max_tensor_bytes() <= total // 2


@pytest.mark.parametrize("text, value", [("1000", 1000), ("4k", 4096), ("512M", 512 << 20), ("2GiB", 2 << 30)])
def test_limit_from_environment(monkeypatch, text, value):
    monkeypatch.setenv(io.MAX_BYTES_ENV, text)
    assert io.max_tensor_bytes() == value


def test_bad_limit_in_environment_is_a_clean_error(monkeypatch, tmp_path, runner):
    monkeypatch.setenv(io.MAX_BYTES_ENV, "lots")
    path = npz_with(tmp_path / "in.npz")
    result = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and "LSTMGRAD_MAX_TENSOR_BYTES='lots'" in result.stderr


def test_limit_counts_all_tensors_of_a_file_together(monkeypatch, tmp_path):
    """x (240 bytes) fits a 300-byte limit alone, but not together with cs_prev (72 bytes)."""
    path = npz_with(tmp_path / "in.npz")
    monkeypatch.setenv(io.MAX_BYTES_ENV, "300")
    io.read_inputs(path, ["x"])
    with pytest.raises(InputFileError, match=r"cs_prev declares shape \[3, 6\] .* on top of 240 bytes already read"):
        io.read_inputs(path, ["x", "cs_prev"])


def test_limit_applies_to_hdf5_attributes(monkeypatch, tmp_path):
    path = h5_with(tmp_path / "in.h5", lambda node, fh: (node.__delitem__("seq_len_max"),
                                                         node.attrs.__setitem__("seq_len_max", np.zeros(64))))
    monkeypatch.setenv(io.MAX_BYTES_ENV, "100")
    with pytest.raises(InputFileError, match="attribute seq_len_max declares shape"):
        io.read_inputs(path, [], ["seq_len_max"])


def test_pickle_module_is_never_used_by_the_reader(tmp_path, monkeypatch):
    """Belt and braces: reading every fixture and hostile NPZ never calls pickle.loads."""
    def boom(*args, **kwargs):
        raise AssertionError("pickle used")
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    path = npz_with(tmp_path / "evil.npz", replace={"x": pickle_bomb(tmp_path)})
    with pytest.raises(InputFileError):
        io.read_inputs(path, ["x"])
    io.read_inputs(npz_with(tmp_path / "ok.npz"), ["x", "w"])
