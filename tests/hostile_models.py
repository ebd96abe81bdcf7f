"""Crafted model files (issue 41): Keras archives, full-model HDF5 files and state_dicts that aim at what a model
file adds to a tensor file: its configuration (JSON), its zip directory, the names it keeps tensors under, links.
Small on disk however much they declare (zeros deflated by repeating one flushed block, zip directories left as
holes of sparse files), except where what is crafted is itself large: ``build_all`` makes the issue's sizes (a
200 MB attribute, a million links: seconds and a few hundred MB), the tests smaller ones past the same bounds.

Used by tests/test_hostile_models.py (every case through `seq` and `inspect --json`, with peak memory and written
bytes measured in a real process) and benchmarks/bomb_probe.py; ``python tests/hostile_models.py DIR`` writes
the set into DIR."""

from __future__ import annotations

import json
import struct
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bombs import Member, MiB, npy_bytes, npy_header, write_members  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KERAS = FIXTURES / "keras"
TORCH = FIXTURES / "torch"


# -- Keras archives ----------------------------------------------------------------------------------------

def archive_members(source: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(source) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def write_archive(path: Path, members: dict[str, bytes] | list[tuple[str, bytes]],
                  compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in (members.items() if isinstance(members, dict) else members):
            zf.writestr(name, data)
    return path


def first_layer(config: dict, kind: str = "LSTM") -> dict:
    """The first serialised layer of class ``kind`` of a Sequential's configuration."""
    return next(layer for layer in config["config"]["layers"] if layer["class_name"] == kind)


def edited_archive(path: Path, source: Path, edit) -> Path:
    """``source`` (a .keras fixture) with ``edit(config)`` applied to its config.json."""
    members = archive_members(source)
    config = json.loads(members["config.json"])
    edit(config)
    members["config.json"] = json.dumps(config).encode()
    return write_archive(path, members)


def lstm_option(name: str, value, kind: str = "LSTM"):
    def edit(config):
        first_layer(config, kind)["config"][name] = value
    return edit


def layer_config(value, kind: str = "LSTM"):
    def edit(config):
        first_layer(config, kind)["config"] = value
    return edit


def nested_lists(nbytes: int) -> bytes:
    """``[[], [], ...]``: ``nbytes`` of JSON that nests 2 deep and holds nbytes / 4 lists."""
    count = max(1, (nbytes - 2) // 4)
    return b"[" + b"[], " * (count - 1) + b"[]]"


def padded_json(document: dict, nbytes: int) -> bytes:
    """``document`` with a key ``"padding"`` of nested empty lists: ``nbytes`` of JSON in all."""
    text = json.dumps(document).encode()
    return text[:-1] + b', "padding": ' + nested_lists(nbytes - len(text) - 14) + b"}"


def archive_with_padded(path: Path, source: Path, member: str, nbytes: int) -> Path:
    """``source`` whose ``member`` (config.json or metadata.json) is itself plus ``nbytes`` of empty lists,
    deflated (64 MiB of it is 64 KB)."""
    members = archive_members(source)
    members[member] = padded_json(json.loads(members[member]), nbytes)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data, zipfile.ZIP_DEFLATED if name == member else zipfile.ZIP_STORED)
    return path


def archive_weights_padded(path: Path, source: Path, zeros: int = 2 << 30) -> Path:
    """``source`` whose model.weights.h5 is the real file followed by ``zeros`` bytes of zeros, deflated (2 GiB of
    zeros are 2 MB): an HDF5 file reads the same with bytes after its end."""
    members = archive_members(source)
    weights = members.pop("model.weights.h5")
    head = Member("model.weights.h5", weights + bytes(-len(weights) % MiB), zeros)
    others = [Member(name, data, deflate=False) for name, data in members.items()]
    return write_members(path, [*others, head])


def archive_of_many_members(path: Path, source: Path, count: int = 1_000_000, hole: bool = True) -> Path:
    """``source``'s members and a central directory of ``count`` entries (47 MB for a million): with ``hole`` a
    hole of a sparse file (no disk; a reader that reads the directory before the end record finds zeros), else
    ``count`` entries for ``assets/a`` (what zipfile reads whole)."""
    base = write_archive(path, archive_members(source)).read_bytes()
    start = struct.unpack_from("<I", base, base.rfind(b"PK\x05\x06") + 16)[0]  # the real directory, dropped
    entry = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0)
    entry += b"assets/a"
    directory_size = len(entry) * count
    with open(path, "wb") as fh:
        fh.write(base[:start])
        if hole:
            fh.truncate(start + directory_size)
        else:
            fh.write(entry * count)
        fh.seek(start + directory_size)
        fh.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count & 0xFFFF, count & 0xFFFF, directory_size,
                             start, 0) if count < 0xFFFF else _zip64_end(count, directory_size, start))
    return path


