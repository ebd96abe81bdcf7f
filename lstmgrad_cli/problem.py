"""Loading a gradient problem from a file: the tensors an op needs, validated, with where each
parameter came from.  ``seq``/``cell`` (jobs.py), ``check`` (diagnose.py) and batch runs all read
their inputs through ``load_problem``, so they agree on names, defaults and messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import io, validation
from .errors import InvalidArgumentError

# Tensors with a time axis: the ones an out-of-core run leaves on disk.
TIME_MAJOR = ("x", "i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad")
# TF op names by (kind, gate layout): the gradient ops and the forward ops they differentiate.
OPS = {("seq", "ifco"): "BlockLSTMGradV2", ("seq", "icfo"): "BlockLSTMGrad", ("cell", "icfo"): "LSTMBlockCellGrad"}
FORWARD_OPS = {("seq", "ifco"): "BlockLSTMV2", ("seq", "icfo"): "BlockLSTM", ("cell", "icfo"): "LSTMBlockCell"}


@dataclass
class Problem:
    """A gradient problem read from a file and validated, with where each parameter came from."""

    path: str
    kind: str  # "seq" | "cell"
    layout: str
    arrays: dict
    dims: validation.Dims
    seq_len_max: int  # 1 for the cell op
    use_peephole: bool
    sources: dict = field(default_factory=dict)  # parameter -> "flag" | "tensor" | "attribute" | "default"
    defaults: list[str] = field(default_factory=list)  # what was not given and how it was filled in
    keys: list[str] = field(default_factory=list)  # every entry of the file (group), as stored

    @property
    def dtype(self) -> str:
        return str(self.arrays["x"].dtype)

    @property
    def op(self) -> str:
        return OPS[(self.kind, self.layout)]


def resolve_param(name: str, flag, loaded: io.LoadedFile, default, default_text: str, sources: dict,
                  defaults: list[str]):
    """A scalar parameter: the command-line flag, else the file (tensor or attribute), else the default;
    records where it came from in ``sources`` and, for a default, a line in ``defaults``."""
    if flag is not None:
        sources[name] = "flag"
        return flag
    if name in loaded.scalars:
        value, origin = loaded.scalars[name]
        sources[name] = origin
        return value
    sources[name] = "default"
    defaults.append(f"{name}: not in the file, {default_text}")
    return default


def fill_absent_peepholes(loaded: io.LoadedFile, use_peephole: bool, defaults: list[str]) -> None:
    """Without peepholes wci/wcf/wco are never read: a file may leave them out (zeros of [C] are used)."""
    w = loaded.tensors.get("w")
    absent = [n for n in validation.PEEPHOLES if n not in loaded.tensors]
    if not absent or use_peephole or w is None or np.ndim(w) != 2 or w.dtype.kind != "f":
        return  # (validation explains a bad w)
    for name in absent:
        loaded.tensors[name] = np.zeros(np.shape(w)[1] // 4, dtype=w.dtype)
    defaults.append(f"{', '.join(absent)}: not in the file, zeros (unused without peepholes)")


def detect_kind(path: Path, x) -> str:
    """seq if x is rank 3, cell if rank 2."""
    if x is None:
        raise InvalidArgumentError(f"{path}: missing tensor x (needed to tell seq from cell; or pass --kind)")
    kind = {3: "seq", 2: "cell"}.get(np.ndim(x))
    if kind is None:
        raise InvalidArgumentError(f"{path}: x has rank {np.ndim(x)}; expected 3 (seq) or 2 (cell)")
    return kind


def load_problem(path, *, kind: str | None = None, layout: str = "ifco", use_peephole: bool | None = None,
                 seq_len_max: int | None = None, group: str | None = None) -> Problem:
    """Read and validate a seq or cell input; ``kind=None`` decides from the rank of x (3: seq, 2: cell).

    Flags (non-None arguments) override values in the file; missing ``seq_len_max`` means T and
    missing ``use_peephole`` false; without peepholes, absent wci/wcf/wco are zeros.  Every problem
    is an ``InvalidArgumentError`` naming the file.
    """
    with open_problem(path, kind=kind, layout=layout, use_peephole=use_peephole, seq_len_max=seq_len_max,
                      group=group) as problem:
        return problem


@contextlib.contextmanager
def open_problem(path, *, kind: str | None = None, layout: str = "ifco", use_peephole: bool | None = None,
                 seq_len_max: int | None = None, group: str | None = None, lazy: bool = False) -> Iterator[Problem]:
    """``load_problem`` whose time-major tensors may stay on disk (``lazy``, HDF5 only) while the block runs.

    Lazy tensors are read a chunk of time steps at a time by the backward pass, so an input larger
    than memory can be processed; they must not be used after the block ends.
    """
    path = Path(path)
    wanted = validation.SEQ_TENSORS if kind != "cell" else validation.CELL_TENSORS
    scalars = ("seq_len_max", "use_peephole") if kind != "cell" else ("use_peephole",)
    with io.open_inputs(path, wanted, scalars, group, lazy=TIME_MAJOR if lazy else ()) as loaded:
        yield _problem_from(path, loaded, kind, layout, use_peephole, seq_len_max)


def _problem_from(path: Path, loaded: io.LoadedFile, kind, layout, use_peephole, seq_len_max) -> Problem:
    if kind is None:
        kind = detect_kind(path, loaded.tensors.get("x"))
    layout = layout if kind == "seq" else "icfo"
    names = validation.SEQ_TENSORS if kind == "seq" else validation.CELL_TENSORS
    problem = Problem(str(path), kind, layout, {}, validation.Dims(0, 0, 0, 0), 1, False, keys=list(loaded.keys))

    def param(name, flag, default, text):
        return resolve_param(name, flag, loaded, default, text, problem.sources, problem.defaults)

    try:
        problem.use_peephole = validation.check_use_peephole(
            param("use_peephole", use_peephole, False, "no peepholes (false)"))
        fill_absent_peepholes(loaded, problem.use_peephole, problem.defaults)
        missing = [n for n in names if n not in loaded.tensors]
        if missing:
            raise InvalidArgumentError(
                f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)} ({problem.op} needs "
                f"{', '.join(names)}; the file has {io.describe_keys(loaded.keys)})")
        arrays = validation.as_float_arrays({n: loaded.tensors[n] for n in names})
        if kind == "seq":
            problem.dims = validation.check_block_lstm_grad(arrays)
            T = problem.dims.T
            problem.seq_len_max = validation.check_seq_len_max(
                param("seq_len_max", seq_len_max, T, f"using T = {T}"), T)
        else:
            problem.dims = validation.check_lstm_block_cell_grad(arrays)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{path}: {err}") from None
    problem.arrays = arrays
    return problem
