"""Gradients through time: per-step norms, the vanishing/exploding verdict in words, a terminal chart.

``StepRecorder`` is passed to the backward pass as its ``observe`` callback and keeps the L2 norm
of the gradient carried back out of every step (into ``h`` and ``cs`` of the step before).

The verdict does not come from those carried norms: they mix in every step's own ``h_grad`` and
``cs_grad``, so a loss on every output looks level however fast a signal fades.  It comes from a
second backward pass (``impulse_norms``) in which the only output gradient is a fixed random unit
vector at ``h[seq_len_max - 1]``: what reaches step t is that vector through the product of the
step Jacobians from the last step back to t, and its norm is how much of a late signal is left.
Both are reported, each labelled for what it is.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..errors import InvalidOptionError, LstmGradError, OutputExistsError, OutputFileError
from ..messages import Message, Param

SPARK = "▁▂▃▄▅▆▇█"
ASCII_SPARK = "_.-:=+*#"  # the same eight levels where the terminal cannot show blocks


class StepRecorder:
    """``observe(t, carried_h, carried_cs)`` callback: norms of the carried gradients per step."""

    def __init__(self, seq_len_max: int):
        self.h = [0.0] * seq_len_max
        self.cs = [0.0] * seq_len_max

    def __call__(self, t: int, carried_h, carried_cs) -> None:
        self.h[t] = _norm(carried_h)
        self.cs[t] = _norm(carried_cs)


def _norm(a) -> float:
    if hasattr(a, "get"):  # a cupy array: bring it to the host
        a = a.get()
    a = np.asarray(a, dtype=np.float64)
    return float(np.sqrt(np.dot(a.ravel(), a.ravel())))


class _Impulse:
    """A ``[T, B, C]`` output gradient read by slicing, as the backward pass reads inputs: zero everywhere
    but ``step``, which holds a fixed random vector of unit norm (no array of the full size is made)."""

    def __init__(self, shape: tuple, dtype, step: int | None, seed: int = 0):
        self.shape, self.dtype, self.step = tuple(shape), np.dtype(dtype), step
        self.ndim, self.size = len(self.shape), math.prod(self.shape)
        if step is not None:
            value = np.random.default_rng(seed).standard_normal(self.shape[1:])
            self.value = (value / np.linalg.norm(value)).astype(self.dtype)

    def __getitem__(self, index) -> np.ndarray:
        lo, hi, _ = (slice(None) if index in ((), Ellipsis) else index).indices(self.shape[0])
        out = np.zeros((max(hi - lo, 0), *self.shape[1:]), dtype=self.dtype)
        if self.step is not None and lo <= self.step < hi:
            out[self.step - lo] = self.value
        return out


class _Discard:
    """An ``x_grad_out`` that keeps nothing: the impulse pass needs only what is carried between steps."""

    def __init__(self, shape: tuple, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __setitem__(self, index, value) -> None:
        pass


def impulse_norms(run_backward, arrays: dict, seq_len_max: int) -> list[float]:
    """Norm of (dL/dh, dL/dcs) carried out of each step t < seq_len_max when the only output gradient is a
    unit vector at h[seq_len_max - 1]; ``run_backward(arrays, observe, x_grad_out)`` runs the op's backward
    pass (the same backend and settings as the real one)."""
    if seq_len_max == 0:
        return []
    shape, dtype = arrays["h_grad"].shape, arrays["h_grad"].dtype
    recorder = StepRecorder(seq_len_max)
    impulse = {**arrays, "cs_grad": _Impulse(shape, dtype, None), "h_grad": _Impulse(shape, dtype, seq_len_max - 1)}
    run_backward(impulse, recorder, _Discard(arrays["x"].shape, arrays["x"].dtype))
    return [math.hypot(h, cs) for h, cs in zip(recorder.h, recorder.cs, strict=True)]


def x_grad_norms(x_grad, seq_len_max: int, chunk: int = 64) -> list[float]:
    """Norm of x_grad[t] for t < seq_len_max, reading a lazy array (h5py dataset) a chunk at a time."""
    norms = []
    for lo in range(0, seq_len_max, chunk):
        block = np.asarray(x_grad[lo:min(lo + chunk, seq_len_max)], dtype=np.float64)
        norms.extend(float(v) for v in np.sqrt(np.einsum("tbi,tbi->t", block, block)))
    return norms


def _factors(norms: list[float]) -> list[float | None]:
    """factor[t] = |carried out of step t| / |carried out of step t+1| (the backward pass runs t+1 -> t)."""
    out: list[float | None] = []
    for t in range(len(norms) - 1):
        a, b = norms[t], norms[t + 1]
        out.append(a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else None)
    return out


def _describe(name: str, norms: list[float]) -> list[str]:
    factors = _factors(norms)
    known = [(f, t) for t, f in enumerate(factors) if f is not None and f > 0]
    if not known:
        return [f"{name}: too few steps (or all zero) to measure growth"]
    grow_f, grow_t = max(known)
    decay_f, decay_t = min(known)
    geo = math.exp(sum(math.log(f) for f, _ in known) / len(known))
    trend = "explodes" if geo > 1.1 else "vanishes" if geo < 0.9 else "stays level"
    lines = [f"{name}: {trend} going back in time (geometric mean x{geo:.3g} per step, "
             f"x{norms[0] / norms[-1]:.3g} from step {len(norms) - 1} to step 0)" if norms[-1] > 0 else
             f"{name}: {trend} going back in time (geometric mean x{geo:.3g} per step)"]
    if grow_f > 1:
        lines.append(f"  largest growth: x{grow_f:.3g} from step {grow_t + 1} back to step {grow_t}")
    if decay_f < 1:
        lines.append(f"  largest decay: x{decay_f:.3g} from step {decay_t + 1} back to step {decay_t}")
    return lines


def _verdict(impulse: list[float]) -> list[str]:
    """Vanishing, exploding or level, from the norms of a unit gradient injected at the last step."""
    L = len(impulse)
    if not L or not all(math.isfinite(v) for v in impulse):
        return ["last-step gradient: no steps, or not finite: no verdict"]
    left = impulse[0]  # what reaches step 0 of a unit vector at step L-1
    if left == 0.0:
        return [f"last-step gradient: vanishes entirely: nothing of a unit gradient at step {L - 1} reaches step 0"]
    per_step = left ** (1.0 / L)
    trend = "explodes" if per_step > 1.1 else "vanishes" if per_step < 0.9 else "stays level"
    lines = [f"last-step gradient: {trend} going back in time: a unit gradient at h[{L - 1}] is x{left:.3g} by "
             f"step 0 (x{per_step:.3g} per step, through the product of the step Jacobians)"]
    return lines + _describe("  per step", impulse)[1:]


def per_step_report(x_grad, recorder: StepRecorder, seq_len_max: int, impulse: list[float] | None = None) -> dict:
    """Per-step numbers and their description, ready for JSON.

    ``impulse``: ``impulse_norms`` of the same problem, from which the vanishing/exploding verdict comes.
    """
    series = {
        "x_grad": x_grad_norms(x_grad, seq_len_max),  # of the gradient with every output gradient
        "h_prev_grad": list(recorder.h),  # gradient carried out of step t into h[t-1], every output gradient
        "cs_prev_grad": list(recorder.cs),  # ... into cs[t-1]
    }
    summary = []
    if impulse is not None:
        series["last_step"] = list(impulse)  # a unit gradient at h[L-1] alone, carried back to step t
        summary += _verdict(impulse)
    summary += _describe("carried h gradient (every step's own h_grad, cs_grad mixed in)", series["h_prev_grad"])
    summary += _describe("carried cs gradient (every step's own h_grad, cs_grad mixed in)", series["cs_prev_grad"])
    return {"steps": seq_len_max, "norms": series,
            "growth_factors": {k: _factors(v) for k, v in series.items() if k != "x_grad"},
            "summary": summary}


def sparkline(values: list[float], width: int = 60, levels: str = SPARK) -> str:
    """Values on a log scale as one line of block characters, or of ``levels`` lowest to highest (buckets of steps
    when there are many)."""
    if not values:
        return ""
    buckets = max(1, math.ceil(len(values) / width))
    points = [max(values[k:k + buckets]) for k in range(0, len(values), buckets)]
    logs = [math.log10(v) if v > 0 and math.isfinite(v) else None for v in points]
    present = [v for v in logs if v is not None]
    if not present:
        return " " * len(points)
    lo, hi = min(present), max(present)
    span = hi - lo or 1.0
    return "".join(" " if v is None else levels[min(len(levels) - 1, int((v - lo) / span * len(levels)))]
                   for v in logs)


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415 - optional (the plot extra)
    except ImportError:
        raise LstmGradError(Message.format("{} needs matplotlib: pip install 'lstmgrad[plot]'",
                                           Param("plot"))) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def check_plot_path(path, force: bool = False, protected: Iterable = ()) -> None:
    """Refuse, before any work, a figure path matplotlib could not write (format: ``InvalidOptionError``, a usage
    error; directory), one that is a ``protected`` file (an input, the output), and one that exists unless
    ``force`` (``OutputExistsError``)."""
    path = Path(path)
    if path.is_dir():
        raise OutputFileError(f"{path}: is a directory; name a figure file (.png, .pdf, .svg)")
    plt = _pyplot()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise InvalidOptionError(f"{path}: unknown figure format {path.suffix or '(none)'!r}; "
                                 f"use one of {', '.join('.' + f for f in sorted(formats))}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputFileError(f"{path}: directory {parent} does not exist")
    for other in protected:
        if _same_file(path, Path(other)):
            also = "" if str(other) == str(path) else f" ({other})"
            raise OutputFileError(f"{path}: is a file this run reads or writes{also}; name another figure file")
    if path.exists() and not force:
        raise OutputExistsError(Message.format("{}: already exists; use {} to replace it with the figure", path,
                                               Param("force", True)))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def save_plot(report: dict, path, title: str, force: bool = False) -> None:
    """The per-step norms as a figure (matplotlib, the optional ``plot`` extra), written as every output is: into a
    temporary file beside ``path``, renamed into place when complete (an existing file replaced only with
    ``force``)."""
    from ..io.atomic import atomic_file  # noqa: PLC0415 - (only a run that draws writes a figure)

    plt = _pyplot()
    path = Path(path)

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    labels = {"x_grad": "|x_grad[t]|", "h_prev_grad": "|dL/dh[t-1]| carried", "cs_prev_grad": "|dL/dcs[t-1]| carried",
              "last_step": "unit gradient at the last step, carried to t"}
    for key, values in report["norms"].items():
        steps = range(len(values))
        positive = [v if v > 0 else float("nan") for v in values]
        ax.plot(steps, positive, marker="o" if len(values) <= 50 else None, markersize=3, label=labels[key])
    ax.set_yscale("log")
    ax.set_xlabel("time step t")
    ax.set_ylabel("L2 norm")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_file(path, force) as tmp, open(tmp.fd, "wb", closefd=False) as fh:
            fig.savefig(fh, format=path.suffix.lower().lstrip("."))
    except (OSError, ValueError) as err:
        raise LstmGradError(f"{path}: cannot write the figure: {err}") from None
    finally:
        plt.close(fig)
