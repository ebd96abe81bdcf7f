"""``lstmgrad inspect``: what is in a file, which op it fits, and everything that is wrong with it.

The library behind the command (no click here).  Unlike the gradient commands, which stop at the
first problem, ``inspect_file`` reads every entry on its own (an unreadable one is a problem, not a
crash), checks each tensor's dtype, rank and shape against the sizes the others imply, and lists
all problems at once, without computing any gradient.

Which op: x of rank 3 is a sequence (BlockLSTMGradV2 or BlockLSTMGrad), rank 2 one cell step
(LSTMBlockCellGrad); a file without the forward outputs is an input for ``lstmgrad forward``; a file
of ``*_grad`` tensors is a gradient file (a reference for ``lstmgrad check``).  Every tensor is checked by
the rules ``seq``/``cell`` enforce (validation.py, which lists them all here), and seq_len_max, the gate
layout and use_peephole are decided as ``seq``/``cell`` decide them (decide.py: the file's metadata and
scalars, else the stored gates), with the same warnings, so the two never disagree.  The forward pass with
what was decided is then recomputed at every step in float64 (gradcheck.py) for forget_bias and cell_clip,
and for a misfit at a step the detection does not sample.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import frameworks, io
from ..analysis import decide, gradcheck
from ..analysis.decide import Given
from ..analysis.summary import json_safe
from ..errors import LstmGradError
from ..io import npydir
from ..messages import TYPED, Command, Message, Param, cut, message_of
from ..ops import validation
from ..problem.reading import load_problem
from ..spec import CELL_LAYOUT, FORWARD_INPUTS, FORWARD_OPS, GRADIENT_NAMES, OPS

SCALARS = ("seq_len_max", "use_peephole")
KNOWN = (*validation.SEQ_TENSORS, *SCALARS, *GRADIENT_NAMES)
ALIASES = {io.camel(name): name for name in KNOWN if io.camel(name) != name}
# Entries no command would read (not the op's, a Keras layer's or a PyTorch module's) are read and shown up to this
# many; the others are counted, never read (a file with 65,000 stray members took minutes and 370 MB).
OTHERS_SHOWN = 50
FRAMEWORK_NAMES = frozenset(frameworks.file_names(frameworks.FrameworkOptions()))


@dataclass
class TensorInfo:
    key: str  # as stored
    name: str | None  # TF's name it stands for, None if lstmgrad does not use it
    shape: list[int] | None
    dtype: str | None
    min: float | None = None
    max: float | None = None
    finite: bool | None = None
    nonfinite: int = 0
    role: str = ""


@dataclass
class Problem:
    severity: str  # "error" (the gradient commands would refuse the file) or "warning"
    tensor: str | None
    message: str


@dataclass
class InspectReport:
    path: str
    format: str
    group: str | None
    # "seq" | "cell" | "forward-seq" | "forward-cell" | "gradients" | "keras" | "torch" | "keras-weights"
    # | "torch-weights" | None
    kind: str | None = None
    op: str | None = None
    layout: str | None = None
    layout_source: str | None = None  # "metadata" | "found from the activations" | None
    use_peephole: bool | None = None
    use_peephole_source: str | None = None
    seq_len_max: int | None = None
    dims: dict | None = None
    tensors: list[TensorInfo] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    groups: list[str] = field(default_factory=list)
    forward_fit: dict | None = None  # the float64 recompute of every step with the layout and peepholes found
    activations: dict | None = None  # what the stored activations fit (detect.ActivationFit.to_json, as seq's)
    framework_layers: list[dict] = field(default_factory=list)  # a Keras weights file's or a state_dict's LSTMs
    notes: list[str] = field(default_factory=list)
    scalar_sources: dict = field(default_factory=dict)  # seq_len_max / use_peephole -> "tensor" | "attribute"
    not_read: list[str] = field(default_factory=list)  # entries past OTHERS_SHOWN that no command would read

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["ok"] = not self.errors
        return json_safe(doc)

    def error(self, tensor, message):
        self.problems.append(Problem("error", tensor, message))

    def warn(self, tensor, message):
        self.problems.append(Problem("warning", tensor, message))


def _read(path: Path, fmt: str, names, scalars, group: str | None, collect_errors: bool = False,
          headers=()) -> io.LoadedFile:
    """``io.read_inputs`` of an input whose format is known (``npydir.input_format``, which knows the group)."""
    with io.open_inputs(path, names, scalars, group, collect_errors=collect_errors, input_format=fmt,
                        headers=headers) as loaded:
        return loaded


def _useful(key: str) -> bool:
    """Whether a command may read ``key``: one of the op's tensors (or an alias), a Keras layer's or a PyTorch
    module's (a state_dict's keys behind their module's prefix too)."""
    last = key.rpartition(".")[2]
    return (_canonical(key) is not None or key in FRAMEWORK_NAMES
            or frameworks.names.keras_direction_of(key) is not None
            or last.startswith((*frameworks.names.TORCH_PARAMETERS, "weight_hr")))


