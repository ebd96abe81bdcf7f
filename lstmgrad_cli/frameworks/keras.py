"""Keras ``LSTM`` layers and ``Bidirectional`` wrappers as their users hold them.

A layer has ``kernel`` [I, 4C], ``recurrent_kernel`` [C, 4C] and, with use_bias, ``bias`` [4C], gates i, f, c, o
(IFCO).  Its input ``x`` is [B, T, I] (``time_major``: [T, B, I]), its output gradient ``h_grad`` [B, T, C] with
return_sequences, else [B, C]; ``h0``/``c0`` and ``hn_grad``/``cn_grad`` [B, C]; a ``mask`` [B, T] (an
``Embedding(mask_zero=True)`` or ``Masking`` layer upstream): the layer runs the steps the mask keeps and carries
its state, and its output, over the others (zeros there instead with ``zero_output_for_mask``).
``go_backwards``: the layer runs x from its last step and returns its outputs in that order; ``reverse``: it is a
``Bidirectional``'s backward layer, whose outputs the wrapper puts back into x's order.

A whole ``Bidirectional`` holds ``forward_kernel``, ..., ``backward_bias`` (a weights file's ``forward_layer`` and
``backward_layer`` groups); its output merges the two directions' (``merge_mode``: concat [B, T, 2C], sum, mul, ave);
``h0``, ``c0``, ``hn_grad``, ``cn_grad`` are [2, B, C] (forward, backward).

What a layer was made with (activations, use_bias, go_backwards, ...) is read from a model's configuration when
the weights come from a ``.keras`` archive or a full-model HDF5 file (``KerasLayer.from_config``); otherwise
Keras' defaults are assumed, and the summary says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import InvalidArgumentError
from ..layers import activations
from ..layers.modules import MERGE_MODES, Module
from ..layers.recurrence import DirectionGrads, DirectionWeights
from ..layers.schedule import Schedule
from ..messages import Message, Param, cut
from .common import (
    FrameworkOptions,
    Plan,
    as_bool_mask,
    cells,
    check_applicable,
    dtyped,
    nonempty,
    rank,
    shaped,
    states,
)
from .keras_masks import MaskSource, Reaching
from .names import KERAS_ALIASES as ALIASES
from .names import KERAS_PARAMETERS as PARAMETERS  # noqa: F401 - (keras.PARAMETERS, for unused.py)
from .names import KERAS_STATE_NAMES as STATE_NAMES
from .names import KERAS_WRAPPED as WRAPPED
from .names import keras_direction_of as direction_of


def tensors_of(held: dict) -> dict:
    """The Keras names of what a file holds under its own spelling (a weights file's cell/vars/0, ...); a whole
    Bidirectional's as forward_kernel, ..., backward_bias."""
    out = {n: held[n] for n in STATE_NAMES if n in held}
    for name, aliases in ALIASES.items():
        found = _one(held, [a for a in aliases if a in held], name)
        if found is not None:
            out[name] = found
        for direction in WRAPPED:
            key = f"{direction}_{name}"
            spellings = [key] if key in held else []  # and under the layer's group, whatever it is called
            spellings += [k for k in held if "/" in k and direction_of(k.split("/", 1)[0]) == direction
                          and k.split("/", 1)[1] in aliases]
            found = _one(held, spellings, key)
            if found is not None:
                out[key] = found
    return out


def _one(held: dict, spellings: list[str], name: str):
    """The one tensor spelt any of ``spellings`` (None without one); two spellings of one tensor are refused."""
    if len(spellings) > 1:
        raise InvalidArgumentError(f"both {cut(spellings[0])} and {cut(spellings[1])} are the layer's {name}: keep "
                                   "one")
    return held[spellings[0]] if spellings else None


@dataclass(frozen=True)
class KerasLayer:
    """What a Keras LSTM layer (or a Bidirectional of them) was made with, and where that was found."""

    activation: str = "tanh"  # activations.ACTIVATIONS keys
    recurrent_activation: str = "sigmoid"
    use_bias: bool | None = None  # None: whether a bias is there
    go_backwards: bool = False
    reverse: bool = False  # a Bidirectional's backward layer
    zero_output_for_mask: bool | None = None  # None: Keras' default, True inside a Bidirectional returning sequences
    wrapped: bool = False  # one of a Bidirectional's two layers
    unroll: bool = False
    return_sequences: bool | None = None  # None: from h_grad's rank
    merge_mode: str | None = None  # a whole Bidirectional's ("None": merge_mode=None, a list of the two outputs)
    source: str = ""  # "": Keras' defaults, assumed; else where they were read ("m.keras config.json")
    notes: tuple[str, ...] = field(default=())
    stateful: bool = False  # its initial states are the previous batch's final ones
    time_major: bool = False  # tf.keras' time_major=True: x is [T, B, I]
    policy: str = ""  # its dtype policy ("mixed_float16", ...; "": none recorded, the tensors' own dtype)
    return_state: bool = False
    reaching: Reaching | None = None  # the mask and initial states the model hands it (None: no model recorded)

    @classmethod
    def from_config(cls, config: dict, *, keras_major: int = 3, source: str = "",
                    wrapper: dict | None = None, backward: bool = False, inference: bool = False) -> KerasLayer:
        """The options of an LSTM layer's config (``config["config"]`` of a serialised layer, or the dict itself),
        inside a Bidirectional's config ``wrapper`` (its backward layer: ``backward``).  Options whose maths is not
        implemented are refused by name."""
        cfg = config.get("config", config) if isinstance(config, dict) else {}
        name = cut(repr(cfg.get("name", "the layer")))
        kind = config.get("class_name", "LSTM") if isinstance(config, dict) else "LSTM"
        if kind not in ("LSTM", "CuDNNLSTM"):
            raise InvalidArgumentError(f"layer {name} is a {cut(str(kind))}, not an LSTM: lstmgrad computes LSTM "
                                       "layers")
        notes = []
        for option in ("dropout", "recurrent_dropout"):
            rate = float(cfg.get(option) or 0)
            if rate > 0 and not inference:
                raise InvalidArgumentError(Message.format(
                    "layer {} has {}={}: in training its random masks change the gradient, and lstmgrad cannot know "
                    "them; if the gradient was taken in inference (training=False, where dropout does nothing), say "
                    "so with {}", name, option, f"{rate:g}", Param("inference", True)))
            if rate > 0:
                notes.append(Message.format("{}={} taken as inactive ({})", option, f"{rate:g}",
                                            Param("inference", True)))
        act = activations.resolve(cfg.get("activation", "tanh"), keras_major)
        gate = activations.resolve(cfg.get("recurrent_activation", "sigmoid"), keras_major)
        merge = None
        go_backwards = bool(cfg.get("go_backwards", False))
        if wrapper is not None:
            wcfg = wrapper.get("config", wrapper)
            merge = wcfg.get("merge_mode", "concat")
            merge = "None" if merge is None else merge  # (a list of the two outputs: their gradients concatenated)
            wrapped = wcfg.get("layer", {})
            wrapped = wrapped.get("config", wrapped) if isinstance(wrapped, dict) else {}
            if wrapped.get("go_backwards"):  # its backward layer then runs forwards, and Keras flips its outputs
                raise InvalidArgumentError(f"the Bidirectional {cut(repr(wcfg.get('name', '')))} wraps a layer made "
                                           "with go_backwards=True (its backward layer runs forwards in time): "
                                           "lstmgrad computes Bidirectionals whose forward layer runs forwards")
            go_backwards = False  # the wrapper runs its backward layer backwards: that is ``reverse``
        zero_output = cfg.get("zero_output_for_mask")
        policy = policy_name((wrapper.get("config", wrapper) if wrapper is not None else cfg).get("dtype"))
        if "bfloat16" in policy:
            raise InvalidArgumentError(f"layer {name} computes in bfloat16 (its dtype policy is {cut(policy)}), a "
                                       "dtype numpy has not: lstmgrad does not compute it")
        if policy not in POLICIES:
            raise InvalidArgumentError(f"layer {name} has the dtype policy {cut(repr(policy))}, which lstmgrad does "
                                       f"not compute (it computes {', '.join(p for p in POLICIES if p[:1].isalpha())})")
        return cls(act, gate, cfg.get("use_bias"), go_backwards, backward,
                   None if zero_output is None else bool(zero_output), wrapper is not None,
                   bool(cfg.get("unroll", False)), cfg.get("return_sequences"), merge, source, tuple(notes),
                   bool(cfg.get("stateful", False)), bool(cfg.get("time_major", False)), policy,
                   bool(cfg.get("return_state", False)))

    def needs(self, input_size: int, units: int, bidirectional: bool = False) -> list[str]:
        """What the gradient of this layer is computed from, in words: each tensor to give, its shape and why."""
        I, C = input_size, units  # noqa: E741
        x = f"x [T, B, {I}]" if self.time_major else f"x [B, T, {I}]"
        merge = self.merge_mode or "concat"
        width = f"{2 * C}" if bidirectional and merge in ("concat", "None") else f"{C}"
        sequence = f"[T, B, {width}]" if self.time_major else f"[B, T, {width}]"
        if self.return_sequences is True:
            h_grad = f"h_grad {sequence}"
        elif self.return_sequences is False:
            h_grad = f"h_grad [B, {width}] (the last output's)"
        else:
            h_grad = f"h_grad {sequence} or [B, {width}] (the last output's)"
        if bidirectional and merge == "None":
            h_grad += " (merge_mode=None: the two outputs' gradients concatenated on the last axis)"
        out = [x, h_grad]
        states = f"[2, B, {C}]" if bidirectional else f"[B, {C}]"
        if self.reaching is not None and self.reaching.masked:
            masking = self.reaching.computable_from_x()
            out.append(f"mask [B, T] (the model masks its input: {self.reaching.mask_words}"
                       + ("; computed from x when not given)" if masking is not None else ")"))
        if self.reaching is not None and self.reaching.states:
            out.append(f"h0, c0 {states} (the model calls it with initial_state: "
                       f"{', '.join(repr(s) for s in self.reaching.states)})")
        elif self.stateful:
            out.append(f"h0, c0 {states} (stateful=True: the states the previous batch left)")
        if self.return_state:
            out.append(f"hn_grad, cn_grad {states} where its final states are used (return_state=True)")
        if self.policy == MIXED_FLOAT16:
            out.append("computed in float16 (dtype policy mixed_float16)")
        return out

    def assumed(self, bidirectional: bool = False) -> str | None:
        """Words for the summary: what was assumed (no configuration) or read."""
        notes = Message(*(Message("; ", n) for n in self.notes))
        if self.source:
            acts = f"activation={self.activation}, recurrent_activation={self.recurrent_activation}"
            return Message(f"layer options from {self.source}: {acts}", notes)
        merge = f", merge_mode={self.merge_mode or 'concat'}" if bidirectional else ""
        return Message.format("no model configuration (a bare weights file): Keras' defaults assumed, activation=tanh, "
                              "recurrent_activation=sigmoid{}, no mask unless given (a .keras archive or full-model "
                              ".h5 as {} says what the layer was made with){}", merge, Param("weights"), notes)


MIXED_FLOAT16 = "mixed_float16"  # float32 variables, computed in float16: what lstmgrad computes as Keras does
# (tf.keras 2's "_infer": the tensors' own dtype) the others (bfloat16, quantised) are refused
POLICIES = ("", "_infer", "float16", "float32", "float64", MIXED_FLOAT16)


def policy_name(dtype) -> str:
    """A layer config's ``dtype``: a policy's name (Keras 3's DTypePolicy, tf.keras' Policy) or a dtype's."""
    if isinstance(dtype, dict):
        inner = dtype.get("config")
        dtype = inner.get("name") if isinstance(inner, dict) else None
    return dtype if isinstance(dtype, str) and len(dtype) < 64 else ""


class KerasPlan(Plan):
    bidirectional: bool = False

    def weight_grads(self, k, d, grads: DirectionGrads, xp=np) -> dict:
        I = grads.w_grad.shape[0] - self.module.layers[k][d].C  # noqa: E741
        prefix = ("forward_", "backward_")[d] if self.bidirectional else ""
        out = {f"{prefix}kernel_grad": grads.w_grad[:I], f"{prefix}recurrent_kernel_grad": grads.w_grad[I:]}
        if f"{prefix}bias" in self.tensors:  # (a Bidirectional's two layers may differ)
            out[f"{prefix}bias_grad"] = grads.b_grad
        return out


def plan(tensors: dict, options: FrameworkOptions, layer: KerasLayer | None = None) -> KerasPlan:
    """Check a Keras user's tensors and build what computes their gradients."""
    check_applicable("keras", options)
    layer = layer or KerasLayer()
    if options.reverse and not layer.reverse:
        if layer.wrapped or layer.source:  # what the weights' group or the model's configuration says it is
            what = "a Bidirectional's forward layer" if layer.wrapped else "not a Bidirectional's layer"
            raise InvalidArgumentError(Message.format(
                "{} says the layer is a Bidirectional's backward layer, and it is {}{}: leave it out, or name the "
                "backward layer's group", Param("reverse"), what, f" ({layer.source})" if layer.source else ""))
        layer = replace(layer, reverse=True)
    if layer.reverse:  # a Bidirectional's backward layer: what the wrapper sets holds for it
        layer = replace(layer, wrapped=True)
    if options.go_backwards:
        layer = replace(layer, go_backwards=True)
    bidirectional = "forward_kernel" in tensors or "backward_kernel" in tensors
    prefixes = ("forward_", "backward_") if bidirectional else ("",)
    needed = ["x", *(f"{p}{n}" for p in prefixes for n in ("kernel", "recurrent_kernel"))]
    missing = [n for n in needed if tensors.get(n) is None]
    if missing:
        what = "a Keras Bidirectional needs x, forward_/backward_ kernel, recurrent_kernel" if bidirectional else (
            "a Keras LSTM needs x, kernel, recurrent_kernel, h_grad; bias, h0, c0, hn_grad, cn_grad, mask are "
            "optional")
        raise InvalidArgumentError(f"missing tensor{'s' * (len(missing) > 1)} {', '.join(missing)} ({what})")
    if bidirectional and (options.reverse or options.go_backwards):
        raise InvalidArgumentError(Message.format("{} and {} are for one layer; these are a whole Bidirectional's "
                                                  "weights (both directions), computed together", Param("reverse"),
                                                  Param("go_backwards")))
    notes, warnings = [], []
    arrays, result_dtypes = _policy_arrays(tensors, layer, notes)
    batch_major = not (options.time_major or layer.time_major)
    x = rank("x", arrays["x"], 3, "[B, T, I]" if batch_major else "[T, B, I]")
    x = np.swapaxes(x, 0, 1) if batch_major else x
    T, B, I = x.shape  # noqa: E741
    nonempty(x.shape, "Keras")
    directions = [_direction(arrays, p, I, layer, x.dtype) for p in prefixes]
    C = directions[0].C
    if bidirectional and directions[1].C != C:
        raise InvalidArgumentError(f"the Bidirectional's two layers differ in size ({C} and {directions[1].C} units)")
    mask = None if arrays.get("mask") is None else as_bool_mask(arrays["mask"], B, T)
    if layer.reaching is not None:
        mask = _recorded(layer.reaching, mask, np.asarray(tensors["x"]), batch_major, arrays, notes, warnings)
    if mask is not None and mask.all():
        mask = None  # (every step used: the plain schedule, the same maths)
    sequence = layer.return_sequences if layer.return_sequences is not None else (
        arrays.get("h_grad") is not None and np.ndim(arrays["h_grad"]) == 3)
    if layer.zero_output_for_mask is None:  # a Bidirectional sets it to return_sequences on both its layers
        layer = replace(layer, zero_output_for_mask=sequence and (bidirectional or layer.wrapped))
    if mask is not None and layer.unroll and layer.zero_output_for_mask and (layer.reverse or layer.go_backwards
                                                                             or bidirectional):
        raise InvalidArgumentError("the layer was made with unroll=True, and masked it runs backwards with "
                                   "zero_output_for_mask: Keras' unrolled loop then zeroes outputs by the mask not "
                                   "reversed (unlike its loop without unroll), which lstmgrad does not reproduce")
    if bidirectional:
        schedules = [_schedule(T, B, mask, False, False, layer), _schedule(T, B, mask, True, True, layer)]
    else:
        schedules = [_schedule(T, B, mask, layer.go_backwards or layer.reverse, layer.reverse, layer)]
    merge = layer.merge_mode or "concat"
    if merge == "None":
        merge = "concat"
        notes.append("merge_mode=None: the wrapper returns its two outputs, and h_grad is their gradients "
                     "concatenated on the last axis (forward first)")
    if merge not in MERGE_MODES:
        raise InvalidArgumentError(f"a Bidirectional with merge_mode={merge!r} is not implemented (lstmgrad computes "
                                   f"{', '.join(MERGE_MODES)})")
    width = 2 * C if bidirectional and merge == "concat" else C
    count = len(directions)
    h_grad, last_grad = _output_grad(arrays.get("h_grad"), T, B, width, batch_major, layer, bidirectional, merge)
    hn_grad = states("hn_grad", arrays.get("hn_grad"), count, B, C, None, "forward, backward")
    cn_grad = states("cn_grad", arrays.get("cn_grad"), count, B, C, None, "forward, backward")
    if h_grad is None and last_grad is None and hn_grad is None and cn_grad is None:
        raise InvalidArgumentError("missing tensor h_grad: the gradient arriving at the layer's output (or hn_grad, "
                                   "cn_grad: those at its final states, where the output is unused)")
    if mask is not None and not layer.source and h_grad is not None:
        notes += _zero_output_assumed(layer, mask, h_grad)
    if layer.stateful and (arrays.get("h0") is None or arrays.get("c0") is None):
        warnings.append("the layer was made with stateful=True: its initial states are the previous batch's final "
                        "ones, and without h0 and c0 they are taken as zeros (right for a first batch only); give them "
                        "as h0, c0")
    result = KerasPlan(
        "keras", Module([directions], schedules, merge), np.ascontiguousarray(x),
        states("h0", arrays.get("h0"), count, B, C, x.dtype, "forward, backward"),
        states("c0", arrays.get("c0"), count, B, C, x.dtype, "forward, backward"),
        h_grad, last_grad, hn_grad, cn_grad, batch_major, (count, B, C) if count > 1 else (B, C), arrays,
        notes=[n for n in (layer.assumed(bidirectional),) if n] + notes, warnings=warnings,
        description=_description(layer, bidirectional, merge, mask is not None or arrays.get("mask") is not None))
    result.bidirectional = bidirectional
    result.result_dtypes = result_dtypes
    return result


def _policy_arrays(tensors: dict, layer: KerasLayer, notes: list) -> tuple[dict, dict]:
    """The tensors as the layer computes with them, and the dtype each gradient is returned in where it is not
    theirs.  Under mixed_float16 Keras casts x, the states and its float32 variables to float16, computes in
    float16 and returns the gradients of float32 tensors in float32: so does lstmgrad (its pass in float32 between
    the two roundings).  Without a recorded policy the tensors must have one dtype."""
    if layer.policy != MIXED_FLOAT16:
        try:
            return dtyped(tensors), {}
        except InvalidArgumentError as err:
            kinds = {np.asarray(v).dtype for n, v in tensors.items() if n != "mask" and v is not None}
            if kinds == {np.dtype(np.float16), np.dtype(np.float32)}:
                raise InvalidArgumentError(Message.format(
                    "{}: float32 tensors with float16 output gradients are what a layer under the mixed_float16 dtype "
                    "policy gives; give the model file that records it (a .keras archive or full-model .h5 as {}), "
                    "or tensors of one dtype", err, Param("weights"))) from None
            raise
    arrays = {}
    for name, value in tensors.items():
        arrays.update(dtyped({name: value}))
    kept = {n: a.dtype for n, a in arrays.items() if n != "mask"}
    arrays = {n: a.astype(np.float16) if n != "mask" else a for n, a in arrays.items()}
    dtypes = {f"{n}_grad": d for n, d in kept.items() if not n.endswith("_grad")}
    for state in ("h0", "c0"):
        dtypes.setdefault(f"{state}_grad", kept["x"])
    notes.append(Message.format(
        "dtype policy {} ({}): computed at the layer's precision, as Keras casts it: x, the states and the weights "
        "rounded to float16, the gradients rounded to float16 and those of float32 tensors returned in float32; "
        "Keras' own float16 arithmetic rounds at every operation, so its gradients differ from these by about "
        "its rounding, 1e-3 of the largest value (these are the closer to the exact gradient)",
        MIXED_FLOAT16, layer.source or "given"))
    return arrays, {n: d for n, d in dtypes.items() if d != np.float16}


def _recorded(reaching: Reaching, mask, x_given: np.ndarray, batch_major: bool, arrays: dict, notes: list,
              warnings: list):
    """The mask to compute with, by what the model records reaches the layer (``reaching``): the one given, or
    the one its Masking layer computes from x; refused when neither.  Its initial states must be given too."""
    states = [n for n in ("h0", "c0") if arrays.get(n) is None]
    if reaching.states and states:
        raise InvalidArgumentError(f"the model calls this layer with initial_state (the outputs of "
                                   f"{', '.join(repr(s) for s in reaching.states)}): save them as h0 and c0 beside x")
    masking = reaching.computable_from_x()
    if mask is None and reaching.masked:
        found = _masking_mask(x_given, masking) if masking is not None and batch_major else None
        if found is None:
            raise InvalidArgumentError(f"the model masks this layer's input ({reaching.mask_words}): save the mask as "
                                       "`mask` [B, T] beside x (True where a step is used)" + (
                                           "; x has steps of zeros, which Masking makes of the steps it masks"
                                           if masking is not None and batch_major else ""))
        notes.append(f"mask computed from x, as the model's Masking layer {masking.layer!r} computes it "
                     f"(the steps whose features are not all {masking.mask_value:g})")
        return found
    if mask is not None and not reaching.masked:
        notes.append("the model records no mask reaching this layer: computed with the mask given")
    elif mask is not None and masking is not None and batch_major:
        found = _masking_mask(x_given, masking)
        if found is not None and not np.array_equal(found, mask):
            warnings.append(f"the mask given is not the one the model's Masking layer {masking.layer!r} computes "
                            f"from x (at {int(np.sum(found != mask))} steps); computed with the mask given")
    return mask


def _masking_mask(x: np.ndarray, masking: MaskSource) -> np.ndarray | None:
    """[B, T]: the steps of x [B, T, I] whose features are not all mask_value, as a Masking layer finds them; None
    when x cannot say.  The LSTM's x is Masking's output, which holds zeros at the steps it masks: with mask_value
    0 those are the steps of zeros; with another value a step of zeros may be a masked one or a real one."""
    value = masking.mask_value
    if x.dtype.kind != "f" or x.ndim != 3:
        return None
    if np.isnan(value):
        return np.ones(x.shape[:2], bool)  # (NaN equals nothing: Keras masks no step)
    kept = np.any(x != value, axis=-1)
    if value != 0 and not np.any(x, axis=-1).all():
        return None
    return kept


def _zero_output_assumed(layer: KerasLayer, mask: np.ndarray, h_grad: np.ndarray) -> list[str]:
    """Where a bare weights file leaves zero_output_for_mask to Keras' default and the gradient depends on it (h_grad
    not zero at masked steps), which was assumed."""
    at_masked = np.any(h_grad[~mask.T], axis=-1) if h_grad.ndim == 3 else np.zeros(0, bool)
    if not np.any(at_masked):
        return []
    where = ("True (a Bidirectional returning sequences sets it), so the output gradient at masked steps is dropped"
             if layer.zero_output_for_mask else
             "False (Keras' default), so the output gradient at masked steps goes to the step whose output Keras "
             "carries there")
    return [f"zero_output_for_mask={where}; h_grad is not zero at {int(np.sum(at_masked))} masked step(s): a .keras "
            "archive or full-model .h5 says what the layer was made with"]


def _direction(arrays: dict, prefix: str, I: int, layer: KerasLayer, dtype) -> DirectionWeights:  # noqa: E741
    """One layer's weights in the op's layout (w = [kernel; recurrent_kernel]) with its activations."""
    kernel = rank(f"{prefix}kernel", arrays[f"{prefix}kernel"], 2, "[I, 4C]")
    recurrent = rank(f"{prefix}recurrent_kernel", arrays[f"{prefix}recurrent_kernel"], 2, "[C, 4C]")
    C = cells(f"{prefix}recurrent_kernel", recurrent.shape[1], recurrent.shape[0], "Keras")
    shaped(f"{prefix}kernel", kernel, (I, 4 * C), "[I, 4C]")
    shaped(f"{prefix}recurrent_kernel", recurrent, (C, 4 * C), "[C, 4C]")
    bias = arrays.get(f"{prefix}bias")
    if layer.use_bias is not None and layer.use_bias != (bias is not None):
        raise InvalidArgumentError(f"the layer was made with use_bias={layer.use_bias} but {prefix}bias is "
                                   f"{'missing' if bias is None else 'there'}")
    b = np.zeros(4 * C, dtype) if bias is None else shaped(f"{prefix}bias", bias, (4 * C,), "[4C]")
    return DirectionWeights(np.concatenate([kernel, recurrent]), b, layer.activation, layer.recurrent_activation)


def _schedule(T: int, B: int, mask, backwards: bool, reverse: bool, layer: KerasLayer) -> Schedule:
    """How a Keras layer runs: forwards, go_backwards (outputs in the order run) or as a Bidirectional's backward
    layer (outputs put back into x's order); the output without return_sequences is the last one it made."""
    if mask is None:
        return Schedule.plain(T, B, reversed=backwards, outputs_in_run_order=backwards and not reverse, last=T - 1)
    return Schedule.from_mask(mask, backwards=backwards, outputs_in_x_order=reverse,
                              zero_output_for_mask=layer.zero_output_for_mask)


def _output_grad(h_grad, T, B, width, batch_major, layer: KerasLayer, bidirectional, merge):
    """(sequence, last) gradients at the output, time-major."""
    if h_grad is None:
        return None, None
    h_grad = np.asarray(h_grad)
    unit = "2C" if bidirectional and merge == "concat" else "C"
    if h_grad.ndim == 2:
        if layer.return_sequences:
            raise InvalidArgumentError("h_grad is [B, C], the last output's gradient, but the layer was made with "
                                       "return_sequences=True: give the gradient at the whole output sequence")
        return None, shaped("h_grad", h_grad, (B, width), f"[B, {unit}]")
    if layer.return_sequences is False:
        raise InvalidArgumentError(f"h_grad has shape {list(h_grad.shape)}, a sequence, but the layer was made with "
                                   f"return_sequences=False: give the gradient at its last output, [B, {unit}]")
    label = f"[B, T, {unit}]" if batch_major else f"[T, B, {unit}]"
    shape = (B, T, width) if batch_major else (T, B, width)
    if h_grad.shape != shape:
        raise InvalidArgumentError(f"h_grad has shape {list(h_grad.shape)}, expected {label} = {list(shape)} (or "
                                   f"[B, {unit}], the last output's gradient)")
    return (np.swapaxes(h_grad, 0, 1) if batch_major else h_grad), None


def _description(layer: KerasLayer, bidirectional: bool, merge: str, masked: bool) -> str:
    what = f"Keras Bidirectional(LSTM), merge_mode={merge}" if bidirectional else "Keras LSTM layer"
    if not bidirectional and layer.reverse:
        what += " (a Bidirectional's backward layer)"
    elif not bidirectional and layer.go_backwards:
        what += " (go_backwards)"
    if (layer.activation, layer.recurrent_activation) != activations.DEFAULT:
        what += f", activation={layer.activation}, recurrent_activation={layer.recurrent_activation}"
    if layer.policy == MIXED_FLOAT16:
        what += f", {MIXED_FLOAT16}"
    return what + (", masked" if masked else "")
