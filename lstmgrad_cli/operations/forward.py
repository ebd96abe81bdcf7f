"""One forward job: weights and inputs in, a complete file for ``lstmgrad seq``/``cell`` out.

The library behind ``lstmgrad forward seq|cell`` (no click here).  It runs BlockLSTMV2 (layout
IFCO), BlockLSTM (layout ICFO) or LSTMBlockCell on ``x, cs_prev, h_prev, w, wci, wcf, wco,
b`` with TF's per-op defaults for ``forget_bias`` and ``cell_clip`` (docs/semantics.md), adds
the output gradients ``cs_grad``/``h_grad`` (zeros, ones, seeded normal noise, or the input file's),
and writes everything under TF's names in TF's order, so the result is a consistent example that
the gradient commands read as it is.  Gate values beyond ``seq_len_max`` are zeros (TF leaves
uninitialised memory there).  Which op produced the file is recorded in its metadata (HDF5
attributes or the NPZ metadata entry); the gradient commands read only the tensors.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import __version__, backends, io
from ..analysis import decide
from ..analysis.summary import TensorSummary, summarise
from ..errors import InvalidArgumentError
from ..messages import Message, Param
from ..ops import block_lstm, block_lstm_v2, lstm_block_cell, validation
from ..problem.reading import fill_absent_peepholes, resolve_param
from ..problem.request import Request
from ..spec import (
    DEFAULT_LAYOUT,
    FORWARD_DEFAULTS,
    FORWARD_INPUTS,
    OUTPUT_GRADIENTS,
    forward_op_name,
    layout_for,
)

_GRADS_RE = re.compile(r"^(zeros|ones|file|random)(?::(\d+))?$")


def parse_grads(spec: str | None) -> tuple[str | None, int]:
    """``zeros``, ``ones``, ``random[:SEED]`` or ``file`` -> (mode, seed); None means "file if present, else ones"."""
    if spec is None:
        return None, 0
    match = _GRADS_RE.match(spec.strip().lower())
    if not match or (match.group(2) is not None and match.group(1) != "random"):
        raise InvalidArgumentError(Message.format("{} must be zeros, ones, random[:SEED] or file, got {}",
                                                  Param("grads"), repr(spec)))
    return match.group(1), int(match.group(2) or 0)


@dataclass(frozen=True)
class ForwardOptions(Request):
    """A forward run: the request (None: from the file, else the op's default), the output gradients to add."""

    kind: str = "seq"  # "seq" or "cell"
    layout: str = DEFAULT_LAYOUT  # seq only (the cell op has its own: spec.layout_for)
    grads: str | None = None  # see parse_grads
    force: bool = False

    @property
    def op(self) -> str:
        return forward_op_name(self.kind, self.layout)


@dataclass
class ForwardResult:
    input: str
    output: str | None
    op: str
    layout: str
    dtype: str | None = None
    compute_dtype: str | None = None
    use_peephole: bool | None = None
    seq_len_max: int | None = None
    forget_bias: float | None = None
    cell_clip: float | None = None
    grads: str | None = None
    dims: dict | None = None
    sources: dict = field(default_factory=dict)  # parameter -> "flag" | "tensor" | "attribute" | "default"
    defaults: list[str] = field(default_factory=list)
    tensors: list[TensorSummary] = field(default_factory=list)
    seconds: float | None = None
    backend: str | None = None  # where it was computed, and the version of what computed it
    backend_version: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def run_forward_file(input_path: str | Path, output_path: str | Path, options: ForwardOptions, *,
                     backend=None) -> ForwardResult:
    """Run the forward op on one file's inputs and write the complete gradient-op input file.  It computes where
    ``backend`` (an object; None: the one ``options.backend`` names) computes: on the host (numpy, whichever host
    backend is named), or, for a GPU backend, on its device, the inputs copied there once and the outputs back
    (``backends.placed``, ``backends.on_host``)."""
    start = time.perf_counter()
    if backend is None:
        name = backends.resolve_name(options.backend)
        backend = backends.get_backend(name)
    else:
        name = backend.name
    input_path, out = Path(input_path), Path(output_path)
    op = options.op
    layout = layout_for(options.kind, options.layout)
    if not backends.takes_gpu_arrays(backend):  # the host backends' forward is numpy's (ops/forward.py)
        name, version = "numpy", np.__version__
    else:
        version = getattr(backend, "version", None)
    result = ForwardResult(str(input_path), None, op, layout, backend=name, backend_version=version)
    mode, seed = parse_grads(options.grads)
    fb_default, clip_default = FORWARD_DEFAULTS[op]
    decide.forget_bias_allowed(op, options.forget_bias)
    io.check_output(out, options.force, [input_path])

    scalars = ("seq_len_max", "use_peephole") if options.kind == "seq" else ("use_peephole",)
    loaded = io.read_inputs(input_path, (*FORWARD_INPUTS, *OUTPUT_GRADIENTS), scalars, options.group)
    try:
        use_peephole = validation.check_use_peephole(
            resolve_param("use_peephole", options.use_peephole, loaded, False, "no peepholes (false)",
                          result.sources, result.defaults))
        fill_absent_peepholes(loaded, use_peephole, result.defaults)
        needed = [n for n in FORWARD_INPUTS if use_peephole or n not in validation.PEEPHOLES]
        missing = [n for n in needed if n not in loaded.tensors]
        if missing:
            raise InvalidArgumentError(
                f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)} ({op} needs "
                f"{', '.join(needed)}{'' if use_peephole else ', and wci, wcf, wco with peepholes'}; "
                f"the file has {io.describe_keys(loaded.keys)})")
        arrays = validation.as_float_arrays({n: loaded.tensors[n] for n in FORWARD_INPUTS})
        dims = validation.check_forward(arrays, options.kind == "seq")
        if options.kind == "seq":
            seq_len_max = validation.check_seq_len_max(
                resolve_param("seq_len_max", options.seq_len_max, loaded, dims.T, f"using T = {dims.T}",
                              result.sources, result.defaults), dims.T)
        else:
            seq_len_max = None
        forget_bias = float(options.forget_bias if options.forget_bias is not None else fb_default)
        cell_clip = float(options.cell_clip if options.cell_clip is not None else clip_default)
        result.sources["forget_bias"] = "flag" if options.forget_bias is not None else "default"
        result.sources["cell_clip"] = "flag" if options.cell_clip is not None else "default"
        if options.cell_clip is None:
            result.defaults.append(f"cell_clip: {op}'s default {cell_clip:g}" + (" (no clipping)" if cell_clip <= 0
                                                                                 else ""))
        if options.forget_bias is None and op != "BlockLSTMV2":  # V2 has no such attribute to default
            result.defaults.append(f"forget_bias: {op}'s default {forget_bias:g}")
        step_shape = ((dims.T,) if options.kind == "seq" else ()) + (dims.B, dims.C)
        dtype = arrays["x"].dtype
        cs_grad, h_grad, result.grads = _output_grads(mode, seed, loaded, step_shape, dtype, result)
        cdt = validation.resolve_compute_dtype(dtype, options.compute_dtype)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{input_path}: {err}") from None

    common = dict(cell_clip=cell_clip, use_peephole=use_peephole, compute_dtype=options.compute_dtype)
    there = backends.placed(backend, arrays)
    if op == "BlockLSTMV2":
        outs = block_lstm_v2(seq_len_max, **there, **common)
    elif op == "BlockLSTM":
        outs = block_lstm(seq_len_max, **there, forget_bias=forget_bias, **common)
    else:
        outs = lstm_block_cell(**there, forget_bias=forget_bias, **common)
    outs = backends.on_host(backend, outs)

    tensors: dict[str, np.ndarray] = {}
    if seq_len_max is not None:
        tensors["seq_len_max"] = np.array(seq_len_max, dtype=np.int64)
    tensors.update(arrays)
    tensors.update(outs._asdict())
    tensors["cs_grad"], tensors["h_grad"] = cs_grad, h_grad
    tensors["use_peephole"] = np.array(use_peephole)
    metadata = {
        "tool": "lstmgrad", "version": __version__, "op": op, "layout": layout,
        "forget_bias": forget_bias, "cell_clip": cell_clip, "grads": result.grads,
        "dtype": str(dtype), "compute_dtype": str(cdt), "source": str(input_path.resolve()),
        "group": options.group or "", "backend": name, "backend_version": result.backend_version or "",
    }
    io.write_outputs(out, tensors, metadata, force=options.force)

    result.output = str(out)
    result.dtype, result.compute_dtype = str(dtype), str(cdt)
    result.use_peephole, result.seq_len_max = use_peephole, seq_len_max
    result.forget_bias, result.cell_clip, result.dims = forget_bias, cell_clip, dims._asdict()
    result.tensors = [summarise(n, v) for n, v in tensors.items() if n not in ("seq_len_max", "use_peephole")]
    result.seconds = time.perf_counter() - start
    return result


