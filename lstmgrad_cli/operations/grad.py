"""One gradient job: read an input file, check it, compute, write the output, summarise.

This is the library behind ``lstmgrad seq`` and ``lstmgrad cell`` (no click here): the command line,
batch runners and notebooks all call ``run_grad_file``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .. import __version__, io
from ..analysis.perstep import StepRecorder, impulse_norms, per_step_report
from ..analysis.summary import SummarisedOutput, TensorSummary, summarise
from ..backends import auto_note, cpu_blas, get_backend, resolve_name
from ..errors import InvalidArgumentError, OutputExistsError
from ..io import provenance
from ..messages import Message, Param
from ..ops import block_lstm_grad_checked, validation
from ..problem.gradients import gradients
from ..problem.reading import given, open_problem
from ..problem.request import Request
from ..results import BlockLSTMGradOutputs
from ..spec import layout_for

# A streamed x_grad this large is flushed to disk as the pass writes it (io.open_hdf5_output), not all at the end.
LARGE_OUTPUT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class GradOptions(Request):
    """A gradient run: the request (every field None: from the file or default), and what the run does with it."""

    kind: str = "seq"  # "seq" or "cell"
    force: bool = False  # an existing output is replaced
    per_step: bool = False  # seq only: norms of the gradients at every step (perstep.py)
    strict: bool = False  # NaN/Inf in inputs or gradients, or what contradicts the activations, is an error


@dataclass
class GradResult:
    """What a run did, for the summary table and the JSON document."""

    input: str
    output: str | None
    op: str
    member: str | None = None  # the execution of a TensorFlow debug dump (None for other inputs)
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
    sources: dict = field(default_factory=dict)  # parameter -> "flag" | "tensor" | "attribute" | "activations" | ...
    warnings: list[str] = field(default_factory=list)  # what was asked contradicts the activations, or nothing fits
    notes: list[str] = field(default_factory=list)  # what else to say (tensors from --weights, the op a dump recorded)
    recorded_op: str | None = None  # the gradient op TensorFlow ran, when the input (a dump) records it
    framework: str | None = None  # "keras" or "torch": the gradients are in that framework's names
    module: str | None = None  # what the framework's tensors are ("PyTorch nn.LSTM, 2 layers, bidirectional")
    computed_as: str | None = None  # how a framework's module is computed, in words
    activations: dict | None = None  # what the stored activations fit (detect.ActivationFit.to_json)
    tensors: list[TensorSummary] = field(default_factory=list)
    nonfinite_inputs: dict[str, int] = field(default_factory=dict)  # input tensor -> NaN/Inf entries
    per_step: dict | None = None  # with GradOptions.per_step: perstep.per_step_report
    seconds: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def run_grad_file(input_path: str | Path, output_path: str | Path | None, options: GradOptions, *,
                  input_format: str | None = None) -> GradResult:
    """Compute one file's gradients and write them; raises LstmGradError on any problem, writing nothing.

    An HDF5 input of the sequence op is read a chunk of time steps at a time (backwards; its datasets of
    ``lazy.LAZY_LEAST_BYTES`` or more), and with an HDF5 output x_grad is written chunk by chunk too, so memory does
    not grow with T.  ``input_format``:
    what ``io.sniff_format`` said of the input, when the caller has asked it already (a batch's plan).
    """
    start = time.perf_counter()
    input_path = Path(input_path)
    fmt = input_format or io.sniff_format(input_path)
    result = GradResult(str(input_path), None, options.op, layout=layout_for(options.kind, options.layout),
                        member=options.group if fmt == "tfdbg2" else None)

    backend_name = resolve_name(options.backend)
    backend = get_backend(backend_name)
    out = Path(output_path) if output_path is not None else io.default_output(input_path, fmt)
    request = options.key(input_path)
    try:
        io.check_output(out, options.force, [input_path], _other_inputs(options))
    except OutputExistsError:
        return existing_output(result, out, request, start)
    lazy = options.kind == "seq" and fmt in ("hdf5", "npz", "npy-dir")  # (NPZ members and .npy files: large ones)

    asked = options if options.kind == "seq" else replace(options, layout=None)  # (the cell op is always ICFO)
    with open_problem(input_path, asked, lazy=lazy, input_format=fmt) as problem:
        result.op, result.layout, result.warnings = problem.op, problem.layout, problem.warnings
        if problem.framework is not None:
            result.framework = problem.framework.framework
            result.module, result.computed_as = problem.framework.description, problem.framework.computed_as
        result.notes, result.recorded_op = problem.notes, problem.recorded_op
        passed_over = auto_note(options.backend)
        if passed_over:
            result.notes = [*result.notes, passed_over]
        result.activations = problem.fit.to_json() if problem.fit is not None else None
        if options.strict and problem.warnings:
            _verify_left_in_file(problem)  # a corrupt member is the error, not the misfit it may have caused
            raise InvalidArgumentError(_refused_strictly(input_path, problem.warnings))
        cdt = validation.resolve_compute_dtype(problem.arrays["x"].dtype, options.compute_dtype)
        seq_len_max = problem.seq_len_max if options.kind == "seq" else None
        result.backend, result.backend_version = backend_name, getattr(backend, "version", None)
        result.dtype, result.compute_dtype = problem.dtype, str(cdt)
        result.use_peephole, result.seq_len_max = problem.use_peephole, seq_len_max
        result.dims, result.sources, result.defaults = problem.dims._asdict(), problem.sources, problem.defaults
        metadata = {
            "tool": "lstmgrad", "version": __version__, "op": problem.op, "layout": problem.layout,
            "layout_source": problem.sources["layout"], "use_peephole_source": problem.sources["use_peephole"],
            "backend": backend_name, "backend_version": result.backend_version or "",
            "use_peephole": problem.use_peephole, "seq_len_max": -1 if seq_len_max is None else seq_len_max,
            "dtype": result.dtype, "compute_dtype": result.compute_dtype,
            "source": str(input_path.resolve()), "group": options.group or "",
            "framework": result.framework or "tf", "request": request,
        }
        try:
            if lazy and io.output_format(out) == "hdf5" and problem.framework is None:
                x_shape = problem.arrays["x"].shape
                large = math.prod(x_shape) * np.dtype(problem.dtype).itemsize >= LARGE_OUTPUT_BYTES
                with io.open_hdf5_output(out, options.force, large=large) as sink:
                    # summarised as the pass writes it: a tensor larger than memory is not read back for that
                    x_grad = SummarisedOutput(sink.create_dataset("x_grad", shape=x_shape, dtype=problem.dtype))
                    tensors = _compute(problem, backend, cdt, options, result, x_grad_out=x_grad)
                    for name, value in tensors.items():
                        if name != "x_grad":
                            sink.create_dataset(name, data=value)
                    io.write_metadata(sink, metadata)
            else:
                tensors = _compute(problem, backend, cdt, options, result)
                io.write_outputs(out, tensors, metadata, force=options.force)
        except OutputExistsError:  # another run published it while this one computed
            return existing_output(result, out, request, start)
    result.output = str(out)
    result.seconds = time.perf_counter() - start
    return result


def _other_inputs(options: GradOptions) -> dict:
    """What a run reads besides its input, by the name the user gave it (an output must never replace them)."""
    return {} if options.weights is None else {"the weights file": Path(options.weights)}


def existing_output(result: GradResult, out: Path, request: dict, start: float | None = None) -> GradResult:
    """The result of a run whose output already exists: kept (status "skipped") when it is complete and made from
    the same input with the same request, by whichever run; otherwise OutputExistsError saying how it differs.
    ``start``: when the run began (perf_counter), for its seconds; None keeps ``result.seconds``."""
    source = result.input
    difference = provenance.output_difference(out, source, request)
    if difference is None and provenance.records_request(out):
        result.status, result.output = "skipped", str(out)
        result.seconds = result.seconds if start is None else time.perf_counter() - start
        result.notes = [Message.format("already complete, from this input with the same options; kept ({} recomputes "
                                       "it)", Param("force", True))]
        result.warnings = []
        return result
    if difference is None:  # an older output without its request: it may be from other options
        raise OutputExistsError(Message.format("{}: its output {} already exists; use {} to keep it or {} to "
                                               "overwrite it", source, out, Param("skip_existing", True),
                                               Param("force", True)))
    raise OutputExistsError(Message.format("{}: its output {} already exists and {}; use {} to overwrite it", source,
                                           out, difference, Param("force", True)))


def _verify_left_in_file(problem) -> None:
    """Check the inputs left in their file that carry a checksum (an NPZ member's CRC-32: ``verify`` reads the rows
    no one read yet), raising the corrupt file's error.  Before --strict refuses a file for what its activations
    say: a value the layout's fit sampled may be the corrupt one."""
    for value in given(problem).values():
        verify = getattr(value, "verify", None) if isinstance(value, io.LazyRows) else None
        if verify is not None:
            verify()


def _refused_strictly(path, warnings) -> Message:
    return Message.format("{}: {} ({}: nothing written)", path, Message.join("; ", warnings), Param("strict", True))


def _compute(problem, backend, cdt, options: GradOptions, result: GradResult, x_grad_out=None) -> dict:
    """The gradients of a problem, with their summaries (and per-step report) filled into ``result``.

    Raises before anything is published when ``--strict`` finds NaN/Inf.
    """
    with cpu_blas.threads_for_pass(problem.seq_len_max if problem.kind == "seq" else 1, *problem.dims[1:]):
        return _gradients(problem, backend, cdt, options, result, x_grad_out)


def _gradients(problem, backend, cdt, options: GradOptions, result: GradResult, x_grad_out) -> dict:
    arrays = problem.arrays
    recorder = StepRecorder(problem.seq_len_max) if options.per_step and options.kind == "seq" else None
    if recorder is None:
        tensors = gradients(problem, backend, cdt, chunk_steps=options.chunk_steps, x_grad_out=x_grad_out)
    else:  # the op's own gradient, followed over its steps
        outputs = gradients(problem, backend, cdt, chunk_steps=options.chunk_steps, observe=recorder,
                            x_grad_out=x_grad_out, one_op="per_step", op_names=True)
        tensors = problem.framework.from_op(BlockLSTMGradOutputs(**outputs)) if problem.framework else outputs
    result.tensors = [summarise(name, value) for name, value in tensors.items()]
    result.nonfinite_inputs = _count_nonfinite(given(problem))  # (not the forward outputs lstmgrad recomputed)
    note = nonfinite_note(result)
    if note and options.strict:
        raise InvalidArgumentError(_refused_strictly(problem.path, [note]))
    if note:  # a warning as the others are: on stderr (-q too), in the JSON's warnings
        result.warnings = [*result.warnings, note]
    if recorder is not None:
        def backward(inputs, observe, x_grad_out):
            block_lstm_grad_checked(backend, problem.layout, problem.seq_len_max, inputs, problem.use_peephole, cdt,
                                    options.chunk_steps, observe=observe, x_grad_out=x_grad_out)

        result.per_step = per_step_report(outputs["x_grad"], recorder, problem.seq_len_max,
                                          impulse_norms(backward, arrays, problem.seq_len_max))
    return tensors


def nonfinite_note(result: GradResult) -> str:
    """Words for NaN/Inf found in a run's inputs and gradients; empty when all is finite."""
    notes = []
    if result.nonfinite_inputs:
        notes.append("NaN/Inf in inputs: " + ", ".join(f"{n} ({c})" for n, c in result.nonfinite_inputs.items()))
    bad = [f"{t.name} ({t.nonfinite})" for t in result.tensors if not t.finite]
    if bad:
        notes.append("NaN/Inf in gradients: " + ", ".join(bad))
    return "; ".join(notes)


def _count_nonfinite(arrays: dict) -> dict[str, int]:
    """NaN/Inf entries per input tensor (they are computed through, as TF does, and reported).

    Lazy (on-disk) tensors were counted as the backward pass read them; rows it did not read are read now."""
    counts = {}
    for name, a in arrays.items():
        if isinstance(a, np.ndarray):
            counts[name] = int(a.size - np.count_nonzero(np.isfinite(a)))
        elif isinstance(a, io.LazyRows):  # counted as the pass read it; only the rest is read now
            counts[name] = a.nonfinite()
        else:
            counts[name] = summarise(name, a).nonfinite
    return {name: n for name, n in counts.items() if n}
