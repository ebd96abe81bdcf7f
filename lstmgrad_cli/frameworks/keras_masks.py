"""What a Keras model's configuration says reaches one of its LSTM layers besides x: a mask, and initial states.

Keras hands a layer the mask of its input.  An ``Embedding(mask_zero=True)`` makes one (the steps whose token id
is not 0), a ``Masking(mask_value)`` layer another (the steps whose features are not all mask_value), a call may
pass one (``lstm(x, mask=m)``); layers that support masking hand their input's on (Dense, Dropout, normalisations,
activations, TimeDistributed, attention, a recurrent layer returning sequences, a nested model), merges combine
theirs, and the other built-in layers drop it (Conv1D, Reshape, Flatten, pooling, a Lambda, ...).  ``reaching``
follows a layer's input back through the configuration, into and out of models nested in models, by those rules
(Keras 3's, which tf.keras 2's agree with for the layers they share), and says where its mask comes from; a Keras 3
functional model also records the mask each call got (its node's ``mask`` argument), which counts too.  A layer
whose rules are not known here (a custom layer) with a mask before it may hand it on: its mask is "unknown".

Only what the configuration says is read; every walk is bounded (``MAX_STEPS``, ``MAX_DEPTH``), so a hostile
configuration (cycles, thousands of layers) costs little and ends with "unknown", never a wrong "no mask".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

CONTAINERS = ("Functional", "Sequential", "Model")
# Layers whose output carries the mask of their (first) input: Keras 3's layers that support masking without a
# compute_mask of their own (verified with Keras 3.13: an LSTM after each is handed the mask).
KEEP = frozenset({
    "Dense", "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "AlphaDropout",
    "GaussianDropout", "GaussianNoise", "ActivityRegularization", "Activation", "ReLU", "LeakyReLU", "PReLU", "ELU",
    "Softmax", "LayerNormalization", "GroupNormalization", "BatchNormalization", "UnitNormalization", "Rescaling",
    "Normalization", "Identity", "TimeDistributed", "MultiHeadAttention", "GroupedQueryAttention", "Attention",
    "AdditiveAttention",
})
RECURRENT = frozenset({"LSTM", "GRU", "SimpleRNN", "RNN", "Bidirectional", "CuDNNLSTM", "CuDNNGRU", "ConvLSTM1D",
                       "ConvLSTM2D", "ConvLSTM3D"})  # the mask goes on with return_sequences, not to their states
ANY_MERGE = frozenset({"Concatenate"})  # a mask where any input has one
ALL_MERGE = frozenset({"Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum"})  # where every input has one
# Built-in layers that drop a mask, for configurations that do not say which module a layer is from (older files)
DROP = frozenset({
    "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "SeparableConv1D", "DepthwiseConv1D",
    "Flatten", "Reshape", "Permute", "RepeatVector", "Cropping1D", "ZeroPadding1D", "UpSampling1D", "MaxPooling1D",
    "AveragePooling1D", "GlobalAveragePooling1D", "GlobalMaxPooling1D", "Dot", "Lambda", "EinsumDense",
})
MAX_STEPS = 20_000  # layers looked at for one LSTM layer, at most
MAX_DEPTH = 150  # layers followed back in one chain (and models nested), at most


@dataclass(frozen=True)
class MaskSource:
    """Where a mask reaching a layer comes from."""

    kind: str  # "embedding" | "masking" | "input" (a model input passed as the mask) | "argument" (another tensor
    #            passed as the mask) | "unknown"
    layer: str  # the layer (or model input) that makes it, or that lstmgrad cannot follow
    mask_value: float | None = None  # a Masking layer's (None: not a number)
    direct: bool = False  # a Masking layer whose output is the LSTM's x itself

    @property
    def words(self) -> str:
        if self.kind == "embedding":
            return f"{self.layer}, mask_zero=True"
        if self.kind == "masking":
            value = "not a number" if self.mask_value is None else f"{self.mask_value:g}"
            return f"{self.layer}, Masking(mask_value={value})"
        if self.kind == "input":
            return f"a mask the model takes as its input {self.layer!r}"
        if self.kind == "argument":
            return f"a mask {self.layer!r} computes, passed to the call"
        return f"{self.layer}, a layer lstmgrad does not know, after a mask"


@dataclass(frozen=True)
class Reaching:
    """What reaches an LSTM layer (or Bidirectional) of a model besides x."""

    mask: tuple[MaskSource, ...] = ()
    states: tuple[str, ...] = ()  # where its initial_state comes from (the layers making them), when it is given one

    @property
    def masked(self) -> bool:
        return bool(self.mask)

    @property
    def mask_words(self) -> str:
        return "; ".join(dict.fromkeys(source.words for source in self.mask))

    def computable_from_x(self) -> MaskSource | None:
        """The Masking layer whose output is x itself, when it alone makes the mask (computable from x)."""
        if len(self.mask) == 1 and self.mask[0].kind == "masking" and self.mask[0].direct:
            return self.mask[0] if self.mask[0].mask_value is not None else None
        return None


def reaching(model_config: dict, names: tuple[str, ...]) -> Reaching:
    """What reaches the layer at ``names`` (its own name and the nested models' above it, from the top model's
    layers down) of a model's configuration: the sources of its mask and of its initial states."""
    walk = _Walk()
    try:
        found = walk.layer_reaching(_Scope(model_config, ()), tuple(names), 0)
    except _GaveUp as stop:
        return Reaching((MaskSource("unknown", stop.where),), ())
    return found