def _output_grads(mode, seed, loaded: io.LoadedFile, shape, dtype, result: ForwardResult):
    present = [n for n in OUTPUT_GRADIENTS if n in loaded.tensors]
    if mode is None:
        mode = "file" if len(present) == 2 else "ones"
        result.defaults.append("cs_grad, h_grad: " + ("taken from the input file" if mode == "file"
                                                       else "not both in the file, ones"))
    if mode == "file":
        if len(present) < 2:
            absent = [n for n in OUTPUT_GRADIENTS if n not in present]
            raise InvalidArgumentError(Message.format("{}: {} not in the file", Param("grads", "file"),
                                                      " and ".join(absent)))
        grads = validation.as_float_arrays({n: loaded.tensors[n] for n in OUTPUT_GRADIENTS})
        for name, value in grads.items():
            if value.shape != tuple(shape):
                raise InvalidArgumentError(f"{name} has shape {list(value.shape)}, expected {list(shape)}")
        return grads["cs_grad"].astype(dtype), grads["h_grad"].astype(dtype), "file"
    if mode == "random":
        rng = np.random.default_rng(seed)
        return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype),
                f"random:{seed}")
    fill = np.zeros if mode == "zeros" else np.ones
    return fill(shape, dtype=dtype), fill(shape, dtype=dtype), mode
