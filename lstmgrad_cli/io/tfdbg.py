"""TensorFlow debug dumps (tfdbg2) read without TensorFlow: every execution of a block-LSTM op in them.

``tf.debugging.experimental.enable_dump_debug_info(DIR, tensor_debug_mode="FULL_TENSOR",
circular_buffer_size=-1)`` writes, per process, six TFRecord files ``tfdbg_events.<time>.<host>.<suffix>``
of ``DebugEvent`` messages (tfrecord.py frames them, protowire.py decodes them):

* ``.graphs``: each op created in a ``tf.function`` (``GraphOpCreation``: type, name, input names);
* ``.graph_execution_traces``: each output tensor of each op run inside a graph, in execution order;
* ``.execution``: each eager op (its input and output tensor ids, output values) and each function call.

A dump is one input holding many problems: every run of ``BlockLSTM``, ``BlockLSTMV2``, ``LSTMBlockCell`` and
their gradient ops is an *execution*, named ``<graph>/<op name>#<k>`` (``eager/<op type>#<k>`` for eager
ops; ``k`` counts the runs of that op).  ``index_dump`` streams the records once and keeps, per execution,
only where each input and output value lies (file, record, position): memory grows with the number of
records, not their data.  ``open_dump`` reads one execution's values, re-reading and re-checking their records:
every TensorProto is declared first (dtype, shape, and how many values it holds, counted from the lengths),
checked with the others (declared.py), and only then decoded.  A hostile dump is bounded on the way: a shape
of more than 254 dimensions (TensorFlow's limit) or an execution of more than 65,536 tensors is refused, and a
record too large to hold in memory is walked on disk (tfrecord.py).

How inputs are found.  In a graph, an input ``producer:slot`` is the latest traced output of that producer
before the op ran; ops tfdbg2 never traces (``Identity``, loop plumbing) are followed to their own input.
Eagerly, an input tensor id is an output of an earlier execution.  tfdbg2 records no value for a function's
arguments, for eager tensors no op produced (``tf.constant``), or for records a circular buffer dropped:
such inputs are reported missing with the reason, and ``--weights FILE`` can supply them.  No op attribute
is recorded: the layout follows from the forward op's type, ``use_peephole`` from the activations (detect.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputFileError, LstmGradError
from ..messages import Command, Message, Param
from ..spec import GRADIENT_OPS, SIGNATURES
from . import protowire as pw
from ._common import Budget, Format, LoadedFile, describe_keys, max_tensor_bytes
from .declared import Declared, checked, store
from .tfrecord import open_record, read_records

SUFFIXES = ("metadata", "source_files", "stack_frames", "graphs", "execution", "graph_execution_traces")
FULL_TENSOR = 7
MODES = {0: "UNSPECIFIED", 1: "NO_TENSOR", 2: "CURT_HEALTH", 3: "CONCISE_HEALTH", 4: "FULL_HEALTH", 5: "SHAPE",
         6: "FULL_NUMERICS", 7: "FULL_TENSOR", 8: "REDUCE_INF_NAN_THREE_SLOTS"}
DUMP_CALL = ('tf.debugging.experimental.enable_dump_debug_info(DIR, tensor_debug_mode="FULL_TENSOR", '
             "circular_buffer_size=-1)")

OPS = SIGNATURES  # op type -> (kind, layout, forward op, input names, output names): spec.py's table
# Ops tfdbg2 never traces whose output is an input passed through: follow them to that input.
_PASS_THROUGH = {"Identity": 0, "Snapshot": 0, "Enter": 0, "Exit": 0, "NextIteration": 0, "Switch": 0,
                 "RefIdentity": 0, "StopGradient": 0, "IdentityN": None}  # None: the input of the same slot
_MAX_FOLLOW = 64
MAX_TENSORS_PER_OP = 65536  # inputs, outputs or recorded values of one eager execution (no op has so many)
MAX_DIMS = 254  # TensorFlow's own limit on a shape's rank (TensorShape::MaxDimensions)
# TensorFlow DataType -> numpy dtype and the TensorProto field of its typed values
_DTYPES = {1: (np.float32, 5), 2: (np.float64, 6), 3: (np.int32, 7), 9: (np.int64, 10), 10: (np.bool_, 11),
           19: (np.float16, 13)}
_DTYPE_NAMES = {0: "DT_INVALID", 4: "DT_UINT8", 5: "DT_INT16", 6: "DT_INT8", 7: "DT_STRING", 8: "DT_COMPLEX64",
                14: "DT_BFLOAT16", 17: "DT_UINT16", 18: "DT_COMPLEX128", 20: "DT_RESOURCE", 21: "DT_VARIANT",
                **{code: np.dtype(dtype).name for code, (dtype, _field) in _DTYPES.items()}}


def sniff(names: list[str]) -> bool:
    """A dump directory: some ``X.metadata`` with its ``X.execution`` or ``X.graph_execution_traces`` beside it."""
    present = set(names)
    return any(n.endswith(".metadata") and ({n[:-8] + "execution", n[:-8] + "graph_execution_traces"} & present)
               for n in names)


# -- what an index holds ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRef:
    """Where a recorded value lies: the ``index``-th TensorProto field of the record at ``offset``."""

    file: Path
    offset: int
    index: int
    mode: int
    dtype: str | None
    shape: tuple | None


@dataclass(frozen=True)
class Missing:
    """An input the dump has no value for, and why."""

    tensor: str  # the producer's tensor name ("x:0") or eager tensor id
    why: str


@dataclass
class OpExecution:
    """One run of a block-LSTM op (forward or gradient) found in a dump."""

    member: str  # "<graph>/<op name>#<k>" or "eager/<op type>#<k>": what --group / --execution select
    op_type: str
    op_name: str
    graph: str | None  # the tf.function's graph, None when eager
    occurrence: int  # k: runs of this op before this one
    mode: int
    inputs: dict = field(default_factory=dict)  # TF input name -> TensorRef | Missing
    outputs: dict = field(default_factory=dict)  # TF output name -> TensorRef
    forward_op: str | None = None  # gradient ops: the type of the op that made the activations (input i)
    forward_member: str | None = None

    @property
    def kind(self) -> str:
        return OPS[self.op_type][0]

    @property
    def is_gradient(self) -> bool:
        return self.op_type in GRADIENT_OPS

    @property
    def missing(self) -> dict[str, Missing]:
        return {n: v for n, v in self.inputs.items() if isinstance(v, Missing)}

    @property
    def right_op(self) -> str | None:
        """The gradient op that is right for the forward op that made the activations (None if unknown)."""
        if not self.is_gradient or self.forward_op not in OPS:
            return None
        kind, layout = OPS[self.forward_op][:2]
        return next(op for op, spec in OPS.items() if spec[2] is not None and spec[:2] == (kind, layout))

    def describe(self) -> dict:
        """A JSON-ready summary (no values): shapes and dtypes, which inputs have values, the forward op."""
        def ref(value):
            if isinstance(value, Missing):
                return {"recorded": False, "tensor": value.tensor, "why": value.why}
            return {"recorded": True, "dtype": value.dtype, "shape": list(value.shape or ())}

        return {"member": self.member, "op_type": self.op_type, "op_name": self.op_name,
                "where": "eager" if self.graph is None else f"graph {self.graph}", "execution": self.occurrence,
                "tensor_debug_mode": MODES.get(self.mode, str(self.mode)),
                "forward_op": self.forward_op, "forward_execution": self.forward_member, "right_op": self.right_op,
                "inputs": {n: ref(v) for n, v in self.inputs.items()},
                "outputs": {n: ref(v) for n, v in self.outputs.items()}}


@dataclass
class DumpIndex:
    path: Path
    tensorflow_version: str | None
    executions: list[OpExecution]
    modes: dict[str, int]  # tensor_debug_mode -> records written with it
    records: int
    dropped: str | None = None  # what the dump shows its circular buffer dropped (``_Buffered.dropped``), if any

    def gradient_executions(self, kind: str | None = None) -> list[OpExecution]:
        return [e for e in self.executions if e.is_gradient and (kind is None or e.kind == kind)]

    def find(self, member: str) -> OpExecution:
        for execution in self.executions:
            if execution.member == member:
                return execution
        raise InputFileError(f"{self.path}: no execution {member!r} in this TensorFlow debug dump (it has "
                             f"{describe_keys([e.member for e in self.executions])})")


# -- reading a dump -------------------------------------------------------------------------------------

def file_sets(path: Path) -> list[dict[str, Path]]:
    """The dump's file sets (one per process that wrote to it): suffix -> file."""
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        raise InputFileError(f"{path}: cannot list the dump: {err.strerror or err}") from None
    present = set(names)  # (a list here made a directory of 32,000 files take 90 s to list)
    sets = []
    for name in names:
        if name.endswith(".metadata"):
            prefix = name[:-len("metadata")]
            sets.append({s: path / (prefix + s) for s in SUFFIXES if (prefix + s) in present})
    if not sets:
        raise InputFileError(f"{path}: no *.metadata file: not a TensorFlow debug dump")
    return sets


