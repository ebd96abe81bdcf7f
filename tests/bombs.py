"""Crafted inputs that declare far more than they hold or than the op can use (issue 34): compression bombs,
sparse files, impossible shapes, pipes named like inputs.  Each is small on disk and built in well under a
second, however much it declares: deflate streams are made by repeating one flushed block of zeros, HDF5
chunks are written precompressed, sparse files are extended without writing.

Used by tests/test_bombs.py (peak memory of every refusal, measured in a real process) and the hostile-file
tests; ``python tests/bombs.py DIR`` writes the whole set into DIR (the files behind the table in issue 34's
report)."""

from __future__ import annotations

import io as bytes_io
import json
import os
import struct
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import load_case  # noqa: E402
from tfdbg_builder import event, field, packed, record, shape_proto, write_dump  # noqa: E402

MiB = 1 << 20
KERAS_INPUT = Path(__file__).resolve().parent.parent / "fixtures" / "keras" / "keras_two_layers.in.npz"


def valid_inputs() -> dict[str, np.ndarray]:
    return load_case("seq_v2_peep")[0]


def npy_header(shape, descr: str) -> bytes:
    buf = bytes_io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"shape": tuple(shape), "fortran_order": False, "descr": descr})
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buf = bytes_io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(array), allow_pickle=False)
    return buf.getvalue()


# -- zip archives written by hand (a member of any size, deflated in a few milliseconds) ---------------------

_ZEROS_BLOCK = None


def _zeros_block() -> bytes:
    """A raw deflate block holding 1 MiB of zeros, flushed so that copies of it can follow one another."""
    global _ZEROS_BLOCK  # noqa: PLW0603 - built once
    if _ZEROS_BLOCK is None:
        comp = zlib.compressobj(9, zlib.DEFLATED, -15)
        _ZEROS_BLOCK = comp.compress(bytes(MiB)) + comp.flush(zlib.Z_FULL_FLUSH)
    return _ZEROS_BLOCK


class Member:
    """A zip member: ``head`` bytes, then ``zeros`` bytes of zeros (whole MiBs), deflated or stored."""

    def __init__(self, name: str, head: bytes, zeros: int = 0, deflate: bool = True):
        assert zeros % MiB == 0
        self.name, self.head, self.zeros, self.deflate = name, head, zeros, deflate

    def payload(self) -> tuple[bytes, int, int]:
        """(compressed bytes, uncompressed size, CRC-32)."""
        crc = zlib.crc32(self.head)
        chunk = bytes(MiB)
        for _ in range(self.zeros // MiB):
            crc = zlib.crc32(chunk, crc)
        size = len(self.head) + self.zeros
        if not self.deflate:
            return self.head + bytes(self.zeros), size, crc
        comp = zlib.compressobj(9, zlib.DEFLATED, -15)
        data = comp.compress(self.head) + comp.flush(zlib.Z_FULL_FLUSH)
        data += _zeros_block() * (self.zeros // MiB)
        data += b"\x03\x00"  # a final, empty block of fixed codes
        return data, size, crc


def write_members(path: Path, members: list[Member], sizes=None) -> Path:
    """A zip archive of ``members`` (no zip64: each under 4 GiB).  ``sizes`` maps a member name to the
    (compressed, uncompressed) sizes its central directory entry declares instead of the true ones."""
    out, central = bytearray(), bytearray()
    for m in members:
        data, size, crc = m.payload()
        name = m.name.encode()
        method = 8 if m.deflate else 0
        offset = len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size, len(name), 0)
        out += name + data
        csize, usize = (sizes or {}).get(m.name, (len(data), size))
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, csize, usize,
                               len(name), 0, 0, 0, 0, 0, offset) + name
    start = len(out)
    out += central
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), start, 0)
    path.write_bytes(bytes(out))
    return path


def valid_members(drop=()) -> list[Member]:
    return [Member(f"{k}.npy", npy_bytes(v)) for k, v in valid_inputs().items() if k not in drop]


