"""A Keras layer's options from the model configuration saved beside its weights.

``model.save('m.keras')`` writes the configuration (config.json) and the weights (model.weights.h5, where Keras 3
names each layer's group after its class: ``layers/lstm``, ``layers/lstm_1``, ``layers/bidirectional/
backward_layer``, nested models' layers under ``layers/sequential/layers/...``).  A full-model HDF5 file
(``model.save('m.h5')``) keeps the configuration in its ``model_config`` attribute and each layer's weights under
its own name (``model_weights/<name>/<name>/...``).  ``layer_options`` finds the layer whose weights a group holds
and reads what it was made with; ``layer_from_group`` says what a bare weights file's group name alone tells.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..errors import InvalidArgumentError
from ..messages import Message, Param
from . import keras_masks
from .common import FrameworkOptions
from .keras import KerasLayer

CONTAINERS = ("Functional", "Sequential", "Model")
STACKED = ("keras.layers.RNN over StackedRNNCells: lstmgrad computes LSTM layers, not cells stacked in one RNN (the "
           "same maths as LSTM layers with return_sequences=True one after another: build that model, copy each "
           "cell's weights into its layer, and save it)")
WRAPPER = "Bidirectional"


def snake(class_name: str) -> str:
    """Keras' own snake_case of a class name (LSTM -> lstm, InputLayer -> input_layer)."""
    text = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", class_name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", text).lower()


def _layers(config: dict) -> list:
    inner = config.get("config", {}) if isinstance(config, dict) else {}
    layers = inner.get("layers", []) if isinstance(inner, dict) else []
    return [layer for layer in layers if isinstance(layer, dict)] if isinstance(layers, list) else []


@dataclass(frozen=True)
class Found:
    """An LSTM layer, or a Bidirectional wrapper (``backward`` None) or one of its two layers, of a configuration."""

    group: str  # where model.save_weights / a .keras archive keeps its weights (Keras 3)
    names: tuple[str, ...]  # the layers' own names from the top container down (legacy files go by these)
    layer: dict  # the LSTM's serialised config (a wrapper's forward layer for the whole wrapper)
    wrapper: dict | None
    backward: bool | None
    refused: str = ""  # a recurrent layer that is not an LSTM's maths: why (GRU, StackedRNNCells, ...)

    def legacy_match(self, parts: list[str]) -> bool:
        """Whether a legacy full-model file's group (``model_weights/<name>/.../<name>``) holds this layer."""
        if len(parts) < 2 or parts[0] != self.names[0]:
            return False
        last = parts[-1]
        if self.wrapper is not None and self.backward is not None:
            return len(parts) > 2 and last.startswith("backward_" if self.backward else "forward_")
        return last == self.names[-1]


def _walk(config: dict, prefix: str = "", names: tuple = (), depth: int = 0) -> Iterator[Found]:
    """Every LSTM layer and Bidirectional wrapper (and its two layers) of a container's configuration."""
    if depth > 50:
        return
    used: dict[str, int] = {}
    sequential = config.get("class_name") == "Sequential"
    for layer in _layers(config):
        kind = str(layer.get("class_name", ""))
        if sequential and kind == "InputLayer":
            continue  # a Sequential's layers (and so its weights file) leave its input out
        base = snake(kind)
        count = used.get(base, 0)
        used[base] = count + 1
        group = f"{prefix}layers/{base}" + (f"_{count}" if count else "")
        inner = layer.get("config", {}) if isinstance(layer.get("config"), dict) else {}
        path = (*names, str(inner.get("name", layer.get("name", ""))))
        if kind in CONTAINERS:
            yield from _walk(layer, group + "/", path, depth + 1)
        elif kind == WRAPPER:
            wrapped = inner.get("layer", {})
            backward = inner.get("backward_layer") or wrapped
            yield Found(group, path, wrapped, layer, None)
            yield Found(f"{group}/forward_layer", path, wrapped, layer, False)
            yield Found(f"{group}/backward_layer", path, backward, layer, True)
        elif kind in ("LSTM", "CuDNNLSTM"):
            yield Found(group, path, layer, None, False)
        elif kind == "RNN":
            yield _rnn(group, path, layer, inner)
        elif kind in OTHER_RECURRENT:
            yield Found(group, path, layer, None, False, f"{group} is a {kind} layer, not an LSTM: lstmgrad computes "
                                                         "LSTM layers")