class _GaveUp(Exception):
    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


@dataclass
class _Scope:
    """A model of the configuration as one call of it sees it: its serialised config and the masks of its inputs."""

    config: dict
    input_masks: tuple  # per input: a tuple of MaskSource
    layers: dict = field(default_factory=dict)  # name -> serialised layer
    order: list = field(default_factory=list)  # a Sequential's layers, InputLayer left out

    def __post_init__(self):
        inner = self.config.get("config") if isinstance(self.config, dict) else None
        listed = inner.get("layers") if isinstance(inner, dict) else None
        for layer in listed if isinstance(listed, list) else []:
            if isinstance(layer, dict):
                self.layers.setdefault(_name(layer), layer)
                if _kind(layer) != "InputLayer":
                    self.order.append(layer)

    @property
    def sequential(self) -> bool:
        return self.config.get("class_name") == "Sequential"

    def input_index(self, name: str) -> int:
        inner = self.config.get("config", {})
        refs = inner.get("input_layers") if isinstance(inner, dict) else None
        refs = [refs] if isinstance(refs, list) and refs and isinstance(refs[0], str) else refs
        for k, ref in enumerate(refs if isinstance(refs, list) else []):
            if isinstance(ref, list) and ref and ref[0] == name:
                return k
        return 0

    def outputs(self) -> list:
        inner = self.config.get("config", {})
        refs = inner.get("output_layers") if isinstance(inner, dict) else None
        refs = [refs] if isinstance(refs, list) and refs and isinstance(refs[0], str) else refs
        return [tuple(r[:3]) for r in (refs if isinstance(refs, list) else []) if isinstance(r, list) and len(r) >= 3]


def _kind(layer: dict) -> str:
    return str(layer.get("class_name", ""))


def _name(layer: dict) -> str:
    inner = layer.get("config") if isinstance(layer.get("config"), dict) else {}
    return str(layer.get("name", inner.get("name", "")))


def _config(layer: dict) -> dict:
    return layer.get("config") if isinstance(layer.get("config"), dict) else {}


def _ref(value) -> tuple | None:
    """(layer, node index, tensor index) of a serialised tensor: Keras 3's ``__keras_tensor__`` or tf.keras 2's
    [layer, node, tensor, kwargs]."""
    if isinstance(value, dict) and value.get("class_name") == "__keras_tensor__":
        history = value.get("config", {}).get("keras_history") if isinstance(value.get("config"), dict) else None
        value = history
    if isinstance(value, list) and len(value) >= 3 and isinstance(value[0], str):
        node, index = value[1], value[2]
        if isinstance(node, int) and isinstance(index, int) and not isinstance(node, bool):
            return value[0], node, index
    return None


def _refs(value) -> list:
    """Every tensor a serialised argument holds (a tensor, or a list of them)."""
    found = _ref(value)
    if found is not None:
        return [found]
    if isinstance(value, (list, tuple)):
        return [r for item in value[:64] for r in _refs(item)]
    return []


