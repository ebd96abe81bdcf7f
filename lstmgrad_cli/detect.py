"""Which op made these activations: the gate layout and peephole setting the stored gates fit.

The gradient ops use only the stored activations (docs/semantics.md), so BlockLSTMGradV2 run on a
BlockLSTM (ICFO) file, or run without peepholes on activations computed with them, gives a wrong
gradient and no error.  ``fit_activations`` recomputes the gate pre-activations ``[x, h_prev] @ w + b``
for a few time steps (the first two, the middle and the last two before seq_len_max) and a few batch
rows, and tests the four hypotheses (layout IFCO or ICFO, peepholes on or off) on what forget_bias
and cell_clip, which no file records, cannot change:

* ``ci = tanh(z_c)``: the c block is where the layouts differ (columns C..2C in ICFO, 2C..3C in IFCO);
* ``i = σ(z_i + cs_prev·wci)`` and ``o = σ(z_o + cs·wco)`` with the stored (clipped) states: the peepholes;
* ``f = σ(z_f + forget_bias + cs_prev·wcf)``: forget_bias is the one constant that makes f fit (the
  median of ``logit(f) - z_f`` over unsaturated entries), so f tests the layout and ``wcf`` too.

A hypothesis fits when every tested gate is reproduced within ``gradcheck.CONSISTENCY_TOL``.  The cost is
a few products of at most ``SAMPLE_ROWS * len(steps)`` rows, whatever T and B (benchmarks/bench_detection.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .forward import gate_slices, logit, sigmoid
from .gradcheck import CONSISTENCY_TOL, UNSATURATED
from .validation import PEEPHOLES

SAMPLE_ROWS = 8  # batch rows recomputed per step
LAYOUT_OPS = {"ifco": "BlockLSTMV2", "icfo": "BlockLSTM"}


@dataclass
class Hypothesis:
    """How well one (layout, use_peephole) reproduces the stored gates."""

    layout: str
    use_peephole: bool
    worst: float | None  # largest deviation of a tested gate, in units of the tolerance; None: nothing to test
    gate: str | None  # the gate with that deviation
    forget_bias: float | None  # the constant that fits f best (None when f is saturated everywhere)

    @property
    def fits(self) -> bool:
        return self.worst is not None and self.worst <= 1.0


@dataclass
class ActivationFit:
    """What the stored activations fit; ``layout``/``use_peephole`` are None when they cannot tell."""

    steps: list[int]
    rows: int
    tolerance: float
    peephole_weights_zero: bool
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first

    @property
    def tested(self) -> bool:
        return any(h.worst is not None for h in self.hypotheses)

    @property
    def fitting(self) -> list[Hypothesis]:
        return [h for h in self.hypotheses if h.fits]

    @property
    def fits_nothing(self) -> bool:
        return self.tested and not self.fitting

    @property
    def layouts(self) -> list[str]:
        return sorted({h.layout for h in self.fitting})

    @property
    def peepholes(self) -> list[bool]:
        return sorted({h.use_peephole for h in self.fitting})

    @property
    def layout(self) -> str | None:
        return self.layouts[0] if len(self.layouts) == 1 else None

    @property
    def use_peephole(self) -> bool | None:
        return self.peepholes[0] if len(self.peepholes) == 1 else None

    def fits(self, layout: str | None = None, use_peephole: bool | None = None) -> bool:
        """Whether some fitting hypothesis has this layout and/or peephole setting."""
        return any((layout is None or h.layout == layout) and (use_peephole is None or h.use_peephole == use_peephole)
                   for h in self.fitting)

    def why_peephole_unknown(self) -> str:
        if not self.tested:
            return "nothing could be recomputed"
        if self.peephole_weights_zero:
            return "the peephole weights wci, wcf, wco are all zero"
        return "both settings reproduce the stored gates (peephole terms below the tolerance)"

    def misfit(self) -> str:
        """The best hypothesis and how far it is off, for 'fits nothing' messages."""
        best = self.hypotheses[0]
        return (f"closest: layout {best.layout} with use_peephole={str(best.use_peephole).lower()}, {best.gate} off by "
                f"{best.worst * self.tolerance:.3g} (tolerance {self.tolerance:g})")

    def to_json(self) -> dict:
        doc = asdict(self)
        doc.update(layout=self.layout, use_peephole=self.use_peephole, fits_nothing=self.fits_nothing,
                   layouts=self.layouts, peepholes=self.peepholes)
        return doc


def sample_steps(seq_len_max: int) -> list[int]:
    """The time steps recomputed: the first two, the middle, and the last two before seq_len_max."""
    L = seq_len_max
    return sorted({t for t in (0, 1, L // 2, L - 2, L - 1) if 0 <= t < L})


def fit_activations(arrays: dict, kind: str, seq_len_max: int, layouts=("ifco", "icfo")) -> ActivationFit | None:
    """Test the layouts (and both peephole settings) on validated arrays; None when there is no step to test.

    ``arrays`` may hold lazy (on-disk) time-major tensors: only the sampled steps are read.
    """
    seq = kind == "seq"
    x, w = arrays["x"], arrays["w"]
    B, I = x.shape[-2], x.shape[-1]  # noqa: E741
    C = w.shape[1] // 4
    steps = sample_steps(seq_len_max) if seq else [0]
    if not steps or B == 0 or C == 0:
        return None
    dtype = str(x.dtype)
    tol = CONSISTENCY_TOL.get(dtype, 1e-4)
    rows = np.unique(np.linspace(0, B - 1, min(B, SAMPLE_ROWS)).round().astype(np.intp))

    def at(name: str, t: int) -> np.ndarray:
        value = arrays[name][t] if seq else arrays[name]
        return np.asarray(value)[rows].astype(np.float64)

    def before(state: str, name: str, t: int) -> np.ndarray:
        return np.asarray(arrays[state])[rows].astype(np.float64) if t == 0 else at(name, t - 1)

    stack = {name: np.concatenate([at(name, t) for t in steps]) for name in ("x", "i", "f", "o", "ci", "cs")}
    cs_prev = np.concatenate([before("cs_prev", "cs", t) for t in steps])
    h_prev = np.concatenate([before("h_prev", "h", t) for t in steps])
    w64 = np.asarray(w, dtype=np.float64)
    peep = {n: np.asarray(arrays[n], dtype=np.float64) for n in PEEPHOLES}
    with np.errstate(all="ignore"):
        z = stack["x"] @ w64[:I] + h_prev @ w64[I:] + np.asarray(arrays["b"], dtype=np.float64)
        hypotheses = []
        for layout in layouts:
            k = gate_slices(C, layout)
            ci_dev = _worst(stack["ci"], np.tanh(z[:, k["c"]]))
            for use_peephole in (False, True):
                zi, zf, zo = z[:, k["i"]], z[:, k["f"]], z[:, k["o"]]
                if use_peephole:
                    zi, zf, zo = zi + cs_prev * peep["wci"], zf + cs_prev * peep["wcf"], zo + stack["cs"] * peep["wco"]
                f_dev, forget_bias = _forget_fit(stack["f"], zf, dtype)
                devs = {"ci": ci_dev, "i": _worst(stack["i"], sigmoid(zi)), "o": _worst(stack["o"], sigmoid(zo)),
                        "f": f_dev}
                tested = {g: d for g, d in devs.items() if d is not None}
                gate = max(tested, key=tested.get) if tested else None
                worst = tested[gate] / tol if gate else None
                hypotheses.append(Hypothesis(layout, use_peephole, worst, gate, forget_bias))
    hypotheses.sort(key=lambda h: (not h.fits, np.inf if h.worst is None else h.worst))
    zero = all(not np.any(p) for p in peep.values())
    return ActivationFit(steps, len(rows), tol, zero, hypotheses)


def _worst(stored: np.ndarray, recomputed: np.ndarray) -> float | None:
    """The largest |stored - recomputed| over entries where both are finite; None when there are none."""
    dev = np.abs(stored - recomputed)
    dev = dev[np.isfinite(dev)]
    return float(dev.max()) if dev.size else None


def _forget_fit(f: np.ndarray, zf: np.ndarray, dtype: str) -> tuple[float | None, float | None]:
    """(largest deviation, forget_bias) with the forget_bias that fits f best; (None, None) when f is saturated."""
    lim = UNSATURATED.get(dtype, 1e-3)
    usable = (f > lim) & (f < 1 - lim) & np.isfinite(zf)
    if not usable.any():
        return None, None
    forget_bias = float(np.median(logit(f[usable]) - zf[usable]))
    return _worst(f, sigmoid(zf + forget_bias)), forget_bias