def npz_member_bomb(path: Path, name: str = "seq_len_max", shape=(375_000_000,), descr: str = "<i4") -> Path:
    """The valid seq case whose ``name`` member really holds ``shape`` of zeros (1.5 GB by default), deflated."""
    nbytes = int(np.prod(shape)) * np.dtype(descr).itemsize
    zeros = nbytes - nbytes % MiB  # whole MiBs of zeros repeated; the rest follows the header
    member = Member(f"{name}.npy", npy_header(shape, descr) + bytes(nbytes - zeros), zeros)
    return write_members(path, [*valid_members(drop=(name,)), member])


def npy_v3_header_bomb() -> bytes:
    """A .npy stream of format 3.0 whose header declares 4 GiB of text (numpy's own reader allocates what it
    declares before it checks its limit) and holds a hundred bytes."""
    return b"\x93NUMPY\x03\x00" + struct.pack("<I", 0xFFFFFFFF) + b"{'descr': '<f4', " + b" " * 90 + b"\n"


def npz_v3_header_bomb(path: Path, stored: bool = True) -> Path:
    """A valid NPZ but for x, a stored (np.savez's way) or deflated member of ``npy_v3_header_bomb``."""
    members = [Member("x.npy", npy_v3_header_bomb(), deflate=not stored), *valid_members(drop=("x",))]
    return write_members(path, members)


def npy_dir_v3_header_bomb(folder: Path) -> Path:
    """A directory of .npy files whose x.npy is ``npy_v3_header_bomb``."""
    folder.mkdir()
    for key, value in valid_inputs().items():
        if key != "x":
            np.save(folder / f"{key}.npy", value)
    (folder / "x.npy").write_bytes(npy_v3_header_bomb())
    return folder


def npz_declared_sizes_bomb(path: Path) -> Path:
    """x's central directory entry says 2 GB unpacked from 300 bytes packed (more than deflate can do) and its
    header declares the 2 GB: both lie, and the numbers alone say so."""
    x = Member("x.npy", npy_header((500_000_000, 1), "<f4") + bytes(240))
    data, size, _ = x.payload()
    return write_members(path, [*valid_members(drop=("x",)), x], sizes={"x.npy": (len(data), 2_000_000_000 + 128)})


def npz_duplicate_members(path: Path) -> Path:
    """x.npy twice: numpy's np.load keeps the last in silence."""
    members = valid_members()
    members.append(Member("x.npy", npy_bytes(np.full((5, 3, 4), 7, np.float32))))
    return write_members(path, members)


def npz_many_members(path: Path, count: int = 65_000) -> Path:
    """The valid case plus ``count`` tiny members."""
    tiny = npy_bytes(np.zeros(1, np.float32))
    members = valid_members() + [Member(f"m{k}.npy", tiny, deflate=False) for k in range(count)]
    return write_members(path, members)


# -- HDF5 ------------------------------------------------------------------------------------------------

def _gzip_chunk(nbytes: int) -> bytes:
    return zlib.compress(bytes(nbytes), 9)


def h5_gzip_bomb(path: Path, name: str = "x", shape=(125_000_000, 3, 4), chunk_rows: int = 87_381,
                 group: str | None = None, others: dict | None = None) -> Path:
    """``name`` is a gzip dataset of zeros: 4 bytes each of ``shape`` (1.5 GB by default), in chunks of 1 MiB
    written precompressed; the other tensors are ``others`` (the valid seq case by default)."""
    others = valid_inputs() if others is None else others
    with h5py.File(path, "w") as fh:
        node = fh.require_group(group) if group else fh
        for key, value in others.items():
            if key != name:
                node.create_dataset(key, data=value)
        chunks = (min(chunk_rows, shape[0]), *shape[1:])
        ds = node.create_dataset(name, shape=shape, dtype="f4", chunks=chunks, compression="gzip")
        blob = _gzip_chunk(int(np.prod(chunks)) * 4)
        for row in range(0, shape[0], chunks[0]):
            ds.id.write_direct_chunk((row,) + (0,) * (len(shape) - 1), blob)
    return path