def _read_all(path: Path, fmt: str, group: str | None, report: InspectReport) -> tuple[dict[str, np.ndarray], list]:
    """Every entry of the file (or group) a command may read, that reads as an array; the first OTHERS_SHOWN others
    declared only (their shape and dtype, in ``report.tensors``: no command reads their data, so neither does
    inspect); each unreadable one is reported, and the entries left out are named in ``report.not_read``.  Returns
    the arrays read and every key in the file's order."""
    keys = [k for k in _read(path, fmt, (), (), group).keys if k != io.METADATA_KEY]
    others = [k for k in keys if not _useful(k)]
    report.not_read = others[OTHERS_SHOWN:]
    shown = others[:OTHERS_SHOWN]
    useful = [k for k in keys if _useful(k)]
    loaded = _read(path, fmt, useful, (), group, collect_errors=True, headers=shown)
    for key, (shape, dtype) in loaded.headers.items():
        report.tensors.append(TensorInfo(key, None, list(shape), str(dtype)))
    for key, err in loaded.errors.items():
        message = str(err).removeprefix(f"{path}: ")
        if "is a group, not a dataset" in message:
            report.groups.append(key)
            continue
        report.tensors.append(TensorInfo(key, _canonical(key), None, None, role="unreadable"))
        report.error(key, f"cannot be read: {message}")
    return {key: np.asarray(value) for key, value in loaded.tensors.items()}, keys


def _canonical(key: str) -> str | None:
    key = key.removeprefix("@")
    if key in KNOWN:
        return key
    return ALIASES.get(key)


STATS_CHUNK = 1 << 20  # values widened to float64 at a time for a tensor's statistics


def _summary(key, name, a: np.ndarray) -> TensorInfo:
    info = TensorInfo(key, name, list(a.shape), str(a.dtype))
    if a.dtype.kind in "fiub" and a.size:
        flat, low, high = a.reshape(-1), np.inf, -np.inf
        for start in range(0, flat.size, STATS_CHUNK):  # (a float64 copy of a chunk, not of the tensor)
            wide = flat[start:start + STATS_CHUNK].astype(np.float64)
            finite = wide[np.isfinite(wide)]
            info.nonfinite += wide.size - finite.size
            if finite.size:
                low, high = min(low, float(finite.min())), max(high, float(finite.max()))
        info.finite = info.nonfinite == 0
        if low <= high:
            info.min, info.max = low, high
    elif a.dtype.kind in "fiub":
        info.finite = True
    return info


