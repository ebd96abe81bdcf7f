"""Loading a gradient problem from a file: the tensors an op needs, validated, with where each
parameter came from.  ``seq``/``cell`` (operations/grad.py), ``check`` (operations/check.py) and batch runs all read
their inputs through ``load_problem``, so they agree on names, defaults and messages.

The activations decide what no one said: the gate layout, ``use_peephole`` and ``seq_len_max`` not given
by an argument or the input are what the stored activations show (decide.py, which ``inspect`` uses too),
and a given value they contradict is kept but reported (``Problem.warnings``; the command line's strict
mode makes it an error).
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .. import frameworks, io, ops
from ..analysis import decide, detect
from ..analysis.decide import Given
from ..errors import InputFileError, InvalidArgumentError, LstmGradError, UnrecordedTensorsError
from ..messages import TYPED, Command, Message, Param, cut, message_of
from ..ops import validation
from ..spec import (  # noqa: F401 - (re-exported)
    DEFAULT_LAYOUT,
    FORWARD_DEFAULTS,
    FORWARD_INPUTS,
    FORWARD_OPS,
    LAYOUT_V2,
    OPS,
    TIME_MAJOR,
    layout_for,
)
from .request import Request


class OpArrays(Mapping):
    """The op's tensors by name (``names``' order), where the forward outputs of a Keras or PyTorch layer lstmgrad
    recomputes are made when first asked for (``forward()``: them by name, validated).  A GPU backend computes such
    a layer on its device from the layer's own tensors (layers/device.py) and never asks: no forward pass on the
    host for nothing.  ``ready()``: the tensors there are without making any."""

    def __init__(self, names, given: dict, forward: Callable[[], dict]):
        self._names, self._given, self._forward, self._made = tuple(names), given, forward, None

    def __getitem__(self, name):
        if name in self._given:
            return self._given[name]
        if name not in self._names:
            raise KeyError(name)
        if self._made is None:
            self._made = self._forward()
        return self._made[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def ready(self) -> dict:
        return {n: self[n] for n in self._names if n in self._given or self._made is not None}

    def __contains__(self, name) -> bool:  # (without making the forward outputs)
        return name in self._names


def ready(arrays: Mapping) -> dict:
    """The tensors of ``arrays`` there are now (``OpArrays.ready``): none made for the asking."""
    return arrays.ready() if isinstance(arrays, OpArrays) else dict(arrays)


def given(problem) -> dict:
    """``problem``'s tensors that its input gave: without the forward outputs lstmgrad recomputed (made or not)."""
    made = decide.activation_names(problem.kind) if problem.sources.get("activations") == "recomputed" else ()
    return {name: problem.arrays[name] for name in problem.arrays if name not in made}


@dataclass
class Problem:
    """A gradient problem read from a file and validated, with where each parameter came from."""

    path: str
    kind: str  # "seq" | "cell"
    layout: str
    arrays: Mapping  # name -> array (a dict; OpArrays where a layer's forward outputs are made when asked for)
    dims: validation.Dims
    seq_len_max: int  # 1 for the cell op
    use_peephole: bool
    # parameter -> "flag" | "tensor" | "attribute" | "dump" | "metadata" | "activations" (found from them)
    # | "default" | "op" (decide.py)
    sources: dict = field(default_factory=dict)
    defaults: list[str] = field(default_factory=list)  # what was not given and how it was filled in
    keys: list[str] = field(default_factory=list)  # every entry of the file (group), as stored
    fit: detect.ActivationFit | None = None  # what the stored activations fit (None: nothing to recompute)
    warnings: list[str] = field(default_factory=list)  # what was asked contradicts the activations, or they fit nothing
    notes: list[str] = field(default_factory=list)  # what else the summary should say (the op a dump recorded, ...)
    member: str | None = None  # the execution of a TensorFlow debug dump this problem is
    recorded_op: str | None = None  # the gradient op TensorFlow ran on these tensors, when the input says
    framework: frameworks.Plan | None = None  # a Keras or PyTorch module's tensors: how to compute and name them
    unused: list[str] = field(default_factory=list)  # a framework input's entries no computation uses (as stored)

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
    given = given_param(name, flag, loaded, sources)
    if given is not None:
        return given
    sources[name] = "default"
    defaults.append(f"{name}: not in the file, {default_text}")
    return default