_CACHE: dict[Path, tuple[tuple, DumpIndex]] = {}  # a few indexes, so a batch over one dump reads it once per process
_CACHE_SIZE = 4


def index_dump(path: str | os.PathLike) -> DumpIndex:
    """Every block-LSTM execution of the dump at ``path``, with where its values lie; reads every record
    once (both checksums verified) and keeps no tensor data.  An index is reused while the dump's files
    keep their sizes and modification times."""
    path = Path(path)
    stamp = _stamp(path)
    cached = _CACHE.get(path.resolve())
    if cached is not None and cached[0] == stamp:
        return cached[1]
    index = _index(path)
    _CACHE[path.resolve()] = (stamp, index)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    return index


def _stamp(path: Path) -> tuple:
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))
    except OSError:
        return ()


def _index(path: Path) -> DumpIndex:
    limit = max_tensor_bytes()
    version, executions, modes, count = None, [], {}, 0
    runs: dict[str, int] = {}  # op key -> runs so far, over every file set: each execution has its own name
    dropped = []
    for files in file_sets(path):
        graphs, creations = {}, {}
        state = _Runs(executions, runs)
        for suffix in ("metadata", "graphs", "execution", "graph_execution_traces"):
            for record in _records(files, suffix, limit, path):
                count += 1
                state.buffered.records[suffix] += 1
                try:
                    event = {number: value for number, _wire, value in pw.fields(_message(record.data))}
                    if suffix == "metadata" and 3 in event:
                        version = _text_field(event[3], 1) or version
                    elif suffix == "graphs" and 7 in event:
                        op = _op_creation(event[7])
                        creations[op["graph_id"], op["op_name"]] = op
                    elif suffix == "graphs" and 8 in event:
                        graphs[_text_field(event[8], 1)] = _text_field(event[8], 2)
                    elif suffix == "execution" and 9 in event:
                        _eager(state, files[suffix], record, event[9], modes)
                    elif suffix == "graph_execution_traces" and 10 in event:
                        _traced(state, files[suffix], record, event[10], creations, graphs, modes)
                except (pw.WireError, ValueError) as err:
                    raise InputFileError(f"{path}: the {suffix} record at byte {record.offset} is not a valid "
                                         f"DebugEvent ({err})") from None
        said = state.buffered.dropped()
        if said is not None:
            dropped.append(said)
    return DumpIndex(path, version, executions, modes, count, "; ".join(dropped) or None)


