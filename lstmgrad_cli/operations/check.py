"""``lstmgrad check``: compare our gradients with a reference file and explain why they differ.

The library behind the command (no click here).  ``run_check`` loads an input file as ``seq``/``cell``
would, computes its gradients, compares them tensor by tensor with a reference (for example
gradients dumped from TensorFlow) and, when they disagree, recomputes the gradients under each
known cause of disagreement to see which one reproduces the reference:

* TF's autodiff gradient of BlockLSTMV2 runs the ICFO kernel BlockLSTMGrad (docs/semantics.md), or more
  generally the other gate layout;
* peepholes on instead of off, or off instead of on;
* another ``seq_len_max`` (candidates from where the reference's x_grad stops being zero);
* TF's GPU LSTMBlockCellGrad, which counts the peephole term of cs_prev_grad twice (section 7 row 2);
* half precision rounded op by op (TF's CPU float16 kernels), the reverse, or float32 tensors run in
  half by mixed precision.

Single causes are tried first, then pairs of them.  ``--gradcheck`` adds gradcheck.py's forward
consistency and finite-difference checks.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .. import io
from ..analysis import gradcheck
from ..analysis.summary import json_safe
from ..backends import get_backend, resolve_name
from ..errors import InputFileError, InvalidArgumentError, LstmGradError
from ..messages import Message, Param, one_line
from ..ops import BlockLSTMGradOutputs, validation
from ..ops.forward import gate_slices
from ..problem.gradients import gradients
from ..problem.reading import Problem, load_problem, peephole_origin
from ..problem.request import Request
from ..spec import (
    ACTIVATIONS,
    CELL_GRADS_FULL,
    LAYOUT_OPS,
    LAYOUT_V1,
    LAYOUT_V2,
    OPS,
    OTHER_LAYOUT,
    PEEPHOLES,
    SEQ_GRADS,
)
from .batch import WorkerFailure, run_each

# (rtol, atol): passes when max|ours - ref| <= atol + rtol * max|ref|.  float32 and float16 as the
# fixtures' README recommends against TF CPU; float64 is for references computed in double.
TOLERANCES = {"float16": (1e-2, 1e-3), "float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}
MAX_SEQ_LEN_CANDIDATES = 16


# -- loading --------------------------------------------------------------------------------------

def load_reference(path, kind: str, group: str | None = None, names=None) -> tuple[dict, list[str]]:
    """The gradient tensors of a reference file (snake_case or camelCase names; ``names``: those of a Keras or
    PyTorch layer) and its other keys."""
    names = names or (SEQ_GRADS if kind == "seq" else CELL_GRADS_FULL)
    loaded = io.read_inputs(path, names, (), group)  # camelCase spellings are found too
    grads = dict(loaded.tensors)
    if not grads:
        raise InputFileError(
            f"{path}: no gradient tensors (expected some of {', '.join(names)}; the file has "
            f"{io.describe_keys(loaded.keys)})")
    known = {*names, *(io.camel(n) for n in names)}
    others = [k for k in loaded.keys if k not in known and k != io.METADATA_KEY]
    return {n: grads[n] for n in names if n in grads}, others


# -- computing ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """How a set of gradients is computed; the variants of ``explain`` change one or two fields."""

    layout: str
    use_peephole: bool
    seq_len_max: int
    compute_dtype: str | None = None
    double_count: bool = False  # TF's GPU LSTMBlockCellGrad peephole bug
    half_inputs: bool = False  # float32 tensors run in half (mixed precision)


def compute(problem: Problem, setting: Setting, backend, op_names: bool = False) -> dict[str, np.ndarray]:
    """The gradients of ``problem`` under ``setting`` (problem/gradients.py, and TF's GPU peephole double count),
    under the op's output names; a Keras or PyTorch layer's under its framework's names and layouts, unless
    ``op_names``."""
    out_dtype = problem.arrays["x"].dtype
    compute_dtype = setting.compute_dtype
    whole = problem.framework is not None and not problem.framework.single  # a whole module: no one op to vary
    if setting.half_inputs and not whole:
        problem = replace(problem, arrays={n: a.astype(np.float16) for n, a in problem.arrays.items()})
        compute_dtype = "float16"
    if setting.double_count and not whole:
        grads = _double_counted(problem, problem.arrays, setting)
        if problem.framework is not None and not op_names:
            grads = problem.framework.from_op(BlockLSTMGradOutputs(**grads))
    else:
        grads = gradients(problem, backend, compute_dtype, layout=setting.layout, use_peephole=setting.use_peephole,
                          seq_len_max=setting.seq_len_max, one_op="gradcheck" if op_names else None,
                          op_names=op_names)
    return {n: np.asarray(g).astype(out_dtype, copy=False) for n, g in grads.items()}


def _double_counted(problem: Problem, arrays: dict, setting: Setting) -> dict[str, np.ndarray]:
    """Gradients as TF's GPU LSTMBlockCellGrad gives them: cs_prev_grad = dcs f + 2 (di wci + df wcf).

    For a sequence, the cell gradient applied step by step (a TF1 LSTMBlockCell in a loop), so the
    wrong cs_prev_grad is carried into the earlier steps.  Computed in float64.
    """
    a = {n: np.asarray(v, dtype=np.float64) for n, v in gradcheck.as_sequence(arrays, problem.kind).items()}
    T, B, I = a["x"].shape  # noqa: E741
    C = a["w"].shape[1] // 4
    L = setting.seq_len_max if problem.kind == "seq" else 1
    k = gate_slices(C, setting.layout)
    peep = setting.use_peephole
    x_grad = np.zeros((T, B, I))
    w_grad, b_grad = np.zeros_like(a["w"]), np.zeros_like(a["b"])
    wci_grad, wcf_grad, wco_grad = (np.zeros(C) for _ in range(3))
    carried_cs, carried_h = np.zeros((B, C)), np.zeros((B, C))
    dicfo = np.zeros((B, 4 * C))
    for t in reversed(range(L)):
        cs_prev = a["cs_prev"] if t == 0 else a["cs"][t - 1]
        h_prev = a["h_prev"] if t == 0 else a["h"][t - 1]
        i, cs, f, o, ci, co = (a[n][t] for n in ACTIVATIONS[:-1])
        dc, dh = carried_cs + a["cs_grad"][t], carried_h + a["h_grad"][t]
        do = o * (1 - o) * dh * co
        dcs = (1 - co * co) * dh * o + dc
        if peep:
            dcs = dcs + do * a["wco"]
        dci = (1 - ci * ci) * dcs * i
        df = f * (1 - f) * dcs * cs_prev
        di = i * (1 - i) * dcs * ci
        carried_cs = dcs * f
        if peep:
            carried_cs = carried_cs + 2 * (di * a["wci"] + df * a["wcf"])
            wci_grad += (di * cs_prev).sum(0)
            wcf_grad += (df * cs_prev).sum(0)
            wco_grad += (do * cs).sum(0)
        dgates = np.zeros((B, 4 * C))
        for name, value in (("i", di), ("c", dci), ("f", df), ("o", do)):
            dgates[:, k[name]] = value
        xh_grad = dgates @ a["w"].T
        x_grad[t], carried_h = xh_grad[:, :I], xh_grad[:, I:]
        w_grad += np.concatenate([a["x"][t], h_prev], axis=1).T @ dgates
        b_grad += dgates.sum(0)
        dicfo = dgates
    grads = dict(x_grad=x_grad, cs_prev_grad=carried_cs, h_prev_grad=carried_h, w_grad=w_grad, wci_grad=wci_grad,
                 wcf_grad=wcf_grad, wco_grad=wco_grad, b_grad=b_grad)
    if problem.kind == "cell":
        grads["x_grad"] = x_grad[0]
        grads = {n: (dicfo if n == "dicfo" else grads[n]) for n in CELL_GRADS_FULL}
    return grads


# -- comparing ------------------------------------------------------------------------------------

@dataclass
class Comparison:
    name: str
    shape: list[int]
    reference_shape: list[int]
    max_abs_error: float | None
    max_rel_error: float | None  # max |ours - ref| / max |ref|
    ulps: float | None  # max_rel_error in units of the dtype's machine epsilon
    reference_max_abs: float | None
    tolerance: float | None  # atol + rtol * max |ref|
    passed: bool
    note: str = ""
    out_of_tolerance: int | None = None  # finite elements with |ours - ref| > tolerance
    worst_index: list[int] | None = None  # where |ours - ref| is largest
    worst_ours: float | None = None
    worst_reference: float | None = None
    first_bad_step: int | None = None  # tensors with a time axis (x_grad of a sequence): first step out of tolerance
    axes: list[str] | None = None  # what each axis is, in the layout the input gave ("t", "b", "i", "c", ...)


# What each axis of the op's gradients is ("col": one of the 4C gate columns).
OP_AXES = {"x_grad": ("t", "b", "i"), "cs_prev_grad": ("b", "c"), "h_prev_grad": ("b", "c"), "w_grad": ("row", "col"),
           "b_grad": ("col",), "wci_grad": ("c",), "wcf_grad": ("c",), "wco_grad": ("c",), "dicfo": ("b", "col")}


# A Keras or PyTorch gradient's axes, by its name: Keras' [I, 4C] and [C, 4C], PyTorch's [4C, I] and [4C, C].
FRAMEWORK_AXES = ((re.compile(r"((forward|backward)_)?kernel_grad"), ("i", "col")),
                  (re.compile(r"((forward|backward)_)?recurrent_kernel_grad"), ("c", "col")),
                  (re.compile(r"((forward|backward)_)?bias_grad"), ("col",)),
                  (re.compile(r"weight_ih_l\d+(_reverse)?_grad"), ("col", "i")),
                  (re.compile(r"weight_hh_l\d+(_reverse)?_grad"), ("col", "c")),
                  (re.compile(r"bias_(ih|hh)_l\d+(_reverse)?_grad"), ("col",)))


def gradient_axes(problem: Problem, names=()) -> dict[str, tuple[str, ...]]:
    """What each axis of each gradient of ``problem`` (a framework's: of those ``names``) is, in the layout its
    input gave: a cell's x_grad is [b, i]; a Keras layer's batch-first (unless time_major) and a PyTorch one's with
    batch_first are [b, t, i]; a module's states [n, b, c], n its layers and directions."""
    axes = dict(OP_AXES)
    if problem.kind == "cell":
        axes["x_grad"] = ("b", "i")
    plan = problem.framework
    if plan is not None:  # its own names, in the layout the user gave (frameworks.Plan says which)
        axes = plan.axes()
        for name in names:
            found = [ax for pattern, ax in FRAMEWORK_AXES if pattern.fullmatch(name)]
            if found:
                axes[name] = found[0]
    return axes


def compare(ours: dict, reference: dict, rtol: float, atol: float, dtype, axes=None) -> list[Comparison]:
    """Per tensor in both: max absolute/relative error, error in ulps, pass/fail against the tolerance, and
    where the difference is (the worst element, how many are out of tolerance, for a tensor whose ``axes``
    (name -> what each axis is) has a time axis "t", the first step out of tolerance)."""
    axes = axes or {}
    eps = float(np.finfo(np.dtype(dtype)).eps)
    results = []
    for name, ref in reference.items():
        if name not in ours:
            continue
        mine = np.asarray(ours[name], dtype=np.float64)
        ref64 = np.asarray(ref).astype(np.float64) if np.asarray(ref).dtype.kind in "fiub" else None
        if ref64 is None:
            results.append(Comparison(name, list(mine.shape), list(np.shape(ref)), None, None, None, None, None, False,
                                      f"reference is not numeric (dtype {np.asarray(ref).dtype})"))
            continue
        if ref64.shape != mine.shape:
            note = f"shape {list(ref64.shape)} in the reference, {list(mine.shape)} here"
            if ref64.shape == mine.shape[::-1] or (ref64.ndim == 2 and ref64.T.shape == mine.shape):
                note += " (transposed?)"
            results.append(Comparison(name, list(mine.shape), list(ref64.shape), None, None, None, None, None, False,
                                      note))
            continue
        finite_ref, finite_mine = np.isfinite(ref64), np.isfinite(mine)
        note = ""
        if not np.array_equal(finite_ref, finite_mine) or not np.array_equal(ref64[~finite_ref], mine[~finite_mine],
                                                                             equal_nan=True):
            note = (f"NaN/Inf differ: {int((~finite_ref).sum())} in the reference, "
                    f"{int((~finite_mine).sum())} here")
        both = finite_ref & finite_mine
        err = float(np.max(np.abs(mine[both] - ref64[both]))) if both.any() else 0.0
        scale = float(np.max(np.abs(ref64[both]))) if both.any() else 0.0
        tol = atol + rtol * scale
        rel = err / scale if scale else (0.0 if err == 0 else float("inf"))
        ulps = rel / eps if np.isfinite(rel) else None
        comparison = Comparison(name, list(mine.shape), list(ref64.shape), err, rel, ulps, scale, tol,
                                err <= tol and not note, note)
        labels = axes.get(name)
        if labels is not None and len(labels) == mine.ndim:
            comparison.axes = list(labels)
        if both.any() and err > 0:
            diff = np.where(both, np.abs(mine - ref64), -1.0)
            worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
            comparison.worst_index = [int(k) for k in worst]
            comparison.worst_ours, comparison.worst_reference = float(mine[worst]), float(ref64[worst])
            beyond = diff > tol
            comparison.out_of_tolerance = int(beyond.sum())
            if comparison.axes and "t" in comparison.axes and beyond.any():
                per_step = np.moveaxis(beyond, comparison.axes.index("t"), 0)
                comparison.first_bad_step = int(np.argmax(per_step.reshape(per_step.shape[0], -1).any(axis=1)))
        results.append(comparison)
    return results


# -- explaining -----------------------------------------------------------------------------------

@dataclass
class Variant:
    """One hypothesis: the reference was computed with ``changes`` instead of our setting."""

    causes: list[str]  # keys of CAUSES
    changes: dict
    reproduces: bool = False
    tensors_matching: int = 0
    tensors_compared: int = 0
    worst: float | None = None  # largest error / tolerance over the tensors
    explanation: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _variants(problem: Problem, base: Setting, reference: dict) -> list[tuple[str, dict]]:
    """Single changes of ``base`` worth trying, as (cause, changes)."""
    out: list[tuple[str, dict]] = []
    if problem.kind == "seq":
        out.append(("layout", {"layout": OTHER_LAYOUT[base.layout]}))
    peepholes_zero = all(not np.any(problem.arrays[n]) for n in PEEPHOLES)
    if base.use_peephole or not peepholes_zero:
        out.append(("peephole", {"use_peephole": not base.use_peephole}))
    if problem.kind == "seq":
        for length in _seq_len_candidates(problem, base.seq_len_max, reference):
            out.append(("seq_len_max", {"seq_len_max": length}))
    if base.use_peephole and not peepholes_zero:
        out.append(("gpu_double_count", {"double_count": True}))
    dtype = problem.dtype
    if dtype == "float16":
        if base.compute_dtype == "float16":
            out.append(("float32_once", {"compute_dtype": "float32"}))
        else:
            out.append(("half_op_by_op", {"compute_dtype": "float16"}))
    elif dtype == "float32":
        out.append(("mixed_precision", {"half_inputs": True}))
    return out


def _seq_len_candidates(problem: Problem, current: int, reference: dict) -> list[int]:
    T = problem.dims.T
    candidates = []
    x_grad = reference.get("x_grad")
    if x_grad is not None and np.shape(x_grad) == tuple(problem.arrays["x"].shape):
        nonzero = np.flatnonzero(np.any(np.asarray(x_grad).reshape(T, -1) != 0, axis=1))
        candidates.append(int(nonzero[-1]) + 1 if nonzero.size else 0)  # x_grad is zero from seq_len_max on
    if T <= MAX_SEQ_LEN_CANDIDATES:
        candidates.extend(range(T + 1))
    else:
        candidates.append(T)
    return [c for c in dict.fromkeys(candidates) if c != current]


CAUSES = {
    "layout": "gate layout",
    "peephole": "use_peephole",
    "seq_len_max": "seq_len_max",
    "gpu_double_count": "GPU LSTMBlockCellGrad peephole double count",
    "half_op_by_op": "half precision op by op",
    "float32_once": "float32 arithmetic",
    "mixed_precision": "half precision (mixed precision)",
}


def _explain(causes: list[str], problem: Problem, base: Setting, changes: dict) -> Message:
    texts = []
    for cause in causes:
        if cause == "layout":
            texts.append(_layout_explanation(problem, base.layout, changes["layout"]))
        elif cause == "peephole":
            texts.append(_peephole_explanation(problem, base.use_peephole, changes["use_peephole"]))
        elif cause == "seq_len_max":
            texts.append(Message.format(
                "The reference was computed with seq_len_max={}, here it is {} ({}); steps from seq_len_max on "
                "contribute nothing. Use {}.", changes["seq_len_max"], base.seq_len_max,
                problem.sources.get("seq_len_max", "flag"), Param("seq_len_max", changes["seq_len_max"])))
        elif cause == "gpu_double_count":
            texts.append(
                "The reference has TensorFlow's GPU LSTMBlockCellGrad peephole bug: cs_prev_grad counts the "
                "peephole term twice, dcs*f + 2*(di*wci + df*wcf) (tensorflow/tensorflow#34171; "
                "docs/semantics.md). TF's CPU kernel, BlockLSTMGrad and lstmgrad are correct.")
        elif cause == "half_op_by_op":
            texts.append(Message.format(
                "The reference was computed in half precision op by op, as TF's CPU float16 kernels do "
                "(every step rounded to half); lstmgrad computes float16 inputs in float32 and rounds once, "
                "which is more accurate. Use {} to reproduce TF CPU.", Param("compute_dtype", "float16")))
        elif cause == "float32_once":
            texts.append(Message.format(
                "The reference was computed in float32 and rounded to half once (lstmgrad's default, or a "
                "GPU), not op by op in half; drop {}.", Param("compute_dtype", "float16")))
        elif cause == "mixed_precision":
            texts.append(
                "The reference was computed in half precision from these float32 tensors, as TensorFlow's "
                "automatic mixed precision does with these ops on GPU (docs/semantics.md); the difference "
                "is half-precision rounding, not a bug in either result.")
    return Message.join(" ", texts)


def _layout_explanation(problem: Problem, ours: str, theirs: str) -> Message:
    """Why the reference matches the other layout, from what the activations fit (not from what was asked)."""
    found = problem.fit.layout if problem.fit is not None else None
    op_ours, op_theirs = OPS[("seq", ours)], OPS[("seq", theirs)]
    if found == ours and theirs == LAYOUT_V1:
        return Message.format(
            "The reference is BlockLSTMGrad, TensorFlow's V1 kernel with the ICFO gate layout, run on activations "
            "that BlockLSTMV2 made (they fit the IFCO layout only). That is what tf.GradientTape returns for "
            "BlockLSTMV2: TensorFlow registers the V1 gradient for both ops (docs/semantics.md), so the c and f "
            "gate blocks are swapped and the x, cs_prev, h_prev, w and b gradients are wrong. lstmgrad's "
            "BlockLSTMGradV2 result is the true gradient; to reproduce TF's tape anyway, use {}.",
            Param("layout", LAYOUT_V1))
    if found == ours:
        return Message.format(
            "The reference is BlockLSTMGradV2 (IFCO gate layout) run on activations that BlockLSTM (V1) made "
            "(they fit the ICFO layout only): the c and f gate blocks are swapped, so it is not their gradient. "
            "lstmgrad's BlockLSTMGrad result is; {} reproduces the reference.", Param("layout", LAYOUT_V2))
    if found == theirs:
        return Message.format(
            "The reference is {} (layout {}), the gradient of the op that made these activations (they fit layout "
            "{}); here {} was computed as asked ({}). Drop {}.", op_theirs, theirs, theirs, op_ours,
            Param("layout", ours), Param("layout", ours))
    return Message.format(
        "The reference matches {} (layout {}); here {} (layout {}) was computed, and the activations cannot tell "
        "which op made them. If they come from {}, use {}; if from BlockLSTMV2 and the reference is BlockLSTMGrad, "
        "it is TF's GradientTape gradient of BlockLSTMV2, which runs the V1 kernel (docs/semantics.md).", op_theirs,
        theirs, op_ours, ours, LAYOUT_OPS[theirs], Param("layout", theirs))


def _peephole_explanation(problem: Problem, ours: bool, theirs: bool) -> Message:
    """Why the reference matches the other use_peephole, from what the activations fit."""
    fit = problem.fit
    found = None
    if fit is not None and fit.fitting:
        settings = {h.use_peephole for h in fit.fitting if h.layout == problem.layout}
        found = settings.pop() if len(settings) == 1 else None
    flag = Param("use_peephole", theirs)
    ref, here = f"use_peephole={str(theirs).lower()}", f"use_peephole={str(ours).lower()}"
    source = peephole_origin(problem)
    if found == theirs:
        return Message.format("The reference was computed with {}, which the activations were computed with too; "
                              "here {} ({}). Use {}.", ref, here, source, flag)
    if found == ours:
        return Message.format("The reference was computed with {}, but the activations were computed with {}: the "
                              "reference is not the gradient of the op that made them (the gradient op was run with "
                              "another use_peephole than the forward op). {} reproduces it.", ref, here, flag)
    return Message.format("The reference was computed with {}, here it is {} ({}); use {}.", ref, here, source, flag)


def _relative_errors(comps: list[Comparison]) -> float:
    return sum(c.max_rel_error for c in comps if c.max_rel_error is not None and np.isfinite(c.max_rel_error))


def explain(problem: Problem, base: Setting, reference: dict, rtol: float, atol: float, backend,
            pairs: bool = True, base_comparisons: list[Comparison] | None = None) -> list[Variant]:
    """Try each known cause (then pairs of causes) and say which reproduce the reference.

    Half-precision inputs (mixed precision) are judged with float16 tolerances, so they must also
    bring the reference closer than our own result is: a difference that half rounding merely
    hides is not explained by it.  Several seq_len_max values can reproduce a reference when the
    file's activations are zero beyond its seq_len_max (zero gates pass no gradient); the smallest
    is kept.
    """
    singles = _variants(problem, base, reference)
    tried: list[Variant] = []
    base_error = _relative_errors(base_comparisons) if base_comparisons is not None else np.inf

    def attempt(causes, changes):
        setting = replace(base, **changes)
        tol_r, tol_a = rtol, atol
        if setting.half_inputs:
            tol_r, tol_a = max(rtol, TOLERANCES["float16"][0]), max(atol, TOLERANCES["float16"][1])
        try:
            ours = compute(problem, setting, backend)
        except InvalidArgumentError:
            return
        comps = compare(ours, reference, tol_r, tol_a, problem.dtype)
        ratios = [c.max_abs_error / c.tolerance if c.tolerance else (0.0 if not c.max_abs_error else np.inf)
                  for c in comps if c.max_abs_error is not None]
        reproduces = bool(comps) and all(c.passed for c in comps)
        if setting.half_inputs and reproduces:
            reproduces = _relative_errors(comps) < base_error
        variant = Variant(list(causes), changes, reproduces, sum(c.passed for c in comps), len(comps),
                          float(max(ratios)) if ratios else None)
        if variant.reproduces:
            variant.explanation = _explain(list(causes), problem, base, changes)
        tried.append(variant)

    for cause, changes in singles:
        attempt([cause], changes)
    if pairs and not any(v.reproduces for v in tried):
        for (c1, ch1), (c2, ch2) in itertools.combinations(singles, 2):
            if c1 == c2 or set(ch1) & set(ch2):
                continue
            attempt([c1, c2], {**ch1, **ch2})
    lengths = [v.changes["seq_len_max"] for v in tried if v.reproduces and v.causes == ["seq_len_max"]]
    for v in tried:
        if v.reproduces and v.causes == ["seq_len_max"] and v.changes["seq_len_max"] != min(lengths):
            v.reproduces, v.explanation = False, ""
    return sorted(tried, key=lambda v: (not v.reproduces, len(v.causes),
                                        v.worst if v.worst is not None else np.inf))


# -- the whole check ------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckOptions(Request):
    """A check: the request of the input checked, and how it is compared (with a reference, or gradcheck)."""

    reference_group: str | None = None
    rtol: float | None = None
    atol: float | None = None
    gradcheck: bool = False
    samples: int = 24
    seed: int = 0


@dataclass
class CheckReport:
    input: str
    reference: str | None
    op: str
    kind: str
    layout: str
    backend: str
    dtype: str
    compute_dtype: str | None
    use_peephole: bool
    seq_len_max: int | None
    dims: dict
    rtol: float
    atol: float
    sources: dict = field(default_factory=dict)
    defaults: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what was asked contradicts the activations, or nothing fits
    activations: dict | None = None  # what the stored activations fit (detect.ActivationFit.to_json)
    notes: list[str] = field(default_factory=list)  # the op a dump recorded, tensors from --weights, ...
    member: str | None = None  # the execution of a TensorFlow debug dump
    recorded_op: str | None = None  # the gradient op TensorFlow ran, when the input records it
    comparisons: list[Comparison] = field(default_factory=list)
    not_in_reference: list[str] = field(default_factory=list)
    other_reference_keys: list[str] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)
    forward: gradcheck.ForwardFit | None = None
    forward_alternative: gradcheck.ForwardFit | None = None  # a layout/peephole that fits better
    gradcheck: gradcheck.GradcheckResult | None = None
    framework: str | None = None  # "keras" | "torch": a framework's layer or module, in its own names
    module: str | None = None  # what it is ("PyTorch nn.LSTM, 2 layers, bidirectional")
    computed_as: str | None = None  # how its gradients are computed
    whole: bool = False  # several layers or directions (or activations the op has not): no op's causes to vary

    @property
    def comparisons_passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    @property
    def passed(self) -> bool:
        ok = self.comparisons_passed
        if self.forward is not None:
            ok = ok and self.forward.consistent
        if self.gradcheck is not None:
            ok = ok and self.gradcheck.ok
        return ok

    def to_json(self) -> dict:
        """A JSON-safe document: infinite or NaN numbers become None."""
        doc = asdict(self)
        doc["passed"] = self.passed
        doc["comparisons_passed"] = self.comparisons_passed
        if self.forward is not None:
            doc["forward"] = self.forward.to_json()
        if self.forward_alternative is not None:
            doc["forward_alternative"] = self.forward_alternative.to_json()
        if self.gradcheck is not None:
            doc["gradcheck"] = self.gradcheck.to_json()
        return json_safe(doc)


def run_check(input_path, reference_path, options: CheckOptions) -> CheckReport:
    """Compare (and explain), and with ``options.gradcheck`` check the forward pass and the gradient."""
    if reference_path is None and not options.gradcheck:
        raise InvalidArgumentError("nothing to check: give a reference file or ask for the gradient check")
    backend_name = resolve_name(options.backend)
    backend = get_backend(backend_name)
    problem = load_problem(input_path, options)
    rtol, atol = TOLERANCES[problem.dtype]
    rtol = options.rtol if options.rtol is not None else rtol
    atol = options.atol if options.atol is not None else atol
    base = Setting(problem.layout, problem.use_peephole, problem.seq_len_max, options.compute_dtype)
    if options.compute_dtype is not None:
        validation.resolve_compute_dtype(problem.arrays["x"].dtype, options.compute_dtype)
    ours = compute(problem, base, backend)
    report = CheckReport(
        str(input_path), None if reference_path is None else str(reference_path), problem.op, problem.kind,
        problem.layout, backend_name, problem.dtype,
        str(validation.resolve_compute_dtype(problem.arrays["x"].dtype, options.compute_dtype)),
        problem.use_peephole, problem.seq_len_max if problem.kind == "seq" else None, problem.dims._asdict(),
        rtol, atol, problem.sources, problem.defaults, problem.warnings,
        problem.fit.to_json() if problem.fit is not None else None, problem.notes, problem.member,
        problem.recorded_op)
    plan = problem.framework
    if plan is not None:
        report.framework, report.module, report.computed_as = plan.framework, plan.description, plan.computed_as
        report.whole = not plan.single

    if reference_path is not None:
        reference, others = load_reference(reference_path, problem.kind, options.reference_group,
                                           list(ours) if problem.framework else None)
        report.comparisons = compare(ours, reference, rtol, atol, problem.dtype, gradient_axes(problem, ours))
        report.not_in_reference = [n for n in ours if n not in reference]
        report.other_reference_keys = others
        if report.not_in_reference and io.sniff_format(reference_path) == "tfdbg2":
            report.warnings.append(
                f"the dump recorded {len(reference)} of the gradient op's {len(ours)} outputs (cut short, or still "
                f"being written?): {', '.join(report.not_in_reference)} could not be compared")
        if not report.comparisons_passed and any(c.max_abs_error is not None for c in report.comparisons) \
                and not report.whole:
            report.variants = explain(problem, base, reference, rtol, atol, backend,
                                      base_comparisons=report.comparisons)
            report.explanations = [v.explanation for v in report.variants if v.reproduces]

    if options.gradcheck:  # (it checks the op's gradient: a Keras or PyTorch layer's under the op's names)
        _gradcheck(problem, options, backend, compute(problem, base, backend, op_names=True)
                   if problem.framework is not None else ours, report)
    return report


def check_dump(dump, reference, options: CheckOptions, members: list[str], *, workers: int = 1,
               on_report=None) -> list:
    """``run_check`` of each execution of a TensorFlow debug dump, against the gradients TF recorded for it
    (``reference`` None) or a reference file; a ``CheckReport`` per execution, or the one-line error that
    stopped it (an input with no recorded value, a dead worker)."""
    jobs = [(str(dump), str(reference) if reference is not None else str(dump),
             replace(options, group=member, reference_group=options.reference_group if reference else member))
            for member in members]
    results = run_each(check_one, jobs, workers=workers, on_result=on_report)
    return [r.error if isinstance(r, WorkerFailure) else r for r in results]


def check_one(job: tuple) -> CheckReport | str:
    """One check: (input, reference, options) -> its report, or the error that stopped it, in one line."""
    source, reference, options = job
    try:
        return run_check(source, reference, options)
    except LstmGradError as err:
        return one_line(err)
    except MemoryError:
        return f"{source} [{options.group}]: out of memory"


def _gradcheck(problem: Problem, options: CheckOptions, backend, ours: dict, report: CheckReport) -> None:
    fit = gradcheck.forward_consistency(
        problem.arrays, problem.kind, layout=problem.layout, use_peephole=problem.use_peephole,
        seq_len_max=problem.seq_len_max, forget_bias=options.forget_bias, cell_clip=options.cell_clip)
    report.forward = fit
    if not fit.consistent:
        best = gradcheck.forward_fits(problem.arrays, problem.kind, seq_len_max=problem.seq_len_max,
                                      forget_bias=options.forget_bias, cell_clip=options.cell_clip)[0]
        if best.consistent:
            report.forward_alternative = best
    stored = ours if problem.kind == "seq" else {n: g for n, g in ours.items() if n != "dicfo"}
    report.gradcheck = gradcheck.finite_difference_check(
        problem.arrays, problem.kind, layout=problem.layout, use_peephole=problem.use_peephole,
        seq_len_max=problem.seq_len_max, forget_bias=fit.forget_bias, cell_clip=fit.cell_clip,
        samples=options.samples, seed=options.seed, backend=backend, stored_grads=stored)
