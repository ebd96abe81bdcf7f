"""Where a Keras weights file keeps its LSTM layers: found by walking its groups, reading only datasets' shapes."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidArgumentError
from ..messages import cut
from .keras_config import InvalidConfigError, layer_options, other_recurrent

KERAS_WALK_GROUPS = 10_000  # groups a weights file is searched through for LSTM layers, at most
KERAS_WALK_LINKS = 200_000  # links looked at in those groups, at most (each group's own count is io.hdf5's bound)
MAX_NAME_BYTES = 4096  # a layer's name attribute longer than this is left unread (the group's name is shown)


def keras_layers(path) -> list[dict]:
    """The LSTM layers of a Keras weights file: for each, its group (what ``--weights-group`` takes), the layer's
    own name and the shapes of kernel, recurrent_kernel and bias.  A Keras 3 file (``model.save_weights``) keeps a
    layer's weights at ``<group>/cell/vars/0, 1, 2``, under ``layers/`` and inside nested models and wrappers
    (``layers/bidirectional/backward_layer``); an older tf.keras or legacy ``.h5`` file at
    ``<group>/lstm_cell/kernel[:0]``.  Only datasets' shapes are read, in ``_walk_groups``'s bounds."""
    layers = []

    def visit(name, group, h5py) -> bool:
        layer = _keras_lstm(name, group, h5py, path)
        if layer is not None:
            layers.append(layer)
        return layer is None  # (a layer's own groups hold no other layer)

    _walk_groups(path, visit)
    return layers


def _walk_groups(path, visit) -> None:
    """``visit(name, group, h5py)`` for each group of the HDF5 file ``path``, depth first in the order of their names,
    looking into a group's own groups where it returns True; only hard links are followed, and at most
    ``KERAS_WALK_GROUPS`` groups and ``KERAS_WALK_LINKS`` links are looked at (a group's links are counted before
    they are listed)."""
    from ..errors import InputFileError  # noqa: PLC0415
    from ..io import hdf5  # noqa: PLC0415 - h5py is imported when an HDF5 file is actually read

    with hdf5.open_hdf5(path) as (fh, h5py), hdf5.hdf5_errors(path):
        pending, seen, links = [("", fh)], 0, 0
        while pending and seen < KERAS_WALK_GROUPS:
            name, group = pending.pop()
            seen += 1
            if not visit(name, group, h5py):
                continue
            keys = hdf5.group_keys(group, path, f"group {cut(repr(name))}" if name else "its root group")
            links += len(keys)
            if links > KERAS_WALK_LINKS:
                raise InputFileError(f"{path}: its groups hold more than {KERAS_WALK_LINKS} links (a model's layers "
                                     "are thousands at most); refused")
            children = [(f"{name}/{k}" if name else k, _hard_child(group, k, h5py)) for k in keys]
            pending.extend(reversed([(n, g) for n, g in children if isinstance(g, h5py.Group)]))


def _keras_lstm(name: str, group, h5py, path) -> dict | None:
    """The LSTM layer whose weights ``group`` holds (Keras 3 or older tf.keras layout), else None; an LSTMCell of a
    StackedRNNCells (``<rnn>/cell/cells/lstm_cell[_N]/vars``) is listed with ``"stacked": True``."""
    cell = _hard_path(group, ("cell", "vars"), h5py)
    stacked = "/cells/" in f"/{name}" and cell is None
    if stacked:
        cell = _hard_path(group, ("vars",), h5py)
    if cell is not None:
        shapes = [_dataset_shape(cell, str(k), h5py) for k in range(3)]
    else:
        cell = _hard_path(group, ("lstm_cell",), h5py)
        if cell is None:
            return None
        shapes = [next((s for s in (_dataset_shape(cell, n, h5py), _dataset_shape(cell, f"{n}:0", h5py)) if s), None)
                  for n in ("kernel", "recurrent_kernel", "bias")]
    if None in shapes[:2] or len(shapes[0]) != 2 or len(shapes[1]) != 2:
        return None
    (I, G), (C, G2) = shapes[0], shapes[1]  # noqa: E741
    if G != G2 or G != 4 * C:
        return None  # a GRU or another cell: not an LSTM's weights
    return {"group": name, "name": _own_name(group, h5py, path) or name.rsplit("/", 1)[-1], "kernel": [I, G],
            "recurrent_kernel": [C, G], "bias": list(shapes[2]) if shapes[2] is not None else None, "input_size": I,
            "units": C, "stacked": stacked, "parent_name": _own_name(group.parent, h5py, path) if "/" in name else ""}


def _own_name(group, h5py, path) -> str:
    """A Keras 3 layer's own name (its group's ``vars/`` name attribute), "" where there is none."""
    own = _hard_path(group, ("vars",), h5py)
    label = _name_of(own, path) if own is not None else None
    return label.decode("utf-8", "replace") if label else ""


def keras_cells(path) -> list[str]:
    """The groups of a Keras weights file that hold an LSTM cell's weights as ``vars/0, 1, 2`` (kernel [I, 4C],
    recurrent_kernel [C, 4C], bias): an LSTMCell a subclassed model keeps as an attribute (``decoder_cell``), and the
    ``cell`` of each LSTM layer (``layers/lstm/cell``), for one step of it.  Walked as ``keras_layers`` walks."""
    found = []

    def visit(name, group, h5py) -> bool:
        own = _hard_path(group, ("vars",), h5py)
        shapes = [_dataset_shape(own, str(k), h5py) for k in range(2)] if own is not None else [None]
        if None not in shapes and all(len(s) == 2 for s in shapes) and shapes[0][1] == shapes[1][1] == \
                4 * shapes[1][0]:
            found.append(name)
        return name.rpartition("/")[2] != "vars"

    _walk_groups(path, visit)
    return found


def _name_of(group, path) -> bytes | None:
    """The layer's own name Keras keeps in the ``name`` attribute of its vars group; None when there is none (or
    one longer than a name, left unread)."""
    from ..errors import InputFileError  # noqa: PLC0415
    from ..io import hdf5  # noqa: PLC0415

    try:
        return hdf5.string_attribute(group, path, "name", MAX_NAME_BYTES, "a layer's name")
    except InputFileError:
        return None



def _hard_child(group, name: str, h5py):
    if not isinstance(group, h5py.Group) or name not in group:
        return None
    return group[name] if isinstance(group.get(name, getlink=True), h5py.HardLink) else None


def _hard_path(group, parts, h5py):
    for part in parts:
        group = _hard_child(group, part, h5py)
    return group if isinstance(group, h5py.Group) else None


def _dataset_shape(group, name: str, h5py):
    obj = _hard_child(group, name, h5py)
    return tuple(obj.shape) if isinstance(obj, h5py.Dataset) and obj.shape is not None else None


def keras_model_layers(path, fmt: str, inference: bool = False) -> tuple[list[dict], str | None]:
    """The LSTM layers a Keras weights file, full-model HDF5 file or ``.keras`` archive holds, each with what it
    was made with where the file records it (``"options"``: words, or ``"refused"``: why lstmgrad cannot compute
    it; ``"needs"``: what its gradient is computed from, ``KerasLayer.needs``; ``inference``: dropout taken as
    inactive), and a whole Bidirectional as one more entry (``"bidirectional": True``); and where the options came from
    (None: a bare weights file)."""
    from ..errors import LstmGradError  # noqa: PLC0415
    from ..io import keras_archive  # noqa: PLC0415 - h5py is imported when an HDF5 file is actually read
    from ..messages import message_of  # noqa: PLC0415

    if fmt == "keras":
        with keras_archive.model_weights(path) as (weights, config, version):
            layers = keras_layers(weights)
        source = f"{Path(path).name} config.json"
    else:
        layers = keras_layers(path)
        found = keras_archive.hdf5_model_config(path)
        config, version = found if found is not None else (None, "")
        source = f"{Path(path).name} model_config" if found is not None else None
    layers = sorted(_with_wrappers(layers), key=lambda layer: layer["group"])
    for layer in layers:
        if config is None or layer.get("stacked"):
            continue
        try:
            options = layer_options(config, layer["group"], keras_version=version, source=source,
                                    inference=inference)
        except LstmGradError as err:
            layer["refused"] = message_of(err)
            layer["invalid"] = isinstance(err, InvalidConfigError)  # (Keras itself would refuse the model)
            continue
        layer["options"] = {"activation": options.activation, "recurrent_activation": options.recurrent_activation,
                            # (as the configuration says: a Bidirectional's backward layer runs backwards)
                            "go_backwards": options.go_backwards or options.reverse,
                            "return_sequences": options.return_sequences,
                            **({"merge_mode": options.merge_mode} if layer.get("bidirectional") else {})}
        layer["needs"] = options.needs(layer["input_size"], layer["units"], bool(layer.get("bidirectional")))
    return layers, source


def keras_other_recurrent(path, fmt: str) -> list[str]:
    """Why each recurrent layer a Keras archive's or full-model file's configuration holds, and lstmgrad does not
    compute, is refused (a GRU, an RNN over StackedRNNCells, ...); [] for a bare weights file."""
    from ..io import keras_archive  # noqa: PLC0415

    if fmt == "keras":
        with keras_archive.model_weights(path) as (_weights, config, version):
            return other_recurrent(config, keras_archive.keras_major(version))
    found = keras_archive.hdf5_model_config(path)
    return other_recurrent(found[0], keras_archive.keras_major(found[1])) if found is not None else []


def resolve_group(path, group: str | None) -> tuple[str | None, str]:
    """The group of a Keras weights file, full-model .h5 or .keras archive to read an LSTM layer from: ``group``
    as given; where none is given and the file holds one LSTM layer (or one Bidirectional), that layer's; where a
    layer's own name is given (as inspect prints it: ``enc2``), its group.  With a note saying which, when it is
    not the group as given ("" otherwise).  A group path (with a "/") is taken as given: the file is not walked."""
    from .. import io  # noqa: PLC0415 - h5py is imported when an HDF5 file is actually read

    if group is not None and "/" in group.strip("/"):
        return group, ""
    fmt = io.sniff_format(path)
    if fmt not in ("hdf5", "keras"):
        return group, ""
    layers, _source = keras_model_layers(path, fmt)
    if group is None:
        units = [layer for layer in layers if not layer.get("stacked") and not _in_wrapper(layer, layers)]
        if len(units) != 1 or not units[0]["group"]:
            return None, ""
        what = "Bidirectional" if units[0].get("bidirectional") else "LSTM layer"
        return units[0]["group"], f"the model's one {what}, {cut(units[0]['name'])!r}: group {cut(units[0]['group'])}"
    wanted = group.strip("/")
    if not layers or any(layer["group"] == wanted or layer["group"].startswith(f"{wanted}/") for layer in layers):
        return group, ""
    named = [layer for layer in layers if layer["name"] == wanted and not layer.get("stacked")]
    named = [layer for layer in named if layer.get("bidirectional")] or named  # (a wrapper before its layers)
    if len(named) == 1:
        return named[0]["group"], f"layer {cut(wanted)!r}: group {cut(named[0]['group'])}"
    listed = ", ".join(f"{cut(layer['name'])!r} at {cut(layer['group'])}" for layer in layers[:12]
                       if not layer.get("stacked"))
    several = " (several are)" if named else ""
    raise InvalidArgumentError(f"{path} has no LSTM layer named {cut(wanted)!r}{several}, nor "
                               f"a group of that name holding one: its LSTM layers are {listed}"
                               + (", ..." if len(layers) > 12 else ""))


def _in_wrapper(layer: dict, layers: list[dict]) -> bool:
    parent = layer["group"].rpartition("/")[0]
    return any(other.get("bidirectional") and other["group"] == parent for other in layers)


def _with_wrappers(layers: list[dict]) -> list[dict]:
    """Each Bidirectional's two layers, and before them the wrapper itself (its group, both layers' shapes)."""
    out = []
    for layer in layers:
        parent, _, last = layer["group"].rpartition("/")
        if last in ("forward_layer",) or (last.startswith("forward_") and "/" in layer["group"]):
            twin = next((other for other in layers if other["group"].rpartition("/")[0] == parent
                         and other["group"].rpartition("/")[2].startswith("backward_")), None)
            if twin is not None:
                wrapper = {**layer, "group": parent, "name": layer.get("parent_name") or parent.rsplit("/", 1)[-1],
                           "bidirectional": True}
                if twin["bias"] != layer["bias"]:  # (an explicit backward_layer may have none)
                    wrapper["backward_bias"] = twin["bias"]
                out.append(wrapper)
        out.append(layer)
    return out
