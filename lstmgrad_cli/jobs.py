"""One gradient job: read an input file, check it, compute, write the output, summarise.

This is the library behind ``lstmgrad seq`` and ``lstmgrad cell`` (no click here): the command line,
batch runners and notebooks all call ``run_grad_file``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import __version__, io, validation
from .backends import get_backend, resolve_name
from .errors import InvalidArgumentError
from .ops import block_lstm_grad_checked, lstm_block_cell_grad_full
from .summary import TensorSummary, summarise

OPS = {("seq", "ifco"): "BlockLSTMGradV2", ("seq", "icfo"): "BlockLSTMGrad", ("cell", "icfo"): "LSTMBlockCellGrad"}


@dataclass(frozen=True)
class GradOptions:
    """Everything a gradient run needs besides the file names; None means "from the file or default"."""

    kind: str = "seq"  # "seq" or "cell"
    layout: str = "ifco"  # seq only; the cell op is always ICFO
    backend: str | None = None
    use_peephole: bool | None = None
    seq_len_max: int | None = None
    group: str | None = None
    compute_dtype: str | None = None
    chunk_steps: int | None = None
    force: bool = False

    @property
    def op(self) -> str:
        return OPS[(self.kind, self.layout if self.kind == "seq" else "icfo")]


@dataclass
class GradResult:
    """What a run did, for the summary table and the JSON document."""

    input: str
    output: str | None
    op: str
    status: str = "ok"
    error: str | None = None
    layout: str | None = None
    backend: str | None = None
    backend_version: str | None = None
    dtype: str | None = None
    compute_dtype: str | None = None
    use_peephole: bool | None = None
    seq_len_max: int | None = None
    dims: dict | None = None
    defaults: list[str] = field(default_factory=list)  # what was not given and how it was filled in
    sources: dict = field(default_factory=dict)  # parameter -> "flag" | "tensor" | "attribute" | "default"
    tensors: list[TensorSummary] = field(default_factory=list)
    nonfinite_inputs: dict[str, int] = field(default_factory=dict)  # input tensor -> NaN/Inf entries
    seconds: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _param(name, flag_value, loaded: io.LoadedFile, default, default_text, result: GradResult):
    if flag_value is not None:
        result.sources[name] = "flag"
        return flag_value
    if name in loaded.scalars:
        value, origin = loaded.scalars[name]
        result.sources[name] = origin
        return value
    result.sources[name] = "default"
    result.defaults.append(f"{name}: not in the file, {default_text}")
    return default


def run_grad_file(input_path: str | Path, output_path: str | Path | None, options: GradOptions) -> GradResult:
    """Compute one file's gradients and write them; raises LstmGradError on any problem, writing nothing."""
    start = time.perf_counter()
    input_path = Path(input_path)
    names = validation.SEQ_TENSORS if options.kind == "seq" else validation.CELL_TENSORS
    scalars = ("seq_len_max", "use_peephole") if options.kind == "seq" else ("use_peephole",)
    layout = options.layout if options.kind == "seq" else "icfo"
    result = GradResult(str(input_path), None, options.op, layout=layout)

    backend_name = resolve_name(options.backend)
    backend = get_backend(backend_name)
    fmt = io.sniff_format(input_path)
    out = Path(output_path) if output_path is not None else io.default_output(input_path, fmt)
    io.check_output(out, options.force, [input_path])

    loaded = io.read_inputs(input_path, names, scalars, options.group)
    use_peephole = validation.check_use_peephole(
        _param("use_peephole", options.use_peephole, loaded, False, "no peepholes (false)", result))
    _fill_absent_peepholes(loaded, use_peephole, result)
    missing = [n for n in names if n not in loaded.tensors]
    if missing:
        raise InvalidArgumentError(
            f"{input_path}: missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"({options.op} needs {', '.join(names)}; the file has {', '.join(loaded.keys) or 'nothing'})")
    try:
        arrays = validation.as_float_arrays(loaded.tensors)
        if options.kind == "seq":
            dims = validation.check_block_lstm_grad(arrays)
            seq_len_max = validation.check_seq_len_max(
                _param("seq_len_max", options.seq_len_max, loaded, dims.T, f"using T = {dims.T}", result), dims.T)
        else:
            dims = validation.check_lstm_block_cell_grad(arrays)
            seq_len_max = None
        cdt = validation.resolve_compute_dtype(arrays["x"].dtype, options.compute_dtype)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{input_path}: {err}") from None

    if options.kind == "seq":
        outputs = block_lstm_grad_checked(backend, layout, seq_len_max, arrays, use_peephole, cdt, options.chunk_steps)
    else:
        outputs = lstm_block_cell_grad_full(**arrays, use_peephole=use_peephole, backend=backend,
                                            compute_dtype=cdt)
    tensors = outputs._asdict()

    result.backend, result.backend_version = backend_name, getattr(backend, "version", None)
    result.dtype, result.compute_dtype = str(arrays["x"].dtype), str(cdt)
    result.use_peephole, result.seq_len_max, result.dims = use_peephole, seq_len_max, dims._asdict()
    metadata = {
        "tool": "lstmgrad", "version": __version__, "op": options.op, "layout": layout,
        "backend": backend_name, "backend_version": result.backend_version or "",
        "use_peephole": use_peephole, "seq_len_max": -1 if seq_len_max is None else seq_len_max,
        "dtype": result.dtype, "compute_dtype": result.compute_dtype,
        "source": str(input_path.resolve()), "group": options.group or "",
    }
    io.write_outputs(out, tensors, metadata, force=options.force)
    result.output = str(out)
    result.tensors = [summarise(name, value) for name, value in tensors.items()]
    result.nonfinite_inputs = _count_nonfinite(arrays)
    result.seconds = time.perf_counter() - start
    return result


def _count_nonfinite(arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """NaN/Inf entries per input tensor (they are computed through, as TF does, and reported)."""
    counts = {name: int(a.size - np.count_nonzero(np.isfinite(a))) for name, a in arrays.items()}
    return {name: n for name, n in counts.items() if n}


def _fill_absent_peepholes(loaded: io.LoadedFile, use_peephole: bool, result: GradResult) -> None:
    """Without peepholes, wci/wcf/wco are never read: a file may leave them out (zeros are used)."""
    absent = [n for n in validation.PEEPHOLES if n not in loaded.tensors]
    if use_peephole or not absent or "w" not in loaded.tensors:
        return
    w = np.asarray(loaded.tensors["w"])
    if w.ndim != 2 or w.dtype.kind != "f":
        return  # validation will explain w
    for name in absent:
        loaded.tensors[name] = np.zeros(w.shape[1] // 4, dtype=w.dtype)
    result.defaults.append(f"{', '.join(absent)}: not in the file, zeros (unused without peepholes)")