def _metadata(scalars: dict) -> dict:
    """The lstmgrad metadata of the file (or group), as seq reads it; {} when there is none or it is not JSON."""
    if io.METADATA_KEY not in scalars:
        return {}
    try:
        meta = json.loads(str(scalars[io.METADATA_KEY][0]))
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def inspect_file(path, group: str | None = None, *, weights=None, weights_group: str | None = None,
                 framework: frameworks.FrameworkOptions | None = None) -> InspectReport:
    """Everything about one file; raises InputFileError only when it cannot be opened at all.  With ``weights``
    (a model or weights file, as ``seq --weights`` takes it), the two are checked together as seq reads them."""
    path = Path(path)
    fmt = npydir.input_format(path, group)
    report = InspectReport(str(path), fmt, group)
    raw, order = _read_all(path, fmt, group, report)
    try:
        scalars = _read(path, fmt, (), (*SCALARS, io.METADATA_KEY), group).scalars
    except LstmGradError:
        scalars = {}
    meta = _metadata(scalars)
    recorded = decide.recorded_layout(scalars[io.METADATA_KEY][0]) if io.METADATA_KEY in scalars else None
    report.metadata = {k: v for k, v in meta.items() if k in ("tool", "version", "op", "layout", "forget_bias",
                                                              "cell_clip", "grads", "source", "backend")}
    for name, (value, origin) in scalars.items():
        if name == io.METADATA_KEY:
            continue
        report.scalar_sources[name] = origin
        if origin == "attribute":
            raw[f"@{name}"] = np.asarray(value)  # an HDF5 attribute, shown as @name

    by_name: dict[str, np.ndarray] = {}
    for key, value in raw.items():
        name = _canonical(key)
        if name is not None and name in by_name:
            report.error(key, f"both {name!r} and its alias {key!r} are present; keep one")
            continue
        if name is not None:
            by_name[name] = value
        report.tensors.append(_summary(key, name, value))
    position = {key: k for k, key in enumerate(order)}  # (the declared-only entries among them, in the file's order)
    report.tensors.sort(key=lambda t: position.get(t.key, len(order)))

    if weights is not None:
        return _with_weights(report, path, group, weights, weights_group, framework)
    framework = _framework_kind(path, fmt, group, raw, order, report, bool(framework and framework.inference))
    if framework:
        return report
    if "x" not in by_name:
        grads = [n for n in GRADIENT_NAMES if n in by_name]
        if grads:
            report.kind = "gradients"
            report.notes.append(Message.format("a gradient file ({}): a {} for {}", ", ".join(grads),
                                               Param("reference"), Command("check")))
            _roles(report, set(grads))
        else:
            report.missing.append("x")
            report.error("x", Message("no x: cannot tell which op the file is for", Message.format(
                " (groups here: {}; use {})", ", ".join(report.groups), Param("group")) if report.groups else ""))
            _roles(report, set())
        return report

    x = by_name["x"]
    if x.ndim not in (2, 3):
        report.error("x", f"x has rank {x.ndim} (shape {list(x.shape)}); expected 3 (seq: [T, B, I]) or 2 "
                          "(cell: [B, I])")
        _roles(report, {"x"})
        return report
    seq = x.ndim == 3
    kind = "seq" if seq else "cell"
    names = validation.SEQ_TENSORS if seq else validation.CELL_TENSORS
    forward_only = decide.recompute(kind, by_name)
    peephole = _use_peephole(by_name, report)
    if forward_only:
        report.kind = "forward-seq" if seq else "forward-cell"
        names = FORWARD_INPUTS
        report.notes.append(Message.format("no forward outputs: an input for {}",
                                           Command(f"forward {'seq' if seq else 'cell'}")))
        report.op = "BlockLSTMV2 / BlockLSTM" if seq else "LSTMBlockCell"
    else:
        report.kind = kind
        report.op = "BlockLSTMGradV2 / BlockLSTMGrad" if seq else "LSTMBlockCellGrad"
    needed = [n for n in names if peephole or n not in validation.PEEPHOLES]
    report.missing = [n for n in needed if n not in by_name]
    for name in report.missing:
        report.error(name, f"missing tensor {name}" + (" (needed with use_peephole=true)"
                                                       if name in validation.PEEPHOLES else ""))
    used = {*names, *SCALARS}
    _roles(report, used, seq)

    # every problem, through the rules the gradient commands enforce (they stop at the first)
    present = {n: by_name[n] for n in names if n in by_name}
    issues, dims = validation.shape_issues(present, kind, forward=forward_only)
    for issue in [*validation.dtype_issues(present), *issues]:
        report.error(issue.tensor, issue.message)
    if dims is not None:
        report.dims = dims._asdict() if seq else {"B": dims.B, "I": dims.I, "C": dims.C}
    length = _seq_len_max_given(by_name, dims, seq, report)
    if not seq:
        report.layout, report.layout_source = CELL_LAYOUT, SOURCES["op"]
    if forward_only and seq and recorded is not None:
        report.layout, report.layout_source = recorded.value, recorded.source
        report.op = FORWARD_OPS[("seq", recorded.value)]
    blocking = [p for p in report.errors if p.tensor is None or _canonical(p.tensor) in (*names, *SCALARS)]
    decisions = None
    if not forward_only and not blocking and dims is not None and length is not None:
        arrays = {n: by_name[n] for n in names if n in by_name}
        for n in validation.PEEPHOLES:  # (absent without peepholes: zeros, as seq fills them)
            arrays.setdefault(n, np.zeros(dims.C, dtype=by_name["x"].dtype))
        decisions = _decide(arrays, by_name, kind, dims, peephole, recorded, report)
        length = decisions.seq_len_max.value if decisions is not None else length
    elif seq and report.layout is None:
        report.notes.append("gate layout unknown: the gates cannot be recomputed (missing or invalid tensors)")
    report.seq_len_max = length if seq else None
    _check_values(by_name, dims, length, report)
    if decisions is not None:
        _forward_pass(arrays, decisions, report)
    return report


