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

A hypothesis fits when every tested gate is reproduced within ``gradcheck.CONSISTENCY_TOL``.  Only
``SAMPLE_ROWS`` batch rows and ``SAMPLE_UNITS`` units of each gate are recomputed, so the cost is a few
small products whatever T, B and C (benchmarks/bench_detection.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ..backends import cpu_blas
from ..ops.forward import logit, sigmoid
from ..ops.validation import PEEPHOLES
from ..spec import LAYOUT_OPS, LAYOUTS  # noqa: F401 - LAYOUT_OPS re-exported
from .gradcheck import CONSISTENCY_TOL, UNSATURATED

SAMPLE_ROWS = 8  # batch rows recomputed per step
SAMPLE_UNITS = 32  # cell units of each gate block recomputed



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
        # by hand: dataclasses.asdict deep-copies field by field, ~0.1 ms of every file a batch runs
        hypotheses = [{"layout": h.layout, "use_peephole": h.use_peephole, "worst": h.worst, "gate": h.gate,
                       "forget_bias": h.forget_bias} for h in self.hypotheses]
        return {"steps": list(self.steps), "rows": self.rows, "tolerance": self.tolerance,
                "peephole_weights_zero": self.peephole_weights_zero, "hypotheses": hypotheses,
                "layout": self.layout, "use_peephole": self.use_peephole, "fits_nothing": self.fits_nothing,
                "layouts": self.layouts, "peepholes": self.peepholes}


def sample_steps(seq_len_max: int) -> list[int]:
    """The time steps recomputed: the first two, the middle, and the last two before seq_len_max."""
    L = seq_len_max
    return sorted({t for t in (0, 1, L // 2, L - 2, L - 1) if 0 <= t < L})


def seq_len_max_stopped(arrays: dict, T: int) -> int | None:
    """The seq_len_max of stored activations that do not give it, where they say it is less than T: TF zeroes cs and
    h from step seq_len_max on and leaves i, f, o, ci, co there as whatever memory held (tf-semantics.md), which a
    backward pass over all T steps would read.  Zero cs and h at the last steps are taken for that only where the
    activations do not fit over all T steps but do fit before them.  None: nothing says it is not T.
    ``arrays`` may hold lazy time-major tensors: only the steps looked at are read."""
    cs, h = arrays["cs"], arrays["h"]
    if not cs.size:  # no example or no unit: no step holds anything to say so (and none to look at, T times)
        return None
    steps = T
    while steps > 0 and not np.any(cs[steps - 1]) and not np.any(h[steps - 1]):
        steps -= 1
    if steps == T:
        return None
    over_all = fit_activations(arrays, "seq", T)
    if over_all is not None and not over_all.fits_nothing:  # they fit at the zero steps too: really computed
        return None
    before = fit_activations(arrays, "seq", steps)
    if before is not None and before.fits_nothing:
        return None  # they fit nowhere: the warnings about them say more than a guess would
    return steps


def fit_activations(arrays: dict, kind: str, seq_len_max: int, layouts=tuple(LAYOUTS)) -> ActivationFit | None:
    """Test the layouts (and both peephole settings) on validated arrays; None when there is no step to test.

    ``arrays`` may hold lazy (on-disk) time-major tensors: only the sampled steps are read.
    """
    seq = kind == "seq"
    x, w = arrays["x"], arrays["w"]
    B = x.shape[-2]
    C = w.shape[1] // 4
    steps = sample_steps(seq_len_max) if seq else [0]
    if not steps or B == 0 or C == 0:
        return None
    dtype = str(x.dtype)
    tol = CONSISTENCY_TOL.get(dtype, 1e-4)
    rows = _spread(B, SAMPLE_ROWS)
    units = _spread(C, SAMPLE_UNITS)
    sample = _Sample(arrays, seq, steps, rows)
    stored = {name: sample.at(name, units) for name in ("i", "f", "o", "ci", "cs")}
    x_rows = sample.at("x")
    h_prev = sample.before("h_prev", "h")
    cs_prev = sample.before("cs_prev", "cs", units)
    columns = _gate_columns(C, units.tobytes())  # the sampled units of every gate block
    w = np.asarray(w)[:, columns].astype(np.float64)
    b = np.asarray(arrays["b"])[columns].astype(np.float64)
    zero = not any(np.asarray(arrays[n]).any() for n in PEEPHOLES)
    with np.errstate(all="ignore"):
        # the pre-activations of the sampled units of every block, [rows * steps, units] each, in one product:
        # small whatever the shape, so on one BLAS thread (threads it woke would spin against the work after it)
        with cpu_blas.single_threaded():
            z_all = np.concatenate([x_rows, h_prev], axis=1) @ w + b
        z = {block: z_all[:, block * units.size:(block + 1) * units.size] for block in range(4)}
        # a peephole term that is exactly zero (the weights of the sampled units are) changes nothing: the
        # deviation without it is reused, which halves the work for the common file without peepholes.  Zero
        # weights give zero terms wherever the states are finite (NaN or Inf times zero is NaN: computed then).
        if zero and np.isfinite(cs_prev).all() and np.isfinite(stored["cs"]).all():
            peep_terms, peeped = {}, dict.fromkeys(("i", "f", "o"), False)
        else:
            peep = {n: np.asarray(arrays[n])[units].astype(np.float64) for n in PEEPHOLES}
            peep_terms = {"i": cs_prev * peep["wci"], "f": cs_prev * peep["wcf"], "o": stored["cs"] * peep["wco"]}
            peeped = {gate: bool(term.any()) for gate, term in peep_terms.items()}
        forget = _ForgetFit(stored["f"], dtype)
        gate_dev = {}  # (gate, layout or None, use_peephole or None) -> (deviation, forget_bias)
        for use_peephole in (False, True):
            for gate, block in (("i", 0), ("o", 3)):  # the same block in both layouts
                if use_peephole and not peeped[gate]:
                    gate_dev[gate, None, True] = gate_dev[gate, None, False]
                    continue
                if use_peephole:
                    recomputed = sigmoid(z[block] + peep_terms[gate])
                else:
                    recomputed = sigmoid(z[block])
                gate_dev[gate, None, use_peephole] = (_worst(stored[gate], recomputed), None)
        for layout in layouts:
            k = LAYOUTS[layout]
            gate_dev["ci", layout, None] = (_worst(stored["ci"], np.tanh(z[k["c"]])), None)
            for use_peephole in (False, True):
                if use_peephole and not peeped["f"]:
                    gate_dev["f", layout, True] = gate_dev["f", layout, False]
                    continue
                zf = z[k["f"]] + peep_terms["f"] if use_peephole else z[k["f"]]
                gate_dev["f", layout, use_peephole] = forget.fit(zf)
    hypotheses = []
    for layout in layouts:
        for use_peephole in (False, True):
            devs = {"ci": gate_dev["ci", layout, None][0], "i": gate_dev["i", None, use_peephole][0],
                    "o": gate_dev["o", None, use_peephole][0], "f": gate_dev["f", layout, use_peephole][0]}
            tested = {g: d for g, d in devs.items() if d is not None}
            gate = max(tested, key=tested.get) if tested else None
            worst = tested[gate] / tol if gate else None
            hypotheses.append(Hypothesis(layout, use_peephole, worst, gate, gate_dev["f", layout, use_peephole][1]))
    hypotheses.sort(key=lambda h: (not h.fits, np.inf if h.worst is None else h.worst))
    return ActivationFit(steps, len(rows), tol, zero, hypotheses)


class _Sample:
    """The sampled rows of the sampled steps of time-major tensors (or of the cell op's [B, ...] ones), as
    float64 [steps * rows, ...]: one gather from an in-memory tensor, a read per step from a lazy one."""

    def __init__(self, arrays: dict, seq: bool, steps: list[int], rows: np.ndarray):
        self.arrays, self.seq, self.steps, self.rows = arrays, seq, steps, rows

    def at(self, name: str, cols=None) -> np.ndarray:
        return self._gather(self.arrays[name], self.steps, cols) if self.seq else self._rows(self.arrays[name], cols)

    def before(self, state: str, name: str, cols=None) -> np.ndarray:
        """The value before each sampled step: the initial ``state`` at step 0, else ``name`` one step earlier."""
        if not self.seq:
            return self._rows(self.arrays[state], cols)
        earlier = [t - 1 for t in self.steps if t > 0]
        parts = [self._rows(self.arrays[state], cols)] if self.steps[0] == 0 else []
        if earlier:
            parts.append(self._gather(self.arrays[name], earlier, cols))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _rows(self, value, cols) -> np.ndarray:
        picked = np.asarray(value)[self.rows]
        return (picked if cols is None else picked[:, cols]).astype(np.float64)

    def _gather(self, value, steps: list[int], cols) -> np.ndarray:
        if isinstance(value, np.ndarray) and value.flags.c_contiguous:  # one take of precomputed flat indexes
            picked = value.reshape(-1).take(self._flat_index(value.shape, steps, cols))
        elif isinstance(value, np.ndarray):
            picked = value[np.asarray(steps, dtype=np.intp)[:, None], self.rows]  # [steps, rows, ...]
            picked = picked.reshape(len(steps) * len(self.rows), picked.shape[-1])  # (not -1: I may be 0)
            picked = picked if cols is None else picked[:, cols]
        else:  # lazy: only these steps are read
            picked = np.concatenate([np.asarray(value[t])[self.rows] for t in steps])
            picked = picked if cols is None else picked[:, cols]
        return picked.astype(np.float64)

    def _flat_index(self, shape: tuple, steps: list[int], cols) -> np.ndarray:
        """The flat indexes of ``[steps][:, rows][..., cols]`` in a C-ordered [T, B, N] tensor, as
        [steps * rows, cols]; the five gate tensors share them, and a batch's files of one shape too."""
        return _flat_index(tuple(shape), tuple(steps), self.rows.tobytes(), None if cols is None else cols.tobytes())


@functools.lru_cache(maxsize=64)
def _flat_index(shape: tuple, steps: tuple, rows: bytes, cols: bytes | None) -> np.ndarray:
    _, B, N = shape
    cols = np.arange(N, dtype=np.intp) if cols is None else np.frombuffer(cols, dtype=np.intp)
    starts = (np.asarray(steps, dtype=np.intp)[:, None] * B + np.frombuffer(rows, dtype=np.intp)).reshape(-1, 1) * N
    index = starts + cols
    index.flags.writeable = False
    return index


@functools.lru_cache(maxsize=64)
def _gate_columns(C: int, units: bytes) -> np.ndarray:
    """The columns of w holding the sampled ``units`` of every gate block."""
    units = np.frombuffer(units, dtype=np.intp)
    columns = np.concatenate([block * C + units for block in range(4)])
    columns.flags.writeable = False
    return columns


@functools.lru_cache(maxsize=64)
def _spread_cached(n: int, k: int) -> np.ndarray:
    spread = np.array(sorted({round(v) for v in np.linspace(0, n - 1, min(n, k))}), dtype=np.intp)
    spread.flags.writeable = False
    return spread


def _spread(n: int, k: int) -> np.ndarray:
    """Up to ``k`` indices spread evenly over ``range(n)`` (without np.unique: its first call imports ~40 ms)."""
    return _spread_cached(n, k)


def _worst(stored: np.ndarray, recomputed: np.ndarray) -> float | None:
    """The largest |stored - recomputed| over entries where both are finite; None when there are none.
    ``recomputed`` (a float64 array of its own) is overwritten."""
    dev = np.subtract(stored, recomputed, out=recomputed)
    np.abs(dev, out=dev)
    worst = dev.max(initial=0.0)
    if np.isfinite(worst):  # NaN or Inf anywhere would show here
        return float(worst) if dev.size else None
    dev = dev[np.isfinite(dev)]
    return float(dev.max()) if dev.size else None


class _ForgetFit:
    """The forget gate f against ``σ(z_f + forget_bias)`` with the forget_bias that fits it best, for several
    z_f (layouts, peephole settings): ``logit(f)`` and where f is unsaturated are found once."""

    def __init__(self, f: np.ndarray, dtype: str):
        lim = UNSATURATED.get(dtype, 1e-3)
        self.f, self.unsaturated, self.logit = f, (f > lim) & (f < 1 - lim), logit(f)

    def fit(self, zf: np.ndarray) -> tuple[float | None, float | None]:
        """(largest deviation, forget_bias); (None, None) when f is saturated wherever zf is finite."""
        usable = self.unsaturated & np.isfinite(zf)
        if not usable.any():
            return None, None
        offsets = self.logit[usable] - zf[usable]
        lo, hi = (offsets.size - 1) // 2, offsets.size // 2  # the median (np.median imports numpy.ma, ~30 ms)
        middle = np.partition(offsets, (lo, hi))
        forget_bias = float(middle[lo] + middle[hi]) / 2
        return _worst(self.f, sigmoid(zf + forget_bias)), forget_bias
