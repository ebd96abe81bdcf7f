"""The backend contract's conformance checks: what every backend must do, run on small problems against the numpy
backend (the reference the golden files hold to TensorFlow's).

``check(backend)`` returns what a backend got wrong (empty: it conforms).  The test suite runs it on every
built-in backend (the cupy backend through its kernels built for the host) and on any installed plugin;
``lstmgrad backends --check`` runs it on every usable backend; a plugin's own tests can call it:

    from lstmgrad_cli.backends.conformance import check
    assert check(MyBackend()) == []
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..spec import LAYOUTS, TIME_MAJOR, SeqTensors
from .contract import outputs_of

T, B, I, C = 5, 3, 4, 6  # noqa: E741 - small, with B != C != I so a transposed axis shows


@dataclass(frozen=True)
class Case:
    """One call the ops may make: the problem's dtype and settings, and what is passed besides."""

    dtype: str
    compute_dtype: str
    use_peephole: bool
    layout: str
    seq_len_max: int = T
    chunk_steps: int | None = None
    return_dgates: bool = False
    x_grad_out: bool = False
    observe: bool = False
    lazy: bool = False  # time-major inputs as lazy arrays (an HDF5 input's)
    cell: bool = False  # one cell step: T = 1 and h is None

    def __str__(self) -> str:
        extras = [name for name in ("return_dgates", "x_grad_out", "observe", "lazy", "cell") if getattr(self, name)]
        return (f"{self.dtype} computed in {self.compute_dtype}, {self.layout}, peephole={self.use_peephole}, "
                f"seq_len_max={self.seq_len_max}, chunk_steps={self.chunk_steps}" + "".join(f", {e}" for e in extras))


def cases() -> Iterator[Case]:
    for layout in LAYOUTS:
        for peephole in (False, True):
            for dtype in ("float32", "float64"):
                yield Case(dtype, dtype, peephole, layout)
            yield Case("float16", "float32", peephole, layout)
            yield Case("float16", "float16", peephole, layout)
    yield Case("float32", "float32", True, "icfo", seq_len_max=3, chunk_steps=2)
    yield Case("float32", "float32", False, "ifco", seq_len_max=0)
    yield Case("float32", "float32", True, "ifco", return_dgates=True)
    yield Case("float32", "float32", False, "ifco", x_grad_out=True, chunk_steps=2)
    yield Case("float64", "float64", True, "ifco", observe=True, chunk_steps=2)
    yield Case("float32", "float32", True, "ifco", lazy=True, chunk_steps=2)
    yield Case("float32", "float32", True, "icfo", cell=True, return_dgates=True)


class LazyRows:
    """A time-major tensor read by slicing along its first axis, as an HDF5 input's (``io.LazyDataset``) is:
    ``shape``, ``ndim``, ``dtype``, ``size``, ``[lo:hi]`` and ``read_into``; no ``__array__``."""

    def __init__(self, array: np.ndarray):
        self._array = array
        self.shape, self.dtype, self.ndim, self.size = array.shape, array.dtype, array.ndim, array.size

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        return np.array(self._array[index])

    def read_into(self, lo: int, hi: int, out: np.ndarray, dest=None) -> np.ndarray:
        filled = out if dest is None else out[dest]
        filled[...] = self._array[lo:hi]
        return filled