def given_param(name: str, flag, loaded: io.LoadedFile, sources: dict):
    """The command-line flag, else the file's tensor or attribute, else None; records where it came from."""
    if flag is not None:
        sources[name] = "flag"
        return flag
    if name in loaded.scalars:
        value, origin = loaded.scalars[name]
        sources[name] = origin
        return value
    return None


def _given(name: str, flag, loaded: io.LoadedFile) -> Given | None:
    """The argument (a flag), else the input's tensor or attribute, as a ``decide.Given``; None when neither."""
    if flag is not None:
        return Given(flag, "flag")
    if name in loaded.scalars:
        value, origin = loaded.scalars[name]
        return Given(value, origin)
    return None


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
        raise InvalidArgumentError(Message.format("{}: missing tensor x (needed to tell seq from cell; or give {})",
                                                  path, Param("kind")))
    kind = {3: "seq", 2: "cell"}.get(np.ndim(x))
    if kind is None:
        raise InvalidArgumentError(f"{path}: x has rank {np.ndim(x)}; expected 3 (seq) or 2 (cell)")
    return kind


def load_problem(path, request: Request | None = None, **fields) -> Problem:
    """Read and validate a seq or cell input as ``request`` (or a ``Request`` of ``fields``) asks.

    ``kind=None`` decides from the rank of x (3: seq, 2: cell).  Given fields (not None) override values in the
    file.  The gate layout and ``use_peephole``, when neither the request nor the input gives them, are what the
    stored activations fit (detect.py), else ifco and false; a given value the activations contradict is used as
    given, with a line in ``Problem.warnings``.  Missing ``seq_len_max`` means T; without peepholes, absent
    wci/wcf/wco are zeros.  Tensors the input lacks are read from ``weights`` (another input, any format) when
    given.  Without any forward outputs (i, cs, f, o, ci, co, h) they are recomputed by the forward op, with
    ``forget_bias`` and ``cell_clip`` from the request, the file, or the op's defaults.
    Every problem is an ``InvalidArgumentError`` naming the file.
    """
    with open_problem(path, request if request is not None else Request(**fields)) as problem:
        return problem


@contextlib.contextmanager
def open_problem(path, request: Request, *, lazy: bool = False, input_format: str | None = None
                 ) -> Iterator[Problem]:
    """``load_problem`` whose time-major tensors may stay on disk (``lazy``: HDF5 datasets, large stored NPZ members
    and .npy files) while the block runs.

    Lazy tensors are read a chunk of time steps at a time by the backward pass, so an input larger
    than memory can be processed; they must not be used after the block ends.  ``input_format``: what
    ``io.sniff_format`` said of ``path``, when the caller has asked it already.  Keras and PyTorch tensors
    (``request.framework``, else told from the names) are turned into the op's (frameworks.py).
    """
    kind, layout, use_peephole, seq_len_max = request.kind, request.layout, request.use_peephole, request.seq_len_max
    group, weights, weights_group = request.group, request.weights, request.weights_group
    forget_bias, cell_clip = request.forget_bias, request.cell_clip
    path = Path(path)
    framework = request.framework
    wanted = _names_to_read(kind, framework)
    scalars = ("seq_len_max", "use_peephole") if kind != "cell" else ("use_peephole",)
    scalars += ("forget_bias", "cell_clip")  # used only when the activations are recomputed
    scalars += (io.METADATA_KEY,)  # the forward op of an ``lstmgrad forward`` output
    resolved = ""
    if weights is not None and kind != "cell" and framework.framework in (None, "keras"):
        weights_group, resolved = _weights_group(weights, weights_group)
    with io.open_inputs(path, wanted, scalars, group, lazy=TIME_MAJOR if lazy else (),
                        input_format=input_format) as loaded:
        notes, keys, supplied, extra = _supplement(loaded, weights, weights_group, wanted, scalars)
        notes += [f"from {weights}: {resolved}"] if resolved else []
        try:
            step = frameworks.framework_of([*keys, *loaded.tensors], kind, np.ndim(loaded.tensors["x"])
                                           if "x" in loaded.tensors else None)
            name = step or ("tf" if kind == "cell" else frameworks.detect([*keys, *loaded.tensors], framework))
            misnamed = frameworks.pytorch.misnamed(keys) if name == "torch" else []
            if misnamed:  # (before any layer number is used to count or to read)
                raise InvalidArgumentError(Message.format("{}: {}", path, misnamed[0]))
            plan = None
            if name == "tf":
                try:
                    if kind == "cell" and frameworks.without_weights([*keys, *loaded.tensors]):
                        raise InvalidArgumentError(frameworks.cells.MISSING_WEIGHTS)
                    frameworks.check_applicable(name, framework)
                    _refuse_unused(loaded.keys)
                except InvalidArgumentError as err:
                    raise err.prefixed(str(path)) from None
            unused = []
            if name in frameworks.FRAMEWORKS:
                plan, unused = _framework_plan(path, loaded, name, framework, group, weights, weights_group, extra,
                                               step is not None)
                layout, use_peephole, kind = LAYOUT_V2, False, "seq"  # a layer's gates are in V2's order
            if plan is not None and not plan.single:
                problem = _module_problem(path, loaded, plan)
            else:
                problem = _problem_from(path, loaded, kind, layout, use_peephole, seq_len_max, forget_bias,
                                        cell_clip, defer_forward=plan is not None)
        except InvalidArgumentError:
            if weights is None or supplied:
                raise
            where = _layers_in(weights, keys, weights_group, kind)
            if not where:
                raise
            # what was missing is beside the point: nothing could be read from a file (or a group of it) that keeps
            # its layers in groups below (or holds none lstmgrad computes)
            raise InvalidArgumentError(Message.format("{}: nothing was read from {}{}, which {}", path, weights,
                                                      f" (group {weights_group})" if weights_group else "",
                                                      where)) from None
        problem.notes = notes + problem.notes
        if plan is not None:
            problem.framework, problem.unused = plan, unused
            problem.sources["layout"] = problem.sources["use_peephole"] = name
            problem.notes += plan.notes
            problem.warnings += plan.warnings
        yield problem