class _Buffered:
    """What a file set says of the circular buffer it was written through (``circular_buffer_size``, by default
    1000: the ``.execution`` and ``.graph_execution_traces`` files each keep the last so many records).

    tfdbg2 records neither the buffer's size nor what it dropped, but a tf.function's calls tell: each call of a
    graph is one record of ``.execution`` (its ``graph_id``) and traces each op output of the graph once
    (tf.function's control flow runs in graphs of their own).  So the kept calls of a graph, times the outputs one
    call traces (those seen), is how many of its traces there must be after the oldest one kept; fewer, and the
    buffer dropped at least the difference, the traces file being full (it then holds as many records as the
    buffer does).  An ``.execution`` file holding that many records was full too: its earlier executions were
    dropped, how many is not recorded."""

    def __init__(self) -> None:
        self.records: Counter = Counter()  # suffix -> records
        self.calls: Counter = Counter()  # graph id -> .execution records of a call of it
        self.traces: Counter = Counter()  # graph id -> its traces
        self.outputs: dict[str, set] = {}  # graph id -> the (op name, slot) it traces

    def dropped(self) -> str | None:
        missing = sum(max(0, calls * len(self.outputs.get(graph, ())) - self.traces[graph])
                      for graph, calls in self.calls.items())
        if not missing:
            return None
        size = self.records["graph_execution_traces"]
        said = (f"its circular buffer dropped at least {missing} graph execution traces (tfdbg2 keeps the last "
                f"{size} records of each kind: circular_buffer_size={size}; the calls it kept traced more)")
        if self.records["execution"] >= size:
            said += f", and its .execution file is full too ({size} records): earlier executions were dropped"
        return (f"{said}; executions whose values were dropped cannot be computed: dump again with "
                "circular_buffer_size=-1")


def _message(data):
    """A record's data as ``protowire.fields`` walks it (a large record stays a FileSpan on disk)."""
    return memoryview(data) if isinstance(data, bytes | bytearray) else data


def _records(files: dict, suffix: str, limit: int, path: Path):
    if suffix not in files:
        return
    yield from read_records(files[suffix], limit, label=f"{path}/{files[suffix].name}")


def _text_field(message, number: int) -> str | None:
    for n, wire, value in pw.fields(message):
        if n == number:
            return pw.as_text(wire, value)
    return None