@dataclass
class _Call:
    """One call of a layer, as its inbound node records it."""

    inputs: list  # the first argument's tensors
    mask: list | None  # the tensors of a mask passed to it (None: none recorded)
    states: list  # the initial_state tensors


def _calls(layer: dict) -> list[_Call]:
    nodes = layer.get("inbound_nodes")
    calls = []
    for node in nodes[:64] if isinstance(nodes, list) else []:
        if isinstance(node, dict):  # Keras 3: {"args": [...], "kwargs": {...}}
            args = node.get("args") if isinstance(node.get("args"), list) else []
            kwargs = node.get("kwargs") if isinstance(node.get("kwargs"), dict) else {}
            first = _refs(args[0]) if args else []
            mask = _refs(kwargs["mask"]) if kwargs.get("mask") is not None else None
            states = _refs(kwargs.get("initial_state")) + [r for a in args[1:] for r in _refs(a)]
            calls.append(_Call(first, mask or None, states))
        elif isinstance(node, list):  # tf.keras 2: [[layer, node, tensor, kwargs], ...]: x, then any states
            entries = [e for e in node if _ref(e) is not None]
            kwargs = next((e[3] for e in entries if len(e) > 3 and isinstance(e[3], dict)), {})
            mask = _refs(kwargs.get("mask")) if kwargs.get("mask") is not None else None
            states = _refs(kwargs.get("initial_state")) + [_ref(e) for e in entries[1:]]
            calls.append(_Call([_ref(e) for e in entries[:1]], mask or None, states))
    return calls


def _undirect(masks: tuple) -> tuple:
    return tuple(replace(m, direct=False) if m.direct else m for m in masks)


def _union(*groups) -> tuple:
    return tuple(dict.fromkeys(m for g in groups for m in g))


