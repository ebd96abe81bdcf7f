"""``lstmgrad inspect``: what is in a file, which op it fits, and everything that is wrong with it.

The library behind the command (no click here).  Unlike the gradient commands, which stop at the
first problem, ``inspect_file`` reads every entry on its own (an unreadable one is a problem, not a
crash), checks each tensor's dtype, rank and shape against the sizes the others imply, and lists
all problems at once, without computing any gradient.

Which op: x of rank 3 is a sequence (BlockLSTMGradV2 or BlockLSTMGrad), rank 2 one cell step
(LSTMBlockCellGrad); a file without the forward outputs is an input for ``lstmgrad forward``; a file
of ``*_grad`` tensors is a gradient file (a reference for ``lstmgrad check``).  The gate layout
cannot be read off the tensors: it comes from the file's lstmgrad metadata when there is some,
else from the stored gates, by the detection ``seq``/``cell`` run (detect.py: the same steps, the same
tolerance, NaN/Inf entries left out), so the two never disagree; use_peephole, when the file does not give
it, too.  The forward pass with what was found is then recomputed at every step in float64 (gradcheck.py)
for forget_bias and cell_clip, and for a misfit at a step the detection does not sample.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import detect, frameworks, gradcheck, io, validation
from .errors import LstmGradError
from .io import npydir
from .spec import FORWARD_INPUTS, FORWARD_OPS, GRADIENT_NAMES, OPS, RANKS
from .summary import json_safe

SCALARS = ("seq_len_max", "use_peephole")
GRAD_NAMES = GRADIENT_NAMES
KNOWN = (*validation.SEQ_TENSORS, *SCALARS, *GRAD_NAMES)
ALIASES = {io.camel(name): name for name in KNOWN if io.camel(name) != name}
FLOAT_KINDS = {np.dtype(t) for t in validation.FLOAT_DTYPES}


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


def _read(path: Path, fmt: str, names, scalars, group: str | None, collect_errors: bool = False) -> io.LoadedFile:
    """``io.read_inputs`` of an input whose format is known (``npydir.input_format``, which knows the group)."""
    with io.open_inputs(path, names, scalars, group, collect_errors=collect_errors, input_format=fmt) as loaded:
        return loaded


def _read_all(path: Path, fmt: str, group: str | None, report: InspectReport) -> dict[str, np.ndarray]:
    """Every entry of the file (or group) that reads as an array; each unreadable one is reported."""
    keys = [k for k in _read(path, fmt, (), (), group).keys if k != io.METADATA_KEY]
    loaded = _read(path, fmt, keys, (), group, collect_errors=True)
    for key, err in loaded.errors.items():
        message = str(err).removeprefix(f"{path}: ")
        if "is a group, not a dataset" in message:
            report.groups.append(key)
            continue
        report.tensors.append(TensorInfo(key, _canonical(key), None, None, role="unreadable"))
        report.error(key, f"cannot be read: {message}")
    return {key: np.asarray(value) for key, value in loaded.tensors.items()}


def _canonical(key: str) -> str | None:
    key = key.removeprefix("@")
    if key in KNOWN:
        return key
    return ALIASES.get(key)


def _summary(key, name, a: np.ndarray) -> TensorInfo:
    info = TensorInfo(key, name, list(a.shape), str(a.dtype))
    if a.dtype.kind in "fiub" and a.size:
        wide = a.astype(np.float64)
        finite = np.isfinite(wide)
        info.nonfinite = int(a.size - finite.sum())
        info.finite = info.nonfinite == 0
        if finite.any():
            info.min, info.max = float(wide[finite].min()), float(wide[finite].max())
    elif a.dtype.kind in "fiub":
        info.finite = True
    return info


def _metadata(path: Path, fmt: str, group) -> dict:
    try:
        if fmt == "npz":
            loaded = _read(path, fmt, (io.METADATA_KEY,), (), group)
            raw = loaded.tensors.get(io.METADATA_KEY)
            return json.loads(str(raw)) if raw is not None else {}
        return io.read_metadata(path)
    except (LstmGradError, ValueError, OSError):
        return {}


def inspect_file(path, group: str | None = None) -> InspectReport:
    """Everything about one file; raises InputFileError only when it cannot be opened at all."""
    path = Path(path)
    fmt = npydir.input_format(path, group)
    report = InspectReport(str(path), fmt, group)
    raw = _read_all(path, fmt, group, report)
    meta = _metadata(path, fmt, group)
    report.metadata = {k: v for k, v in meta.items() if k in ("tool", "version", "op", "layout", "forget_bias",
                                                              "cell_clip", "grads", "source", "backend")}

    try:
        scalars = _read(path, fmt, (), SCALARS, group).scalars
    except LstmGradError:
        scalars = {}
    for name, (value, origin) in scalars.items():
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

    framework = _framework_kind(path, fmt, group, raw, report)
    if framework:
        return report
    if "x" not in by_name:
        grads = [n for n in GRAD_NAMES if n in by_name]
        if grads:
            report.kind = "gradients"
            report.notes.append(f"a gradient file ({', '.join(grads)}): a --reference for lstmgrad check")
            _roles(report, set(grads))
        else:
            report.missing.append("x")
            report.error("x", "no x: cannot tell which op the file is for"
                         + (f" (groups here: {', '.join(report.groups)}; use --group)" if report.groups else ""))
            _roles(report, set())
        return report

    x = by_name["x"]
    if x.ndim not in (2, 3):
        report.error("x", f"x has rank {x.ndim} (shape {list(x.shape)}); expected 3 (seq: [T, B, I]) or 2 "
                          "(cell: [B, I])")
        _roles(report, {"x"})
        return report
    seq = x.ndim == 3
    names = validation.SEQ_TENSORS if seq else validation.CELL_TENSORS
    forward_only = not any(n in by_name for n in validation.ACTIVATIONS)
    peephole = _use_peephole(by_name, report)
    if forward_only:
        report.kind = "forward-seq" if seq else "forward-cell"
        names = FORWARD_INPUTS
        report.notes.append(f"no forward outputs: an input for `lstmgrad forward {'seq' if seq else 'cell'}`")
        report.op = "BlockLSTMV2 / BlockLSTM" if seq else "LSTMBlockCell"
    else:
        report.kind = "seq" if seq else "cell"
        report.op = "BlockLSTMGradV2 / BlockLSTMGrad" if seq else "LSTMBlockCellGrad"
    needed = [n for n in names if peephole or n not in validation.PEEPHOLES]
    report.missing = [n for n in needed if n not in by_name]
    for name in report.missing:
        report.error(name, f"missing tensor {name}" + (" (needed with use_peephole=true)"
                                                       if name in validation.PEEPHOLES else ""))
    used = {*names, *SCALARS}
    _roles(report, used, seq)

    dims = _check_shapes(by_name, names, seq, report)
    length = _check_seq_len_max(by_name, dims, seq, report)
    report.seq_len_max = length if seq else None
    _check_values(by_name, dims, length, report)
    _layout(by_name, names, seq, dims, length, peephole, meta, report)
    return report


def _framework_kind(path: Path, fmt: str, group, raw: dict, report: InspectReport) -> bool:
    """A Keras weights file, a PyTorch state_dict, or a Keras/PyTorch layer's tensors: said in notes (and what
    is wrong with the tensors, as problems); False for anything else."""
    if fmt == "hdf5" and group is None:
        layers = frameworks.keras_layers(path)
        if layers:
            report.kind, report.framework_layers = "keras-weights", layers
            for layer in layers:
                bias = f", bias {layer['bias']}" if layer["bias"] else ", no bias"
                report.notes.append(
                    f"Keras LSTM layer {layer['name']!r} at {layer['group']}: kernel {layer['kernel']}, "
                    f"recurrent_kernel {layer['recurrent_kernel']}{bias} (input size {layer['input_size']}, "
                    f"{layer['units']} units): lstmgrad seq DATA --weights {path} --weights-group {layer['group']}"
                    + (" --reverse" if layer["group"].endswith("/backward_layer") else ""))  # (a Bidirectional's)
            _framework_roles(report, "weights")
            return True
    keys = [k for k in raw if not k.startswith("@")]
    torch = frameworks.torch_state_dict_layers(keys)
    if torch and "x" not in raw:
        report.kind, report.framework_layers = "torch-weights", torch
        for layer in torch:
            where = f" --weights-group {layer['prefix']}" if layer["prefix"] else ""
            flags = (f" --layer {layer['layer']}" if layer["layer"] else "") + (
                " --reverse" if layer["reverse"] else "")
            report.notes.append(f"PyTorch nn.LSTM layer {layer['layer']}{' reverse' if layer['reverse'] else ''}"
                                f"{' in ' + layer['prefix'] if layer['prefix'] else ''}: lstmgrad seq DATA "
                                f"--weights {path}{where}{flags}")
            if layer["projection"]:
                report.warn(None, f"layer {layer['layer']} has proj_size > 0 (weight_hr): not these ops' maths; "
                                  "lstmgrad does not compute it")
        _framework_roles(report, "weights")
        return True
    name = frameworks.detect(keys, frameworks.FrameworkOptions())
    if name not in frameworks.VIEWS:
        return False
    report.kind = name
    held = {k: np.asarray(v) for k, v in raw.items()}
    try:
        frameworks.view(name, frameworks.FrameworkOptions()).to_op(
            frameworks.keras_tensors(held) if name == "keras" else held)
        report.notes.append(f"a {'Keras LSTM' if name == 'keras' else 'PyTorch nn.LSTM'} layer's tensors: lstmgrad "
                            "seq computes its gradients in its names")
    except LstmGradError as err:
        report.error(None, str(err))
    _framework_roles(report, "used")
    return True


def _framework_roles(report: InspectReport, role: str) -> None:
    for t in report.tensors:
        if t.role != "unreadable":
            t.role = role


def _roles(report: InspectReport, used: set, seq: bool = True) -> None:
    for t in report.tensors:
        if t.role == "unreadable":
            continue
        if t.name in used:
            t.role = "scalar" if t.name in SCALARS else "used"
        elif t.name in GRAD_NAMES:
            t.role = "gradient output (ignored)"
        elif t.name == "h" and not seq:
            t.role = "not read by LSTMBlockCellGrad"
        else:
            t.role = "unused"
        if t.role not in ("used", "scalar"):
            report.unused.append(t.key)


def _use_peephole(by_name, report) -> bool:
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


def _check_shapes(by_name, names, seq, report) -> validation.Dims | None:
    """dtype, rank and shape of every tensor present; returns the sizes when they can be told."""
    ranks = RANKS["seq" if seq else "cell"]
    x_dtype = by_name["x"].dtype
    rank_ok = {}
    for name in names:
        a = by_name.get(name)
        if a is None:
            continue
        if a.dtype not in FLOAT_KINDS:
            report.error(name, f"{name} has dtype {a.dtype}; expected float16, float32 or float64")
        elif a.dtype != x_dtype and x_dtype in FLOAT_KINDS:
            report.error(name, f"{name} is {a.dtype} but x is {x_dtype}: all tensors must have one dtype")
        rank_ok[name] = a.ndim == ranks[name]
        if not rank_ok[name]:
            report.error(name, f"{name} must be rank {ranks[name]} but is rank {a.ndim} (shape {list(a.shape)})")
    x = by_name["x"]
    T, B, I = x.shape if seq else (1, *x.shape)  # noqa: E741
    C = None
    w = by_name.get("w")
    if w is not None and rank_ok.get("w"):
        if w.shape[1] % 4 == 0 and (w.shape[1] or not seq):
            C = w.shape[1] // 4
        else:
            report.error("w", f"w has {w.shape[1]} columns; expected a positive multiple of 4 (4 * cell_size)")
    for fallback, axis, div in (("cs_prev", 1, 1), ("h_prev", 1, 1), ("b", 0, 4)):
        if C is None and rank_ok.get(fallback) and by_name[fallback].shape[axis] % div == 0:
            C = by_name[fallback].shape[axis] // div
    if C is None:
        return None
    report.dims = {"T": T, "B": B, "I": I, "C": C} if seq else {"B": B, "I": I, "C": C}
    step = (T, B, C) if seq else (B, C)
    expected = {"cs_prev": (B, C), "h_prev": (B, C), "w": (I + C, 4 * C), "wci": (C,), "wcf": (C,), "wco": (C,),
                "b": (4 * C,), **{n: step for n in (*validation.ACTIVATIONS, "cs_grad", "h_grad")}}
    labels = {"cs_prev": "[B, C]", "h_prev": "[B, C]", "w": "[I + C, 4C]", "b": "[4C]", "wci": "[C]", "wcf": "[C]",
              "wco": "[C]"}
    for name in names:
        a = by_name.get(name)
        if a is None or name == "x" or not rank_ok.get(name) or name not in expected:
            continue
        if tuple(a.shape) != expected[name]:
            label = labels.get(name, "[T, B, C]" if seq else "[B, C]")
            report.error(name, f"{name} has shape {list(a.shape)}, expected {label} = {list(expected[name])} "
                               f"(from x {list(x.shape)} and cell size {C})")
    return validation.Dims(T, B, I, C)


def _check_seq_len_max(by_name, dims, seq, report) -> int | None:
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


def _layout(by_name, names, seq, dims, length, peephole, meta, report) -> None:
    if not seq:
        report.layout, report.layout_source = "icfo", "the cell op is always ICFO"
    meta_layout = meta.get("layout")
    if seq and meta_layout in ("ifco", "icfo"):
        report.layout, report.layout_source = meta_layout, "metadata"
        report.op = OPS[("seq", meta_layout)]
        if report.kind == "forward-seq":
            report.op = FORWARD_OPS[("seq", meta_layout)]
    blocking = [p for p in report.errors if p.tensor is None or _canonical(p.tensor) in (*names, *SCALARS)]
    if report.kind not in ("seq", "cell") or blocking or dims is None or length is None:
        if seq and report.layout is None:
            report.notes.append("gate layout unknown: no metadata, and the gates cannot be recomputed "
                                "(missing or invalid tensors)")
        return
    arrays = {n: by_name[n] for n in names if n in by_name}
    for n in validation.PEEPHOLES:
        arrays.setdefault(n, np.zeros(dims.C, dtype=by_name["x"].dtype))
    if seq and "seq_len_max" not in by_name:  # found as seq finds it (problem.py)
        with contextlib.suppress(LstmGradError, ValueError, FloatingPointError):
            stopped = detect.seq_len_max_stopped(arrays, dims.T)
            if stopped is not None:
                length = report.seq_len_max = stopped
                report.notes.append(f"seq_len_max {stopped}: not in the file; cs and h are zero from step {stopped} "
                                    "on, where TF stops computing (seq takes it; --seq-len-max says otherwise)")
    if length == 0:
        report.notes.append("seq_len_max is 0: no step to recompute, the layout cannot be told")
        return
    kind = "seq" if seq else "cell"
    try:
        fit = detect.fit_activations(arrays, kind, length)  # as load_problem finds them for seq and cell
    except (LstmGradError, ValueError, FloatingPointError):
        return
    if fit is None or not fit.tested:
        report.notes.append("the stored gates cannot be recomputed (no batch row or unit, or none finite and "
                            "unsaturated): the layout cannot be told")
        return
    report.activations = fit.to_json()
    if fit.fits_nothing:
        report.warn(None, f"the stored activations do not fit x, h_prev, w, b in either layout, with or without "
                          f"peepholes ({fit.misfit()}); saved at a different step, or from a different checkpoint? "
                          "(lstmgrad check --gradcheck)")
        return
    if seq and report.layout_source != "metadata":
        if fit.layout is not None:
            report.layout, report.layout_source = fit.layout, "found from the activations"
            report.op = OPS[("seq", fit.layout)]
        else:
            report.notes.append("both layouts reproduce the stored gates: the layout cannot be told")
    elif seq and report.layout not in fit.layouts:
        report.warn(None, f"the metadata says layout {report.layout}, but the stored gates fit {fit.layouts[0]}")
    elif not seq and fit.layouts == ["ifco"]:
        report.warn(None, "the activations fit the IFCO gate layout (a step of BlockLSTMV2?), but LSTMBlockCellGrad "
                          "is ICFO: for a BlockLSTMV2 step use `lstmgrad seq` with x of shape [1, B, I]")
    peeps = sorted({h.use_peephole for h in fit.fitting if h.layout == report.layout}) or fit.peepholes
    if len(peeps) == 1 and report.use_peephole_source == "default":  # not given: the activations say it
        report.use_peephole, report.use_peephole_source = peeps[0], "found from the activations"
    elif len(peeps) == 1 and peephole != peeps[0]:
        report.warn("use_peephole", f"the stored activations were computed with use_peephole="
                                    f"{str(peeps[0]).lower()}, the file says {str(peephole).lower()} "
                                    f"({report.use_peephole_source}); use "
                                    f"--{'' if peeps[0] else 'no-'}peephole")
    found = next((h for h in fit.fitting if h.layout == (report.layout or h.layout)
                  and h.use_peephole == report.use_peephole), fit.fitting[0])
    _forward_pass(arrays, kind, length, found, fit.tolerance, report)


def _forward_pass(arrays, kind, length, found: detect.Hypothesis, tol: float, report: InspectReport) -> None:
    """Every step recomputed in float64 with the layout and peepholes the detection found: forget_bias and
    cell_clip in a note, and a warning for a misfit where the detection did not look.  A NaN or Inf deviation
    (a non-finite value in a tensor, computed through) is left out, as the detection leaves it out."""
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
        report.warn(None, f"the stored activations fit layout {found.layout} with use_peephole="
                          f"{str(found.use_peephole).lower()} at the steps seq and cell sample, but not at every "
                          f"step: {bad}; saved at a different step, or from a different checkpoint? "
                          "(lstmgrad check --gradcheck)")
    elif forward.consistent:
        report.notes.append(f"forward pass reproduced: {values}")
    else:
        report.notes.append(f"forward pass reproduced where the values are finite: {values}")