@functools.lru_cache(maxsize=16)
def _names_to_read(kind: str | None, framework: frameworks.FrameworkOptions) -> tuple[str, ...]:
    """The tensors an input of ``kind`` is read for: the op's, and those a Keras or PyTorch layer's (or cell
    step's) may hold.  The same for every file of a batch: made once (~17 us a file)."""
    wanted = validation.SEQ_TENSORS if kind != "cell" else validation.CELL_TENSORS
    if kind != "cell" and framework.framework != "tf":
        wanted = tuple(dict.fromkeys([*wanted, *frameworks.file_names(framework)]))
    if kind == "cell":  # a PyTorch or Keras cell's step too (frameworks/cells.py)
        wanted = tuple(dict.fromkeys([*wanted, *frameworks.names.cell_file_names()]))
    return wanted


# Keys that change a framework layer's maths: never ignored in silence where the op's own tensors are given.
_FRAMEWORK_ONLY = {"lengths": "per-example lengths, as a PyTorch packed batch has", "mask": "a Keras mask"}


def _refuse_unused(keys) -> None:
    """The TF ops run every example over the same steps: a lengths or mask key beside the op's tensors would be
    ignored, and the gradient wrong."""
    found = [k for k in _FRAMEWORK_ONLY if k in keys]
    if found:
        raise InvalidArgumentError(
            Message.format("{} is there ({}), and the TF block-LSTM ops have none: every example runs seq_len_max "
                           "steps. For a Keras or PyTorch layer's tensors give their names (kernel, weight_ih_l0, ...) "
                           "or {}; for the op's own, remove it", found[0], _FRAMEWORK_ONLY[found[0]],
                           Param("framework")))


def _framework_plan(path: Path, loaded: io.LoadedFile, name: str, options, group, weights, weights_group,
                    extra, step: bool = False) -> tuple[frameworks.Plan, list[str]]:
    """What computes a Keras or PyTorch user's gradients (frameworks.py; ``step``: one cell step, cells.py), and the
    input's entries it does not use (warned of); a single layer-direction of the op's own maths replaces the
    input's tensors by the op's (its forward outputs are then recomputed)."""
    if name == "torch" and not step:
        _read_torch_layers(path, loaded, group)
    held = {n: np.asarray(v[()]) for n, v in loaded.tensors.items()}  # (lazy datasets read whole)
    try:
        if step:
            frameworks.check_applicable(name, options)
            plan = frameworks.cells.plan(name, held, keys=loaded.keys)
        else:
            layer = _keras_layer(weights, weights_group, extra, options) if name == "keras" else None
            plan = frameworks.plan(name, held, options, layer)
        names = frameworks.unused.used_names(plan)
        others = [k for k in loaded.keys if k != io.METADATA_KEY and not frameworks.unused.stands_for(k, names)]
        unused, warning = frameworks.unused.check(_tensors_among(path, loaded, group, others), plan)
        if warning:
            plan.warnings.append(warning)
    except InvalidArgumentError as err:
        if name == "keras" and weights_group and extra is not None and extra.format == "hdf5" and any(
                found["stacked"] and found["group"].startswith(weights_group.strip("/") + "/")
                for found in frameworks.keras_layers(weights)):
            raise InvalidArgumentError(f"{path}: {weights_group} is a {frameworks.keras_config.STACKED}") from None
        hints = frameworks.unused.hints(_tensors_among(path, loaded, group, loaded.keys), name)  # (misnamed ones)
        if hints and hints not in str(err):
            err = InvalidArgumentError(Message(message_of(err), f"; {hints}"))
        raise err.prefixed(str(path)) from None
    if plan.single:
        op, steps = plan.op_tensors()
        loaded.tensors = op
        loaded.scalars = {"seq_len_max": (steps, name)}
    return plan, unused