class _Walk:
    def __init__(self):
        self.steps = 0
        self.known: dict = {}  # (scope, layer, call, output) -> its mask; None while it is being found (a cycle)

    def _step(self, where: str, depth: int) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS or depth > MAX_DEPTH:
            raise _GaveUp(where)

    def layer_reaching(self, scope: _Scope, names: tuple, depth: int) -> Reaching:
        """What reaches the layer ``names[-1]``, inside the models ``names[:-1]`` of ``scope``."""
        self._step(names[0] if names else "", depth)
        if not names:
            return Reaching()
        target = scope.layers.get(names[0])
        if target is None:
            return Reaching()
        results = []
        for masks, states, call in self._inputs_of(scope, target, depth):
            if len(names) == 1:
                results.append(Reaching(masks, states))
                continue
            inner = _Scope(target, tuple(call))
            results.append(self.layer_reaching(inner, names[1:], depth + 1))
        return Reaching(_union(*(r.mask for r in results)), tuple(dict.fromkeys(s for r in results for s in r.states)))

    def _inputs_of(self, scope: _Scope, layer: dict, depth: int):
        """For each call of ``layer`` in ``scope``: the masks reaching it, where its initial states come from, and
        the masks of each of its inputs (what a nested model's inputs get)."""
        if scope.sequential:
            position = next((k for k, other in enumerate(scope.order) if other is layer), None)
            if position is None:
                return
            if position == 0:
                masks = scope.input_masks[0] if scope.input_masks else ()
            else:
                masks = self.output_mask(scope, _name(scope.order[position - 1]), 0, 0, depth + 1)
            yield masks, (), [masks]
            return
        for call in _calls(layer):
            each = [self.output_mask(scope, *ref, depth + 1) for ref in call.inputs]
            masks = each[0] if each else ()
            if call.mask is not None:  # a mask this call was given (Keras 3 records the one Keras itself passed)
                masks = self._given_mask(scope, call, masks, depth)
                each = [masks, *each[1:]] if each else [masks]
            states = tuple(dict.fromkeys(ref[0] for ref in call.states))
            yield masks, states, each

    def _given_mask(self, scope: _Scope, call: _Call, propagated: tuple, depth: int) -> tuple:
        """The mask a call records: Keras' own (what the input's propagates: ``propagated``), one computed as a
        Masking layer computes it, or another tensor (a model input, or one the model computes)."""
        ref = call.mask[0]
        source = scope.layers.get(ref[0])
        if source is not None and _kind(source) == "InputLayer":
            outer = self.output_mask(scope, *ref, depth + 1)  # (in a nested model: whatever feeds that input)
            return _union(tuple(m for m in outer if m.kind in ("input", "argument")), (MaskSource("input", ref[0]),))
        direct = [m for m in propagated if m.direct]
        if direct and not self._masking_ops(scope, ref, call):
            propagated = _undirect(propagated)
        return propagated or (MaskSource("argument", ref[0]),)

    def _masking_ops(self, scope: _Scope, ref: tuple, call: _Call) -> bool:
        """Whether a recorded mask is any(not_equal(masking_input, mask_value)), as Keras 3 records a Masking layer's
        mask, for the Masking layer whose output is the call's x."""
        producer = scope.layers.get(call.inputs[0][0]) if call.inputs else None
        any_op = scope.layers.get(ref[0])
        if producer is None or any_op is None or _kind(any_op) != "Any" or _kind(producer) != "Masking":
            return False
        any_calls, masking_calls = _calls(any_op), _calls(producer)
        if not any_calls or not any_calls[0].inputs or not masking_calls or not masking_calls[0].inputs:
            return False
        not_equal = scope.layers.get(any_calls[0].inputs[0][0])
        if not_equal is None or _kind(not_equal) != "NotEqual":
            return False
        compared = _calls(not_equal)
        return bool(compared and compared[0].inputs and compared[0].inputs[0] == masking_calls[0].inputs[0])

    def output_mask(self, scope: _Scope, name: str, node: int, index: int, depth: int) -> tuple:
        """The mask Keras attaches to output ``index`` of call ``node`` of layer ``name`` in ``scope`` (each found
        once; a layer fed by its own output, which no model Keras builds has, gives up)."""
        key = (id(scope), name, node, index)
        if key in self.known:
            if self.known[key] is None:
                raise _GaveUp(name)
            return self.known[key]
        self.known[key] = None
        self.known[key] = found = self._find(scope, name, node, index, depth)
        return found

    def _find(self, scope: _Scope, name: str, node: int, index: int, depth: int) -> tuple:
        self._step(name, depth)
        layer = scope.layers.get(name)
        if layer is None:
            return ()
        kind, cfg = _kind(layer), _config(layer)
        if kind == "InputLayer":
            k = scope.input_index(name)
            return scope.input_masks[k] if k < len(scope.input_masks) else ()
        if kind == "Embedding":
            return (MaskSource("embedding", name),) if cfg.get("mask_zero") is True else ()
        if kind == "Masking":
            value = cfg.get("mask_value", 0.0)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            return (MaskSource("masking", name, float(value) if number else None, direct=True),)
        if kind in RECURRENT and not (index == 0 and cfg.get("return_sequences") is True):
            return ()  # (a last output, or a state: no mask, whatever reaches the layer)
        known = (*CONTAINERS, *KEEP, *RECURRENT, *ANY_MERGE, *ALL_MERGE)
        if kind not in known and _built_in(layer) and not (kind == "Lambda" and cfg.get("mask") is not None):
            return ()  # a Keras layer that drops it (nothing before it is looked at)
        calls = list(self._inputs_of(scope, layer, depth))
        if not calls:
            return ()
        masks, _states, each = calls[min(node, len(calls) - 1)]
        if kind in CONTAINERS:
            inner = _Scope(layer, tuple(each))
            if inner.sequential:
                return self.output_mask(inner, _name(inner.order[-1]), 0, 0, depth + 1) if inner.order else masks
            outputs = inner.outputs()
            if index >= len(outputs):
                return ()
            return self.output_mask(inner, *outputs[index], depth + 1)
        if kind in RECURRENT or kind in KEEP:
            return _undirect(masks)
        if kind in ANY_MERGE:
            return _undirect(_union(*each))
        if kind in ALL_MERGE:
            return _undirect(_union(*each)) if each and all(each) else ()
        return (MaskSource("unknown", name),) if any(each) else ()


def _built_in(layer: dict) -> bool:
    """A Keras layer (whose masking rules are Keras'), not a custom one."""
    if layer.get("registered_name") not in (None, ""):
        return False
    module = layer.get("module")
    if isinstance(module, str):
        return module.startswith(("keras.", "tf_keras.")) or module == "keras"
    return _kind(layer) in DROP