def _op_creation(message) -> dict:
    op = {"op_type": "", "op_name": "", "graph_name": "", "graph_id": "", "input_names": []}
    for n, wire, value in pw.fields(message):
        if n in (1, 2, 3, 4):
            op[("op_type", "op_name", "graph_name", "graph_id")[n - 1]] = pw.as_text(wire, value)
        elif n == 6:
            op["input_names"].append(pw.as_text(wire, value))
    return op


class _Runs:
    """What the index pass keeps while it walks the records of one file set."""

    def __init__(self, executions: list, counts: dict[str, int]):
        self.executions = executions
        self.counts = counts  # op key -> runs so far (of every file set read yet)
        self.latest: dict[tuple, TensorRef] = {}  # (graph id, op name, slot) -> latest traced value
        self.open: dict[tuple, OpExecution] = {}  # (graph id, op name) -> its latest execution
        self.produced: dict[int, tuple] = {}  # eager tensor id -> (TensorRef, execution member or None, op type)
        self.relevant: set | None = None  # (graph id, op name) of block-LSTM ops and what feeds them
        self.buffered = _Buffered()

    def relevant_ops(self, creations: dict) -> set:
        """The graph ops whose traces matter: block-LSTM ops and every op on the way to their inputs (made once,
        when the first trace arrives: the rest of a model's traces are then skipped after two fields)."""
        if self.relevant is None:
            self.relevant = set()
            for (graph_id, op_name), op in creations.items():
                if op["op_type"] in OPS:
                    self.relevant.add((graph_id, op_name))
                    for source in op["input_names"]:
                        self.relevant.update(_chain(creations, graph_id, source))
        return self.relevant

    def start(self, op_type, op_name, graph, mode) -> OpExecution:
        key = f"{graph or 'eager'}/{op_name}"
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        execution = OpExecution(f"{key}#{k}", op_type, op_name, graph, k, mode)
        self.executions.append(execution)
        return execution


def _eager(state: _Runs, file: Path, record, message, modes: dict) -> None:
    op_type, inputs, outputs, mode, protos = "", [], [], 0, []
    for n, wire, value in pw.fields(message):
        if n == 1:
            op_type = pw.as_text(wire, value)
        elif n == 3:  # a call of a tf.function: its graph
            state.buffered.calls[pw.as_text(wire, value)] += 1
        elif n in (4, 5):
            ids = inputs if n == 4 else outputs
            if len(ids) + (pw.count_varints(value) if wire == pw.LENGTH else 1) > MAX_TENSORS_PER_OP:
                raise pw.WireError(f"an execution with more than {MAX_TENSORS_PER_OP} "
                                   f"{'inputs' if n == 4 else 'outputs'}")
            ids += pw.packed_varints(wire, value)
        elif n == 6:
            mode = pw.as_int(wire, value)
        elif n == 7:
            if len(protos) == MAX_TENSORS_PER_OP:
                raise pw.WireError(f"an execution recording more than {MAX_TENSORS_PER_OP} tensors")
            protos.append(_tensor_header(pw.as_bytes(wire, value)))
    modes[MODES.get(mode, str(mode))] = modes.get(MODES.get(mode, str(mode)), 0) + 1
    refs = [TensorRef(file, record.offset, j, mode, dtype, shape) for j, (dtype, shape) in enumerate(protos)]
    execution = None
    if op_type in OPS:
        execution = state.start(op_type, op_type, None, mode)
        _, _, _, in_names, out_names = OPS[op_type]
        for name, tensor_id in zip(in_names, inputs, strict=False):
            found = state.produced.get(tensor_id)
            execution.inputs[name] = found[0] if found else Missing(
                f"eager tensor {tensor_id}", "no recorded execution produced it: made by tf.constant, from numpy "
                "or a Python number, read from a tf.Variable (eager reads under a GradientTape are not recorded: "
                "run the step in a tf.function), made before dumping started, left out by enable_dump_debug_info's "
                "op_regex or tensor_dtypes, or dropped by a circular buffer")
        execution.outputs = {name: ref for name, ref in zip(out_names, refs, strict=False)}
        _link_forward(execution, lambda name: state.produced.get(inputs[in_names.index(name)])
                      if name in in_names and in_names.index(name) < len(inputs) else None)
    for slot, tensor_id in enumerate(outputs):
        if slot < len(refs):
            state.produced[tensor_id] = (refs[slot], execution.member if execution else None, op_type)


