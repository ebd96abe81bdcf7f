"""The cupy backend's pass on device arrays by its chunk size, beside cuDNN, on a GPU (issue 39).

A chunk's buffers (its steps' gate gradients and [x, h_prev, 1]) are sized by a byte budget
(``default_chunk_steps``); here each shape runs with the chunks a budget of 8 to 512 MB gives and in one chunk,
the loop the backend chooses, medians of ``--repeats`` calls back to back, every variant in each round.  Then a
pageable host array page-locked in place a slice at a time, each slice's DMA beside the next one's locking, against
locking it whole and against the staging buffers.

    python3 benchmarks/gpu_chunk_sizes.py [--repeats N] [T,B,I,C ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from gpu_args import repeats_and_shapes

SHAPES = ((100, 64, 256, 256), (200, 128, 512, 512), (100, 256, 1024, 1024), (1000, 64, 512, 512))
BUDGETS_MB = (8, 16, 32, 64, 128, 512)


def sweep(cp, shape, repeats: int) -> None:
    from lstmgrad_cli.backends._cupy import CupyBackend
    from lstmgrad_cli.backends._xp import default_chunk_steps
    from lstmgrad_cli.operations import bench
    from lstmgrad_cli.spec import LAYOUT_V2, SeqTensors

    T, B, I, C = shape  # noqa: E741
    inputs = bench.make_inputs(shape)
    sync = cp.cuda.get_current_stream().synchronize
    tensors = SeqTensors(**{k: cp.asarray(v) for k, v in inputs.items()})
    backend = CupyBackend()
    kw = dict(seq_len_max=T, use_peephole=False, layout=LAYOUT_V2, compute_dtype=np.dtype("float32"))
    sizes = {}
    for mb in BUDGETS_MB:
        sizes.setdefault(default_chunk_steps(T, B, C, 4, I, False, int(mb * 2**20)), f"{mb} MB")
    sizes.setdefault(T, "one chunk")
    calls = {}
    for K, label in sorted(sizes.items()):
        def call(K=K):
            backend.block_lstm_grad(tensors, **kw, chunk_steps=K)
            sync()
        calls[f"K={K} ({label})"] = call
    try:
        calls["cuDNN"] = bench.framework_call("torch", inputs, False, device="cuda")[0]
    except Exception as err:  # noqa: BLE001 - no CUDA torch: no comparison
        print(f"no cuDNN: {type(err).__name__}: {err}")
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    print(f"\n{','.join(map(str, shape))}: median of {repeats}, back to back\n\n| chunks | ms |\n| --- | ---: |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} |", flush=True)


def locked_in_slices(cp, megabytes: int, repeats: int, slice_mb: int = 32) -> None:
    """A fresh pageable array to the device: page-locked whole then copied; page-locked a slice at a time with each
    slice's DMA beside the next slice's locking; and through the staging buffers.  (Unlocked after, not timed.)"""
    from cupyx import empty_pinned

    from lstmgrad_cli.backends._cupy_copies import THREADS, PinnedCopies

    runtime = cp.cuda.runtime
    n = megabytes * 2**20 // 4
    device = cp.empty(n, np.float32)
    staged = PinnedCopies(cp, empty_pinned)
    stream = cp.cuda.Stream(non_blocking=True)
    page = 4096
    results = {"locked whole, then copied": [], f"locked in {slice_mb} MB slices beside the copies": [],
               f"staged ({THREADS} threads)": []}
    for _ in range(repeats):
        source = np.random.default_rng().standard_normal(n, dtype=np.float32)
        for name in results:
            host = source.copy()  # (fresh pages, touched: as np.load's)
            base = host.ctypes.data
            start = time.perf_counter()
            locked = []
            if name.startswith("staged"):
                staged.copy_in([(host, device)])
            elif name.startswith("locked whole"):
                runtime.hostRegister(base, host.nbytes, 0)
                locked.append(base)
                device.set(host)
            else:  # page-aligned slices, the first from the array's own start
                end = base + host.nbytes
                bounds = [base] + list(range((base // page + 1) * page, end, slice_mb * 2**20)) + [end]
                bounds = sorted(set(bounds))
                target = device.data.ptr
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                    runtime.hostRegister(lo, hi - lo, 0)
                    locked.append(lo)
                    runtime.memcpyAsync(target + (lo - base), lo, hi - lo, runtime.memcpyHostToDevice, stream.ptr)
                stream.synchronize()
            cp.cuda.Device().synchronize()
            results[name].append(time.perf_counter() - start)
            for ptr in locked:
                runtime.hostUnregister(ptr)
    print(f"\n{megabytes} MB of pageable host memory to the device, median of {repeats}\n\n| how | ms | GB/s |\n"
          "| --- | ---: | ---: |")
    for name, values in results.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds * 1e3:.1f} | {n * 4 / seconds / 1e9:.1f} |", flush=True)


def main(argv: list[str]) -> int:
    import cupy as cp

    repeats, shapes = repeats_and_shapes(argv, 7, SHAPES)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"{props['name'].decode()}, cupy {cp.__version__}, L2 {props.get('l2CacheSize', 0) / 2**20:.0f} MB; float32, "
          "no peepholes", flush=True)
    for shape in shapes:
        sweep(cp, shape, repeats)
    locked_in_slices(cp, 512, 3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
