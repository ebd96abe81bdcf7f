"""The decisions no flag made: gate layout, use_peephole, seq_len_max, and whether to recompute the activations.

Pure functions of what a problem holds: what was given (a flag, the input's tensor or attribute, the forward
op a debug dump recorded, the layout ``lstmgrad forward`` recorded in its output's metadata) and the stored
activations.  ``seq``, ``cell``, ``check`` and ``load()`` (problem/), ``inspect`` of a file (operations/inspect.py)
and of a debug dump (operations/inspect_dump.py) all decide through them, so they agree, and say so in the same words.

The rules:

* seq_len_max: the given value, else where TF stopped (cs and h zero from a step on where the activations fit
  only before it: ``detect.seq_len_max_stopped``), else T.
* layout: the given value, else the one layout the activations fit, else ifco; the cell op is always ICFO.
* use_peephole: the given value, else the one setting the activations fit (with the layout chosen), else false.
* A given value the activations contradict is kept, with a warning; activations that fit both layouts (all-zero
  weights, ...) or nothing at all are a warning too.

Each decision holds its value, where it came from (``source``: "flag", "tensor", "attribute", "dump",
"metadata", "activations", "default", "op") and what to tell the user, as ``Message``s whose parameters
(``--layout`` on the command line, ``layout=`` in Python) the caller spells.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from ..messages import Command, Message, Param
from ..ops import validation
from ..spec import ACTIVATIONS, CELL_LAYOUT, DEFAULT_LAYOUT, LAYOUT_OPS, LAYOUT_V1, LAYOUT_V2, OPS
from . import detect

# A source in the words a summary shows it (the JSON keeps the codes).
SOURCE_WORDS = {"activations": "found from the activations", "flag": "as asked", "default": "default",
                "dump": "the forward op recorded in the dump", "metadata": "recorded in the file's lstmgrad metadata"}


@dataclass(frozen=True)
class Given:
    """A value given before the activations are looked at, and by whom."""

    value: object
    source: str  # "flag" | "tensor" | "attribute" | "dump" | "metadata"


@dataclass
class Decision:
    """A decided value, where it came from, and what to tell the user about it."""

    value: object
    source: str
    warnings: list[Message | str] = field(default_factory=list)  # the activations contradict it, or cannot tell
    notes: list[Message | str] = field(default_factory=list)  # how it was found
    defaults: list[Message | str] = field(default_factory=list)  # a default filled in where nothing could tell


@dataclass
class Decisions:
    """The decisions of one problem whose activations are stored, and what the activations fit."""

    seq_len_max: Decision
    layout: Decision
    use_peephole: Decision
    fit: detect.ActivationFit | None
    warnings: list[Message | str] = field(default_factory=list)  # about the activations as a whole

    def _all(self, what: str) -> list:
        return [m for d in (self.seq_len_max, self.layout, self.use_peephole) for m in getattr(d, what)]

    @property
    def all_warnings(self) -> list:
        return [*self._all("warnings"), *self.warnings]

    @property
    def all_notes(self) -> list:
        return self._all("notes")

    @property
    def all_defaults(self) -> list:
        return self._all("defaults")

    @property
    def sources(self) -> dict:
        return {"seq_len_max": self.seq_len_max.source, "layout": self.layout.source,
                "use_peephole": self.use_peephole.source}


def activation_names(kind: str) -> tuple:
    """The forward outputs a problem of ``kind`` holds (the cell gradient reads no h)."""
    return ACTIVATIONS if kind == "seq" else ACTIVATIONS[:-1]


def recompute(kind: str, present) -> bool:
    """Whether the activations are to be recomputed by the forward op: the input holds none of them (some and
    not others is a missing-tensor error: never mixed with recomputed ones)."""
    return not any(name in present for name in activation_names(kind))


def recorded_layout(metadata_text) -> Given | None:
    """The layout ``lstmgrad forward`` recorded in its output (its metadata's forward op); None for any other
    metadata, or text that is not lstmgrad's."""
    try:
        meta = json.loads(str(metadata_text))
    except ValueError:
        return None
    if not isinstance(meta, dict) or meta.get("tool") != "lstmgrad":
        return None
    layouts = {op: layout for layout, op in LAYOUT_OPS.items()}
    layout = layouts.get(meta.get("op"))
    return Given(layout, "metadata") if layout is not None and meta.get("layout") == layout else None


def recorded_op_note(recorded: str | None, forward: str | None, right: str | None) -> str | None:
    """Words for a gradient op a dump recorded that is not the gradient of the forward op that made its activations
    (``right``); None when it is, or when that is unknown.  The commands compute ``right``."""
    if not (recorded and forward and right) or right == recorded:
        return None
    tape = " (TF's GradientTape gradient of BlockLSTMV2 runs the V1 kernel, ICFO)" if (
        recorded == "BlockLSTMGrad" and forward == "BlockLSTMV2") else ""
    return f"TensorFlow ran {recorded} on activations {forward} made; the gradient of {forward} is {right}{tape}"


def forget_bias_allowed(op: str, forget_bias) -> None:
    """A forward op's forget_bias: BlockLSTMV2 has none (its kernel adds 0), so another value is refused."""
    if op == "BlockLSTMV2" and forget_bias not in (None, 0.0):
        raise InvalidArgumentError(Message.format(
            "BlockLSTMV2 has no forget_bias (its kernel adds 0): use {} (BlockLSTM) for a forget bias, or add it to "
            "the f block of b", Param("layout", LAYOUT_V1)))


def seq_len_max(T: int, given: Given | None, arrays=None) -> Decision:
    """The given seq_len_max (checked), else where TF stopped as the stored activations show (``arrays``; None
    when there are none to look at), else T."""
    if given is not None:
        return Decision(validation.check_seq_len_max(given.value, T), given.source)
    stopped = detect.seq_len_max_stopped(arrays, T) if arrays is not None else None
    if stopped is not None:
        return Decision(stopped, "activations", notes=[Message.format(
            "seq_len_max {}: not in the file; cs and h are zero from step {} on, where TF stops computing ({} says "
            "otherwise)", stopped, stopped, Param("seq_len_max"))])
    return Decision(T, "default", defaults=[f"seq_len_max: not in the file, using T = {T}"])


def layout(kind: str, given: Given | None, fit: detect.ActivationFit | None, seq_len_max: int = 1, *,
           activations: bool = True) -> Decision:
    """The gate layout: the cell op's ICFO; else the given one; else the one the activations fit; else ifco.
    ``activations`` False: there are none to fit (they are to be recomputed), and a default needs no word."""
    if kind == "cell":
        decision = Decision(CELL_LAYOUT, "op")  # LSTMBlockCell(Grad) has one layout
        if fit is not None and fit.layouts == [LAYOUT_V2]:
            decision.warnings.append(Message.format(
                "the activations fit the IFCO gate layout (a step of BlockLSTMV2?), but LSTMBlockCellGrad is "
                "ICFO: for a BlockLSTMV2 step use {} with x of shape [1, B, I]", Command("seq")))
        return decision
    if given is not None:
        decision = Decision(given.value, given.source)
        if fit is not None and fit.layouts and given.value not in fit.layouts:
            decision.warnings.append(_layout_contradicted(given, fit.layouts[0]))
        return decision
    if fit is not None and fit.layout is not None:
        return Decision(fit.layout, "activations")
    decision = Decision(DEFAULT_LAYOUT, "default")
    if not activations:
        return decision
    if fit is not None and len(fit.layouts) > 1:
        decision.warnings.append(both_layouts_fit())
        return decision
    if fit is None:
        why = "seq_len_max is 0: no step to recompute" if seq_len_max == 0 else "nothing to recompute"
    else:
        why = "they fit neither layout"
    decision.defaults.append(f"layout: not given and the activations cannot tell ({why}); {DEFAULT_LAYOUT} "
                             f"({OPS['seq', DEFAULT_LAYOUT]})")
    return decision


def both_layouts_fit() -> Message:
    """Activations both layouts reproduce: the default is a guess, and the gradient depends on it."""
    other = next(name for name in LAYOUT_OPS if name != DEFAULT_LAYOUT)
    return Message.format(
        "the stored activations fit both gate layouts (the c and f gate blocks cannot be told apart, as with "
        "all-zero weights): computed as {} ({}), the default; if {} made them, give {}", DEFAULT_LAYOUT,
        OPS["seq", DEFAULT_LAYOUT], LAYOUT_OPS[other], Param("layout", other))


def _layout_contradicted(given: Given, found: str) -> Message:
    asked = given.value
    consequence = ("TensorFlow's GradientTape gradient of BlockLSTMV2 (the V1 kernel on IFCO activations), not the "
                   "true gradient" if asked == LAYOUT_V1 else "not the gradient of the op that made them")
    return Message.format("the activations fit layout {} ({}), not {} as {}: {} of them is {}", found,
                          LAYOUT_OPS[found], asked, _given_words(given, Param("layout", asked)), OPS["seq", asked],
                          consequence)


def _given_words(given: Given, param: Param) -> Message | str:
    """Who gave a value, for "not X as asked (...)"."""
    if given.source == "flag":
        return Message.format("asked ({})", param)
    return {"tensor": f"the file's {param.name} tensor says", "attribute": f"the file's {param.name} attribute says",
            "dump": "the forward op recorded in the dump says",
            "metadata": "the file's lstmgrad metadata says"}.get(given.source, f"{given.source} says")


def use_peephole(given: Given | None, fit: detect.ActivationFit | None, layout: str, *,
                 activations: bool = True) -> Decision:
    """use_peephole: the given value, else the one setting the activations fit with ``layout``, else false."""
    fitting = None
    if fit is not None and fit.fitting:
        fitting = sorted({h.use_peephole for h in fit.fitting if h.layout == layout}) or fit.peepholes
    if given is not None:
        decision = Decision(given.value, given.source)
        if fitting and given.value not in fitting:
            decision.warnings.append(_peephole_contradicted(given, fitting[0]))
        return decision
    if fitting is not None and len(fitting) == 1:
        return Decision(fitting[0], "activations")
    decision = Decision(False, "default")
    if activations:
        why = fit.why_peephole_unknown() if fit is not None and not fit.fits_nothing else (
            "they fit no setting" if fit is not None else "nothing to recompute")
        decision.defaults.append(f"use_peephole: not in the file and the activations cannot tell ({why}); false")
    return decision


def _peephole_contradicted(given: Given, found: bool) -> Message:
    asked = given.value
    text = Message.format(
        "the activations were computed with use_peephole={}, not use_peephole={} as asked ({}): the gradient with "
        "use_peephole={} is not the gradient of the op that made them", str(found).lower(), str(asked).lower(),
        peephole_origin(given), str(asked).lower())
    if given.source != "flag":  # what to give instead
        text = Message.format("{}; {} computes theirs", text, Param("use_peephole", found))
    return text


def peephole_origin(given: Given) -> Message | str:
    """Where the use_peephole in force came from, in the words a user recognises."""
    if given.source == "flag":
        return Message(Param("use_peephole", given.value))
    if given.source in ("tensor", "attribute"):
        return f"the file's use_peephole {given.source}"
    return SOURCE_WORDS.get(given.source, given.source)


def fits_nothing(fit: detect.ActivationFit | None) -> list[Message]:
    """A warning for activations no layout and peephole setting reproduce."""
    if fit is None or not fit.fits_nothing:
        return []
    return [Message.format(
        "the stored activations fit neither gate layout, with or without peepholes ({}): corrupted, saved at "
        "another step or from another checkpoint, or another kind of cell? {} says which tensor and step",
        fit.misfit(), Param("gradcheck", True))]


def decide(kind: str, arrays: dict, T: int, *, layout_given: Given | None = None,
           use_peephole_given: Given | None = None, seq_len_max_given: Given | None = None) -> Decisions:
    """Every decision of a problem whose activations are stored, in order: seq_len_max (the activations are
    fitted over the steps TF ran), what they fit, the layout, use_peephole.  ``arrays``: validated tensors
    (lazy time-major ones too: only the sampled steps are read)."""
    length = seq_len_max(T, seq_len_max_given, arrays) if kind == "seq" else Decision(1, "op")
    fit = detect.fit_activations(arrays, kind, length.value)
    chosen = layout(kind, layout_given, fit, length.value)
    peephole = use_peephole(use_peephole_given, fit, chosen.value)
    return Decisions(length, chosen, peephole, fit, fits_nothing(fit))