# Recurrent layers that are not LSTMs: named when a group holds one.
OTHER_RECURRENT = ("GRU", "SimpleRNN", "CuDNNGRU", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D")


def _rnn(group: str, path: tuple, layer: dict, inner: dict) -> Found:
    """``keras.layers.RNN(cell)``: over one LSTMCell it is an LSTM layer (the cell's activations, the RNN's
    go_backwards, return_sequences, ...); over StackedRNNCells or another cell it is refused by name."""
    cell = inner.get("cell") if isinstance(inner.get("cell"), dict) else {}
    cell_kind = str(cell.get("class_name", "a cell"))
    if cell_kind == "LSTMCell":
        cell_config = cell.get("config", {}) if isinstance(cell.get("config"), dict) else {}
        merged = {**cell_config, **{k: v for k, v in inner.items() if k != "cell"}}
        return Found(group, path, {"class_name": "LSTM", "config": merged}, None, False)
    if cell_kind == "StackedRNNCells":
        return Found(group, path, layer, None, False, f"{group} is a {STACKED}")
    return Found(group, path, layer, None, False, f"{group} is a keras.layers.RNN over {cell_kind}, not an LSTM: "
                                                  "lstmgrad computes LSTM layers")


def lstm_groups(model_config: dict) -> list[str]:
    """Every LSTM layer's (and Bidirectional's) group a configuration describes (Keras 3 names)."""
    return [found.group for found in _walk(model_config) if not found.refused]


def other_recurrent(model_config: dict) -> list[str]:
    """Why each recurrent layer of a configuration that lstmgrad does not compute is refused."""
    return [found.refused for found in _walk(model_config) if found.refused]


def layer_options(model_config: dict, group: str, *, keras_version: str = "", source: str = "",
                  inference: bool = False) -> KerasLayer:
    """The options of the layer whose weights are at ``group`` (Keras 3 or legacy full-model layout)."""
    from ..io.keras_archive import keras_major  # noqa: PLC0415 - (a version number's reading, kept with io)

    wanted = group.strip("/")
    parts = wanted.split("/")
    legacy = parts[0] == "model_weights"
    major = keras_major(keras_version)
    for found in _walk(model_config):
        if (found.legacy_match(parts[1:]) if legacy else wanted == found.group):
            if found.refused:
                raise InvalidArgumentError(found.refused)
            options = KerasLayer.from_config(found.layer, keras_major=major, source=source, wrapper=found.wrapper,
                                             backward=bool(found.backward), inference=inference)
            options = replace(options, reaching=keras_masks.reaching(model_config, found.names))
            if found.wrapper is not None and found.backward is None:  # the whole wrapper: both layers must agree
                other = KerasLayer.from_config(found.wrapper.get("config", {}).get("backward_layer") or found.layer,
                                               keras_major=major, inference=inference)
                if (other.activation, other.recurrent_activation) != (options.activation,
                                                                      options.recurrent_activation):
                    raise InvalidArgumentError("the Bidirectional's two layers have different activations; give "
                                               "each layer's group (forward_layer, backward_layer) on its own")
                if other.use_bias != options.use_bias:  # (an explicit backward_layer): each keeps what it has
                    options = replace(options, use_bias=None)
            return options
    groups = ", ".join(lstm_groups(model_config)) or "none"
    refused = other_recurrent(model_config)
    if groups == "none" and refused:
        raise InvalidArgumentError(f"the model has no LSTM layer lstmgrad computes: {'; '.join(refused)}")
    if not wanted:
        raise InvalidArgumentError(Message.format("the model has several layers: name one with {} (its LSTM layers' "
                                                  "groups: {})", Param("weights_group"), groups))
    raise InvalidArgumentError(f"the model configuration has no LSTM layer at {group!r} (its LSTM layers' groups: "
                               f"{groups})")


def layer_from_group(group: str, options: FrameworkOptions) -> KerasLayer | None:
    """What a bare weights file's group name tells: a Bidirectional's backward layer runs backwards in time."""
    last = group.strip("/").rsplit("/", 1)[-1]
    backward = last == "backward_layer" or last.startswith("backward_lstm")
    forward = last == "forward_layer" or last.startswith("forward_lstm")
    if backward and options.go_backwards:
        raise InvalidArgumentError(Message.format("{} is a Bidirectional's backward layer (it runs backwards, its "
                                                  "outputs put back into x's order), not a go_backwards layer: leave "
                                                  "{} out", group, Param("go_backwards")))
    if forward and options.reverse:
        raise InvalidArgumentError(Message.format("{} is a Bidirectional's backward layer, and {} is its forward "
                                                  "layer: leave it out, or name the backward_layer", Param("reverse"),
                                                  group))
    if backward:
        return KerasLayer(reverse=True, wrapped=True, notes=(f"{group} is a Bidirectional's backward layer: run "
                                                             "backwards in time, h_grad in x's time order",))
    if forward:
        return KerasLayer(wrapped=True)
    return None
