"""``lstmgrad inspect DUMP``: every block-LSTM execution in a TensorFlow debug dump, and what is wrong.

The library behind the command for dumps (no click here).  For each execution of BlockLSTM, BlockLSTMV2,
LSTMBlockCell and their gradient ops: where it ran (a tf.function's graph, or eager), which run of the op it
is, its shapes and dtype, which inputs have recorded values (and why the others have none), for a gradient
op the forward op that made its activations and whether TensorFlow ran the right gradient op for it.  The
attributes no dump records are inferred from the recorded values, one execution at a time: use_peephole
from the gates (detect.py), and for forward ops forget_bias and cell_clip (gradcheck.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import detect, gradcheck
from .errors import LstmGradError
from .io import tfdbg
from .io._common import describe_keys
from .spec import ACTIVATIONS, FORWARD_OPS, SIGNATURES
from .summary import json_safe


@dataclass
class ExecutionInfo:
    member: str
    op_type: str
    where: str  # "graph <name>" or "eager"
    execution: int
    dtype: str | None
    dims: dict | None
    recorded: list[str]  # inputs with a value
    missing: dict[str, str]  # input -> why it has no value
    forward_op: str | None = None  # gradient ops: what made the activations
    forward_execution: str | None = None
    right_op: str | None = None  # the gradient op right for that forward op
    use_peephole: bool | None = None  # inferred from the recorded activations
    peephole_note: str = ""
    forget_bias: float | None = None  # forward ops, inferred
    cell_clip: float | None = None  # None with a forward op: no cs reached a clip
    forward_fit: str = ""  # forward ops: the inferred attributes in words
    verdict: str = ""


@dataclass
class DumpReport:
    path: str
    format: str
    tensorflow_version: str | None
    modes: dict
    records: int
    executions: list[ExecutionInfo] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # what seq/cell/check would refuse
    warnings: list[str] = field(default_factory=list)  # wrong gradients TensorFlow recorded, ...

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["ok"] = not self.errors
        return json_safe(doc)


def inspect_dump(path) -> DumpReport:
    """Everything about a dump's block-LSTM executions; raises InputFileError only for a dump that cannot be
    read at all."""
    index = tfdbg.index_dump(path)
    report = DumpReport(str(path), "tfdbg2", index.tensorflow_version, index.modes, index.records)
    if not index.executions:
        report.errors.append("no execution of BlockLSTM, BlockLSTMV2, LSTMBlockCell or their gradient ops is "
                             "recorded in this dump")
    for execution in index.executions:
        info = _info(execution)
        report.executions.append(info)
        where = f"{execution.member}"
        if execution.mode != tfdbg.FULL_TENSOR:
            report.errors.append(tfdbg.mode_error(where, tfdbg.MODES.get(execution.mode, str(execution.mode))))
            continue
        # seq_len_max is found from the activations when it was not recorded (problem.py): only the rest is needed
        needed = {n: why for n, why in info.missing.items() if n != "seq_len_max"}
        if "seq_len_max" in info.missing and execution.is_gradient:
            report.warnings.append(f"{where}: no recorded value for seq_len_max ({info.missing['seq_len_max']}); "
                                   "the gradient commands take T, or the step from which the recorded cs and h are "
                                   "zero (--seq-len-max N says it)")
        if needed and execution.is_gradient:
            report.errors.append(f"{where}: no recorded value for {describe_keys(needed)} "
                                 f"({'; '.join(needed.values())}); --weights FILE can supply it")
        if execution.is_gradient and info.right_op and info.right_op != execution.op_type:
            info.verdict = (f"TensorFlow ran {execution.op_type} on activations {info.forward_op} made: its gradient "
                            f"is {info.right_op}; lstmgrad seq/cell computes that")
            report.warnings.append(f"{where}: {info.verdict}")
        elif execution.is_gradient and info.right_op:
            info.verdict = "the right gradient op for its forward op"
        if not needed:
            problem = _infer(index, execution, info)
            if problem:
                report.errors.append(f"{where}: {problem}")
    return report


def _info(execution: tfdbg.OpExecution) -> ExecutionInfo:
    inputs = execution.inputs
    x, w = inputs.get("x"), inputs.get("w")
    dims = None
    if isinstance(w, tfdbg.TensorRef) and w.shape and len(w.shape) == 2:
        C = w.shape[1] // 4
        if isinstance(x, tfdbg.TensorRef) and x.shape:
            dims = dict(zip(("T", "B", "I") if len(x.shape) == 3 else ("B", "I"), x.shape, strict=False), C=C)
        else:
            dims = {"C": C}
    dtype = next((r.dtype for n, r in inputs.items() if isinstance(r, tfdbg.TensorRef) and n != "seq_len_max"), None)
    return ExecutionInfo(
        execution.member, execution.op_type, "eager" if execution.graph is None else f"graph {execution.graph}",
        execution.occurrence, dtype, dims,
        [n for n, r in inputs.items() if isinstance(r, tfdbg.TensorRef)],
        {n: m.why for n, m in execution.missing.items()},
        execution.forward_op, execution.forward_member, execution.right_op)


def _infer(index: tfdbg.DumpIndex, execution: tfdbg.OpExecution, info: ExecutionInfo) -> str | None:
    """use_peephole (and forget_bias, cell_clip for forward ops) from this execution's recorded values; what
    went wrong reading them, if anything."""
    from . import validation  # noqa: PLC0415 - validation imports io; io must not import it back

    kind, layout = tfdbg.OPS[execution.forward_op if execution.is_gradient and execution.forward_op in tfdbg.OPS
                             else execution.op_type][:2]
    names = [*SIGNATURES[FORWARD_OPS[kind, layout]].inputs, *ACTIVATIONS]
    try:
        loaded = tfdbg.load_execution(index, execution, names, [])
        arrays = validation.as_float_arrays({n: v for n, v in loaded.tensors.items() if n != "seq_len_max"})
        T = arrays["x"].shape[0] if kind == "seq" else 1
        length = 1
        if kind == "seq":  # not recorded: found as the gradient commands find it (problem.py)
            length = loaded.tensors.get("seq_len_max")
            if length is None:
                length = detect.seq_len_max_stopped(arrays, T)
            length = validation.check_seq_len_max(T if length is None else length, T)
        if kind == "seq":
            validation.check_forward(arrays, sequence=True)
        fit = detect.fit_activations(arrays, kind, length, layouts=(layout,))
    except LstmGradError as err:
        return " ".join(str(err).removeprefix(f"{index.path}: ").split())
    except (KeyError, ValueError, TypeError, IndexError) as err:
        return f"its recorded values do not make a {execution.op_type} problem ({err})"
    if fit is None:
        info.peephole_note = "no step to recompute"
        return None
    info.use_peephole = fit.use_peephole
    if fit.peephole_weights_zero:
        info.peephole_note = "irrelevant: the peephole weights are all zero"
    elif fit.use_peephole is None:
        info.peephole_note = "cannot tell: " + fit.why_peephole_unknown()
    else:
        info.peephole_note = "inferred from the activations"
    if not execution.is_gradient and info.use_peephole is not None:
        forward = gradcheck.forward_consistency(arrays, kind, layout=layout, use_peephole=info.use_peephole,
                                                seq_len_max=length)
        info.forget_bias = forward.forget_bias
        info.cell_clip = forward.cell_clip if forward.cell_clip_source == "inferred" else None
        clip = f"cell_clip={info.cell_clip:g}" if info.cell_clip is not None else "no cs reached a cell_clip"
        info.forward_fit = (f"forget_bias={info.forget_bias:g} ({forward.forget_bias_source}), {clip}; "
                            + ("consistent" if forward.consistent else "NOT consistent") + " with x, h_prev, w, b")
    return None
