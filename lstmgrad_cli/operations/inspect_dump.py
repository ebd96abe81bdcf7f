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

from ..analysis import decide, gradcheck
from ..analysis.decide import Given
from ..analysis.summary import json_safe
from ..errors import LstmGradError, UnrecordedTensorsError
from ..io import tfdbg
from ..messages import Command, Message, Param, one_line, prefixed
from ..spec import ACTIVATIONS, FORWARD_OPS, SIGNATURES


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
    if index.dropped:  # (its circular buffer: some executions cannot be found, or lack values)
        report.warnings.append(index.dropped)
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
        # seq_len_max is found from the activations when it was not recorded (decide.py): only the rest is needed
        needed = {n: why for n, why in info.missing.items() if n != "seq_len_max"}
        if "seq_len_max" in info.missing and execution.is_gradient:
            report.warnings.append(Message.format(
                "{}: no recorded value for seq_len_max ({}); the gradient commands take T, or the step from which "
                "the recorded cs and h are zero ({} says it)", where, info.missing["seq_len_max"],
                Param("seq_len_max")))
        if needed and execution.is_gradient:
            report.errors.append(UnrecordedTensorsError(needed).prefixed(where).args[0])
        wrong = decide.recorded_op_note(execution.op_type, info.forward_op, info.right_op)
        if execution.is_gradient and wrong:
            info.verdict = Message.format("{}; {} computes that", wrong, Command(SIGNATURES[execution.op_type].kind))
            report.warnings.append(Message.format("{}: {}", where, info.verdict))
        elif execution.is_gradient and info.right_op:
            info.verdict = "the right gradient op for its forward op"
        if not needed:
            problem = _infer(index, execution, info, report)
            if problem:
                report.errors.append(prefixed(where, problem))
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


def _infer(index: tfdbg.DumpIndex, execution: tfdbg.OpExecution, info: ExecutionInfo, report: DumpReport):
    """What the gradient commands would decide for this execution from its recorded values (decide.py: the
    seq_len_max, the layout against the forward op recorded, use_peephole), and for forward ops forget_bias
    and cell_clip; their warnings go to ``report``.  Returns what went wrong reading the values, if anything."""
    from ..ops import validation  # noqa: PLC0415 - validation imports io; io must not import it back

    signature = SIGNATURES[execution.forward_op if execution.is_gradient and execution.forward_op in SIGNATURES
                           else execution.op_type]
    kind = signature.kind
    names = [*SIGNATURES[FORWARD_OPS[kind, signature.layout]].inputs, *ACTIVATIONS]
    try:
        loaded = tfdbg.load_execution(index, execution, names, [])
        arrays = validation.as_float_arrays({n: v for n, v in loaded.tensors.items() if n != "seq_len_max"})
        if kind == "seq":
            validation.check_forward(arrays, sequence=True)
        recorded = loaded.tensors.get("seq_len_max")
        decisions = decide.decide(kind, arrays, arrays["x"].shape[0] if kind == "seq" else 1,
                                  layout_given=Given(signature.layout, "dump"),
                                  seq_len_max_given=None if recorded is None else Given(recorded, "tensor"))
    except LstmGradError as err:
        text = one_line(err)  # (the dump's path is the report's heading)
        return Message(text.removeprefix(f"{index.path}: ")) if not isinstance(text, Message) else text
    except (KeyError, ValueError, TypeError, IndexError) as err:
        return f"its recorded values do not make a {execution.op_type} problem ({err})"
    for warning in decisions.all_warnings:
        report.warnings.append(prefixed(info.member, warning))
    fit, peephole = decisions.fit, decisions.use_peephole
    if fit is None:
        info.peephole_note = "no step to recompute"
        return None
    info.use_peephole = peephole.value if peephole.source == "activations" else None
    if fit.peephole_weights_zero:
        info.peephole_note = "irrelevant: the peephole weights are all zero"
    elif info.use_peephole is None:
        info.peephole_note = "cannot tell: " + fit.why_peephole_unknown()
    else:
        info.peephole_note = "inferred from the activations"
    if not execution.is_gradient and info.use_peephole is not None:
        forward = gradcheck.forward_consistency(arrays, kind, layout=decisions.layout.value,
                                                use_peephole=info.use_peephole, seq_len_max=decisions.seq_len_max.value)
        info.forget_bias = forward.forget_bias
        info.cell_clip = forward.cell_clip if forward.cell_clip_source == "inferred" else None
        clip = f"cell_clip={info.cell_clip:g}" if info.cell_clip is not None else "no cs reached a cell_clip"
        info.forward_fit = (f"forget_bias={info.forget_bias:g} ({forward.forget_bias_source}), {clip}; "
                            + ("consistent" if forward.consistent else "NOT consistent") + " with x, h_prev, w, b")
    return None
