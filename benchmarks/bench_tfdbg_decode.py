"""Reading a TensorFlow debug dump: lstmgrad's hand-written protobuf walk against the protobuf runtime.

Builds a dump of a training loop (RUNS runs of a tf.function with BlockLSTMV2 and BlockLSTMGradV2 and OTHER
ops of the rest of a model, every tensor traced, T=20, B=16, I=C=32 float32: ~0.5 MB of LSTM values a run)
with tests/tfdbg_builder.py, then times, alternating, medians of REPEATS:

* framing: every record read and both CRC-32C checksums checked (tfrecord.py), nothing decoded;
* lstmgrad: ``tfdbg.index_dump`` (framing plus the protobuf walk of protowire.py that finds the executions
  and where their values lie);
* protobuf runtime: framing plus ``DebugEvent.FromString`` of every record, the parse alone that a reader
  on the runtime would start from (only where TensorFlow's generated ``debug_event_pb2`` is importable: run
  it with the dev-only TF virtualenv's interpreter);
* one execution's values: ``tfdbg.load_execution``, and the runtime's ``FromString`` + ``np.frombuffer`` of
  the same records.

    .venv-tf/bin/python benchmarks/bench_tfdbg_decode.py        # both (TF's venv has protobuf and numpy)
    .venv/bin/python benchmarks/bench_tfdbg_decode.py           # lstmgrad only
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tfdbg_builder import graph_training_dump  # noqa: E402

from lstmgrad_cli.io import tfdbg, tfrecord  # noqa: E402

RUNS, OTHER, REPEATS = 100, 200, 7


def problem(seed=1):
    rng = np.random.default_rng(seed)
    T, B, I, C = 20, 16, 32, 32  # noqa: E741
    shapes = {"x": (T, B, I), "cs_prev": (B, C), "h_prev": (B, C), "w": (I + C, 4 * C), "wci": (C,), "wcf": (C,),
              "wco": (C,), "b": (4 * C,), "cs_grad": (T, B, C), "h_grad": (T, B, C),
              **{n: (T, B, C) for n in ("i", "cs", "f", "o", "ci", "co", "h")},
              "x_grad": (T, B, I), "cs_prev_grad": (B, C), "h_prev_grad": (B, C), "w_grad": (I + C, 4 * C),
              "wci_grad": (C,), "wcf_grad": (C,), "wco_grad": (C,), "b_grad": (4 * C,)}
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    tensors["seq_len_max"] = np.int64(T)
    return tensors


def median_ms(times):
    return f"{statistics.median(times) * 1e3:.1f} ms"


def main() -> None:
    try:
        from tensorflow.core.protobuf import debug_event_pb2  # noqa: PLC0415 - dev-only comparison
    except ImportError:
        debug_event_pb2 = None
    with tempfile.TemporaryDirectory() as tmp:
        dump = graph_training_dump(Path(tmp) / "dump", [problem()] * RUNS, other_ops=OTHER)
        files = sorted(dump.iterdir())
        size = sum(p.stat().st_size for p in files)
        limit = 1 << 30

        def framing():
            for path in files:
                for _ in tfrecord.read_records(path, limit):
                    pass

        def ours():
            tfdbg._CACHE.clear()
            tfdbg.index_dump(dump)

        def runtime():
            for path in files:
                for rec in tfrecord.read_records(path, limit):
                    debug_event_pb2.DebugEvent.FromString(rec.data)

        records = sum(1 for path in files for _ in tfrecord.read_records(path, limit))
        index = tfdbg.index_dump(dump)
        execution = index.gradient_executions()[-1]
        names = list(execution.inputs)

        def ours_one():
            tfdbg.load_execution(index, execution, names, [])

        def runtime_one():
            for name in names:
                ref = execution.inputs[name]
                data = tfrecord.read_record_at(ref.file, ref.offset, limit)
                proto = debug_event_pb2.DebugEvent.FromString(data).graph_execution_trace.tensor_proto
                np.frombuffer(proto.tensor_content, dtype="<f4" if proto.dtype == 1 else "<i8").copy()

        calls = {"framing and checksums": framing, "lstmgrad index_dump": ours, "lstmgrad one execution": ours_one}
        if debug_event_pb2 is not None:
            calls["protobuf runtime parse"] = runtime
            calls["protobuf runtime one execution"] = runtime_one
        times = {name: [] for name in calls}
        for _ in range(REPEATS):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    crc = tfrecord.crc32c is not tfrecord.crc32c_python
    print(f"dump: {RUNS} runs, {len(index.executions)} executions, {records} records, {size / 1e6:.1f} MB; CRC-32C in "
          f"{'C (google-crc32c)' if crc else 'pure Python'}; median of {REPEATS}\n")
    print("| what | median |\n| --- | ---: |")
    for name, values in times.items():
        print(f"| {name} | {median_ms(values)} |")
    if debug_event_pb2 is not None:
        from google.protobuf.internal import api_implementation  # noqa: PLC0415

        print(f"\nprotobuf {sys.modules['google.protobuf'].__version__} ({api_implementation.Type()})")


if __name__ == "__main__":
    main()