def _framework_kind(path: Path, fmt: str, group, raw: dict, order: list, report: InspectReport,
                    inference: bool = False) -> bool:
    """A Keras weights file, a PyTorch state_dict, or a Keras/PyTorch layer's tensors: said in notes (and what
    is wrong with the tensors, as problems); False for anything else.  ``raw``: the entries a command reads, read;
    ``order``: every entry's key (those only declared too, which the unused check names)."""
    if fmt in ("hdf5", "keras") and group is None:
        try:
            layers, source = frameworks.weights_files.keras_model_layers(path, fmt, inference=inference)
        except LstmGradError as err:  # (a model configuration Keras refuses, groups past the bounds, ...)
            report.kind = "keras-weights"
            report.error(None, message_of(err))
            _framework_roles(report, "weights")
            return True
        if layers:
            report.kind, report.framework_layers = "keras-weights", layers
            for layer in layers:
                report.notes.append(_keras_layer_note(path, layer, source))
                if layer.get("refused"):  # (what seq says for its group)
                    report.error(None, Message.format("{}: {}", cut(layer["group"]), layer["refused"]))
                for bias in ("bias", "backward_bias"):  # (kernel and recurrent_kernel agree, or it is no LSTM's)
                    if layer.get(bias) and layer[bias] != [4 * layer["units"]]:
                        report.error(None, f"{layer['group']}: {bias.replace('_', ' ')} has shape {layer[bias]}, "
                                           f"expected [4C] = [{4 * layer['units']}]: seq refuses this layer")
            _framework_roles(report, "weights")
            return True
        if fmt == "keras":  # a model without an LSTM layer lstmgrad computes
            report.kind = "keras-weights"
            try:
                for why in frameworks.weights_files.keras_other_recurrent(path, fmt) or ["no LSTM layer"]:
                    report.warn(None, why)
            except LstmGradError as err:
                report.error(None, message_of(err))
            _framework_roles(report, "weights")
            return True
    keys = [k for k in order if not k.startswith("@")]
    torch = frameworks.torch_state_dict_layers(keys)
    if torch and "x" not in raw:
        report.kind, report.framework_layers = "torch-weights", torch
        for why in frameworks.pytorch.misnamed(keys) + frameworks.pytorch.spelled_twice(keys):
            report.error(None, why)
        for why in frameworks.pytorch.gaps(keys):  # (one layer's weights may be computed alone: --layer)
            report.warn(None, Message.format("{}; the whole module cannot be computed, one layer can ({})", why,
                                             Param("layer")))
        for prefix in dict.fromkeys(layer["prefix"] for layer in torch):
            recurrent = raw.get(f"{prefix}.weight_hh_l0" if prefix else "weight_hh_l0")
            projection = raw.get(f"{prefix}.weight_hr_l0" if prefix else "weight_hr_l0")
            why = _not_an_lstm(recurrent, projection)
            if why:
                report.warn(None, f"{cut(prefix) or 'the state_dict'}: {why}")
                continue
            report.notes.append(_torch_module_note(path, [t for t in torch if t["prefix"] == prefix], prefix,
                                                   None if projection is None else projection.shape[0]))
        _framework_roles(report, "weights")
        return True
    cells = _torch_cells(keys, raw)
    if cells and "x" not in raw:  # an nn.LSTMCell's state_dict (or a model's holding some)
        report.kind = "torch-weights"
        for prefix, (w_ih, w_hh) in cells.items():
            where = Message.format(" {}", Param("weights_group", prefix)) if prefix else ""
            report.notes.append(Message.format(
                "PyTorch nn.LSTMCell{}: weight_ih {}, weight_hh {}: {} {}{} (one step, {})",
                f" {prefix}" if prefix else "", w_ih, w_hh, Command("cell", "DATA"), Param("weights", path), where,
                frameworks.pytorch.CELL_STEP))
        _framework_roles(report, "weights")
        return True
    held = {k: np.asarray(v) for k, v in raw.items()}
    step = frameworks.framework_of(keys, None, held["x"].ndim if "x" in held else None)
    if step is None and frameworks.without_weights(keys):
        report.kind, report.op = "cell", "one step of a PyTorch or Keras cell, without its weights"
        report.error(None, frameworks.cells.MISSING_WEIGHTS)
        _framework_roles(report, "used")
        return True
    name = step or frameworks.detect(keys, frameworks.FrameworkOptions())
    if name not in frameworks.FRAMEWORKS:
        return False
    report.kind = name
    unused = []
    try:
        if step:
            report.op = f"a {'Keras LSTMCell' if name == 'keras' else 'PyTorch nn.LSTMCell'} step's tensors"
            plan = frameworks.cells.plan(name, held, keys=keys)
            report.op = f"{plan.description}, computed as {plan.computed_as}"
            report.notes.append(Message.format("{} computes its gradients in its names", Command("cell")))
        else:
            plan = frameworks.plan(name, held, frameworks.FrameworkOptions())
            report.notes.append(Message.format("a {} layer's tensors: {} computes its gradients in its names",
                                               "Keras LSTM" if name == "keras" else "PyTorch nn.LSTM", Command("seq")))
        unused, warning = frameworks.unused.check(keys, plan)
        if warning:
            report.warn(None, warning)
    except LstmGradError as err:
        report.error(None, message_of(err))
    _framework_roles(report, "used", unused)
    return True


