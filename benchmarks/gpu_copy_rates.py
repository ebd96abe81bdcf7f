"""How fast host arrays reach a GPU, and what feeding a pass in chunks gains (issue 39; `make gpu-check` runs it).

1. Copy rates for one host array of ``--megabytes``, medians of ``--repeats``: cupy's own copy from pageable memory;
   the DMA alone from a pinned buffer (the PCIe floor); the host's copy into pinned memory alone, by 1, 2, 4 and 8
   threads; and both together through ``PinnedCopies`` (two 32 MB buffers, the DMA of one slice beside the host's
   copy of the next) by 1, 2, 4, 8 and 16 threads.  The slower of the host's copy and the DMA bounds what the staging
   gives: the thread count to choose is where it stops being the host's copy.
2. A pass from host arrays through the pinned buffers at ``--shape``: fed in ``STREAM_CHUNKS`` chunks (each chunk's
   copies beside the device's work on the one before: ``ChunkFeed``) against every input copied before the first
   step (as before the feed), and the same pass on device arrays, alternating, all three in the same chunks.

    python3 benchmarks/gpu_copy_rates.py --megabytes 256 --repeats 5 --shape 200,128,512,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def median_seconds(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_rates(cp, megabytes: int, repeats: int) -> None:
    from cupyx import empty_pinned

    from lstmgrad_cli.backends._cupy_copies import PinnedCopies

    n = megabytes * 2**20 // 4
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    device = cp.empty(n, np.float32)
    pinned = empty_pinned((n,), np.float32)
    pinned[...] = host
    sync = cp.cuda.Device().synchronize
    rows = [("cupy from pageable memory", median_seconds(lambda: device.set(host), repeats, sync)),
            ("DMA alone, from pinned memory", median_seconds(lambda: device.set(pinned), repeats, sync))]
    for threads in (1, 2, 4, 8, 16):
        bounds = np.linspace(0, n, threads + 1).astype(np.int64)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as pool:
            def host_copy(pool=pool, bounds=bounds):
                for f in [pool.submit(np.copyto, pinned[lo:hi], host[lo:hi])
                          for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]:
                    f.result()

            rows.append((f"host copy into pinned memory, {threads} threads", median_seconds(host_copy, repeats,
                                                                                               lambda: None)))
        copies = PinnedCopies(cp, empty_pinned, threads=threads)
        rows.append((f"PinnedCopies, {threads} threads",
                     median_seconds(lambda copies=copies: copies.copy_in([(host, device)]), repeats, sync)))
    print(f"\n{megabytes} MB, median of {repeats}\n\n| copy | ms | GB/s |\n| --- | ---: | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {host.nbytes / seconds / 1e9:.1f} |")


def fed_pass(cp, shape, repeats: int) -> None:
    from lstmgrad_cli import block_lstm_v2
    from lstmgrad_cli.backends import _cupy
    from lstmgrad_cli.spec import SeqTensors

    T, B, I, C = shape  # noqa: E741
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, I), dtype=np.float32)
    weights = dict(cs_prev=rng.standard_normal((B, C), dtype=np.float32) * 0.5,
                   h_prev=rng.uniform(-1, 1, (B, C)).astype(np.float32),
                   w=rng.standard_normal((I + C, 4 * C), dtype=np.float32) * (I + C) ** -0.5,
                   wci=np.zeros(C, np.float32), wcf=np.zeros(C, np.float32), wco=np.zeros(C, np.float32),
                   b=np.zeros(4 * C, np.float32))
    forward = block_lstm_v2(T, x, **weights)
    tensors = SeqTensors(x=x, **weights, **forward._asdict(), cs_grad=rng.standard_normal((T, B, C), np.float32),
                         h_grad=rng.standard_normal((T, B, C), np.float32))
    on_device = SeqTensors(*(cp.asarray(a) for a in tensors))
    fed = _cupy.CupyBackend(copies="pinned")
    fed._fits_at_once = lambda *args: False  # fed, as where the GPU could not hold the pass whole
    at_once = _cupy.CupyBackend(copies="pinned")  # every input copied before the first step (the default here)
    K = -(-T // _cupy.STREAM_CHUNKS)  # the same chunks for all three: only where the inputs are differs
    kw = dict(seq_len_max=T, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"), chunk_steps=K)
    sync = cp.cuda.Device().synchronize
    runs = {f"fed in {_cupy.STREAM_CHUNKS} chunks": (fed, tensors), "copied at once": (at_once, tensors),
            "device arrays": (fed, on_device)}
    results = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (backend, given) in runs.items():
            results[name].append(median_seconds(lambda b=backend, g=given: b.block_lstm_grad(g, **kw), 1, sync))
    inputs = sum(a.nbytes for a in tensors)
    print(f"\n{T},{B},{I},{C} float32 ({inputs / 1e9:.2f} GB in), chunks of {K} steps, through the pinned buffers, "
          f"median of {repeats}\n\n| pass | ms |\n| --- | ---: |")
    for name, times in results.items():
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", default="200,128,512,512", help="T,B,I,C of the fed pass")
    args = parser.parse_args()
    import cupy as cp

    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    copy_rates(cp, args.megabytes, args.repeats)
    fed_pass(cp, tuple(int(v) for v in args.shape.split(",")), args.repeats)


if __name__ == "__main__":
    main()
