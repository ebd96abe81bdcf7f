"""What the cupy backend's chunk size and its way of copying host arrays are worth on a GPU, beside cuDNN, engine
against engine in one process (issue 39; `make gpu-check` runs it).

For each shape (issue 39's six by default):

* cuDNN's backward (PyTorch's ``nn.LSTM``, TF32 off), as ``lstmgrad bench`` times it;
* the cupy backend on device arrays, the loop it chooses, in its chunks (``CupyGradient.chunk_budget``), in the
  host's (``_xp.CHUNK_BYTES``), and in one chunk (rows only where they differ);
* from host arrays through the pinned buffers: copied at once (the default where the GPU holds the pass), fed a
  chunk of steps at a time (``ChunkFeed``; the default before for 32 MB or more), and at once with 4 and 16 staging
  threads (the default is up to 8);
* the PCIe floor (the pass's bytes from and to pinned memory).

Each engine is timed as ``lstmgrad bench`` does (``bench._round_robin``: a call 0.3 s after the one before, then one
back to back), medians of ``--repeats`` rounds.  Then one pageable host array page-locked in place
(``cudaHostRegister``) and copied from there, against the staging.

    python3 benchmarks/gpu_pass_parts.py [--repeats N] [T,B,I,C ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from gpu_args import repeats_and_shapes

SHAPES = ((50, 32, 128, 128), (100, 64, 256, 256), (200, 128, 512, 512), (500, 16, 256, 256),
          (100, 256, 1024, 1024), (1000, 64, 512, 512))


def engines(cp, shape, inputs):
    """{name: call} for one shape, each call ending when the device is done."""
    from cupyx import empty_pinned

    from lstmgrad_cli.backends import _cupy
    from lstmgrad_cli.backends._cupy_copies import PinnedCopies
    from lstmgrad_cli.backends._xp import CHUNK_BYTES, default_chunk_steps
    from lstmgrad_cli.operations import bench
    from lstmgrad_cli.spec import LAYOUT_V2, SeqTensors

    T, B, I, C = shape  # noqa: E741
    sync = cp.cuda.get_current_stream().synchronize
    kw = dict(seq_len_max=T, use_peephole=False, layout=LAYOUT_V2, compute_dtype=np.dtype("float32"))
    calls = {}
    try:
        calls["cudnn"] = bench.framework_call("torch", inputs, False, device="cuda")[0]
    except Exception as err:  # noqa: BLE001 - no CUDA torch: no comparison
        print(f"{shape}: no cuDNN ({type(err).__name__}: {err})")
    backend = _cupy.CupyBackend()
    on_device = SeqTensors(**{k: cp.asarray(v) for k, v in inputs.items()})
    sizes = {"device": default_chunk_steps(T, B, C, 4, I, False, backend._gradient.chunk_budget(B, C)),
             "device, host's chunks": default_chunk_steps(T, B, C, 4, I, False, CHUNK_BYTES), "device, one chunk": T}
    seen = set()
    for name, K in sizes.items():
        if K in seen:
            continue
        seen.add(K)

        def device(K=K):
            backend.block_lstm_grad(on_device, **kw, chunk_steps=K)
            sync()
        calls[f"{name} (K={K})"] = device
    host = SeqTensors(**inputs)
    if sum(a.nbytes for a in inputs.values()) >= _cupy.PINNED_LEAST_BYTES:
        fed = _cupy.CupyBackend()
        fed._fits_at_once = lambda *args: False  # as before: every such call fed a chunk at a time
        variants = {"host, at once": _cupy.CupyBackend(), "host, fed": fed}
        for threads in (4, 16):
            other = _cupy.CupyBackend()
            other._pinned = PinnedCopies(cp, empty_pinned, threads=threads)
            variants[f"host, at once, {threads} threads"] = other
    else:
        variants = {"host (cupy's copies)": _cupy.CupyBackend()}
    for name, engine in variants.items():
        def from_host(engine=engine):
            engine.block_lstm_grad(host, **kw)
            sync()
        calls[name] = from_host
    calls["pcie floor"] = bench._pcie_floor_call(cp, shape, inputs, backend, sync)[0]
    return calls


def page_locked(cp, megabytes: int, repeats: int) -> None:
    """A fresh pageable array page-locked in place (cudaHostRegister), copied to the device from there, and
    released, against the same array through the staging buffers; medians of ``repeats``."""
    from cupyx import empty_pinned

    from lstmgrad_cli.backends._cupy_copies import THREADS, PinnedCopies

    n = megabytes * 2**20 // 4
    runtime, sync = cp.cuda.runtime, cp.cuda.Device().synchronize
    device = cp.empty(n, np.float32)
    staged = PinnedCopies(cp, empty_pinned)
    parts = {"register": [], "copy from it": [], "unregister": [], "all three": [], f"staged ({THREADS} threads)": []}
    for _ in range(repeats):
        host = np.random.default_rng().standard_normal(n, dtype=np.float32)  # (its pages touched: as np.load's)
        start = time.perf_counter()
        runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
        registered = time.perf_counter()
        device.set(host)
        sync()
        copied = time.perf_counter()
        runtime.hostUnregister(host.ctypes.data)
        done = time.perf_counter()
        parts["register"].append(registered - start)
        parts["copy from it"].append(copied - registered)
        parts["unregister"].append(done - copied)
        parts["all three"].append(done - start)
        start = time.perf_counter()
        staged.copy_in([(host, device)])
        parts[f"staged ({THREADS} threads)"].append(time.perf_counter() - start)
    print(f"\n{megabytes} MB of pageable host memory to the device, median of {repeats}\n\n| step | ms | GB/s |\n"
          "| --- | ---: | ---: |")
    for name, times in parts.items():
        seconds = statistics.median(times)
        print(f"| {name} | {seconds * 1e3:.1f} | {n * 4 / seconds / 1e9:.1f} |")


def main(argv: list[str]) -> int:
    import cupy as cp

    from lstmgrad_cli.operations import bench

    repeats, shapes = repeats_and_shapes(argv, 5, SHAPES)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"{props['name'].decode()}, cupy {cp.__version__}; float32, no peepholes; medians of {repeats} rounds, "
          "each call 0.3 s after the one before (back to back in brackets)", flush=True)
    page_locked(cp, 256, 3)
    for shape in shapes:
        inputs = bench.make_inputs(shape)
        calls = engines(cp, shape, inputs)
        times = bench._round_robin(calls, repeats)
        median = {key: statistics.median(values) for key, values in times.items()}
        cudnn, floor = median.get("cudnn"), median["pcie floor"]
        device = median[next(name for name in calls if name.startswith("device"))]
        bound = max(floor, device)
        print(f"\n{','.join(map(str, shape))}\n\n| engine | ms | back to back | x cuDNN | x max(floor, device) |\n"
              "| --- | ---: | ---: | ---: | ---: |")
        for name in calls:
            t, b2b = median[name], median[bench.BACK_TO_BACK + name]
            print(f"| {name} | {t * 1e3:.2f} | {b2b * 1e3:.2f} | {t / cudnn if cudnn else float('nan'):.2f} | "
                  f"{t / bound:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