def _zip64_end(count: int, size: int, offset: int) -> bytes:
    record_at = offset + size
    record = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, offset)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, record_at, 1)
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return record + locator + end


def archive_stored_size_lie(path: Path, source: Path, declared: int = 4_000_000_000) -> Path:
    """``source`` whose stored model.weights.h5 declares ``declared`` bytes unpacked in its central directory
    entry (a stored member unpacks to exactly what it packs)."""
    members = archive_members(source)
    sizes = {"model.weights.h5": (len(members["model.weights.h5"]), declared)}
    return write_members(path, [Member(n, d, deflate=False) for n, d in members.items()], sizes)


def archive_assets_first(path: Path, source: Path) -> Path:
    """``source`` with an ``assets/readme.txt`` member first (Keras loads it)."""
    return write_archive(path, [("assets/readme.txt", b"a model\n"), *archive_members(source).items()])


# -- full-model HDF5 files ---------------------------------------------------------------------------------

def legacy_with_config(path: Path, source: Path, edit=None, text: bytes | None = None) -> Path:
    """The full-model HDF5 file ``source`` rewritten with its model_config attribute edited by ``edit(config)``, or
    replaced by ``text`` (the newest file format, whose attributes may be of any size)."""
    with h5py.File(source, "r") as src, h5py.File(path, "w", libver="latest") as dst:
        for key in src:
            src.copy(src[key], dst, key)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        if text is None:
            config = json.loads(src.attrs["model_config"])
            edit(config)
            text = json.dumps(config).encode()
        dst.attrs["model_config"] = text  # (bytes: a variable-length string, as Keras writes it)
    return path


def legacy_with_big_config(path: Path, source: Path, nbytes: int = 200 << 20) -> Path:
    """``source`` whose model_config attribute is ``nbytes`` long (its configuration padded with spaces)."""
    with h5py.File(source, "r") as fh:
        text = fh.attrs["model_config"].encode()
    return legacy_with_config(path, source, text=text + b" " * (nbytes - len(text)))


# -- bare weights files ----------------------------------------------------------------------------------

def weights_with_dangling_links(path: Path, source: Path, count: int = 1_000_000) -> Path:
    """The Keras weights file ``source`` with ``count`` dangling soft links beside its groups (``ghost_N`` at the
    root, in HDF5's dense link storage: a million in about 10 s; the older storage slows to a crawl past 600,000)."""
    with h5py.File(path, "w", libver="latest") as dst:
        links = dst.id.links
        for k in range(count):
            links.create_soft(b"ghost_%d" % k, b"/nowhere/%d" % k)
        with h5py.File(source, "r") as src:
            for key in src:
                src.copy(src[key], dst, key)
    return path


def weights_with_empty_heap_object(path: Path, source: Path, which: int = 3) -> Path:
    """The Keras weights file ``source`` whose global heap (where the layers' name attributes are) has its object
    ``which`` of size 0: HDF5 then loops forever reading the names after it (a fuzzed file found it)."""
    data = bytearray(source.read_bytes())
    at = data.index(b"GCOL") + 16  # ("GCOL", version, 3 reserved, the collection's size; then its objects)
    for _ in range(which - 1):  # each: index, reference count, reserved, size (8 bytes), data padded to 8 bytes
        at += 16 + (int.from_bytes(data[at + 8:at + 16], "little") + 7) // 8 * 8
    data[at + 8:at + 16] = bytes(8)
    path.write_bytes(bytes(data))
    return path


# -- state_dicts -----------------------------------------------------------------------------------------

def torch_module() -> tuple[dict, dict]:
    """(input tensors x, h_grad; the state_dict) of fixtures/torch/torch_module_3layers (nn.LSTM(4, 3, 3))."""
    from safetensors.numpy import load_file

    with np.load(TORCH / "torch_module_3layers.in.npz") as src:
        inputs = {k: src[k] for k in src.files}
    return inputs, load_file(str(TORCH / "torch_module_3layers.weights.safetensors"))


def safetensors_file(path: Path, tensors: dict) -> Path:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
    return path