def _traced(state: _Runs, file: Path, record, message, creations: dict, graphs: dict, modes: dict) -> None:
    graph_id, op_name, slot, mode, proto = "", "", 0, 0, None
    relevant = state.relevant_ops(creations)
    for n, wire, value in pw.fields(message):
        if n == 1:
            graph_id = pw.as_text(wire, value)
        elif n == 2:
            op_name = pw.as_text(wire, value)
        elif n == 3:
            slot = pw.as_int(wire, value)
        elif n == 4:
            mode = pw.as_int(wire, value)
            if (graph_id, op_name) not in relevant:  # another op of the model: nothing more to read
                break
        elif n == 5:
            proto = pw.as_bytes(wire, value)
    modes[MODES.get(mode, str(mode))] = modes.get(MODES.get(mode, str(mode)), 0) + 1
    state.buffered.traces[graph_id] += 1
    state.buffered.outputs.setdefault(graph_id, set()).add((op_name, slot))
    if (graph_id, op_name) not in relevant:
        return
    dtype, shape = _tensor_header(proto) if proto is not None else (None, None)
    ref = TensorRef(file, record.offset, 0, mode, dtype, shape)
    creation = creations.get((graph_id, op_name))
    op_type = creation["op_type"] if creation else ""
    if op_type in OPS:
        _, _, _, in_names, out_names = OPS[op_type]
        if slot == 0:  # the op has just run: its inputs are the latest values of their producers
            graph = graphs.get(graph_id) or graph_id[:8]
            execution = state.start(op_type, op_name, graph, mode)
            state.open[graph_id, op_name] = execution
            for name, source in zip(in_names, creation["input_names"], strict=False):
                execution.inputs[name] = _resolve(state, creations, graph_id, source, graph)
            _link_forward(execution, lambda name: _producer(state, creations, graph_id, creation, in_names, name))
        execution = state.open.get((graph_id, op_name))
        if execution is not None and slot < len(out_names):
            execution.outputs[out_names[slot]] = ref
    state.latest[graph_id, op_name, slot] = ref


def _split(source: str) -> tuple[str, int]:
    name, _, slot = source.rpartition(":")
    return (name, int(slot)) if slot.isdigit() and name else (source, 0)


def _follow(creations: dict, graph_id: str, source: str, latest: dict):
    """(op name, slot, creation) of the traced tensor behind ``source``, through ops tfdbg2 does not trace."""
    name, slot = _split(source)
    for _ in range(_MAX_FOLLOW):
        creation = creations.get((graph_id, name))
        if (graph_id, name, slot) in latest or creation is None or creation["op_type"] not in _PASS_THROUGH:
            return name, slot, creation
        through = _PASS_THROUGH[creation["op_type"]]
        inputs = creation["input_names"]
        index = slot if through is None else through
        if index >= len(inputs):
            return name, slot, creation
        name, slot = _split(inputs[index])
    return name, slot, creations.get((graph_id, name))


def _chain(creations: dict, graph_id: str, source: str) -> list[tuple]:
    """Every (graph id, op name) from ``source`` back through ops tfdbg2 does not trace (Identity, ...)."""
    name, slot = _split(source)
    chain = []
    for _ in range(_MAX_FOLLOW):
        chain.append((graph_id, name))
        creation = creations.get((graph_id, name))
        if creation is None or creation["op_type"] not in _PASS_THROUGH:
            break
        through = _PASS_THROUGH[creation["op_type"]]
        index = slot if through is None else through
        if index >= len(creation["input_names"]):
            break
        name, slot = _split(creation["input_names"][index])
    return chain


def _resolve(state: _Runs, creations: dict, graph_id: str, source: str, graph: str):
    name, slot, creation = _follow(creations, graph_id, source, state.latest)
    ref = state.latest.get((graph_id, name, slot))
    if ref is not None:
        return ref
    op_type = creation["op_type"] if creation else None
    if op_type == "Placeholder":
        why = f"an argument of tf.function {graph}, and tfdbg2 records no values of function arguments"
    elif op_type is None:
        why = "made by an op the dump does not describe"
    else:
        why = (f"the {op_type} op {name!r} that makes it has no recorded output before this execution (left out "
               "by enable_dump_debug_info's op_regex or tensor_dtypes, or dropped by a circular buffer: dump with "
               "circular_buffer_size=-1 and no filter)")
    return Missing(f"{name}:{slot}", why)


def _producer(state: _Runs, creations: dict, graph_id: str, creation: dict, in_names, name):
    """(ref, member, op type) of the op that made input ``name`` of a traced op, for finding the forward op."""
    if name not in in_names or in_names.index(name) >= len(creation["input_names"]):
        return None
    op_name, _slot, producer = _follow(creations, graph_id, creation["input_names"][in_names.index(name)],
                                       state.latest)
    if producer is None:
        return None
    execution = state.open.get((graph_id, op_name))
    return None, execution.member if execution else None, producer["op_type"]


