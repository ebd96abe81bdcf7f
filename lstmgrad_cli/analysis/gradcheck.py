"""Are the stored activations consistent with the weights, and is the gradient the true one?

Two checks behind ``lstmgrad check --gradcheck``, on validated arrays (no files, no click):

* ``forward_consistency`` recomputes every step in float64 from ``x``, ``h_prev``, ``w``, ``b``
  (and the peepholes), *teacher-forced*: step t starts from the stored ``cs[t-1]``, ``h[t-1]``, so
  a bad step is found where it is and does not smear over the rest.  Activations saved from a
  different step or a different checkpoint than the weights are a frequent real bug; the gradient
  ops never notice, because they use only the stored activations (docs/semantics.md).
  ``forget_bias`` and ``cell_clip`` are not in the files: unless given they are inferred from the
  data (forget_bias from logit(f) minus the recomputed pre-activation; cell_clip from the entries
  where the stored cs differs from i*ci + f*cs_prev).
* ``finite_difference_check`` compares the analytic gradient (the op run on float64 activations
  recomputed from the inputs) with central differences of the float64 forward pass, on a sample
  of entries.  The loss is sum(cs_grad * cs + h_grad * h) over the steps t < seq_len_max, the
  function whose gradient the ops compute.  Where cs was clipped the ops pass the gradient straight
  through (docs/semantics.md), so the forward used for the differences keeps each step's clip
  offset fixed at its value at the base point: exactly the function TF differentiates.

Sequence and cell problems are handled alike: a cell problem is a sequence of one step, ICFO.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..backends import get_backend
from ..ops import block_lstm_grad_checked
from ..ops.forward import block_lstm_forward, gate_slices, logit, sigmoid
from ..spec import (
    ACTIVATIONS,
    CELL_LAYOUT,
    FORWARD_DEFAULTS,
    FORWARD_INPUTS,
    LAYOUT_OPS,
    LAYOUTS,
    PEEPHOLES,
    TIME_MAJOR,
    layout_for,
)

# Largest deviation of a recomputed activation that still counts as "the same", by dtype.  The
# forward ops match a float64 recomputation to a few ulp (docs/semantics.md); a wrong step or
# checkpoint moves gate values by orders of magnitude more.
CONSISTENCY_TOL = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-9}
# Forget-bias estimates use only gates away from saturation, where logit(f) is well conditioned.
UNSATURATED = {"float16": 0.05, "float32": 1e-3, "float64": 1e-6}


def as_sequence(arrays: dict, kind: str) -> dict:
    """A cell problem as a sequence of one step (time axis added to x and the per-step tensors)."""
    if kind == "seq":
        return dict(arrays)
    return {n: (a[None] if n in TIME_MAJOR else a) for n, a in arrays.items()}


# -- forward consistency ------------------------------------------------------------------------

@dataclass
class TensorFit:
    name: str
    max_deviation: float  # largest |stored - recomputed| (relative to max(1, |value|) for cs, h)
    bad_entries: int
    first_bad_step: int | None  # time step of the first entry beyond tolerance


@dataclass
class ForwardFit:
    """How well the stored activations match a recomputation with one layout / peephole choice."""

    layout: str
    use_peephole: bool
    forget_bias: float | None
    forget_bias_source: str  # "given" | "inferred" | "default"
    cell_clip: float
    cell_clip_source: str  # "given" | "inferred" | "none reached"
    tolerance: float
    steps: int
    tensors: list[TensorFit] = field(default_factory=list)
    nonzero_beyond_seq_len_max: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return all(t.bad_entries == 0 for t in self.tensors)

    @property
    def score(self) -> float:
        """Worst deviation in units of the tolerance (smaller is better)."""
        return max((t.max_deviation for t in self.tensors), default=0.0) / self.tolerance

    def inconsistent(self) -> list[TensorFit]:
        return [t for t in self.tensors if t.bad_entries]

    def to_json(self) -> dict:
        return {**asdict(self), "consistent": self.consistent}


def forward_consistency(arrays: dict, kind: str, *, layout: str, use_peephole: bool, seq_len_max: int,
                        forget_bias: float | None = None, cell_clip: float | None = None) -> ForwardFit:
    """Teacher-forced float64 recomputation of i, f, o, ci, cs, co, h from the stored state.

    ``arrays`` holds validated tensors (``h`` is optional for the cell op).  Gates use the
    recomputed pre-activations; ``cs`` uses the stored i, ci, f (so a bad ``cs`` is reported on
    its own), ``co`` the stored cs and ``h`` the stored o and co.
    """
    a = {n: np.asarray(v, dtype=np.float64) for n, v in as_sequence(arrays, kind).items()}
    dtype = str(np.asarray(arrays["x"]).dtype)
    tol = CONSISTENCY_TOL.get(dtype, 1e-4)
    L = seq_len_max
    T, B, I = a["x"].shape  # noqa: E741
    C = a["w"].shape[1] // 4
    k = gate_slices(C, layout)
    cs_prevs = np.concatenate([a["cs_prev"][None], a["cs"][:max(L - 1, 0)]])[:L]
    has_h = "h" in a
    if has_h:
        h_prevs = np.concatenate([a["h_prev"][None], a["h"][:max(L - 1, 0)]])[:L]
    else:  # one cell step: the state is h_prev
        h_prevs = a["h_prev"][None][:L]
    gates = a["x"][:L] @ a["w"][:I] + h_prevs @ a["w"][I:] + a["b"]
    zi, zc, zf, zo = (gates[..., k[g]] for g in ("i", "c", "f", "o"))
    if use_peephole:
        zi = zi + cs_prevs * a["wci"]
        zf = zf + cs_prevs * a["wcf"]
        zo = zo + a["cs"][:L] * a["wco"]
    i, f, o, ci, cs = (a[n][:L] for n in ("i", "f", "o", "ci", "cs"))

    fb_source = "given"
    if forget_bias is None:
        lim = UNSATURATED.get(dtype, 1e-3)
        mask = (f > lim) & (f < 1 - lim)
        if mask.any():
            forget_bias, fb_source = float(np.median(logit(f[mask]) - zf[mask])), "inferred"
            if abs(round(forget_bias, 2) - forget_bias) <= 10 * tol:  # 0.99997 is 1.0 in all but rounding
                forget_bias = round(forget_bias, 2) + 0.0  # + 0.0: no "-0.0"
        else:
            forget_bias, fb_source = FORWARD_DEFAULTS[LAYOUT_OPS[layout]][0], "default"

    cs_raw = i * ci + f * cs_prevs
    clip_source = "given"
    if cell_clip is None:
        cell_clip, clip_source = _infer_clip(cs, cs_raw, tol)
    cs_expected = np.clip(cs_raw, -cell_clip, cell_clip) if cell_clip > 0 else cs_raw

    with np.errstate(over="ignore", invalid="ignore"):
        expected = {
            "i": (i, sigmoid(zi), False), "f": (f, sigmoid(zf + forget_bias), False),
            "o": (o, sigmoid(zo), False), "ci": (ci, np.tanh(zc), False),
            "cs": (cs, cs_expected, True), "co": (a["co"][:L], np.tanh(cs), False),
        }
        if has_h:
            expected["h"] = (a["h"][:L], o * a["co"][:L], False)
    fit = ForwardFit(layout, use_peephole, forget_bias, fb_source, float(cell_clip), clip_source, tol, L)
    for name, (stored, recomputed, relative) in expected.items():
        dev = np.abs(stored - recomputed)
        if relative:
            dev = dev / np.maximum(1.0, np.abs(stored))
        dev = np.where(np.isnan(dev), np.inf, dev)
        bad = dev > tol
        first = int(np.argmax(bad.reshape(L, -1).any(axis=1))) if bad.any() else None
        fit.tensors.append(TensorFit(name, float(dev.max()) if dev.size else 0.0, int(bad.sum()), first))
    if kind == "seq" and L < T:
        fit.nonzero_beyond_seq_len_max = [n for n in ("cs", "h") if np.any(a[n][L:] != 0)]
    return fit


def _infer_clip(cs, cs_raw, tol) -> tuple[float, str]:
    """The cell clip that turns i*ci + f*cs_prev into the stored cs, if one does."""
    differ = np.abs(cs - cs_raw) / np.maximum(1.0, np.abs(cs)) > tol
    if not differ.any():
        return 0.0, "none reached"
    bounds = np.abs(cs[differ])
    clip = float(np.median(bounds))
    if np.all(np.abs(bounds - clip) <= tol * max(1.0, clip)) and np.all(np.abs(cs_raw[differ]) > clip):
        return clip, "inferred"
    return 0.0, "none reached"  # no single clip explains it: cs is simply inconsistent


def forward_fits(arrays: dict, kind: str, *, seq_len_max: int, forget_bias: float | None = None,
                 cell_clip: float | None = None, layouts=None, peepholes=(False, True)) -> list[ForwardFit]:
    """``forward_consistency`` for each layout and peephole setting, best fit first."""
    layouts = layouts or (tuple(LAYOUTS) if kind == "seq" else (CELL_LAYOUT,))
    fits = [forward_consistency(arrays, kind, layout=lay, use_peephole=p, seq_len_max=seq_len_max,
                                forget_bias=forget_bias, cell_clip=cell_clip)
            for lay in layouts for p in peepholes]
    return sorted(fits, key=lambda fit: (not fit.consistent, fit.score))


# -- float64 forward and finite differences -----------------------------------------------------

def _forward64(a: dict, fwd: dict, clip_offsets=None, offsets_out=None) -> dict:
    """forward.py's recurrence in float64 on sequence-shaped float64 arrays, as a dict of i..h."""
    outs = block_lstm_forward(fwd["seq_len_max"], **{n: a[n] for n in FORWARD_INPUTS}, forget_bias=fwd["forget_bias"],
                              cell_clip=fwd["cell_clip"], use_peephole=fwd["use_peephole"], layout=fwd["layout"],
                              compute_dtype=np.float64, clip_offsets=clip_offsets, offsets_out=offsets_out)
    return dict(zip(ACTIVATIONS, outs, strict=True))