MAX_KEYS_LOOKED_AT = 1000  # an input's entries looked at for being HDF5 groups, at most (the others: tensors)


def _tensors_among(path: Path, loaded: io.LoadedFile, group, keys) -> list[str]:
    """Those of ``keys`` (an input's entries) that are tensors: not an HDF5 file's groups, nor lstmgrad's metadata."""
    keys = [k for k in keys if k != io.METADATA_KEY]
    if loaded.format != "hdf5" or not keys:
        return keys
    with io.hdf5.open_hdf5(path) as (fh, h5py), io.hdf5.hdf5_errors(path):
        node = io.hdf5.walk(fh, fh, group, path, h5py, f"group {group!r}") if group else fh
        groups = {k for k in keys[:MAX_KEYS_LOOKED_AT] if isinstance(node.get(k, getlink=True), h5py.HardLink)
                  and isinstance(node.get(k), h5py.Group)}
    return [k for k in keys if k not in groups]


def _read_torch_layers(path: Path, loaded: io.LoadedFile, group) -> None:
    """The parameters of every layer and direction of an nn.LSTM the input holds, once its names say which there
    are (a ``--weights`` file's are read with the rest from it: ``_supplement``)."""
    more = [n for n in frameworks.pytorch.parameter_names(loaded.keys) if n not in loaded.tensors]
    if more:
        loaded.tensors.update(io.read_inputs(path, more, (), group).tensors)


def _keras_layer(weights, weights_group, extra, options) -> frameworks.KerasLayer | None:
    """What a Keras layer was made with: from the model configuration a ``--weights`` archive or full-model file
    records, else what its group's name says (a Bidirectional's backward_layer runs backwards)."""
    info = dict(extra.info) if extra is not None else {}
    if extra is not None and extra.format == "hdf5":
        found = io.keras_archive.hdf5_model_config(weights)
        if found is not None:
            info.update(keras_model_config=found[0], keras_version=found[1],
                        keras_config_source=f"{Path(weights).name} model_config")
    if info.get("keras_model_config") is not None:
        return frameworks.keras_config.layer_options(info["keras_model_config"], weights_group or "",
                                                     keras_version=info.get("keras_version", ""),
                                                     source=info.get("keras_config_source", str(weights)),
                                                     inference=options.inference)
    return frameworks.keras_config.layer_from_group(weights_group or "", options)


def _module_problem(path: Path, loaded: io.LoadedFile, plan: frameworks.Plan) -> Problem:
    """A whole module (several layers or directions, or activations the op has not): computed by its plan."""
    T, B, I, C = plan.dims  # noqa: E741
    arrays = {n: v for n, v in plan.tensors.items() if np.asarray(v).dtype.kind == "f"}
    problem = Problem(str(path), "seq", LAYOUT_V2, arrays, validation.Dims(T, B, I, C), T, False,
                      keys=list(loaded.keys))
    problem.sources["seq_len_max"] = plan.framework
    return problem