def _link_forward(execution: OpExecution, producer_of) -> None:
    """A gradient op's forward op: the producer of its input ``i``."""
    if not execution.is_gradient:
        return
    found = producer_of("i")
    if found is not None:
        _, member, op_type = found
        execution.forward_op, execution.forward_member = op_type or None, member


# -- values -----------------------------------------------------------------------------------------------

def _tensor_header(proto) -> tuple[str | None, tuple | None]:
    """(dtype name, shape) of a TensorProto, from its first fields (its values are not walked)."""
    dtype, shape = None, ()
    for n, wire, value in pw.fields(proto):
        if n == 1:
            code = pw.as_int(wire, value)
            dtype = _DTYPE_NAMES.get(code, f"DataType {code}")
        elif n == 2:
            shape = _shape(pw.as_bytes(wire, value))
        elif n > 2:  # TensorFlow writes dtype and shape first
            break
    return dtype, shape


def _shape(message) -> tuple:
    dims = []
    for n, wire, value in pw.fields(message):
        if n == 2:
            if len(dims) == MAX_DIMS:  # (a million dims took seconds to walk, then a traceback)
                raise pw.WireError(f"a shape of more than {MAX_DIMS} dimensions (TensorFlow's limit)")
            size = 0
            for m, w2, v2 in pw.fields(pw.as_bytes(wire, value)):
                if m == 1:
                    size = pw.as_signed(w2, v2)
            dims.append(size)
        elif n == 3 and pw.as_int(wire, value):
            return None  # unknown rank
    return tuple(dims)


