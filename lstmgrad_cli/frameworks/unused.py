"""Which tensors of a Keras or PyTorch user's input no computation uses, and what they may have meant by them.

Every tensor of a framework input is used or reported: ``check`` names the others with a suggestion for a near
miss (``seq_lens``: lengths; ``input_mask``: mask; a typo of a name the module takes), for the caller to warn (the
command line's strict mode refuses).  A name that means something to the other framework, which would change the
gradient if it were used, is refused as the TF op's own inputs refuse both: a ``mask`` beside an nn.LSTM's tensors
(it takes per-example ``lengths``), ``lengths`` beside a Keras layer's (it takes a ``mask``).
"""

from __future__ import annotations

import difflib
import re

from ..errors import InvalidArgumentError
from ..io._common import camel
from ..messages import Message
from . import keras, pytorch
from .cells import KERAS_ALIASES
from .common import Plan

PARAMETER = re.compile(r"^(?:weight_ih|weight_hh|bias_ih|bias_hh|weight_hr)(_l\d+(?:_reverse)?)$")
# Names users give a mask or per-example lengths (lower case), and the one lstmgrad reads them as.
SYNONYMS = {
    "lengths": ("seq_lens", "seq_len", "seq_lengths", "sequence_lengths", "sequence_length", "lens", "length",
                "input_lengths", "input_lens", "x_lengths", "x_lens", "src_lengths", "src_lens", "lengths_",
                "seqlens", "seq_length", "batch_lengths", "num_steps", "steps"),
    "mask": ("input_mask", "attention_mask", "padding_mask", "pad_mask", "masks", "x_mask", "src_mask",
             "seq_mask", "sequence_mask", "keras_mask", "_keras_mask", "step_mask", "time_mask", "valid_mask"),
}
# What each framework reads where the other's name is given.
TAKES = {"keras": ("lengths", "mask"), "torch": ("mask", "lengths")}  # (the other's name, its own)
WORDS = {"keras": "a Keras LSTM layer", "torch": "a PyTorch nn.LSTM"}
CONVERSION = {
    "keras": "lengths is there (per-example lengths, as a PyTorch packed batch has), and a Keras LSTM layer takes a "
             "mask: save mask [B, T] instead (True where a step is used; np.arange(T) < lengths[:, None] for a "
             "post-padded batch), or remove it",
    "torch": "mask is there (a Keras mask [B, T]), and a PyTorch nn.LSTM takes per-example lengths: save lengths "
             "[B] instead (mask.sum(1) for a post-padded batch, as pack_padded_sequence takes them), or remove it",
}

HINTS = {"keras": "a mask [B, T], True where a step is used: np.arange(T) < {key}[:, None] for a post-padded batch",
         "torch": "per-example lengths [B]: {key}.sum(1) for a post-padded batch"}
MAX_NAMED = 20  # unused entries named in a warning, at most (the others counted)


def used_names(plan: Plan) -> set[str]:
    """The names (the framework's) of the tensors a plan computes from."""
    if plan.step:  # one cell step: its own names (a Keras cell's weights under any name it is read by)
        return set(plan.tensors) | {alias for name in plan.tensors for alias in KERAS_ALIASES.get(name, ())}
    if plan.framework == "keras":
        return set(plan.tensors)
    selected = getattr(plan, "selected", None)
    if selected is not None:
        suffixes = {pytorch.suffix(*selected)}
    else:
        suffixes = {pytorch.suffix(k, bool(d)) for k, layer in enumerate(plan.module.layers) for d in range(len(layer))}
    return {n for n in plan.tensors if n in pytorch.STATE_NAMES or (
        (match := PARAMETER.match(n)) is not None and match.group(1) in suffixes)}


def check(keys, plan: Plan) -> tuple[list[str], Message | None]:
    """The keys of an input (as stored) that ``plan`` does not compute from, and a warning naming them with what
    each may have been meant as (None when every one is used).  Raises for the other framework's mask or lengths."""
    refuse_other(keys, plan.framework)
    names = used_names(plan)
    unused = [key for key in keys if not stands_for(key, names)]
    if not unused:
        return [], None
    taken = _taken(plan, names)
    said = ", ".join(f"{key} ({hint})" if (hint := suggestion(key, plan.framework, taken)) else key
                     for key in unused[:MAX_NAMED])
    if len(unused) > MAX_NAMED:
        said += f" and {len(unused) - MAX_NAMED} more"
    plural = "s" if len(unused) > 1 else ""
    reads = ", ".join(n for n in taken if not PARAMETER.match(n))
    if plan.framework == "torch":
        reads += " and its weights (weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0, ...)"
    return unused, Message(f"tensor{plural} not used: {said}; {WORDS[plan.framework]}'s gradient is computed from "
                           f"{reads}")


def hints(keys, framework: str) -> str:
    """For a refusal: the entries of an input that no name of the framework's stands for and that look like one,
    with what each may have been meant as ("" when none does)."""
    if framework not in TAKES:
        return ""
    names = set(keras.STATE_NAMES if framework == "keras" else pytorch.STATE_NAMES)
    if framework == "keras":
        names |= {f"{p}{n}" for p in ("", "forward_", "backward_") for n in keras.PARAMETERS}
    taken = sorted(names)
    found = [f"{key} is there, not used: {hint}" for key in keys
             if not stands_for(key, names) and not PARAMETER.match(key) and key != TAKES[framework][0]
             and (hint := suggestion(key, framework, taken)) is not None]
    return "; ".join(found[:MAX_NAMED])


def refuse_other(keys, framework: str) -> None:
    """A mask beside an nn.LSTM's tensors, lengths beside a Keras layer's: ignored, they would give a wrong
    gradient."""
    other = TAKES.get(framework, (None,))[0]
    if other is not None and other in keys:
        raise InvalidArgumentError(CONVERSION[framework])


def suggestion(key: str, framework: str, taken: list[str]) -> str | None:
    """What an unused ``key`` may have been meant as ("did you mean mask?"), None if nothing."""
    low = key.lower()
    meant = next((name for name, synonyms in SYNONYMS.items() if low == name or low in synonyms), None)
    other, own = TAKES[framework]
    if meant == other:
        return f"did you mean {own}? {WORDS[framework]} takes {HINTS[framework].format(key=key)}"
    if meant is None:
        close = difflib.get_close_matches(low, taken, n=1, cutoff=0.8)
        meant = close[0] if close else None
    return None if meant is None else f"did you mean {meant}?"


def _taken(plan: Plan, names: set[str]) -> list[str]:
    """Every name the module's gradient may be computed from, those given first."""
    if plan.framework == "keras":
        prefixes = ("forward_", "backward_") if any(n.startswith("forward_") for n in names) else ("",)
        weights = [f"{p}{n}" for p in prefixes for n in keras.PARAMETERS]
        return list(dict.fromkeys([*keras.STATE_NAMES[:1], *weights, *keras.STATE_NAMES[1:]]))
    weights = sorted(n for n in names if PARAMETER.match(n))
    return list(dict.fromkeys(["x", *weights, *pytorch.STATE_NAMES[1:]]))


def stands_for(key: str, names: set[str]) -> bool:
    """Whether a stored key is one of ``names`` (camelCase, a weights file's spelling, or a group holding one)."""
    if key in names or any(camel(n) == key for n in names):
        return True
    for name, aliases in keras.ALIASES.items():
        if name in names and key in aliases:
            return True
        for direction in keras.WRAPPED:
            if f"{direction}_{name}" not in names:
                continue
            head, _, rest = key.partition("/")
            if keras.direction_of(head) == direction and (not rest or rest in aliases):
                return True
    return False