def _layers_in(weights, keys, weights_group: str | None = None, kind: str | None = None) -> Message | str:
    """What a ``--weights`` file (or its group ``weights_group``) that supplied nothing holds instead, in words (""
    when nothing useful): where it keeps its LSTM layers (in groups), or that it holds none lstmgrad computes (the
    cells of a StackedRNNCells, a GRU, an nn.LSTMCell); for ``lstmgrad cell`` (``kind``), where it keeps cells."""
    if kind == "cell":
        return _cells_in(weights, keys, weights_group)
    try:
        fmt = io.sniff_format(weights)
        if fmt in ("hdf5", "keras"):
            if weights_group:  # a Keras group names one layer: what is wrong with it is said where it is read
                return ""
            layers, _source = frameworks.weights_files.keras_model_layers(weights, fmt)
            groups = [layer["group"] for layer in layers]
            refused = frameworks.weights_files.keras_other_recurrent(weights, fmt) if not groups else []
        else:  # a state_dict's keys, below the group when one was given
            below = f"{weights_group.strip('./')}." if weights_group else ""
            groups = list(dict.fromkeys(below + d["prefix"] for d in frameworks.torch_state_dict_layers(keys)
                                        if d["prefix"]))
            refused = frameworks.pytorch.cells_in(keys) if not groups else []
    except LstmGradError:  # (it was read a moment ago: what is wrong with it now is for the next run to say)
        return ""
    if refused:
        return Message("holds no LSTM layer lstmgrad computes: ", Message.join("; ", refused))
    if groups and all("/cells/" in g for g in groups):
        return f"holds the LSTM cells of a {frameworks.keras_config.STACKED}"
    if not groups:
        return ""
    return Message.format("holds LSTM layers at {}{}: name one with {}", ", ".join(cut(g, TYPED) for g in groups[:6]),
                          ", ..." if len(groups) > 6 else "", Param("weights_group"))


def _cells_in(weights, keys, weights_group: str | None) -> Message | str:
    """Where a ``--weights`` file that supplied no cell's weights keeps LSTM cells (a state_dict's nn.LSTMCell, a Keras
    file's cell groups), in words; "" when nothing useful."""
    try:
        if io.sniff_format(weights) in ("hdf5", "keras"):
            if weights_group:
                return ""
            fmt = io.sniff_format(weights)
            if fmt == "keras":
                with io.keras_archive.model_weights(weights) as (h5, _config, _version):
                    groups = frameworks.weights_files.keras_cells(h5)
            else:
                groups = frameworks.weights_files.keras_cells(weights)
        else:
            below = f"{weights_group.strip('./')}." if weights_group else ""
            groups = [below + k.removesuffix(".weight_ih") for k in keys if k.endswith(".weight_ih")]
    except LstmGradError:
        return ""
    if not groups:
        return ""
    return Message.format("holds LSTM cell weights at {}{}: name one with {}", ", ".join(groups[:6]),
                          ", ..." if len(groups) > 6 else "", Param("weights_group"))


def _supplement(loaded: io.LoadedFile, weights, weights_group, wanted, scalars) -> tuple:
    """Tensors and scalars the input lacks, read from the ``--weights`` file; what came from where, in words,
    every name the input and the weights file hold, how many came from the weights file, and what was read from
    it (None without one)."""
    if weights is None:
        return [], list(loaded.keys), 0, None
    tensors = [n for n in wanted if n not in loaded.tensors]
    params = [n for n in scalars if n not in loaded.scalars and n != io.METADATA_KEY]
    extra = _read_weights(weights, tensors, params, weights_group)
    found = (*frameworks.pytorch.parameter_names(extra.keys), *frameworks.names.keras_wrapped_names(extra.keys))
    layers = [n for n in found if n not in extra.tensors and n not in loaded.tensors]
    if layers:  # an nn.LSTM's other layers and directions, a Bidirectional's layers, now that the names say which
        extra.tensors.update(io.read_inputs(weights, layers, (), weights_group).tensors)
    loaded.tensors.update(extra.tensors)
    loaded.scalars.update(extra.scalars)
    for name in [*extra.tensors, *extra.scalars]:
        loaded.info.get("missing", {}).pop(name, None)
    taken = [*extra.tensors, *extra.scalars]
    notes = [f"from {weights}: {', '.join(taken)}"] if taken else [f"nothing was needed from {weights}"]
    in_both = [n for n in (*wanted, *scalars) if n not in taken and (n in extra.keys or io.camel(n) in extra.keys)
               and (n in loaded.tensors or n in loaded.scalars)]
    if in_both:
        notes.append(f"in both the input and {weights}: {', '.join(in_both)}; the input's are used")
    return notes, [*loaded.keys, *extra.keys], len(taken), extra


# A batch reads the same tensors of the same --weights file for every input (2.4-4 ms a file from a small HDF5
# weights file, more from a Keras model's): what was read is kept while the file is unchanged, until ``forget_weights``
# (a batch's end; a Dask worker, which runs many batches' files, keeps at most two files of KEPT_WEIGHTS_BYTES).
KEPT_WEIGHTS_BYTES = 256 * 2**20


