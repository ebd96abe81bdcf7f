"""Questions for a lent GPU whose answers decide what issue 39 builds next; each part prints its own table.

1. ``batch``: where a batch of 100 small files (20,16,64,64) spends its time on cupy (its host arrays crossing by
   cupy's own copies, and packed: ``LSTMGRAD_CUPY_COPIES`` pageable and auto), against numpy, in one process
   (``main()`` called as the command line is; alternating, median of 5 after a warm run), and cProfile of one
   cupy run (the functions that took most time themselves, and lstmgrad's own by cumulative time).  The profile is also
   written to $OUT/batch-cupy.pstats where OUT is set.
2. ``graph``: can a whole pass on device arrays be captured as one CUDA graph and replayed?  The backend's own pass
   (``XpGradient.block_lstm_grad``) on a stream being captured, in a private memory pool; cupy's matmul as it is,
   and, if cupy refuses cuBLAS during a capture, through cuBLAS called directly.  Eager pass against replay against
   cuDNN, medians of 30 back to back, and the replay's answers against the eager pass's.
3. ``lock``: a pageable 512 MB array page-locked in place (``cudaHostRegister``) in 32 MB slices by 1, 2, 4 and 8
   threads at once: does locking scale with threads (the copy from locked pages runs at the DMA's rate)?

    python3 benchmarks/gpu_probe.py [batch] [graph] [lock]      (all three by default)
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GRAPH_SHAPES = ((50, 32, 128, 128), (500, 16, 256, 256), (100, 64, 256, 256), (20, 16, 64, 64))


def batch() -> None:
    from bench_batch import write_inputs

    from lstmgrad_cli import backends as registry
    from lstmgrad_cli.cli import main

    tmp = Path(tempfile.mkdtemp(prefix="lstmgrad-probe-"))
    try:
        write_inputs(tmp / "in", (20, 16, 64, 64), 100)

        def run(backend: str) -> float:
            out = tmp / f"out-{backend}"
            shutil.rmtree(out, ignore_errors=True)
            sys.argv = ["lstmgrad", "seq", str(tmp / "in"), "--out-dir", str(out), "-q", "--backend", backend]
            start = time.perf_counter()
            try:
                main()
            except SystemExit as stop:
                if stop.code:
                    raise
            return time.perf_counter() - start

        engines = {"numpy": ("numpy", None), "cupy, cupy's copies": ("cupy", "pageable"),
                   "cupy, packed copies": ("cupy", "auto")}

        def engine(name: str) -> float:
            backend, copies = engines[name]
            if copies is not None:
                os.environ["LSTMGRAD_CUPY_COPIES"] = copies
                registry.refresh()  # (a backend object made anew, reading it)
            return run(backend)

        for name in engines:
            engine(name)
        times = {name: [] for name in engines}
        for _ in range(5):
            for name in times:
                times[name].append(engine(name))
        print("\n100 small files (20,16,64,64) in one process, alternating, median of 5:")
        for name, values in times.items():
            print(f"  {name}: {statistics.median(values):.3f} s ({statistics.median(values) * 10:.2f} ms a file)")
        engine("cupy, packed copies")
        profile = cProfile.Profile()
        profile.enable()
        run("cupy")
        profile.disable()
        if os.environ.get("OUT"):
            profile.dump_stats(os.path.join(os.environ["OUT"], "batch-cupy.pstats"))
        print("```")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats("lstmgrad_cli", 40)
        print("```", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class DirectBlas:
    """cupy as the pass uses it, but ``matmul(a, b, out=)`` of 2-D float32 arrays through cuBLAS called directly on
    the current stream (cupy refuses its own cuBLAS calls during a stream capture)."""

    def __init__(self, cp):
        from cupy_backends.cuda.libs import cublas

        self._cp, self._cublas = cp, cublas
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    def __getattr__(self, name):
        return getattr(self._cp, name)

    def matmul(self, a, b, out=None):
        cp, cublas = self._cp, self._cublas
        if a.ndim != 2 or b.ndim != 2 or a.dtype != np.float32 or out is None or not out.flags.c_contiguous:
            return cp.matmul(a, b, out=out)
        # row-major out[m, n] = a[m, k] @ b[k, n] is column-major out^T = b^T a^T
        m, k = a.shape
        n = b.shape[1]

        def operand(x):  # (op, leading dimension) of x as cuBLAS reads it, column-major
            if x.flags.c_contiguous:
                return cublas.CUBLAS_OP_N, x.shape[1]
            if x.flags.f_contiguous:
                return cublas.CUBLAS_OP_T, x.shape[0]
            raise ValueError("an operand is neither C- nor F-contiguous")

        op_b, ld_b = operand(b)
        op_a, ld_a = operand(a)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.sgemm(handle, op_b, op_a, n, m, k, self._one.ctypes.data, b.data.ptr, max(ld_b, 1), a.data.ptr,
                     max(ld_a, 1), self._zero.ctypes.data, out.data.ptr, max(n, 1))
        return out


def graph() -> None:
    import cupy as cp

    from lstmgrad_cli.backends._cupy import CupyGradient
    from lstmgrad_cli.backends._xp import XpGradient
    from lstmgrad_cli.operations import bench
    from lstmgrad_cli.spec import LAYOUT_V2, SeqTensors

    print("\nOne pass on device arrays as a CUDA graph: medians of 30 back to back, ms\n")
    print("| T,B,I,C | xp | capture | eager | replay | replay's largest difference | cuDNN |\n"
          "| --- | --- | --- | ---: | ---: | ---: | ---: |", flush=True)
    for shape in GRAPH_SHAPES:
        T = shape[0]  # noqa: N806
        inputs = bench.make_inputs(shape, "float32")
        try:
            cudnn = bench.framework_call("torch", inputs, False, device="cuda")[0]
        except Exception:  # noqa: BLE001
            cudnn = None
        for label, xp in (("cupy", cp), ("direct cuBLAS", DirectBlas(cp))):
            stream = cp.cuda.Stream(non_blocking=True)
            pool = cp.cuda.MemoryPool()
            grad = CupyGradient(xp)
            args = (None, T, False, LAYOUT_V2, np.dtype("float32"))
            status, eager_ms, replay_ms, diff = "", float("nan"), float("nan"), float("nan")
            try:
                with cp.cuda.using_allocator(pool.malloc), stream:
                    tensors = SeqTensors(**{k: cp.asarray(v) for k, v in inputs.items()})
                    args = (tensors, *args[1:])

                    def eager(grad=grad, args=args):  # (CupyGradient's own reads the barrier word back)
                        grad._pass.barrier = None
                        return XpGradient.block_lstm_grad(grad, *args)

                    reference = eager()
                    stream.synchronize()
                    times = []
                    for _ in range(30):
                        start = time.perf_counter()
                        eager()
                        stream.synchronize()
                        times.append(time.perf_counter() - start)
                    eager_ms = statistics.median(times) * 1e3
                    stream.begin_capture()
                    try:
                        captured = eager()
                    finally:
                        g = stream.end_capture()
                    status = "ok"
                    g.launch(stream)
                    stream.synchronize()
                    times = []
                    for _ in range(30):
                        start = time.perf_counter()
                        g.launch(stream)
                        stream.synchronize()
                        times.append(time.perf_counter() - start)
                    replay_ms = statistics.median(times) * 1e3
                    diff = max(float(cp.abs(a - b).max() / max(float(cp.abs(b).max()), 1e-30))
                               for a, b in zip(captured, reference, strict=True) if a is not None and a.size)
            except Exception as err:  # noqa: BLE001 - the question is whether it works
                status = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
            cudnn_ms = float("nan")
            if cudnn is not None:
                cudnn()
                times = []
                for _ in range(30):
                    start = time.perf_counter()
                    cudnn()
                    times.append(time.perf_counter() - start)
                cudnn_ms = statistics.median(times) * 1e3
            print(f"| {','.join(map(str, shape))} | {label} | {status} | {eager_ms:.3f} | {replay_ms:.3f} | "
                  f"{diff:.2e} | {cudnn_ms:.3f} |", flush=True)


def lock() -> None:
    import cupy as cp

    runtime = cp.cuda.runtime
    megabytes, slice_mb, page = 512, 32, 4096
    n = megabytes * 2**20 // 4
    device = cp.empty(n, np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    print(f"\n{megabytes} MB pageable, page-locked in {slice_mb} MB slices (median of 3), then copied, then "
          "unlocked\n")
    print("| threads | lock ms | lock GB/s | copy from locked ms | copy GB/s | unlock ms |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for threads in (1, 2, 4, 8):
        results = []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(3):
                host = np.random.default_rng().standard_normal(n, dtype=np.float32)  # fresh pages, touched
                base = host.ctypes.data
                end = base + host.nbytes
                bounds = sorted({base, *range((base // page + 1) * page, end, slice_mb * 2**20), end})
                spans = list(zip(bounds[:-1], bounds[1:], strict=True))
                start = time.perf_counter()
                list(pool.map(lambda span: runtime.hostRegister(span[0], span[1] - span[0], 0), spans))
                locked = time.perf_counter()
                for lo, hi in spans:
                    runtime.memcpyAsync(device.data.ptr + (lo - base), lo, hi - lo, runtime.memcpyHostToDevice,
                                        stream.ptr)
                stream.synchronize()
                copied = time.perf_counter()
                list(pool.map(lambda span: runtime.hostUnregister(span[0]), spans))
                results.append((locked - start, copied - locked, time.perf_counter() - copied))
        lk, cp_, un = (statistics.median(r[k] for r in results) for k in range(3))
        print(f"| {threads} | {lk * 1e3:.1f} | {n * 4 / lk / 1e9:.1f} | {cp_ * 1e3:.1f} | {n * 4 / cp_ / 1e9:.1f} | "
              f"{un * 1e3:.1f} |", flush=True)


def main(argv: list[str]) -> int:
    parts = {"batch": batch, "graph": graph, "lock": lock}
    if any(name not in parts for name in argv):
        print(f"usage: gpu_probe.py [{'] ['.join(parts)}]", file=sys.stderr)
        return 2
    for name in argv or list(parts):
        started = time.perf_counter()
        print(f"\n== {name}", flush=True)
        try:
            parts[name]()
        except Exception as err:  # noqa: BLE001 - one part failing leaves the others
            print(f"{name} failed: {type(err).__name__}: {err}", flush=True)
        print(f"-- {name}: {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