def state_dict_twice_under_group(path: Path) -> Path:
    """The module's state_dict under ``rnn.``, and a zero ``rnn/weight_ih_l0`` beside ``rnn.weight_ih_l0``: the
    group ``rnn`` selects both."""
    _, weights = torch_module()
    tensors = {f"rnn.{k}": v for k, v in weights.items()}
    tensors["rnn/weight_ih_l0"] = np.zeros_like(weights["weight_ih_l0"])
    return safetensors_file(path, tensors)


def state_dict_with_key(path: Path, key: str, inline: bool = True) -> Path:
    """The module's inputs and state_dict in one NPZ (``inline``; else the state_dict alone as safetensors) with
    one more weight named ``key`` (``weight_ih_l999999999``, ...)."""
    inputs, weights = torch_module()
    extra = {key: weights["weight_ih_l1"]}
    if inline:
        np.savez(path, **inputs, **weights, **extra)
        return path
    return safetensors_file(path, {**weights, **extra})


def torch_inputs(path: Path) -> Path:
    inputs, _ = torch_module()
    np.savez(path, **inputs)
    return path


# -- tensors ---------------------------------------------------------------------------------------------

def zero_width_module(path: Path, steps: int = 500_000) -> Path:
    """An nn.LSTM(0, 1)'s x [steps, 1, 0] with its zero-width weight_ih_l0 [4, 0] and the gradient at out[-1]:
    1 KB that declares ``steps`` time steps of nothing."""
    rng = np.random.default_rng(0)
    np.savez(path, x=np.zeros((steps, 1, 0), np.float32), weight_ih_l0=np.zeros((4, 0), np.float32),
             weight_hh_l0=rng.standard_normal((4, 1)).astype(np.float32), h_grad=np.ones((1, 1), np.float32))
    return path