class _Proto:
    """A TensorProto walked once, nothing decoded: its dtype and shape, where its values are and how many there
    are (counted from the lengths: 20 million one-value fields are not walked past the shape's size)."""

    def __init__(self, proto, key: str, path):
        self.key, self.path = key, path
        self.code, self.shape, self.content, self.typed, self.count, self.more = None, (), None, [], 0, False
        for n, wire, value in pw.fields(proto):
            if n == 1:
                self.code = pw.as_int(wire, value)
            elif n == 2:
                self.shape = _shape(pw.as_bytes(wire, value))
            elif n == 4:
                self.content = pw.as_bytes(wire, value)
            elif self.code in _DTYPES and n == _DTYPES[self.code][1]:
                self.typed.append((wire, value))
                self.count += _value_count(self.code, wire, value, key, path)
                if self._known() and self.count > math.prod(self.shape):
                    self.more = wire != pw.LENGTH  # (one value per field: stop counting)
                    break

    def _known(self) -> bool:
        return self.shape is not None and all(d >= 0 for d in self.shape)

    def declared(self) -> tuple[np.dtype, tuple]:
        """(dtype, shape), or InputFileError for a dtype or shape lstmgrad does not read."""
        if self.code not in _DTYPES:
            raise InputFileError(f"{self.path}: {self.key} has dtype "
                                 f"{_DTYPE_NAMES.get(self.code, f'DataType {self.code}')}; expected a float, integer "
                                 "or boolean tensor")
        if not self._known():
            raise InputFileError(f"{self.path}: {self.key} has an unknown shape ({self.shape}); refused")
        return np.dtype(_DTYPES[self.code][0]).newbyteorder("<"), tuple(self.shape)

    def verify(self) -> None:
        """The values the proto holds fit its shape (checked from their lengths, once the shape is within budget)."""
        dtype, shape = self.declared()
        nbytes = math.prod(shape) * dtype.itemsize
        if self.content is not None and len(self.content) and len(self.content) != nbytes:
            raise InputFileError(f"{self.path}: {self.key} holds {len(self.content)} bytes of data for shape "
                                 f"{list(shape)} of {dtype.name} ({nbytes} bytes); corrupt")
        if (self.content is None or not len(self.content)) and self.count > math.prod(shape):
            raise InputFileError(f"{self.path}: {self.key} holds {'at least ' if self.more else ''}{self.count} "
                                 f"values for shape {list(shape)}; corrupt")

    def value(self) -> np.ndarray:
        """The array: ``tensor_content`` bytes, or the typed values (the last one repeated to fill the shape, as
        TensorFlow does).  Call after ``verify``."""
        dtype, shape = self.declared()
        if self.content is not None and len(self.content):
            return np.frombuffer(pw.buffer(self.content), dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
        values = _typed_values(self.code, self.typed, self.key, self.path)
        out = np.zeros(shape, dtype=dtype.newbyteorder("="))
        if len(values):
            flat = out.reshape(-1)
            flat[:len(values)] = values
            flat[len(values):] = values[-1]  # TensorFlow repeats the last value to fill the shape
        return out


def _value_count(code: int, wire: int, value, key: str, path) -> int:
    """How many values one typed field holds, from its length alone (packed) or 1 (one value per field)."""
    if wire != pw.LENGTH:
        return 1
    if code in (1, 2):  # float_val, double_val: packed fixed-width
        width = 4 if code == 1 else 8
        if len(value) % width:
            raise InputFileError(f"{path}: {key} has malformed values ({len(value)} bytes of packed "
                                 f"{'float' if code == 1 else 'double'}s)")
        return len(value) // width
    return pw.count_varints(value)


def _typed_values(code: int, typed: list, key: str, path) -> np.ndarray:
    try:
        if code == 1:  # float_val: packed little-endian float32
            raw = b"".join(bytes(v) if w == pw.LENGTH else v for w, v in typed)
            return np.frombuffer(raw, dtype="<f4")
        if code == 2:
            raw = b"".join(bytes(v) if w == pw.LENGTH else v for w, v in typed)
            return np.frombuffer(raw, dtype="<f8")
        ints = [n for w, v in typed for n in pw.packed_varints(w, v)]
        if code == 19:  # half_val: the 16-bit patterns as non-negative ints
            return np.array([n & 0xFFFF for n in ints], dtype=np.uint16).view(np.float16)
        if code == 10:
            return np.array([bool(n) for n in ints], dtype=np.bool_)
        signed = [n - (1 << 64) if n >= 1 << 63 else n for n in ints]
        return np.array(signed, dtype=_DTYPES[code][0])
    except (ValueError, OverflowError, pw.WireError) as err:
        raise InputFileError(f"{path}: {key} has malformed values ({err})") from None


def _record_protos(data, ref: TensorRef, key: str, label) -> list:
    """The TensorProto fields of a record's execution or trace."""
    event = {n: v for n, _w, v in pw.fields(_message(data))}
    message = event.get(10) if 10 in event else event.get(9)
    protos = [v for n, w, v in pw.fields(message) if n == (5 if 10 in event else 7)] if message is not None else []
    if ref.index >= len(protos):
        raise InputFileError(f"{label}: {key}: its record changed since the dump was indexed")
    return protos


def mode_error(path, mode: str) -> str:
    return (f"{path}: the dump was written with tensor_debug_mode={mode}, which records no tensor values; lstmgrad "
            f"needs them: dump again with {DUMP_CALL}")


# -- the Format entry ------------------------------------------------------------------------------------

@contextlib.contextmanager
def open_dump(path: Path, names, scalars, group=None, lazy=(), collect_errors=False, kind=None, headers=()):
    """One execution's tensors under TF's names (``group`` names the execution; a dump of exactly one
    gradient execution needs none).  ``LoadedFile.info`` says which op ran, the forward op, what is missing."""
    index = index_dump(path)
    execution = select(index, group)
    yield load_execution(index, execution, list(names), list(scalars), collect_errors, kind, headers)


def select_executions(index: DumpIndex, kind: str | None, member: str | None = None, op: str | None = None,
                      execution: int | None = None) -> list[OpExecution]:
    """The gradient-op executions of ``kind`` a command runs: all, or the one named ``member``, or those of the op
    named (name or type) ``op``, or the ``execution``-th run of each op (negative: from the last)."""
    if member:
        return [index.find(member)]
    chosen = index.gradient_executions(kind)
    if op:
        chosen = [e for e in chosen if op in (e.op_name, e.op_type, f"{e.graph or 'eager'}/{e.op_name}")]
    if execution is not None:
        runs: dict[tuple, int] = {}
        for e in chosen:
            runs[e.graph, e.op_name] = runs.get((e.graph, e.op_name), 0) + 1
        chosen = [e for e in chosen if e.occurrence == (execution if execution >= 0
                                                        else runs[e.graph, e.op_name] + execution)]
    if chosen:
        return chosen
    counts: dict[str, int] = {}
    for e in index.gradient_executions():
        counts[e.op_type] = counts.get(e.op_type, 0) + 1
    has = ", ".join(f"{op_type} x{n}" for op_type, n in counts.items()) or "no gradient op"
    wanted = {"seq": "BlockLSTMGrad or BlockLSTMGradV2", "cell": "LSTMBlockCellGrad"}.get(kind, "gradient-op")
    hint = ""
    if kind == "seq" and "LSTMBlockCellGrad" in counts:
        hint = Message("; use ", Command("cell"))
    elif kind == "cell" and set(counts) & {"BlockLSTMGrad", "BlockLSTMGradV2"}:
        hint = Message("; use ", Command("seq"))
    given = [Param(name, value) for name, value in (("op", op), ("execution", execution)) if value is not None]
    picked = Message(" matching ", Message.join(", ", given)) if given else ""
    raise InputFileError(Message.format("{}: no {} executions{} in this TensorFlow debug dump (it has {}){}",
                                        index.path, wanted, picked, has, hint))


def select(index: DumpIndex, member: str | None) -> OpExecution:
    """The execution named ``member``, or the dump's only gradient-op execution."""
    if member:
        return index.find(member)
    gradients = index.gradient_executions()
    if len(gradients) == 1:
        return gradients[0]
    if not index.executions:
        raise InputFileError(f"{index.path}: no block-LSTM op was recorded in this TensorFlow debug dump")
    listing = describe_keys([e.member for e in (gradients or index.executions)])
    raise InputFileError(Message.format("{}: the dump holds {} gradient-op executions; name one with {} ({})",
                                        index.path, len(gradients), Param("group"), listing))


def load_execution(index: DumpIndex, execution: OpExecution, names, scalars, collect_errors=False,
                   kind: str | None = None, headers=()) -> LoadedFile:
    path = index.path
    if execution.mode != FULL_TENSOR:
        raise InputFileError(mode_error(path, MODES.get(execution.mode, str(execution.mode))))
    loaded = LoadedFile(path, "tfdbg2", header_only=frozenset(headers))
    available = {**execution.inputs, **execution.outputs}
    loaded.keys = [n for n, v in available.items() if not isinstance(v, Missing)]
    loaded.info = {"member": execution.member, "op_type": execution.op_type, "kind": execution.kind,
                   "forward_op": execution.forward_op,
                   "right_op": execution.right_op, "missing": {n: m.why for n, m in execution.missing.items()},
                   "outputs": list(execution.outputs)}
    if execution.forward_op in OPS:
        loaded.info["layout"] = OPS[execution.forward_op][1]

    records: dict[tuple, object] = {}  # (file, offset) -> the record's data, read once for every tensor in it
    with contextlib.ExitStack() as opened:
        def declare(name: str) -> Declared | None:
            ref = available.get(name)
            if ref is None or isinstance(ref, Missing):
                return None
            if ref.mode != FULL_TENSOR:
                raise InputFileError(mode_error(path, MODES.get(ref.mode, str(ref.mode))))
            if (ref.file, ref.offset) not in records:
                records[ref.file, ref.offset] = opened.enter_context(
                    open_record(ref.file, ref.offset, max_tensor_bytes(), label=f"{path}/{ref.file.name}"))
            try:
                parsed = _Proto(_record_protos(records[ref.file, ref.offset], ref, name, path)[ref.index], name, path)
                dtype, shape = parsed.declared()
            except pw.WireError as err:
                raise InputFileError(f"{path}: {name} is not a valid TensorProto ({err})") from None
            return Declared(name, name, shape, dtype, lambda: _decoded(parsed, name, path), verify=parsed.verify)

        for name, entry in checked(loaded, Budget(path, kind or execution.kind), names, scalars, declare).items():
            try:
                if isinstance(entry, InputFileError):
                    raise entry
                value = entry.read()
            except LstmGradError as err:
                if not collect_errors:
                    raise
                loaded.errors[name] = err
                continue
            store(loaded, entry, value, scalars)
    return loaded


def _decoded(parsed: _Proto, name: str, path) -> np.ndarray:
    try:
        return parsed.value()
    except pw.WireError as err:
        raise InputFileError(f"{path}: {name} is not a valid TensorProto ({err})") from None


def check_values_recorded(index: DumpIndex) -> None:
    """Refuse a dump with no FULL_TENSOR record at all, naming the mode it was written with."""
    if index.executions and FULL_TENSOR not in {e.mode for e in index.executions}:
        others = ", ".join(sorted(m for m in index.modes if m != "FULL_TENSOR")) or "NO_TENSOR"
        raise InputFileError(mode_error(index.path, others))


def member_slug(member: str) -> str:
    """An execution's name as part of a file name: 'train_step/gradient_tape/BlockLSTMGrad#0' ->
    'train_step.gradient_tape.BlockLSTMGrad.0'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", ".", member).strip(".")


def member_slugs(members) -> dict[str, str]:
    """Each execution's name as part of a file name, distinct within ``members``: ``member_slug``, except where two
    executions' names differ only in characters a file name cannot hold ('g!#0' and 'g?#0' are both 'g.0'); those
    are percent-encoded instead ('g%21%230', 'g%3F%230'), which tells them apart and says which execution each is."""
    members = list(dict.fromkeys(members))
    plain = {m: member_slug(m) for m in members}
    shared = {slug for slug, n in Counter(plain.values()).items() if n > 1}
    return {m: urllib.parse.quote(m, safe="") if plain[m] in shared else plain[m] for m in members}


FORMAT = Format("tfdbg2", "a TensorFlow debug dump (tfdbg2)", True, sniff, open_dump, "npz")