@dataclass
class FDEntry:
    tensor: str
    index: list[int]
    analytic: float
    numeric: float
    abs_error: float
    ok: bool


@dataclass
class GradcheckResult:
    entries: list[FDEntry]
    max_abs_error: float
    max_rel_error: float
    step: float  # relative finite-difference step
    # Gradient computed from the stored activations versus from the recomputed (true) ones, per
    # output: max |difference| / max |true|.  Large when the activations do not fit the weights.
    stored_vs_recomputed: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries)

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _loss(outs, a, L) -> float:
    return float(np.sum(a["cs_grad"][:L] * outs["cs"][:L]) + np.sum(a["h_grad"][:L] * outs["h"][:L]))


def finite_difference_check(arrays: dict, kind: str, *, layout: str, use_peephole: bool, seq_len_max: int,
                            forget_bias: float, cell_clip: float, samples: int = 24, seed: int = 0,
                            backend=None, rtol: float = 1e-5, stored_grads: dict | None = None
                            ) -> GradcheckResult:
    """Analytic gradient (the op on float64 recomputed activations) against central differences."""
    layout = layout_for(kind, layout)
    a = {n: np.array(v, dtype=np.float64) for n, v in as_sequence(arrays, kind).items()}
    L = seq_len_max
    fwd = dict(layout=layout, use_peephole=use_peephole, seq_len_max=L, forget_bias=forget_bias,
               cell_clip=cell_clip)
    offsets = np.zeros(a["x"].shape[:2] + (a["w"].shape[1] // 4,))
    outs = _forward64(a, fwd, offsets_out=offsets)
    tensors = {n: a[n] for n in FORWARD_INPUTS}
    grads = block_lstm_grad_checked(get_backend(backend), layout, L, {**tensors, **outs, "cs_grad": a["cs_grad"],
                                    "h_grad": a["h_grad"]}, use_peephole, np.float64)._asdict()

    def loss_at(name, index, value):
        old = a[name][index]
        a[name][index] = value
        try:
            perturbed = _forward64(a, fwd, clip_offsets=offsets)
            return _loss(perturbed, a, L)
        finally:
            a[name][index] = old

    base = abs(_loss(outs, a, L))
    rng = np.random.default_rng(seed)
    names = [n for n in FORWARD_INPUTS if use_peephole or n not in PEEPHOLES]
    if L == 0:
        names = []
    per_tensor = max(1, -(-samples // max(len(names), 1)))
    eps = np.finfo(np.float64).eps ** (1 / 3)
    entries = []
    for name in names:
        shape = a[name].shape if name != "x" else (L, *a[name].shape[1:])
        size = int(np.prod(shape))
        if size == 0:
            continue
        for flat in rng.choice(size, size=min(per_tensor, size), replace=False):
            index = tuple(int(v) for v in np.unravel_index(int(flat), shape))
            v = a[name][index]
            step = eps * max(1.0, abs(v))
            numeric = (loss_at(name, index, v + step) - loss_at(name, index, v - step)) / (2 * step)
            analytic = float(grads[f"{name}_grad"][index])
            err = abs(analytic - numeric)
            ok = err <= rtol * max(abs(analytic), abs(numeric)) + 1e-9 * max(1.0, base)
            entries.append(FDEntry(name, list(index), analytic, float(numeric), float(err), bool(ok)))
    max_abs = max((e.abs_error for e in entries), default=0.0)
    max_rel = max((e.abs_error / max(abs(e.numeric), 1e-12) for e in entries if e.abs_error), default=0.0)
    result = GradcheckResult(entries, max_abs, max_rel, float(eps))
    if stored_grads:
        for name, stored in stored_grads.items():
            true = grads.get(name)
            if true is None:
                continue
            stored = np.asarray(stored, dtype=np.float64)
            true = true if kind == "seq" or name != "x_grad" else true[0]
            scale = float(np.max(np.abs(true))) if true.size else 0.0
            diff = float(np.max(np.abs(stored - true))) if true.size else 0.0
            result.stored_vs_recomputed[name] = diff / scale if scale else diff
    return result
