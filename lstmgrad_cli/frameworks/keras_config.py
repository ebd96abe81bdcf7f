"""A Keras layer's options from the model configuration saved beside its weights.

``model.save('m.keras')`` writes the configuration (config.json) and the weights (model.weights.h5, where Keras 3
names each layer's group after its class: ``layers/lstm``, ``layers/lstm_1``, ``layers/bidirectional/
backward_layer``, nested models' layers under ``layers/sequential/layers/...``).  A full-model HDF5 file
(``model.save('m.h5')``) keeps the configuration in its ``model_config`` attribute and each layer's weights under
its own name (``model_weights/<name>/<name>/...``).  ``layer_options`` finds the layer whose weights a group holds
and reads what it was made with; ``layer_from_group`` says what a bare weights file's group name alone tells.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..errors import InvalidArgumentError
from ..messages import TYPED, Message, Param, cut
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


def _layers(config: dict, where: str) -> list[dict]:
    """A container's serialised layers; a container Keras could not build (its config or a layer not a JSON
    object) is refused, since which group holds which layer depends on every layer before it."""
    inner = config.get("config")
    if not isinstance(inner, dict):
        if config.get("class_name") in CONTAINERS:
            raise InvalidConfigError(f"the model configuration's {where} has a config that is {_json_kind(inner)}, "
                                     "not a JSON object (Keras refuses it)")
        return []
    layers = inner.get("layers", [])
    if not isinstance(layers, list):
        raise InvalidConfigError(f"the model configuration's {where} has layers that are {_json_kind(layers)}, not "
                                 "a list (Keras refuses it)")
    for k, layer in enumerate(layers):
        if not isinstance(layer, dict) or not isinstance(layer.get("class_name"), str):
            what = _json_kind(layer) if not isinstance(layer, dict) else "a JSON object without a class_name"
            raise InvalidConfigError(f"the model configuration's {where} has a layer (number {k}) that is {what}, "
                                     "not a serialised layer (Keras refuses it)")
    return layers


@dataclass(frozen=True)
class Found:
    """An LSTM layer, or a Bidirectional wrapper (``backward`` None) or one of its two layers, of a configuration."""

    group: str  # where model.save_weights / a .keras archive keeps its weights (Keras 3)
    names: tuple[str, ...]  # the layers' own names from the top container down (legacy files go by these)
    layer: dict  # the LSTM's serialised config (a wrapper's forward layer for the whole wrapper)
    wrapper: dict | None
    backward: bool | None
    refused: str = ""  # a recurrent layer that is not an LSTM's maths: why (GRU, StackedRNNCells, ...)
    invalid: str = ""  # a configuration Keras itself refuses (an option it does not take, of a wrong type): why

    def legacy_match(self, parts: list[str]) -> bool:
        """Whether a legacy full-model file's group (``model_weights/<name>/.../<name>``) holds this layer."""
        if len(parts) < 2 or parts[0] != self.names[0]:
            return False
        last = parts[-1]
        if self.wrapper is not None and self.backward is not None:
            return len(parts) > 2 and last.startswith("backward_" if self.backward else "forward_")
        return last == self.names[-1]


def _walk(config: dict, major: int = 3, prefix: str = "", names: tuple = (), depth: int = 0) -> Iterator[Found]:
    """Every LSTM layer and Bidirectional wrapper (and its two layers) of a container's configuration (written by
    Keras ``major``: what its layers may hold is checked against what that Keras accepts)."""
    if depth > 50 or not isinstance(config, dict):
        return
    used: dict[str, int] = {}
    sequential = config.get("class_name") == "Sequential"
    where = "/".join(names) or "model"
    for layer in _layers(config, cut(where)):
        kind = layer["class_name"]
        if sequential and kind == "InputLayer":
            continue  # a Sequential's layers (and so its weights file) leave its input out
        base = snake(kind)
        count = used.get(base, 0)
        used[base] = count + 1
        group = f"{prefix}layers/{base}" + (f"_{count}" if count else "")
        inner = layer.get("config", {}) if isinstance(layer.get("config"), dict) else {}
        path = (*names, str(inner.get("name", layer.get("name", ""))))
        if kind in CONTAINERS:
            yield from _walk(layer, major, group + "/", path, depth + 1)
        elif kind == WRAPPER:
            invalid = invalid_wrapper(layer, major)
            wrapped = inner.get("layer", {})
            backward = inner.get("backward_layer") or wrapped
            other = next((w["class_name"] for w in (wrapped, backward) if not invalid and w["class_name"] not in
                          LSTMS[major]), None)
            refused = (f"{cut(group)} is a Bidirectional of a {cut(other)} layer, not of an LSTM: lstmgrad computes "
                       "LSTM layers") if other is not None else ""
            yield Found(group, path, wrapped, layer, None, refused, invalid)
            yield Found(f"{group}/forward_layer", path, wrapped, layer, False, refused, invalid)
            yield Found(f"{group}/backward_layer", path, backward, layer, True, refused, invalid)
        elif kind in ("LSTM", "CuDNNLSTM"):
            yield Found(group, path, layer, None, False, invalid=invalid_layer(layer, major))
        elif kind == "RNN":
            yield _rnn(group, path, layer, inner, major)
        elif kind in OTHER_RECURRENT:
            yield Found(group, path, layer, None, False, f"{cut(group)} is a {kind} layer, not an LSTM: lstmgrad "
                                                         "computes LSTM layers")