def _torch_cells(keys, raw: dict) -> dict[str, tuple[list, list]]:
    """The nn.LSTMCells among a state_dict's keys: their module prefix ("" for a cell's own state_dict) -> the shapes of
    weight_ih and weight_hh."""
    found = {}
    for key in keys:
        prefix, _, name = key.rpartition(".")
        other = f"{prefix}.weight_hh" if prefix else "weight_hh"
        if name == "weight_ih" and other in raw:
            found[prefix] = (list(np.shape(raw[key])), list(np.shape(raw[other])))
    return found


def _with_weights(report: InspectReport, path: Path, group, weights, weights_group, framework) -> InspectReport:
    """An input and its weights file read together as ``seq`` reads them (the same loading and checks): what it
    would compute, or every reason it would refuse."""
    try:
        problem = load_problem(path, group=group, weights=weights, weights_group=weights_group,
                               framework=framework or frameworks.FrameworkOptions())
    except LstmGradError as err:
        report.error(None, message_of(err))
        _framework_roles(report, "used")
        return report
    report.dims = problem.dims._asdict()
    plan = problem.framework
    if plan is not None:
        report.kind = plan.framework
        report.op = f"{plan.description}, computed as {plan.computed_as}"
    else:
        report.kind, report.op, report.layout = problem.kind, problem.op, problem.layout
        report.layout_source, report.use_peephole = problem.sources.get("layout"), problem.use_peephole
        report.use_peephole_source = problem.sources.get("use_peephole")
        report.seq_len_max = problem.seq_len_max if problem.kind == "seq" else None
    report.notes += problem.notes
    for warning in problem.warnings:
        report.warn(None, warning)
    _framework_roles(report, "used", problem.unused)
    return report