def keras_bias_bomb(path: Path) -> Path:
    """A Keras 3 weights file whose LSTM bias (cell/vars/2) is a 1.6 GB gzip dataset of zeros (the kernels fit
    fixtures/keras/keras_two_layers.in.npz: I = 4, C = 3)."""
    group = "layers/lstm/cell/vars"
    rng = np.random.default_rng(0)
    weights = {"0": rng.standard_normal((4, 12)).astype("f4"), "1": rng.standard_normal((3, 12)).astype("f4")}
    return h5_gzip_bomb(path, "2", shape=(400_000_000,), chunk_rows=MiB // 4, group=group, others=weights)


def h5_unallocated(path: Path, name: str = "x", shape=(56_000_000, 1, 4)) -> Path:
    """``name`` declares 896 MB and was never written: no byte of it is stored."""
    with h5py.File(path, "w") as fh:
        for key, value in valid_inputs().items():
            if key != name:
                fh.create_dataset(key, data=value)
        fh.create_dataset(name, shape=shape, dtype="f4")
    return path


# -- .npy directories --------------------------------------------------------------------------------------

def npy_dir_sparse(folder: Path, name: str = "seq_len_max", shape=(750_000_000,)) -> Path:
    """A directory of .npy files whose ``name`` declares 3 GB and is a sparse file of that size."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, value in valid_inputs().items():
        if key != name:
            np.save(folder / f"{key}.npy", value)
    head = npy_header(shape, "<i4")
    with open(folder / f"{name}.npy", "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + 4 * int(np.prod(shape)))
    return folder


# -- safetensors -----------------------------------------------------------------------------------------

def safetensors_nested(path: Path, depth: int = 900) -> Path:
    text = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return path


def safetensors_bomb(path: Path, name: str = "seq_len_max", count: int = 375_000_000) -> Path:
    """``name`` declares and holds ``count`` int32 zeros (a sparse file): a rank-1 seq_len_max."""
    header = {name: {"dtype": "I32", "shape": [count], "data_offsets": [0, 4 * count]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        fh.truncate(8 + len(text) + 4 * count)
    return path


# -- TensorFlow debug dumps ------------------------------------------------------------------------------

def eager_dump(folder: Path, proto: bytes, outputs: int = 1) -> Path:
    """An eager Snapshot whose value is ``proto`` feeding every input of a BlockLSTMGradV2."""
    snapshot = event(9, field(1, "Snapshot") + packed(5, [100]) + field(6, 7) + field(7, proto))
    grad = event(9, field(1, "BlockLSTMGradV2") + packed(4, [100] * 18) + packed(5, range(200, 200 + 8))
                 + field(6, 7))
    return write_dump(folder, {"execution": [snapshot, grad]})


def dump_content_bomb(folder: Path, values: int = 20_000_000, how: str = "packed") -> Path:
    """A [5, 3, 4] float32 TensorProto holding ``values`` values: packed float_val (4 bytes each), one
    float_val field per value ("unpacked", 5 bytes each) or tensor_content."""
    head = field(1, 1) + field(2, shape_proto((5, 3, 4)))
    zeros = bytes(4 * values)
    if how == "packed":
        proto = head + field(5, zeros)
    elif how == "unpacked":
        proto = head + (b"\x2d" + bytes(4)) * values
    else:
        proto = head + field(4, zeros)
    return eager_dump(folder, proto)


def dump_int_bomb(folder: Path, values: int = 20_000_000) -> Path:
    """A [5, 3, 4] int32 TensorProto holding ``values`` packed int_val varints (1 byte each)."""
    proto = field(1, 3) + field(2, shape_proto((5, 3, 4))) + field(7, bytes(values))
    return eager_dump(folder, proto)


def dump_dims(folder: Path, dims) -> Path:
    """A float32 TensorProto of shape ``dims`` (and no values)."""
    return eager_dump(folder, field(1, 1) + field(2, shape_proto(dims)))


def dump_many_protos(folder: Path, count: int = 1_000_000) -> Path:
    """One eager op with ``count`` outputs, each recorded."""
    proto = field(7, field(1, 1) + field(2, shape_proto((1,))) + field(4, bytes(4)))
    op = event(9, field(1, "IdentityN") + packed(5, range(1000, 1000 + count)) + field(6, 7) + proto * count)
    return write_dump(folder, {"execution": [op]})


def dump_with_fifo(folder: Path, suffix: str = "execution") -> Path:
    dump = eager_dump(folder, field(1, 1) + field(2, shape_proto((5, 3, 4))) + field(4, bytes(240)))
    target = next(dump.glob(f"*.{suffix}"))
    target.unlink()
    os.mkfifo(target)
    return dump


def dump_many_files(folder: Path, count: int = 32_000) -> Path:
    """A dump directory of ``count`` files: as many .metadata files as a long job's processes write."""
    dump = eager_dump(folder, field(1, 1) + field(2, shape_proto((5, 3, 4))) + field(4, bytes(240)))
    blob = record(event(3, field(1, "2.21.0")))
    for k in range(count - 6):
        (dump / f"tfdbg_events.{k + 2}.host.metadata").write_bytes(blob)
    return dump


# -- the set ---------------------------------------------------------------------------------------------

def build_all(root: Path) -> dict[str, tuple[Path, tuple]]:
    """name -> (input, extra command-line arguments) for every crafted case."""
    root.mkdir(parents=True, exist_ok=True)
    cases = {
        "valid-seq (baseline)": (Path(__file__).resolve().parent.parent / "fixtures" / "seq_v2_peep.in.npz", ()),
        "npz-seq-len-max-1.5GB": (npz_member_bomb(root / "slm.npz"), ()),
        "npz-x-1.5GB-rank-3": (npz_member_bomb(root / "x.npz", "x", (125_000_000, 3, 1), "<f4"), ()),
        "npz-sizes-lie": (npz_declared_sizes_bomb(root / "lie.npz"), ()),
        "npz-duplicate-x": (npz_duplicate_members(root / "dup.npz"), ()),
        "h5-gzip-x-1.5GB": (h5_gzip_bomb(root / "gz.h5"), ()),
        "h5-gzip-seq-len-max-1.5GB": (h5_gzip_bomb(root / "gzslm.h5", "seq_len_max", (375_000_000,), MiB // 4), ()),
        "h5-unallocated-x-896MB": (h5_unallocated(root / "unalloc.h5"), ()),
        "keras-bias-gzip-1.6GB": (KERAS_INPUT, ("--weights", str(keras_bias_bomb(root / "keras.weights.h5")),
                                                "--weights-group", "layers/lstm")),
        "npy-dir-sparse-3GB": (npy_dir_sparse(root / "npydir"), ()),
        "safetensors-nested-900": (safetensors_nested(root / "nest.safetensors"), ()),
        "safetensors-seq-len-max-1.5GB": (safetensors_bomb(root / "slm.safetensors"), ()),
        "tfdbg-packed-20M": (dump_content_bomb(root / "dump-packed"), ()),
        "tfdbg-unpacked-20M": (dump_content_bomb(root / "dump-unpacked", how="unpacked"), ()),
        "tfdbg-content-20M": (dump_content_bomb(root / "dump-content", how="content"), ()),
        "tfdbg-int-20M": (dump_int_bomb(root / "dump-int"), ()),
        "tfdbg-100-dims": (dump_dims(root / "dump-100dims", (1,) * 100), ()),
        "tfdbg-1M-dims": (dump_dims(root / "dump-1Mdims", (1,) * 1_000_000), ()),
        "tfdbg-zero-size-giant": (dump_dims(root / "dump-giant", (0, 1 << 62, 1 << 62)), ()),
        "tfdbg-many-protos": (dump_many_protos(root / "dump-protos"), ()),
        "tfdbg-fifo": (dump_with_fifo(root / "dump-fifo"), ()),
        "npz-65k-members": (npz_many_members(root / "many.npz"), ()),
        "tfdbg-32k-files": (dump_many_files(root / "dump-files"), ()),
    }
    return cases


if __name__ == "__main__":
    for name, (path, args) in build_all(Path(sys.argv[1])).items():
        print(name, path, *args)