# Recurrent layers that are not LSTMs: named when a group holds one.
OTHER_RECURRENT = ("GRU", "SimpleRNN", "CuDNNGRU", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D")


# -- what Keras accepts ------------------------------------------------------------------------------------------

class InvalidConfigError(InvalidArgumentError):
    """A model configuration Keras itself refuses to load (an option its layer does not take, a value of a type it
    cannot use, a structure it cannot build)."""


# The options each layer's constructor takes (its own arguments, then what the classes below it take through
# **kwargs), as Keras 3.15 (keras.layers) and tf.keras 2.21 (tf_keras.layers) define them: the signatures of
# LSTM, LSTMCell, RNN, Bidirectional and Layer, and the keyword arguments their __init__s pop.  Any other key in a
# layer's config makes Keras refuse the model ("Unrecognized keyword arguments passed to LSTM: {'time_major': ...}").
_BASE = {3: {"name", "trainable", "dtype", "autocast", "activity_regularizer", "input_dim", "input_shape"},
         2: {"name", "trainable", "dtype", "dynamic", "input_dim", "input_shape", "batch_input_shape", "batch_size",
             "weights", "activity_regularizer", "autocast", "implementation"}}
_CELL = {"units", "activation", "recurrent_activation", "use_bias", "kernel_initializer", "recurrent_initializer",
         "bias_initializer", "unit_forget_bias", "kernel_regularizer", "recurrent_regularizer", "bias_regularizer",
         "kernel_constraint", "recurrent_constraint", "bias_constraint", "dropout", "recurrent_dropout"}
_RNN = {"return_sequences", "return_state", "go_backwards", "stateful", "unroll", "zero_output_for_mask"}
_CUDNN = {"units", "kernel_initializer", "recurrent_initializer", "bias_initializer", "unit_forget_bias",
          "kernel_regularizer", "recurrent_regularizer", "bias_regularizer", "kernel_constraint",
          "recurrent_constraint", "bias_constraint", "return_sequences", "return_state", "go_backwards", "stateful",
          "time_major"}
ACCEPTED = {
    3: {"LSTM": _CELL | _RNN | _BASE[3] | {"seed", "use_cudnn", "implementation"},
        "LSTMCell": _CELL | _BASE[3] | {"seed", "implementation"},
        "RNN": _RNN | _BASE[3] | {"cell"},
        "Bidirectional": _BASE[3] | {"layer", "merge_mode", "weights", "backward_layer"}},
    2: {"LSTM": _CELL | _RNN | _BASE[2] | {"time_major", "input_length", "return_runtime", "enable_caching_device"},
        "CuDNNLSTM": _CUDNN | _BASE[2],
        "LSTMCell": _CELL | _BASE[2] | {"enable_caching_device"},
        "RNN": _RNN | _BASE[2] | {"cell", "time_major", "input_length"},
        "Bidirectional": _BASE[2] | {"layer", "merge_mode", "weights", "backward_layer"}},
}
LSTMS = {3: ("LSTM",), 2: ("LSTM", "CuDNNLSTM")}  # the layers a Bidirectional of an LSTM wraps
_BOOLEANS = ("return_sequences", "return_state", "go_backwards", "stateful", "unroll", "zero_output_for_mask",
             "use_bias", "unit_forget_bias", "trainable", "time_major")
_RATES = ("dropout", "recurrent_dropout")
MERGES = ("concat", "sum", "mul", "ave")


def invalid_layer(layer: dict, major: int, what: str | None = None) -> str:
    """Why Keras ``major`` refuses a serialised LSTM, LSTMCell or RNN layer's config, or "" when it does not (what
    lstmgrad reads from it must then be of the types Keras writes: booleans, numbers, a name)."""
    what = what or _named(layer)
    kind, config = layer.get("class_name"), layer.get("config")
    if not isinstance(config, dict):
        return f"{what} has a config that is {_json_kind(config)}, not a JSON object (Keras refuses it)"
    if kind not in ACCEPTED[major]:
        return f"{what} is a {cut(str(kind))}, which Keras {major} does not load"
    unknown = [key for key in config if key not in ACCEPTED[major][kind]]
    if unknown:
        key = unknown[0]
        hint = " (a tf.keras option: Keras 3 took it out)" if key == "time_major" and major == 3 else ""
        return (f"{what} has {cut(key)}={_value(config[key])}, an option Keras {major}'s {kind} does not take{hint}: "
                f"Keras refuses this model")
    invalid = _invalid_common(config, major, what)
    if invalid:
        return invalid
    for key in _RATES:
        value = config.get(key, 0)
        if not isinstance(value, int | float) or abs(value) > 1e300:  # (true is 1: Keras takes it so)
            return f"{what} has {key}={_value(value)}, not a rate (Keras refuses it)"
    units = config.get("units", 1)
    if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
        return f"{what} has units={_value(units)}, not a positive integer (Keras refuses it)"
    if major == 3 and config.get("use_cudnn", "auto") not in ("auto", True, False):
        return f"{what} has use_cudnn={_value(config['use_cudnn'])}, not \"auto\", true or false (Keras refuses it)"
    return ""


def _invalid_common(config: dict, major: int, what: str) -> str:
    """What every layer's config must hold: a name Keras takes, and booleans where Keras writes booleans (Keras
    itself takes any value there by its truth, but a config it writes never has one: lstmgrad does not guess)."""
    name = config.get("name")
    if not isinstance(name, str | None) or (major == 3 and isinstance(name, str) and "/" in name):
        return f"{what} has name={_value(name)}, not a string without '/' (Keras refuses it)"
    for key in _BOOLEANS:
        if key in config and not isinstance(config[key], bool):
            return f"{what} has {key}={_value(config[key])}, not true or false"
    return ""


def invalid_wrapper(layer: dict, major: int) -> str:
    """``invalid_layer`` for a Bidirectional: its own options, then the layers it wraps (forward, backward)."""
    what = _named(layer)
    config = layer.get("config")
    if not isinstance(config, dict):
        return f"{what} has a config that is {_json_kind(config)}, not a JSON object (Keras refuses it)"
    unknown = [key for key in config if key not in ACCEPTED[major]["Bidirectional"]]
    if unknown:
        return (f"{what} has {cut(unknown[0])}={_value(config[unknown[0]])}, an option Keras {major}'s Bidirectional "
                "does not take: Keras refuses this model")
    invalid = _invalid_common(config, major, what)
    if invalid:
        return invalid
    merge = config.get("merge_mode", "concat")
    if merge is not None and merge not in MERGES:  # (None: the two outputs apart, computed as concat)
        return f"{what} has merge_mode={_value(merge)}, which Keras refuses ({', '.join(MERGES)} or null)"
    for key in ("layer", "backward_layer"):
        wrapped = config.get(key)
        if wrapped is None and key == "backward_layer":
            continue
        if not isinstance(wrapped, dict) or not isinstance(wrapped.get("class_name"), str):
            return (f"{what} has a {key} that is {_json_kind(wrapped)}, not a serialised layer (Keras refuses it: a "
                    "Bidirectional wraps a keras.layers.Layer)")
        if wrapped["class_name"] in LSTMS[major]:  # (another layer is refused by name: _walk)
            invalid = invalid_layer(wrapped, major, f"the {key.replace('_', ' ')} of {what}")
            if invalid:
                return invalid
    return ""


def _named(layer: dict) -> str:
    """"LSTM layer 'lstm'" (or "an LSTM layer", without a name), for messages."""
    config = layer.get("config")
    name = config.get("name") if isinstance(config, dict) else None
    kind = cut(str(layer.get("class_name")), 30)
    return f"{kind} layer {cut(repr(name))}" if isinstance(name, str) else f"an unnamed {kind} layer"


def _json_kind(value) -> str:
    """What a JSON value is, in words: 'the list [1, 2]', 'the string "GRU"', 'null'."""
    if value is None:
        return "null"
    kinds = {bool: "the boolean", int: "the number", float: "the number", str: "the string", list: "the list",
             dict: "the object"}
    return f"{kinds.get(type(value), 'the value')} {_value(value)}"


def _value(value) -> str:
    """A JSON value as JSON, cut to a few dozen characters (with the cut said)."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = repr(value)
    return cut(text, 40)


def _rnn(group: str, path: tuple, layer: dict, inner: dict, major: int) -> Found:
    """``keras.layers.RNN(cell)``: over one LSTMCell it is an LSTM layer (the cell's activations, the RNN's
    go_backwards, return_sequences, ...); over StackedRNNCells or another cell it is refused by name."""
    invalid = invalid_layer(layer, major)
    cell = inner.get("cell") if isinstance(inner.get("cell"), dict) else {}
    cell_kind = cell.get("class_name", "a cell")
    if cell_kind == "LSTMCell":
        invalid = invalid or invalid_layer(cell, major, "the cell of " + _named(layer))
        cell_config = cell.get("config", {}) if isinstance(cell.get("config"), dict) else {}
        merged = {**cell_config, **{k: v for k, v in inner.items() if k != "cell"}}
        return Found(group, path, {"class_name": "LSTM", "config": merged}, None, False, invalid=invalid)
    if cell_kind == "StackedRNNCells":
        return Found(group, path, layer, None, False, f"{cut(group)} is a {STACKED}")
    return Found(group, path, layer, None, False, invalid or f"{cut(group)} is a keras.layers.RNN over "
                                                            f"{cut(str(cell_kind))}, not an LSTM: lstmgrad computes "
                                                            "LSTM layers")


def lstm_groups(model_config: dict, major: int = 3) -> list[str]:
    """Every LSTM layer's (and Bidirectional's) group a configuration describes (Keras 3 names)."""
    return [found.group for found in _walk(model_config, major) if not found.refused and not found.invalid]


def other_recurrent(model_config: dict, major: int = 3) -> list[str]:
    """Why each recurrent layer of a configuration that lstmgrad does not compute is refused: not an LSTM's maths,
    or a configuration Keras itself refuses."""
    return [found.invalid or found.refused for found in _walk(model_config, major) if found.refused or found.invalid]


def layer_options(model_config: dict, group: str, *, keras_version: str = "", source: str = "",
                  inference: bool = False) -> KerasLayer:
    """The options of the layer whose weights are at ``group`` (Keras 3 or legacy full-model layout)."""
    from ..io.keras_archive import keras_major  # noqa: PLC0415 - (a version number's reading, kept with io)

    wanted = group.strip("/")
    parts = wanted.split("/")
    legacy = parts[0] == "model_weights"
    major = keras_major(keras_version)
    for found in _walk(model_config, major):
        if (found.legacy_match(parts[1:]) if legacy else wanted == found.group):
            if found.invalid:
                raise InvalidConfigError(found.invalid)
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
    found = [cut(g, TYPED) for g in lstm_groups(model_config, major)]
    groups = ", ".join(found[:20]) + (f" and {len(found) - 20} more" if len(found) > 20 else "") or "none"
    refused = other_recurrent(model_config, major)
    if groups == "none" and refused:
        raise InvalidArgumentError(f"the model has no LSTM layer lstmgrad computes: {'; '.join(refused[:5])}"
                                   + (f"; and {len(refused) - 5} more" if len(refused) > 5 else ""))
    if not wanted:
        raise InvalidArgumentError(Message.format("the model has several layers: name one with {} (its LSTM layers' "
                                                  "groups: {})", Param("weights_group"), groups))
    raise InvalidArgumentError(f"the model configuration has no LSTM layer at {cut(repr(group))} (its LSTM layers' "
                               f"groups: {groups})")


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