def _keras_layer_note(path: Path, layer: dict, source: str | None) -> Message:
    """What one LSTM layer (or Bidirectional) of a Keras file is, and the command that computes its gradients."""
    group = Message.format("{} {}", Param("weights", path), Param("weights_group", layer["group"]))
    if layer.get("stacked"):
        return Message.format("an LSTMCell of a StackedRNNCells at {}: not a layer lstmgrad computes",
                              layer["group"])
    bias = f", bias {layer['bias']}" if layer["bias"] else ", no bias"
    if "backward_bias" in layer:  # a Bidirectional whose two layers differ
        bias = ", bias: forward " + (str(layer["bias"]) if layer["bias"] else "none") + ", backward " + (
            str(layer["backward_bias"]) if layer["backward_bias"] else "none")
    what = f"Keras {'Bidirectional' if layer.get('bidirectional') else 'LSTM layer'} {layer['name']!r}"
    each = ", each direction" if layer.get("bidirectional") else ""
    shapes = (f"kernel {layer['kernel']}, recurrent_kernel {layer['recurrent_kernel']}{bias} (input size "
              f"{layer['input_size']}, {layer['units']} units{each})")
    if layer.get("refused"):
        return Message.format("{} at {}: {}; refused (the error above says why)", what, layer["group"], shapes)
    options = layer.get("options")
    made = ", ".join(f"{k}={v}" for k, v in options.items() if v is not None) if options else (
        "options not recorded: Keras' defaults assumed")
    needs = f"; DATA holds {', '.join(layer['needs'])}" if layer.get("needs") else ""
    return Message.format("{} at {}: {}; {}: {} {}{}", what, layer["group"], shapes, made, Command("seq", "DATA"),
                          group, needs)


def _not_an_lstm(recurrent, projection) -> str:
    """Why an nn.LSTM-named state_dict's first recurrent weights (and projection) are not an nn.LSTM's; ""."""
    if recurrent is None:
        return ""
    if projection is not None:  # proj_size P: weight_hr_l0 [P, C], weight_hh_l0 [4C, P]
        if projection.ndim == 2 and recurrent.shape == (4 * projection.shape[1], projection.shape[0]):
            return ""
        return (f"weight_hh_l0 has shape {list(recurrent.shape)} and weight_hr_l0 {list(projection.shape)}: an nn.LSTM "
                "with proj_size P and hidden_size C has [4C, P] and [P, C]")
    if recurrent.ndim == 2 and recurrent.shape[0] == 4 * recurrent.shape[1]:
        return ""
    gates = recurrent.shape[0] // max(recurrent.shape[-1], 1) if recurrent.ndim == 2 else "?"
    return (f"weight_hh_l0 has shape {list(recurrent.shape)}, {gates} gates: not an nn.LSTM (a GRU has 3, a plain RNN "
            "1); lstmgrad computes LSTMs")


def _torch_module_note(path: Path, layers: list[dict], prefix: str, projection: int | None = None) -> Message:
    """What an nn.LSTM of a state_dict is, and the commands for the whole module and for one layer."""
    numbers = {layer["layer"] for layer in layers}
    count = 1 + max(numbers) if max(numbers) < len(numbers) else len(numbers)  # (numbers past them: gaps' warning)
    both = any(layer["reverse"] for layer in layers)
    where = Message.format(" {}", Param("weights_group", cut(prefix, TYPED))) if prefix else ""
    what = (f"PyTorch nn.LSTM{' ' + cut(prefix) if prefix else ''}: {count} layer{'s' * (count > 1)}"
            f"{', bidirectional' if both else ''}{f', proj_size={projection}' if projection else ''}")
    return Message.format("{}: {} {}{} (the whole module; {} for one layer)", what, Command("seq", "DATA"),
                          Param("weights", path), where, Param("layer"))


def _framework_roles(report: InspectReport, role: str, unused=()) -> None:
    """Every readable tensor's role: ``role``, or "unused" for the entries no computation uses."""
    for t in report.tensors:
        if t.role != "unreadable":
            t.role = "unused" if t.key in unused else role
    report.unused += [t.key for t in report.tensors if t.role == "unused"]