def _file_key(path) -> tuple | None:
    """What tells a regular file's content apart within this process (device, inode, size, modification and change
    times); None for anything else (a directory of .npy files, a file over KEPT_WEIGHTS_BYTES: read each time)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > KEPT_WEIGHTS_BYTES:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def forget_weights() -> None:
    """Drop what was kept of --weights files (when a batch ends: its arrays are not held after it)."""
    _kept_weights.cache_clear()
    _kept_group.cache_clear()


def _read_weights(weights, tensors, params, group) -> io.LoadedFile:
    """``io.read_inputs`` of the --weights file, read again only when the file changed: each call gets a LoadedFile
    of its own, the arrays shared and read-only."""
    key = _file_key(weights)
    if key is None:
        return io.read_inputs(weights, tensors, params, group)
    kept = _kept_weights(str(weights), key, tuple(tensors), tuple(params), group)
    return replace(kept, tensors=dict(kept.tensors), scalars=dict(kept.scalars), keys=list(kept.keys),
                   errors=dict(kept.errors), info=dict(kept.info))


@functools.lru_cache(maxsize=2)
def _kept_weights(path: str, key: tuple, tensors: tuple, params: tuple, group) -> io.LoadedFile:
    loaded = io.read_inputs(path, list(tensors), list(params), group)
    for value in loaded.tensors.values():
        value.flags.writeable = False
    return loaded


def _weights_group(weights, group) -> tuple[str | None, str]:
    """``weights_files.resolve_group`` of the --weights file, found again only when the file changed."""
    key = _file_key(weights)
    if key is None:
        return frameworks.weights_files.resolve_group(weights, group)
    return _kept_group(str(weights), key, group)


@functools.lru_cache(maxsize=8)
def _kept_group(path: str, key: tuple, group) -> tuple[str | None, str]:
    return frameworks.weights_files.resolve_group(path, group)


def _problem_from(path: Path, loaded: io.LoadedFile, kind, layout, use_peephole, seq_len_max, forget_bias=None,
                  cell_clip=None, defer_forward: bool = False) -> Problem:
    """The problem of ``loaded``'s tensors.  ``defer_forward``: forward outputs lstmgrad recomputes (a framework
    layer's) are made when first asked for (``OpArrays``), their shapes and dtypes validated now."""
    member = loaded.info.get("member")
    label = f"{path} [{member}]" if member else str(path)
    _refuse_wrong_file(label, path, loaded, kind)
    kind = kind or loaded.info.get("kind")  # a dump knows the op it recorded
    if kind is None:
        kind = detect_kind(label, loaded.tensors.get("x"))
    names = validation.SEQ_TENSORS if kind == "seq" else validation.CELL_TENSORS
    problem = Problem(label, kind, layout_for(kind, layout or DEFAULT_LAYOUT), {}, validation.Dims(0, 0, 0, 0),
                      1, False, keys=list(loaded.keys), member=member, recorded_op=loaded.info.get("op_type"))
    _recorded_op_note(problem, loaded.info)
    try:
        peephole = _given("use_peephole", use_peephole, loaded)
        if peephole is not None:
            peephole = Given(validation.check_use_peephole(peephole.value), peephole.source)
            problem.sources["use_peephole"] = peephole.source
        fill_absent_peepholes(loaded, bool(peephole and peephole.value), problem.defaults)
        activations = decide.activation_names(kind)
        recompute = decide.recompute(kind, loaded.tensors)
        missing = [n for n in names if n not in loaded.tensors and not (recompute and n in activations)]
        if missing:
            raise _missing_error(problem, loaded, missing, names, activations)
        layout_given = Given(layout, "flag") if layout is not None else _recorded_layout(loaded)
        length_given = _given("seq_len_max", seq_len_max, loaded) if kind == "seq" else None
        forward = None
        if recompute:
            forward = _recompute_activations(problem, loaded, layout_given, peephole, length_given, forget_bias,
                                             cell_clip)
            if not (defer_forward and kind == "seq"):
                loaded.tensors.update(forward())
                forward = None
        elif forget_bias is not None or cell_clip is not None:
            problem.notes.append(Message.format(
                "{} and {} set how forward outputs are recomputed; this input has its own, so they change nothing",
                Param("forget_bias"), Param("cell_clip")))
        if forward is not None:
            arrays = _deferred(label, loaded, names, activations, forward)
            problem.dims = validation.check_block_lstm_grad({**arrays.ready(), **_placeholders(arrays, activations)})
        else:
            arrays = validation.as_float_arrays({n: loaded.tensors[n] for n in names})
            if kind == "seq":
                problem.dims = validation.check_block_lstm_grad(arrays)
            else:
                problem.dims = validation.check_lstm_block_cell_grad(arrays)
        if not recompute:
            decisions = decide.decide(kind, arrays, problem.dims.T, layout_given=layout_given,
                                      use_peephole_given=peephole, seq_len_max_given=length_given)
    except InputFileError:  # (a read of an input left in its file: its message names the file already)
        raise
    except LstmGradError as err:
        raise err.prefixed(label) from None
    problem.arrays = arrays
    if recompute:  # ours: nothing to find out from them
        return problem
    problem.fit = decisions.fit
    problem.layout, problem.use_peephole = decisions.layout.value, decisions.use_peephole.value
    problem.seq_len_max = decisions.seq_len_max.value
    problem.sources.update(layout=decisions.layout.source, use_peephole=decisions.use_peephole.source)
    if kind == "seq":
        problem.sources["seq_len_max"] = decisions.seq_len_max.source
    problem.warnings += decisions.all_warnings
    problem.notes += decisions.all_notes
    problem.defaults += decisions.all_defaults
    return problem


