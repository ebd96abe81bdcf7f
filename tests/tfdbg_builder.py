"""Writing tfdbg2 records for tests: a protobuf encoder for the few DebugEvent fields lstmgrad reads, and
TFRecord framing with TensorFlow's checksums.  The real dumps in fixtures/tfdbg/ were made by TensorFlow; this
builds hostile ones (edited records, impossible shapes) and large ones (many runs) without it."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from lstmgrad_cli.io.tfrecord import masked_crc32c

DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2, np.dtype(np.int32): 3, np.dtype(np.int64): 9,
          np.dtype(np.bool_): 10, np.dtype(np.float16): 19}


def record(data: bytes) -> bytes:
    """One TFRecord (the checksum is the reader's own; TF's dumps in fixtures/tfdbg/ check it against TF's)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, value) -> bytes:
    """One field: an int is a varint, a float a double, bytes/str length-delimited."""
    if isinstance(value, bool | int) and not isinstance(value, float):
        return varint(number << 3) + varint(int(value))
    if isinstance(value, float):
        return varint(number << 3 | 1) + struct.pack("<d", value)
    data = value.encode() if isinstance(value, str) else bytes(value)
    return varint(number << 3 | 2) + varint(len(data)) + data


def packed(number: int, values) -> bytes:
    return field(number, b"".join(varint(v) for v in values))


def shape_proto(shape) -> bytes:
    return b"".join(field(2, field(1, int(d)) if d else b"") for d in shape)


def tensor_proto(array: np.ndarray, shape=None) -> bytes:
    array = np.asarray(array)
    return field(1, DTYPES[array.dtype]) + field(2, shape_proto(array.shape if shape is None else shape)) + field(
        4, array.astype(array.dtype.newbyteorder("<")).tobytes())


def event(number: int, message: bytes, wall_time: float = 1.0) -> bytes:
    return field(1, wall_time) + field(number, message)


def op_creation(op_type: str, op_name: str, graph_id: str, inputs=(), num_outputs=1) -> bytes:
    return event(7, field(1, op_type) + field(2, op_name) + field(3, "fn") + field(4, graph_id)
                 + b"".join(field(6, name) for name in inputs) + field(7, num_outputs))


def trace(graph_id: str, op_name: str, slot: int, value: np.ndarray, mode: int = 7) -> bytes:
    return event(10, field(1, graph_id) + field(2, op_name) + (field(3, slot) if slot else b"") + field(4, mode)
                 + field(5, tensor_proto(value)))


def write_dump(folder: Path, files: dict[str, list[bytes]]) -> Path:
    """A dump directory: ``files`` maps a suffix to the DebugEvent messages of that file."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"metadata": [event(3, field(1, "2.21.0") + field(2, "debug.Event:1") + field(3, "test"))], **files}
    for suffix in ("metadata", "source_files", "stack_frames", "graphs", "execution", "graph_execution_traces"):
        (folder / f"tfdbg_events.1.test.{suffix}").write_bytes(b"".join(record(m) for m in files.get(suffix, [])))
    return folder


SEQ_INPUTS = ("seq_len_max", "x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
ACTS = ("i", "cs", "f", "o", "ci", "co", "h")
GRADS = ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad", "b_grad")


def graph_training_dump(folder: Path, runs: list[dict], grad_op: str = "BlockLSTMGradV2",
                        forward_op: str = "BlockLSTMV2", other_ops: int = 0, grad_name: str = "grad") -> Path:
    """A tf.function run ``len(runs)`` times: per run, every input read by a ReadVariableOp, the forward op, the
    output gradients, and the gradient op, all traced, and ``other_ops`` ops of the rest of a model (each
    tracing a [B, C] value); ``grad_name``: the gradient op's name.  Each run is a dict of the tensors under TF's
    names (the seq inputs, the activations, cs_grad, h_grad and the gradient op's outputs)."""
    gid = "graph-0"
    graphs = [event(8, field(1, gid) + field(2, "train_step"))]
    graphs += [op_creation("MatMul", f"dense_{k}/MatMul", gid, ["a:0", "b:0"]) for k in range(other_ops)]
    for name in (*SEQ_INPUTS, "cs_grad", "h_grad"):
        graphs.append(op_creation("ReadVariableOp", f"read_{name}", gid, [f"read_{name}/resource:0"]))
    graphs.append(op_creation(forward_op, "fwd", gid, [f"read_{n}:0" for n in SEQ_INPUTS], 7))
    grad_inputs = [f"read_{n}:0" for n in SEQ_INPUTS] + [f"fwd:{k}" for k in range(7)] + ["read_cs_grad:0",
                                                                                          "read_h_grad:0"]
    graphs.append(op_creation(grad_op, grad_name, gid, grad_inputs, 8))
    traces = []
    for run in runs:
        for name in (*SEQ_INPUTS, "cs_grad", "h_grad"):
            traces.append(trace(gid, f"read_{name}", 0, run[name]))
        traces += [trace(gid, "fwd", k, run[name]) for k, name in enumerate(ACTS)]
        traces += [trace(gid, grad_name, k, run[name]) for k, name in enumerate(GRADS)]
        traces += [trace(gid, f"dense_{k}/MatMul", 0, run["h_prev"]) for k in range(other_ops)]
    return write_dump(folder, {"graphs": graphs, "graph_execution_traces": traces})


def eager_gradient_dump(folder: Path, run: dict, unrecorded=(), grad_op: str = "BlockLSTMGradV2") -> Path:
    """An eager gradient-op execution whose inputs were each made by an eager op the dump recorded (a Snapshot),
    except those named in ``unrecorded``: they come from no recorded execution (read from a tf.Variable under a
    GradientTape, made by tf.constant...).  ``run`` holds the inputs under TF's names and the gradient op's
    outputs."""
    names = (*SEQ_INPUTS, *ACTS, "cs_grad", "h_grad")
    executions, ids = [], []
    for k, name in enumerate(names):
        tensor_id = 100 + k
        ids.append(tensor_id)
        if name not in unrecorded:
            executions.append(event(9, field(1, "Snapshot") + packed(5, [tensor_id]) + field(6, 7)
                                    + field(7, tensor_proto(run[name]))))
    outputs = [200 + k for k in range(len(GRADS))]
    executions.append(event(9, field(1, grad_op) + packed(4, ids) + packed(5, outputs) + field(6, 7)
                            + b"".join(field(7, tensor_proto(run[name])) for name in GRADS)))
    return write_dump(folder, {"execution": executions})