def _roles(report: InspectReport, used: set, seq: bool = True) -> None:
    for t in report.tensors:
        if t.role == "unreadable":
            continue
        if t.name in used:
            t.role = "scalar" if t.name in SCALARS else "used"
        elif t.name in GRADIENT_NAMES:
            t.role = "gradient output (ignored)"
        elif t.name == "h" and not seq:
            t.role = "not read by LSTMBlockCellGrad"
        else:
            t.role = "unused"
        if t.role not in ("used", "scalar"):
            report.unused.append(t.key)


def _use_peephole(by_name, report) -> bool:
    """The file's use_peephole (checked), else false; its source as given."""
    if "use_peephole" not in by_name:
        report.use_peephole_source = "default"
        report.use_peephole = False
        return False
    try:
        report.use_peephole = validation.check_use_peephole(by_name["use_peephole"])
        report.use_peephole_source = report.scalar_sources.get("use_peephole", "tensor")
    except LstmGradError as err:
        report.error("use_peephole", str(err))
        report.use_peephole = False
    return report.use_peephole


def _seq_len_max_given(by_name, dims, seq, report) -> int | None:
    """The file's seq_len_max (checked; None and an error when it is wrong), else T; 1 for the cell op."""
    if not seq:
        return 1
    T = dims.T if dims is not None else by_name["x"].shape[0]
    if "seq_len_max" not in by_name:
        return T
    try:
        return validation.check_seq_len_max(by_name["seq_len_max"], T)
    except LstmGradError as err:
        report.error("seq_len_max", str(err))
        return None


# What a decision's source is called in inspect's report.
SOURCES = {"activations": "found from the activations", "op": "the cell op is always ICFO"}


def _decide(arrays, by_name, kind, dims, peephole, recorded, report: InspectReport) -> decide.Decisions | None:
    """What seq/cell would decide (decide.py, on the same tensors): the report's seq_len_max, layout and
    use_peephole, with their warnings and notes."""
    given = {n: Given(by_name[n], report.scalar_sources.get(n, "tensor")) for n in SCALARS if n in by_name}
    if "use_peephole" in given:
        given["use_peephole"] = Given(peephole, given["use_peephole"].source)
    try:
        decisions = decide.decide(kind, arrays, dims.T, layout_given=recorded,
                                  use_peephole_given=given.get("use_peephole"),
                                  seq_len_max_given=given.get("seq_len_max"))
    except (LstmGradError, ValueError, FloatingPointError):
        return None
    for tensor, decision in (("seq_len_max", decisions.seq_len_max), (None, decisions.layout),
                             ("use_peephole", decisions.use_peephole)):
        for warning in decision.warnings:
            report.warn(tensor, warning)
    for warning in decisions.warnings:
        report.warn(None, warning)
    report.notes += [*decisions.all_notes, *decisions.all_defaults]
    layout, peep = decisions.layout, decisions.use_peephole
    report.layout, report.layout_source = layout.value, SOURCES.get(layout.source, layout.source)
    report.use_peephole, report.use_peephole_source = peep.value, SOURCES.get(peep.source, peep.source)
    if kind == "seq":
        report.op = OPS[("seq", layout.value)]
    if decisions.fit is not None and decisions.fit.tested:
        report.activations = decisions.fit.to_json()
    return decisions