def _recorded_layout(loaded: io.LoadedFile) -> Given | None:
    """The layout the input records: the forward op a debug dump recorded, or ``lstmgrad forward``'s metadata."""
    if loaded.info.get("layout"):
        return Given(loaded.info["layout"], "dump")
    if io.METADATA_KEY in loaded.scalars:
        return decide.recorded_layout(loaded.scalars[io.METADATA_KEY][0])
    return None


def _recorded_op_note(problem: Problem, info: dict) -> None:
    """The gradient op a dump recorded, when it is not the one for the forward op that made its activations."""
    note = decide.recorded_op_note(problem.recorded_op, info.get("forward_op"), info.get("right_op"))
    if note:
        problem.notes.append(note)


def _recompute_activations(problem: Problem, loaded: io.LoadedFile, layout_given: Given | None,
                           peephole_given: Given | None, length_given: Given | None, forget_bias, cell_clip
                           ) -> Callable[[], dict]:
    """No forward outputs in the input: the forward op (BlockLSTMV2, BlockLSTM or LSTMBlockCell, by layout) to run
    on its inputs, as TensorFlow's own forward pass would have stored what it gives: its settings decided and said
    now, and a function that runs it (its outputs by name)."""
    seq = problem.kind == "seq"
    layout = decide.layout(problem.kind, layout_given, None, activations=False)
    problem.layout, problem.sources["layout"] = layout.value, layout.source
    op = FORWARD_OPS[(problem.kind, problem.layout)]
    default_fb, default_clip = FORWARD_DEFAULTS[op]
    inputs = validation.as_float_arrays({n: np.asarray(loaded.tensors[n][()]) for n in FORWARD_INPUTS})
    dims = validation.check_forward(inputs, seq)
    if seq:
        length = decide.seq_len_max(dims.T, length_given)
        problem.seq_len_max, problem.sources["seq_len_max"] = length.value, length.source
        problem.defaults += length.defaults
    peephole = decide.use_peephole(peephole_given, None, problem.layout, activations=False)
    problem.use_peephole, problem.sources["use_peephole"] = peephole.value, peephole.source
    use_peephole = problem.use_peephole
    fb = _attribute("forget_bias", forget_bias, loaded, default_fb, problem)
    clip = _attribute("cell_clip", cell_clip, loaded, default_clip, problem)
    decide.forget_bias_allowed(op, fb)
    common = dict(cell_clip=clip, use_peephole=use_peephole)
    steps = problem.seq_len_max

    def forward() -> dict:
        if op == "BlockLSTMV2":
            outputs = ops.block_lstm_v2(steps, **inputs, **common)
        elif op == "BlockLSTM":
            outputs = ops.block_lstm(steps, **inputs, forget_bias=fb, **common)
        else:
            outputs = ops.lstm_block_cell(**inputs, forget_bias=fb, **common)
        return outputs._asdict()

    problem.sources["activations"] = "recomputed"
    problem.notes.append(f"activations recomputed: {op} with forget_bias={fb:g}, cell_clip={clip:g}"
                         + (" (no clipping)" if clip <= 0 else "") + f", use_peephole={str(use_peephole).lower()}")
    return forward


