"""PyTorch ``nn.LSTM`` modules as their users hold them: a state_dict, x, and the gradient at the module's output.

An ``nn.LSTM(input_size, C, num_layers=L, bidirectional=...)`` has, for each layer K and direction (``_reverse``
for the backward one), ``weight_ih_l{K}`` [4C, I] (I = input_size for layer 0, D*C above), ``weight_hh_l{K}``
[4C, C] and, with bias=True, ``bias_ih_l{K}``/``bias_hh_l{K}`` [4C]; gates i, f, g, o (IFCO).  With
``proj_size=P`` each also has ``weight_hr_l{K}`` [P, C]: h = weight_hr (o * tanh(c)) is P wide, so
``weight_hh_l{K}`` is [4C, P], the layers above read D*P, and h0, h_n and the output are P wide where c0 and c_n
stay C wide (H below: P, else C).  The number of layers and directions is read from the names.  ``x`` is
[T, B, I] ([B, T, I] with batch_first), the module's output gradient ``h_grad`` [T, B, D*H] (or [B, D*H]: at
``out[-1]`` only), ``h0``, ``hn_grad`` [L*D, B, H], ``c0``, ``cn_grad`` [L*D, B, C] (PyTorch keeps states
time-major even with batch_first), ``lengths`` [B] for a packed batch (pack_padded_sequence): each example runs its
first lengths[b] steps, the reverse direction from its own last step, h_n and c_n at each example's last step, the
outputs after it zero.  Unbatched, as nn.LSTM takes it: x [T, I], the states [L*D, H] and [L*D, C], h_grad
[T, D*H] (or [D*H]); batch_first does not apply, and the gradients come back in those shapes.

``layer``/``reverse`` (``--layer``, ``--reverse``) pick one layer and direction instead: its own input as ``x``,
its own output's gradient [T, B, H] as ``h_grad``, its states [B, H] and [B, C].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..layers.modules import Module
from ..layers.recurrence import DirectionGrads, DirectionWeights
from ..layers.schedule import Schedule
from ..messages import TYPED, Command, Message, Param, cut
from .common import FrameworkOptions, Plan, as_lengths, cells, check_applicable, dtyped, nonempty, rank, shaped
from .names import TORCH_CELL_KEYS as CELL_KEYS
from .names import TORCH_PARAMETERS as PARAMETERS
from .names import TORCH_STATE_NAMES as STATE_NAMES  # noqa: F401 - (pytorch.STATE_NAMES, for unused.py)
from .names import TORCH_WEIGHT as WEIGHT
from .names import torch_names as names
from .names import torch_suffix as suffix

# A name that looks like a parameter's but is not spelt as nn.LSTM spells it (a leading zero, another script's
# digits): read as one, it would be a second name for the same parameter.
_LOOSE = re.compile(r"\A(?:weight_ih|weight_hh|weight_hr|bias_ih|bias_hh)_l(\d+)(?:_reverse)?\Z")
_STRICT = re.compile(r"\A(?:weight_ih|weight_hh|weight_hr|bias_ih|bias_hh)_l(?:0|[1-9][0-9]*)(?:_reverse)?\Z")
# A state_dict does not say whether the module was made with dropout > 0, nor which units a training pass dropped.
DROPOUT_NOTE = ("computed without dropout between layers, as the module runs in eval() mode or with dropout=0 (the "
                "units a training pass drops are not in the state_dict)")


def layers_in(keys) -> list[str]:
    """The layer and direction suffixes of the nn.LSTM weights among ``keys`` ("_l0", "_l1_reverse", ...)."""
    return sorted({f"_l{m.group(1)}{m.group(2) or ''}" for k in keys for m in [WEIGHT.match(k)] if m})


def misnamed(keys) -> list[str]:
    """Why names among a state_dict's ``keys`` (behind any module prefix) cannot be an nn.LSTM's, in words: a
    layer number nn.LSTM does not write (``weight_ih_l00`` beside ``weight_ih_l0``, ``weight_ih_l\u0669``: read
    as numbers, two names of one parameter); [] when none."""
    return [f"{cut(key)} is not an nn.LSTM parameter's name: its layer number is not written as nn.LSTM writes them "
            "(0, 1, 2, ... in ASCII digits, no leading zero)" for key in keys
            if _LOOSE.match(key.rpartition(".")[2]) and not _STRICT.match(key.rpartition(".")[2])]


def spelled_twice(keys) -> list[str]:
    """Two keys that name one parameter, module paths written with "." and with "/" (``rnn.weight_ih_l0``,
    ``rnn/weight_ih_l0``): what reading them under their group refuses, in words; [] when none."""
    seen, found = {}, []
    for key in keys:
        name = key.replace("/", ".")
        if name in seen:
            found.append(f"both {cut(seen[name])} and {cut(key)} are {cut(name)}: one parameter written twice, which "
                         "reading it under its group refuses; keep one")
        else:
            seen[name] = key
    return found


def gaps(keys) -> list[str]:
    """Why the layers named among ``keys`` are not a whole nn.LSTM: a layer number past the layers there are
    (``weight_ih_l999999999`` beside ``weight_ih_l0``: a module numbers its layers 0, 1, ..., each with its
    weight_ih, so every number is below the count of weight_ih names, what bounds the layers read from names);
    [] when none.  (One layer's weights alone, for ``layer``, may be any one.)"""
    problems, numbers = [], {}
    for key in keys:
        prefix, _, name = key.rpartition(".")
        match = WEIGHT.match(name)
        if match:
            numbers.setdefault((prefix, match.group(2) or ""), []).append(match.group(1))
    for (prefix, sfx), found in numbers.items():
        largest = max(found, key=layer_number)
        if layer_number(largest) >= len(found):
            first = min(set(range(len(found) + 1)) - {layer_number(n) for n in found})
            where = f"{cut(prefix)}." if prefix else ""
            problems.append(f"{where}weight_ih_l{cut(largest, 20)}{sfx} is there without {where}weight_ih_l{first}"
                            f"{sfx}: an nn.LSTM numbers its layers 0, 1, 2, ... ({len(found)} weight_ih{sfx} here)")
    return problems


def layer_number(digits: str) -> int:
    """A layer number as a name writes it (ASCII digits), at most 10**18 (more layers than any file holds)."""
    return int(digits) if len(digits) <= 18 else 10**18


def parameter_names(keys) -> list[str]:
    """Every nn.LSTM parameter name of the layers and directions found among ``keys`` (for reading them)."""
    found = []
    for sfx in layers_in(keys):
        found += [f"{n}{sfx}" for n in (*PARAMETERS, "weight_hr")]
    return found


def state_dict_layers(keys) -> list[dict]:
    """The nn.LSTM layers and directions among a state_dict's keys, with their module prefix."""
    found = []
    for key in keys:
        prefix, _, name = key.rpartition(".")
        match = WEIGHT.match(name)
        if match:
            found.append({"prefix": prefix, "layer": layer_number(match.group(1)), "reverse": bool(match.group(2)),
                          "projection": f"{prefix + '.' if prefix else ''}weight_hr_l{match.group(1)}"
                                        f"{match.group(2) or ''}" in keys})
    return sorted(found, key=lambda d: (d["prefix"], d["layer"], d["reverse"]))


def cells_in(keys) -> list[str]:
    """Where a state_dict keeps an nn.LSTMCell's weights (``<prefix>.weight_ih`` without a layer suffix), in
    words of refusal; [] when it holds none."""
    keys = set(keys)
    prefixes = sorted({k.rpartition(".")[0] for k in keys if k.endswith(".weight_ih") and
                       f"{k.rpartition('.')[0]}.weight_hh" in keys})
    return [Message.format("{} holds an nn.LSTMCell's weights (one step, called in a Python loop), not an nn.LSTM's: "
                           "{} computes a step of it with {} ({}); for a whole sequence copy them into an "
                           "nn.LSTM (weight_ih_l0 = cell.weight_ih, ...)", cut(p), Command("cell"),
                           Param("weights_group", cut(p, TYPED)), CELL_STEP)
            for p in prefixes]


CELL_STEP = "x, h0, c0 and the gradients at h1, c1 of h1, c1 = cell(x, (h0, c0)) as h1_grad, c1_grad"


def _refuse_other_modules(tensors: dict) -> None:
    if all(k in tensors for k in CELL_KEYS):
        raise InvalidArgumentError(Message.format(
            "weight_ih and weight_hh without a layer suffix are an nn.LSTMCell's (one step, called in a Python loop), "
            "not an nn.LSTM's (weight_ih_l0, ...): {} computes one step of it ({}); for a whole sequence copy the "
            "cell's weights into an nn.LSTM(input_size, hidden_size) (weight_ih_l0 = cell.weight_ih, ...)",
            Command("cell"), CELL_STEP))


class TorchPlan(Plan):
    selected: tuple[int, bool] | None = None  # --layer / --reverse: the one layer-direction computed

    def weight_grads(self, k, d, grads: DirectionGrads, xp=np) -> dict:
        layer, reverse = (k, bool(d)) if self.selected is None else self.selected
        n = names(layer, reverse)
        I = grads.w_grad.shape[0] - self.module.layers[k][d].H  # noqa: E741
        out = {f"{n['weight_ih']}_grad": xp.ascontiguousarray(grads.w_grad[:I].T),
               f"{n['weight_hh']}_grad": xp.ascontiguousarray(grads.w_grad[I:].T)}
        if n["bias_ih"] in self.tensors:
            out[f"{n['bias_ih']}_grad"] = grads.b_grad
            out[f"{n['bias_hh']}_grad"] = grads.b_grad.copy()
        if grads.projection_grad is not None:
            out[f"weight_hr{suffix(layer, reverse)}_grad"] = xp.ascontiguousarray(grads.projection_grad.T)
        return out


@dataclass(frozen=True)
class _Layout:
    """How the user holds the module's tensors, for the words of a message: batch-first or not, unbatched (x [T, I]),
    one layer-direction or the whole module, its directions and whether h is projected (P wide)."""

    batch_first: bool
    unbatched: bool
    single: bool
    D: int
    projected: bool

    @property
    def h(self) -> str:  # the width of h, of one direction
        return "P" if self.projected else "C"

    @property
    def width(self) -> str:  # the width of the output
        return self.h if self.single or self.D == 1 else f"{self.D}*{self.h}"

    def sequence(self, width: str | None = None) -> str:
        width = width or self.width
        if self.unbatched:
            return f"[T, {width}]"
        return f"[B, T, {width}]" if self.batch_first else f"[T, B, {width}]"

    def last(self, width: str | None = None) -> str:
        return f"[{width or self.width}]" if self.unbatched else f"[B, {width or self.width}]"

    @property
    def last_output(self) -> str:
        return "out[:, -1]" if self.batch_first and not self.unbatched else "out[-1]"

    @property
    def x(self) -> str:
        return self.sequence("I")


def plan(tensors: dict, options: FrameworkOptions) -> TorchPlan:
    """Check a PyTorch user's tensors and build what computes their gradients."""
    check_applicable("torch", options)
    _refuse_other_modules(tensors)
    problems = misnamed(tensors)
    if problems:
        raise InvalidArgumentError(problems[0])
    found = layers_in(tensors)
    single = options.layer is not None or options.reverse
    if single:
        chosen = [(options.layer or 0, options.reverse)]
    else:
        # the layers the names number, up to the first one missing where a number is past the layers there are
        # (weight_ih_l999999999 beside weight_ih_l0 is not a billion layers to make, but weight_ih_l1 missing)
        numbers = {layer_number(s[2:].split("_")[0]) for s in found}
        count = 1 + max(numbers, default=0)
        if count > len(numbers):
            count = 1 + min(set(range(len(numbers) + 1)) - numbers)
        D = 2 if any(s.endswith("_reverse") for s in found) else 1
        chosen = [(k, bool(d)) for k in range(count) for d in range(D)]
    missing = [n for n in ("x", *(names(*c)[p] for c in chosen for p in ("weight_ih", "weight_hh")))
               if tensors.get(n) is None]
    if missing:
        where = (Message.format("layer {} of an nn.LSTM; {} and {} choose another",
                                f"{chosen[0][0]}{', reverse' if chosen[0][1] else ''}", Param("layer"),
                                Param("reverse"))
                 if single else "an nn.LSTM: weight_ih_l0, weight_hh_l0, ... for every layer")
        hint = ""
        if found and not {suffix(*c) for c in chosen} <= set(found):
            hint = Message("; the weights here are of ", Message.join(", ", (_selecting(s) for s in found)))
        raise InvalidArgumentError(Message(f"missing tensor{'s' * (len(missing) > 1)} {', '.join(missing)} (", where,
                                           ")", hint))
    arrays = dtyped(tensors)
    stray = [k for k in arrays if k.startswith("weight_hr_l") and k.removeprefix("weight_hr") not in found]
    if stray and not single:
        raise InvalidArgumentError(f"{stray[0]} is there, and no {stray[0].replace('weight_hr', 'weight_ih')}: a "
                                   "projection (proj_size) belongs to a layer and direction of the module")
    projections = [f"weight_hr{suffix(*c)}" for c in chosen]
    projected = [n for n in projections if n in arrays]
    if projected and len(projected) != len(projections):
        absent = next(n for n in projections if n not in arrays)
        raise InvalidArgumentError(f"{projected[0]} is there and {absent} is not: an nn.LSTM with proj_size > 0 "
                                   "projects h in every layer and direction")
    D = 1 if single else (2 if chosen[-1][1] else 1)
    unbatched = np.ndim(arrays["x"]) == 2
    layout = _Layout(options.batch_first, unbatched, single, D, bool(projected))
    notes = []
    if unbatched:
        if arrays.get("lengths") is not None:
            raise InvalidArgumentError(f"lengths is there, and x is unbatched {layout.x} (one example, "
                                       f"{list(np.shape(arrays['x']))}): a packed batch has a batch axis")
        if options.batch_first:
            notes.append(Message.format("x is unbatched {}: {} does not apply to it (nn.LSTM ignores batch_first "
                                        "for unbatched input)", layout.x, Param("batch_first", True)))
        x = arrays["x"][:, None]
    else:
        x = rank("x", arrays["x"], 3, f"{layout.x} (or unbatched [T, I])")
        x = np.swapaxes(x, 0, 1) if options.batch_first else x
    T, B, I = x.shape  # noqa: E741
    nonempty(x.shape, "PyTorch")
    layers = len(chosen) // D
    C, H = _sizes(arrays, chosen[0], layout)
    module_layers = [[_direction(arrays, chosen, k, d, D, I, C, H, single, x.dtype) for d in range(D)]
                     for k in range(layers)]
    lengths = None if arrays.get("lengths") is None else as_lengths(arrays["lengths"], B, T)
    schedules = [_schedule(T, B, lengths, reverse) for reverse in
                 ([options.reverse] if single else [False, True][:D])]
    count = layers * D
    h_grad, last_grad = _output_grad(arrays.get("h_grad"), T, B, D * H if not single else H, lengths, layout)
    hn_grad = _state("hn_grad", arrays.get("hn_grad"), count, B, H, None, layout)
    cn_grad = _state("cn_grad", arrays.get("cn_grad"), count, B, C, None, layout)
    if h_grad is None and last_grad is None and hn_grad is None and cn_grad is None:
        raise InvalidArgumentError("missing tensor h_grad: the gradient arriving at the module's output (or hn_grad, "
                                   "cn_grad: those at its final states, where the output is unused)")
    h0, c0 = arrays.get("h0"), arrays.get("c0")
    result = TorchPlan(
        "torch", Module(module_layers, schedules), np.ascontiguousarray(x),
        _state("h0", h0, count, B, H, x.dtype, layout), _state("c0", c0, count, B, C, x.dtype, layout),
        h_grad, last_grad, hn_grad, cn_grad, options.batch_first and not unbatched,
        _state_shape(h0, c0, count, B, H, layout), arrays,
        description=_description(layers, D, single, chosen, lengths, H if projected else None, unbatched),
        notes=notes + ([DROPOUT_NOTE] if layers > 1 else []), c_state_shape=_state_shape(c0, h0, count, B, C, layout),
        unbatched=unbatched)
    result.selected = chosen[0] if single else None
    return result


def _sizes(arrays: dict, first: tuple[int, bool], layout: _Layout) -> tuple[int, int]:
    """(C, H): the cell size (hidden_size) and the width of h (proj_size where weight_hr projects it, else C), from
    the first layer-direction's weights."""
    n = names(*first)
    w_hh = rank(n["weight_hh"], arrays[n["weight_hh"]], 2, f"[4C, {layout.h}]")
    if not layout.projected:
        C = cells(n["weight_hh"], w_hh.shape[0], w_hh.shape[1], "PyTorch")
        return C, C
    hr = f"weight_hr{suffix(*first)}"
    P, C = rank(hr, arrays[hr], 2, "[P, C] (proj_size, hidden_size)").shape
    if not P or not C or w_hh.shape != (4 * C, P):
        raise InvalidArgumentError(f"{n['weight_hh']} has shape {list(w_hh.shape)} and {hr} {[P, C]}: with "
                                   f"proj_size P = {P} and hidden_size C = {C}, {n['weight_hh']} is [4C, P] = "
                                   f"{[4 * C, P]}")
    return C, P


def _state(name: str, value, count: int, B: int, width: int, dtype, layout: _Layout) -> np.ndarray | None:
    """An initial state or a final state's gradient, [count, B, width] as the module computes it: as nn.LSTM keeps
    it ([L*D, B, width]; unbatched [L*D, width]), or without its first axis where there is one layer-direction;
    zeros when absent (None for an absent gradient: ``dtype`` None)."""
    if value is None:
        return None if dtype is None else np.zeros((count, B, width), dtype)
    value = given = np.asarray(value)
    batch = () if layout.unbatched else (B,)
    if value.ndim == len(batch) + 1 and count == 1:
        value = value[None]
    if value.shape != (count, *batch, width):
        what = ("" if layout.unbatched else "B, ") + ("P" if layout.projected and name in ("h0", "hn_grad") else "C")
        label = f"[1, {what}] or [{what}]" if count == 1 else f"[{count}, {what}] (layers x directions)"
        raise InvalidArgumentError(f"{name} has shape {list(given.shape)}, expected {label} = {[count, *batch, width]}"
                                   + (f" for unbatched x {layout.x}" if layout.unbatched else ""))
    return value if not layout.unbatched else value[:, None]


def _state_shape(given, other, count: int, B: int, width: int, layout: _Layout) -> tuple:
    """The shape of h0_grad or c0_grad: that of h0 or c0 as the user gave it (else of the other state, ``other``, as
    wide as this one), else [L*D, B, width] for the module (as PyTorch keeps it, one layer included) and [B, width]
    for one layer picked from it (without the batch axis when x is unbatched)."""
    like = given if given is not None else other
    if like is not None:
        return (*np.shape(like)[:-1], width)
    shape = (B, width) if layout.single else (count, B, width)
    return tuple(n for k, n in enumerate(shape) if not (layout.unbatched and k == len(shape) - 2))


def _direction(arrays: dict, chosen, k: int, d: int, D: int, I: int, C: int, H: int, single: bool,  # noqa: E741
               dtype) -> DirectionWeights:
    """Layer k, direction d's weights in the op's layout (w = [weight_ih.T; weight_hh.T], b = bias_ih + bias_hh),
    and its projection (weight_hr.T) where h is projected."""
    n = names(*chosen[k * D + d])
    width = I if k == 0 else D * H
    h = "P" if H != C or f"weight_hr{suffix(*chosen[0])}" in arrays else "C"
    what = "[4C, I]" if k == 0 else f"[4C, {D}{h}] (the layer below's {'two directions' if D == 2 else 'output'})"
    w_ih = rank(n["weight_ih"], arrays[n["weight_ih"]], 2, "[4C, I]")
    if single and w_ih.shape != (4 * C, width) and chosen[0][0] > 0 and w_ih.shape[0] == 4 * C:
        raise InvalidArgumentError(Message.format(
            "{} has shape {}, and x is {} wide: with {}, x is that layer's own input (the output of the layer below, "
            "{} wide) and h_grad its output's gradient; without it lstmgrad computes the whole module from the "
            "module's x and output gradient", n["weight_ih"], list(w_ih.shape), width, Param("layer", chosen[0][0]),
            w_ih.shape[1]))
    w_ih = shaped(n["weight_ih"], w_ih, (4 * C, width), what)
    w_hh = shaped(n["weight_hh"], rank(n["weight_hh"], arrays[n["weight_hh"]], 2, f"[4C, {h}]"), (4 * C, H),
                  f"[4C, {h}]")
    with_bias = names(*chosen[0])["bias_ih"] in arrays
    if (n["bias_ih"] in arrays) != (n["bias_hh"] in arrays) or (n["bias_ih"] in arrays) != with_bias:
        raise InvalidArgumentError(f"{n['bias_ih']} and {n['bias_hh']} come together (bias=True) or not at all "
                                   "(bias=False), in every layer")
    b = np.zeros(4 * C, dtype)
    if with_bias:
        b = shaped(n["bias_ih"], arrays[n["bias_ih"]], (4 * C,), "[4C]") + shaped(
            n["bias_hh"], arrays[n["bias_hh"]], (4 * C,), "[4C]")
    hr = f"weight_hr{suffix(*chosen[k * D + d])}"
    projection = None
    if hr in arrays:
        projection = np.ascontiguousarray(shaped(hr, arrays[hr], (H, C), "[P, C] (proj_size, hidden_size)").T)
    return DirectionWeights(np.concatenate([w_ih.T, w_hh.T]), b.astype(dtype), projection=projection)


def _selecting(found_suffix: str) -> Message:
    """"_l1_reverse (--layer 1 --reverse)": a layer-direction the file holds, and how to ask for it."""
    layer = found_suffix[2:].split("_")[0]
    flags = (Param("layer", int(layer) if len(layer) <= 18 else cut(layer, 20)),
             *((" ", Param("reverse", True)) if found_suffix.endswith("reverse") else ()))
    return Message(f"{cut(found_suffix, 30)} (", *flags, ")")


def _schedule(T: int, B: int, lengths, reverse: bool) -> Schedule:
    if lengths is not None and not (lengths == T).all():
        return Schedule.from_lengths(lengths, T, reversed=reverse)
    # out[-1] is x's last step: for the reverse direction the first it runs (h_n is its last)
    return Schedule.plain(T, B, reversed=reverse, last=0 if reverse else T - 1)


def _output_grad(h_grad, T: int, B: int, width: int, lengths, layout: _Layout):
    """(sequence, last) gradients at the output, time-major; a sequence shorter than x (pad_packed_sequence without
    total_length stops at the longest length) is padded with zeros."""
    if h_grad is None:
        return None, None
    h_grad = np.asarray(h_grad)
    last = layout.last()
    if h_grad.ndim == 2 - layout.unbatched:
        if lengths is not None:
            raise InvalidArgumentError(f"h_grad is {last}, the gradient at {layout.last_output}; with lengths, "
                                       f"{layout.last_output} is padding for every shorter example: give the whole "
                                       "out.grad sequence, or hn_grad")
        if h_grad.shape[-1:] != (width,) or h_grad.shape[:-1] != (B,) * (not layout.unbatched):
            _wrong_width("h_grad", h_grad.shape, [*(B,) * (not layout.unbatched), width], last, layout, width)
        return None, h_grad.reshape(B, width)
    label = layout.sequence()
    h_grad = rank("h_grad", h_grad, 3 - layout.unbatched, f"{label} or {last}")
    shape = list(h_grad.shape)
    if layout.unbatched:
        h_grad = h_grad[:, None]
    elif layout.batch_first:
        h_grad = np.swapaxes(h_grad, 0, 1)
    steps = h_grad.shape[0]
    shortest = int(lengths.max(initial=0)) if lengths is not None else T
    if h_grad.shape[1:] != (B, width) or not shortest <= steps <= T:
        want = [T, width] if layout.unbatched else [B, T, width] if layout.batch_first else [T, B, width]
        if h_grad.shape[1:] == (B, width):
            raise InvalidArgumentError(f"h_grad has {steps} time steps, expected {T}"
                                       + (f" (or at least the longest length, {shortest})" if lengths is not None
                                          else ""))
        _wrong_width("h_grad", shape, want, label, layout, width)
    if steps < T:
        h_grad = np.concatenate([h_grad, np.zeros((T - steps, B, width), h_grad.dtype)])
    return h_grad, None


def _wrong_width(name, shape, want, label, layout: _Layout, width):
    hint = ""
    if layout.single and len(shape) >= 1 and shape[-1] == 2 * width:
        hint = Message.format("; its last axis is 2{}, the whole bidirectional output's gradient: without {} and {} "
                              "lstmgrad computes the whole module from it, or give this direction's half", layout.h,
                              Param("layer"), Param("reverse"))
    elif not layout.single and len(shape) >= 1 and width % 2 == 0 and shape[-1] == width // 2 and layout.D == 2:
        hint = Message.format("; its last axis is {}, one direction's: give the whole output's gradient, or {} and {} "
                              "for one direction", layout.h, Param("layer"), Param("reverse"))
    raise InvalidArgumentError(Message(f"{name} has shape {list(shape)}, expected {label} = {list(want)}", hint))


def _description(layers: int, D: int, single: bool, chosen, lengths, projection: int | None, unbatched: bool) -> str:
    if single:
        layer, reverse = chosen[0]
        what = f"PyTorch nn.LSTM layer {layer}{' reverse' if reverse else ''}"
    else:
        what = "PyTorch nn.LSTM" + (f", {layers} layers" if layers > 1 else "") + (", bidirectional" if D == 2 else "")
    return (what + (f", proj_size={projection}" if projection else "") + (", unbatched" if unbatched else "")
            + (", per-example lengths" if lengths is not None else ""))
