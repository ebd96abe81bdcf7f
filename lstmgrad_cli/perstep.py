"""Gradients through time: per-step norms, the fastest growth and decay in words, a terminal chart.

``StepRecorder`` is passed to the backward pass as its ``observe`` callback and keeps the L2 norm
of the gradient carried back out of every step (into ``h`` and ``cs`` of the step before).
``per_step_report`` adds the norms of ``x_grad[t]`` and describes how the carried gradient grows or
decays, which is what people look for first when they suspect vanishing or exploding gradients.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .errors import LstmGradError

SPARK = "▁▂▃▄▅▆▇█"


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


def per_step_report(x_grad, recorder: StepRecorder, seq_len_max: int) -> dict:
    """Per-step numbers and their description, ready for JSON."""
    series = {
        "x_grad": x_grad_norms(x_grad, seq_len_max),
        "h_prev_grad": list(recorder.h),  # gradient carried out of step t into h[t-1]
        "cs_prev_grad": list(recorder.cs),  # ... into cs[t-1]
    }
    summary = _describe("carried h gradient", series["h_prev_grad"]) + _describe("carried cs gradient",
                                                                                  series["cs_prev_grad"])
    return {"steps": seq_len_max, "norms": series,
            "growth_factors": {k: _factors(v) for k, v in series.items() if k != "x_grad"},
            "summary": summary}


def sparkline(values: list[float], width: int = 60) -> str:
    """Values on a log scale as one line of block characters (buckets of steps when there are many)."""
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
    return "".join(" " if v is None else SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))]
                   for v in logs)


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415 - optional (the plot extra)
    except ImportError:
        raise LstmGradError("--plot needs matplotlib: pip install 'lstmgrad[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def check_plot_path(path) -> None:
    """Refuse, before any work, a figure path matplotlib could not write (format, directory)."""
    plt = _pyplot()
    path = Path(path)
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise LstmGradError(f"{path}: unknown figure format {path.suffix or '(none)'!r}; "
                            f"use one of {', '.join('.' + f for f in sorted(formats))}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise LstmGradError(f"{path}: directory {parent} does not exist")


def save_plot(report: dict, path, title: str) -> None:
    """The per-step norms as a figure (matplotlib, the optional ``plot`` extra)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    labels = {"x_grad": "|x_grad[t]|", "h_prev_grad": "|dL/dh[t-1]| carried", "cs_prev_grad": "|dL/dcs[t-1]| carried"}
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
        fig.savefig(path)
    except (OSError, ValueError) as err:
        raise LstmGradError(f"{path}: cannot write the figure: {err}") from None
    finally:
        plt.close(fig)