def _check_values(by_name, dims, length, report) -> None:
    for name, a in by_name.items():
        if a.dtype.kind == "f" and a.size and not np.all(np.isfinite(a)):
            n = int(a.size - np.count_nonzero(np.isfinite(a)))
            report.warn(name, f"{name} has {n} NaN/Inf entr{'y' if n == 1 else 'ies'} (computed through, as TF does)")
    if dims is None:
        return
    seq = by_name["x"].ndim == 3
    L = (length if length is not None else by_name["x"].shape[0]) if seq else None

    def steps(name):
        a = by_name.get(name)
        if a is None or a.dtype.kind != "f" or a.ndim == 0:
            return None
        return (a[:L] if L is not None else a).astype(np.float64)

    for name, low, high, what in (("i", 0, 1, "a sigmoid"), ("f", 0, 1, "a sigmoid"), ("o", 0, 1, "a sigmoid"),
                                  ("ci", -1, 1, "a tanh"), ("co", -1, 1, "a tanh")):
        a = steps(name)
        if a is not None and a.size and (np.nanmin(a) < low or np.nanmax(a) > high):
            report.error(name, f"{name} has values in [{np.nanmin(a):.3g}, {np.nanmax(a):.3g}], outside "
                               f"[{low}, {high}]: not {what} output (pre-activation values?)")
    cs, co, o, h = steps("cs"), steps("co"), steps("o"), steps("h")
    tol = gradcheck.CONSISTENCY_TOL.get(str(by_name["x"].dtype), 1e-4)
    if cs is not None and co is not None and cs.shape == co.shape and cs.size:
        dev = float(np.nanmax(np.abs(np.tanh(cs) - co)))
        if dev > tol:
            report.warn("co", f"co is not tanh(cs) (max deviation {dev:.3g}): cs and co come from different runs")
    if o is not None and co is not None and h is not None and o.shape == co.shape == h.shape and h.size:
        dev = float(np.nanmax(np.abs(o * co - h)))
        if dev > tol:
            report.warn("h", f"h is not o * co (max deviation {dev:.3g}): h comes from a different run")
    if L is not None:
        for name in ("cs", "h"):
            a = by_name.get(name)
            if a is not None and a.ndim == 3 and np.any(a[L:] != 0):
                report.warn(name, f"{name} is nonzero beyond seq_len_max={L} (TF zeroes it): was the sequence run "
                                  "with a larger seq_len_max?")


def _forward_pass(arrays: dict, decisions: decide.Decisions, report: InspectReport) -> None:
    """Every step recomputed in float64 with the layout and peepholes decided: forget_bias and cell_clip in a
    note, and a warning for a misfit where the detection did not look.  A NaN or Inf deviation (a non-finite
    value in a tensor, computed through) is left out, as the detection leaves it out."""
    fit = decisions.fit
    if fit is None or not fit.tested or fit.fits_nothing:
        return
    layout, use_peephole = decisions.layout.value, decisions.use_peephole.value
    found = next((h for h in fit.fitting if h.layout == layout and h.use_peephole == use_peephole), fit.fitting[0])
    kind, length, tol = report.kind, decisions.seq_len_max.value, fit.tolerance

    def recompute(forget_bias=None):
        return gradcheck.forward_consistency(arrays, kind, layout=found.layout, use_peephole=found.use_peephole,
                                             seq_len_max=length, forget_bias=forget_bias)

    try:
        forward = recompute()
        if not np.isfinite(forward.forget_bias) and found.forget_bias is not None:
            # a NaN/Inf pre-activation made the median NaN: the detection's, from the finite entries, rounded
            # as gradcheck rounds its own (0.99997 is 1.0 in all but rounding)
            bias = found.forget_bias
            forward = recompute(round(bias, 2) + 0.0 if abs(round(bias, 2) - bias) <= 10 * tol else bias)
            forward.forget_bias_source = "inferred"
    except (LstmGradError, ValueError, FloatingPointError):
        return
    report.forward_fit = forward.to_json()
    values = (f"forget_bias={forward.forget_bias:g} ({forward.forget_bias_source}), "
              f"cell_clip={forward.cell_clip:g} ({forward.cell_clip_source})")
    misfit = [t for t in forward.inconsistent() if np.isfinite(t.max_deviation)]
    if misfit:
        bad = ", ".join(f"{t.name} (max {t.max_deviation:.3g}, from step {t.first_bad_step})" for t in misfit)
        report.warn(None, Message.format(
            "the stored activations fit layout {} with use_peephole={} at the steps seq and cell sample, but not at "
            "every step: {}; saved at a different step, or from a different checkpoint? {} says which tensor and "
            "step", found.layout, str(found.use_peephole).lower(), bad, Param("gradcheck", True)))
    elif forward.consistent:
        report.notes.append(f"forward pass reproduced: {values}")
    else:
        report.notes.append(f"forward pass reproduced where the values are finite: {values}")