def problem(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors of plausible magnitudes (gates in (0, 1), tanh values in (-1, 1))."""
    rng = np.random.default_rng(seed)
    steps = 1 if case.cell else T

    def n(*shape):
        return rng.standard_normal(shape).astype(case.dtype)

    def u(lo, hi, *shape):
        return rng.uniform(lo, hi, shape).astype(case.dtype)

    return dict(x=n(steps, B, I), cs_prev=n(B, C), h_prev=u(-1, 1, B, C), w=n(I + C, 4 * C) / 3, wci=n(C),
                wcf=n(C), wco=n(C), b=n(4 * C), i=u(0, 1, steps, B, C), cs=n(steps, B, C), f=u(0, 1, steps, B, C),
                o=u(0, 1, steps, B, C), ci=u(-1, 1, steps, B, C), co=u(-1, 1, steps, B, C),
                h=u(-1, 1, steps, B, C), cs_grad=n(steps, B, C), h_grad=n(steps, B, C))


def _call(backend, case: Case, arrays: dict, seen: list | None = None):
    tensors = dict(arrays)
    if case.cell:
        tensors["h"] = None
    if case.lazy:
        tensors = {k: LazyRows(v) if k in TIME_MAJOR and v is not None else v for k, v in tensors.items()}
    extras = {}
    if case.x_grad_out:
        extras["x_grad_out"] = np.zeros(arrays["x"].shape, arrays["x"].dtype)
    if case.observe and seen is not None:  # (the arrays are on the backend's device: copied back as they come)
        host = getattr(backend, "to_host", None) or np.asarray
        extras["observe"] = lambda t, carried_h, carried_cs: seen.append(
            (t, np.array(host(carried_h), copy=True), np.array(host(carried_cs), copy=True)))
    length = 1 if case.cell else case.seq_len_max
    result = backend.block_lstm_grad(SeqTensors(**tensors), seq_len_max=length, use_peephole=case.use_peephole,
                                     layout=case.layout, compute_dtype=np.dtype(case.compute_dtype),
                                     chunk_steps=case.chunk_steps, return_dgates=case.return_dgates, **extras)
    return result, extras.get("x_grad_out")


def check(backend, reference=None) -> list[str]:
    """What ``backend`` gets wrong against the contract (``contract.Backend``), each in one line; [] when nothing.
    ``reference``: the backend to agree with (default: the numpy backend)."""
    if reference is None:
        from ._numpy import NumpyBackend  # noqa: PLC0415

        reference = NumpyBackend(overlap=False)
    problems = []
    for attribute in ("name", "version"):
        if not isinstance(getattr(backend, attribute, None), str):
            problems.append(f"{attribute} is not a str")
    for case in cases():
        try:
            problems += [f"{case}: {p}" for p in _check_case(backend, reference, case)]
        except Exception as err:  # noqa: BLE001 - a backend's crash is what the check reports
            problems.append(f"{case}: raised {type(err).__name__}: {' '.join(str(err).split())}")
    return problems


def _check_case(backend, reference, case: Case) -> list[str]:
    arrays = problem(case)
    want, want_dgates = outputs_of(_call(reference, case, arrays)[0], case.return_dgates)
    seen: list = []
    result, out = _call(backend, case, arrays, seen)
    if case.return_dgates and not (isinstance(result, tuple) and len(result) == 2):
        return ["return_dgates=True did not return (outputs, gate gradients)"]
    got, dgates = outputs_of(result, case.return_dgates)
    problems = []
    if tuple(getattr(got, "_fields", ())) != want._fields:
        return [f"returned {type(got).__name__}, not BlockLSTMGradOutputs"]
    tolerance = 4e-3 if case.compute_dtype == "float16" or case.dtype == "float16" else 64 * float(
        np.finfo(case.compute_dtype).eps)
    for field, a, b in zip(want._fields, want, got, strict=True):
        b = np.asarray(b)
        if b.shape != a.shape or b.dtype != a.dtype:
            problems.append(f"{field} is {b.dtype} {list(b.shape)}, not {a.dtype} {list(a.shape)}")
            continue
        scale = max(float(np.max(np.abs(a.astype(np.float64)), initial=0)), 1.0)
        error = float(np.max(np.abs(b.astype(np.float64) - a), initial=0))
        if not error <= tolerance * scale:
            problems.append(f"{field} is {error / scale:.2g} of its scale off the numpy backend's")
    length = 1 if case.cell else case.seq_len_max
    if np.any(np.asarray(got.x_grad)[length:]):
        problems.append("x_grad beyond seq_len_max is not zeros")
    if case.return_dgates:
        dgates = np.asarray(dgates)
        if dgates.shape != want_dgates.shape:
            problems.append(f"the gate gradients are {list(dgates.shape)}, not {list(want_dgates.shape)}")
        elif not np.allclose(dgates, want_dgates, rtol=tolerance, atol=tolerance):
            problems.append("the gate gradients differ from the numpy backend's")
    if case.x_grad_out and got.x_grad is not out:
        problems.append("x_grad_out was given and x_grad is not it")
    if case.observe:
        steps = [t for t, _, _ in seen]
        if steps != list(range(length - 1, -1, -1)):
            problems.append(f"observe saw steps {steps}, not {length - 1} down to 0")
        elif not np.allclose(seen[-1][1], np.asarray(got.h_prev_grad), rtol=tolerance, atol=tolerance):
            problems.append("observe's last carried_h is not h_prev_grad")
    return problems