def _deferred(label: str, loaded: io.LoadedFile, names, activations, forward: Callable[[], dict]) -> OpArrays:
    """The op's tensors of ``names`` with the forward outputs ``activations`` made by ``forward`` when first asked
    for."""
    given = validation.as_float_arrays({n: loaded.tensors[n] for n in names if n not in activations})

    def made() -> dict:
        try:
            return validation.as_float_arrays(forward())
        except LstmGradError as err:
            raise err.prefixed(label) from None

    return OpArrays(names, given, made)


def _placeholders(arrays: OpArrays, activations) -> dict:
    """Stand-ins of the shape and dtype the forward outputs ``activations`` will have (the op's [T, B, C] in x's
    dtype), no memory each, for validating the other tensors against them before they are made."""
    x, w = arrays["x"], arrays["w"]
    zero = np.zeros((), dtype=x.dtype)
    shape = (x.shape[0], x.shape[1], w.shape[1] // 4) if x.ndim == 3 and w.ndim == 2 else x.shape
    return {n: np.broadcast_to(zero, shape) for n in activations}


def _attribute(name: str, flag, loaded: io.LoadedFile, default: float, problem: Problem) -> float:
    """A forward op's attribute: the flag, else the file's scalar, else the op's default (said in defaults)."""
    value = given_param(name, flag, loaded, problem.sources)
    if value is None:
        problem.sources[name] = "default"
        return default
    array = np.asarray(value)
    if array.ndim or array.dtype.kind not in "iuf" or not np.isfinite(array):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    return float(array)


def _missing_error(problem: Problem, loaded: io.LoadedFile, missing: list[str], names, activations=()):
    """Tensors the input lacks: those a debug dump recorded no value for (``UnrecordedTensorsError``, by cause), or
    those a file does not hold."""
    why = loaded.info.get("missing", {})
    unrecorded = {n: why[n] for n in missing if n in why}
    if unrecorded:
        return UnrecordedTensorsError(unrecorded)
    text = (f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)} ({problem.op} needs "
            f"{', '.join(names)}; the file has {io.describe_keys(loaded.keys)})")
    if any(n in activations for n in missing):  # some forward outputs and not others: never mixed with recomputed
        given = [n for n in activations if n in loaded.tensors]
        text += (f"; of the forward outputs it has {', '.join(given)}: give all of {', '.join(activations)}, or "
                 "none and lstmgrad recomputes them")
    return InvalidArgumentError(text)


def peephole_origin(problem: Problem) -> Message | str:
    """Where the use_peephole in force came from, in the words a user recognises."""
    return decide.peephole_origin(Given(problem.use_peephole, problem.sources.get("use_peephole", "flag")))


def _refuse_wrong_file(path: str, file: Path, loaded: io.LoadedFile, kind: str | None) -> None:
    """A clear word for the wrong command (a step under seq, a sequence under cell) or the wrong file."""
    x = loaded.tensors.get("x")
    if x is not None and kind == "seq" and np.ndim(x) == 2:
        raise InvalidArgumentError(Message.format("{}: x has shape {}, one step [B, I]: this is a single cell step; "
                                                  "use {}", path, list(np.shape(x)), Command("cell")))
    if x is not None and kind == "cell" and np.ndim(x) == 3:
        raise InvalidArgumentError(Message.format("{}: x has shape {}, a sequence [T, B, I]; use {}", path,
                                                  list(np.shape(x)), Command("seq")))
    if x is None and not loaded.info.get("member"):  # (a dump's execution holds its gradients beside its inputs)
        grads = [k for k in loaded.keys if k.endswith("_grad") and k not in ("cs_grad", "h_grad")]
        if grads or io.METADATA_KEY in loaded.keys:
            raise InvalidArgumentError(Message.format("{}: {}", path, _gradient_file(file, grads)))


def _gradient_file(path: Path, grads: list[str]) -> Message:
    """Words for a gradient file given as an input: where it came from, what to give instead."""
    try:
        meta = io.read_metadata(path)
    except (LstmGradError, OSError):
        meta = {}
    compare = Param("reference_path")
    if meta.get("tool") == "lstmgrad" and str(meta.get("op", "")).endswith(("Grad", "GradV2")):
        source = f" of {meta['source']}" if meta.get("source") else ""
        return Message.format("is an lstmgrad output (the {} gradients{}), not an input; give the file with the op's "
                              "tensors (x, cs_prev, ...), or compare with it as a reference ({})", meta["op"], source,
                              compare)
    return Message.format("holds gradients ({}) and no x: a reference to compare with ({}), not an input; give the "
                          "file with the op's tensors (x, cs_prev, h_prev, w, ...)", io.describe_keys(grads), compare)