def empty_batch_problem(path: Path, steps: int = 1_000_000) -> Path:
    """BlockLSTMGradV2's tensors for x [steps, 0, 3] and C = 2: no example, every per-step tensor empty (2 KB)."""
    T, B, I, C = steps, 0, 3, 2  # noqa: E741
    rng = np.random.default_rng(0)
    step = np.zeros((T, B, C), np.float32)
    tensors = {"x": np.zeros((T, B, I), np.float32), "cs_prev": np.zeros((B, C), np.float32),
               "h_prev": np.zeros((B, C), np.float32), "w": rng.standard_normal((I + C, 4 * C)).astype(np.float32),
               "wci": np.zeros(C, np.float32), "wcf": np.zeros(C, np.float32), "wco": np.zeros(C, np.float32),
               "b": np.zeros(4 * C, np.float32),
               **{n: step for n in ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad")}}
    np.savez(path, **tensors)
    return path


def npz_with_unused_member(path: Path, source: Path, nbytes: int = 1600 * MiB) -> Path:
    """The NPZ ``source`` plus an unused member ``junk`` of ``nbytes`` float32 zeros, deflated (1.6 GB in
    1.6 MB)."""
    with np.load(source) as src:
        members = [Member(f"{k}.npy", npy_bytes(src[k])) for k in src.files]
    count = nbytes // 4
    zeros = nbytes - nbytes % MiB
    junk = Member("junk.npy", npy_header((count,), "<f4") + bytes(nbytes - zeros), zeros)
    return write_members(path, [*members, junk])


def lengths_of(path: Path, lengths) -> Path:
    """The nn.LSTM case with per-example ``lengths`` (floats)."""
    inputs, weights = torch_module()
    np.savez(path, **inputs, **weights, lengths=np.asarray(lengths, np.float64))
    return path


def state_dict_long_prefix(path: Path, length: int = 100_000) -> Path:
    """The module's state_dict behind a ``length``-character module name."""
    _, weights = torch_module()
    return safetensors_file(path, {f"{'m' * length}.{k}": v for k, v in weights.items()})


# -- the set ---------------------------------------------------------------------------------------------

def build_all(root: Path) -> dict[str, tuple[Path, tuple]]:
    """name -> (input, extra command-line arguments) for every row of issue 41's tables."""
    root.mkdir(parents=True, exist_ok=True)
    relu, relu_in = KERAS / "keras_relu.keras", KERAS / "keras_relu.in.npz"
    bidir, bidir_in = KERAS / "keras_bidir_concat.keras", KERAS / "keras_bidir_concat.in.npz"
    legacy, legacy_in = KERAS / "keras_legacy_h5.h5", KERAS / "keras_legacy_h5.in.npz"
    weights = KERAS / "keras_two_layers.weights.h5"

    def keras(path, source_in=relu_in, group="layers/lstm"):
        return source_in, ("--weights", str(path), "--weights-group", group)

    cases = {
        "safetensors-twice-under-group": (torch_inputs(root / "torch.in.npz"), (
            "--weights", str(state_dict_twice_under_group(root / "twice.safetensors")), "--weights-group", "rnn")),
        "keras3-time-major": keras(edited_archive(root / "tm.keras", relu, lstm_option("time_major", True))),
        "bidirectional-of-GRU-string": keras(edited_archive(
            root / "gru.keras", bidir, lstm_option("layer", "GRU", "Bidirectional")), bidir_in,
            "layers/bidirectional"),
        "lstm-config-list": keras(edited_archive(root / "c1.keras", relu, layer_config([1, 2]))),
        "lstm-config-string": keras(edited_archive(root / "c2.keras", relu, layer_config("lstm"))),
        "dropout-string": keras(edited_archive(root / "d1.keras", relu, lstm_option("dropout", "abc"))),
        "dropout-list": keras(edited_archive(root / "d2.keras", relu, lstm_option("dropout", [0.5]))),
        "recurrent-dropout-dict": keras(edited_archive(root / "d3.keras", relu, lstm_option(
            "recurrent_dropout", {"rate": 0.5}))),
        "bidirectional-config-list": keras(edited_archive(root / "b1.keras", bidir, layer_config(
            [], "Bidirectional")), bidir_in, "layers/bidirectional"),
        "legacy-dropout-string": (legacy_in, ("--weights", str(legacy_with_config(
            root / "legacy-dropout.h5", legacy, lstm_option("dropout", "abc"))), "--weights-group",
            "model_weights/lstm/sequential/lstm")),
        "config-json-64MiB-of-lists": keras(archive_with_padded(root / "p1.keras", relu, "config.json", 63 * MiB)),
        "config-json-4MiB-of-lists": keras(archive_with_padded(root / "p4.keras", relu, "config.json", 4 * MiB)),
        "metadata-json-64MiB-of-lists": keras(archive_with_padded(root / "p2.keras", relu, "metadata.json",
                                                                  63 * MiB)),
        "legacy-model-config-64MiB-of-lists": (legacy_in, ("--weights", str(legacy_with_config(
            root / "legacy-lists.h5", legacy, text=padded_json(json.loads(h5py.File(legacy, "r").attrs[
                "model_config"]), 63 * MiB))), "--weights-group", "model_weights/lstm/sequential/lstm")),
        "state-dict-layer-999999999": (state_dict_with_key(root / "l999.npz", "weight_ih_l999999999"), ()),
        "state-dict-layer-1e30": (state_dict_with_key(root / "l1e30.npz", "weight_ih_l1" + "0" * 30), ()),
        "state-dict-arabic-digit": (state_dict_with_key(root / "arabic.npz", "weight_ih_l\u0669"), ()),
        "keras-1M-members": keras(archive_of_many_members(root / "many.keras", relu, hole=False)),
        "legacy-model-config-200MB": (legacy_in, ("--weights", str(legacy_with_big_config(root / "big.h5", legacy)),
                                                  "--weights-group", "model_weights/lstm/sequential/lstm")),
        "weights-padded-2GiB": keras(archive_weights_padded(root / "pad.keras", relu)),
        "zero-width-500k": (zero_width_module(root / "zero.npz"), ()),
        "empty-batch-1M-steps": (empty_batch_problem(root / "batch0.npz"), ()),
        "dangling-links-1M": (KERAS / "keras_two_layers.in.npz", (
            "--weights", str(weights_with_dangling_links(root / "links.weights.h5", weights)), "--weights-group",
            "layers/lstm_1")),
        "npz-unused-1.6GB": (npz_with_unused_member(root / "unused.npz", FIXTURES / "seq_v2_peep.in.npz"), ()),
        "assets-first": keras(archive_assets_first(root / "assets.keras", relu)),
        "lengths-1e20": (lengths_of(root / "lengths.npz", [1e20, 5, 5]), ()),
        "module-name-100KB": (torch_inputs(root / "torch2.in.npz"), (
            "--weights", str(state_dict_long_prefix(root / "long.safetensors")))),
        "stored-size-lie-4GB": keras(archive_stored_size_lie(root / "lie.keras", relu)),
    }
    return cases


if __name__ == "__main__":
    for name, (path, args) in build_all(Path(sys.argv[1])).items():
        print(name, path, *args)
