"""A streamed sequence: `lstmgrad seq` on an HDF5 input far larger than the memory it may use, against the
in-memory compute of the same tensors, with peak memory.

Writes (once) an HDF5 file with T=4000, B=64, I=C=256 float32 tensors (about 2.6 GB; BlockLSTMV2's activations
of random inputs and weights), then times, in alternating rounds, each a fresh process:

* streamed: ``/usr/bin/time -v python -m lstmgrad_cli seq big.h5 -o big.grads.h5 --force -q`` (the whole
  command: reading, detection, the pass, writing, summaries), with its peak resident memory;
* in memory: the same tensors loaded whole, then ``block_lstm_grad_v2`` timed alone (the compute floor).

lstmgrad runs from compiled bytecode, as an installed copy does (_installed.py).

HDF5 inputs are read a chunk of time steps at a time (backwards), NaN/Inf counted as they are read, and
x_grad is written chunk by chunk into the HDF5 output, so the peak does not grow with T.  Usage:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/out_of_core.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
from _installed import compile_lstmgrad

from lstmgrad_cli import block_lstm_v2


def write_input(path: Path, T: int, B: int, I: int, C: int, block: int = 100) -> None:  # noqa: E741
    """Random inputs and weights, and the activations BlockLSTMV2 (with peepholes) makes of them, computed a block
    of steps at a time with the state carried over: what a user's file holds, so the run takes detection's usual
    path (random activations fit no layout, and every run warned so)."""
    rng = np.random.default_rng(0)
    cs_prev = rng.normal(size=(B, C)).astype(np.float32)
    h_prev = rng.uniform(-1, 1, size=(B, C)).astype(np.float32)
    w = (rng.normal(size=(I + C, 4 * C)) / np.sqrt(I + C)).astype(np.float32)
    peepholes = {name: (0.1 * rng.normal(size=C)).astype(np.float32) for name in ("wci", "wcf", "wco")}
    b = (0.5 * rng.normal(size=4 * C)).astype(np.float32)
    tmp = path.with_suffix(".partial")
    with h5py.File(tmp, "w") as fh:
        fh.create_dataset("x", (T, B, I), dtype=np.float32)
        for name in ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad"):
            fh.create_dataset(name, (T, B, C), dtype=np.float32)
        cs, h = cs_prev, h_prev
        for lo in range(0, T, block):
            n = min(block, T - lo)
            x = rng.normal(size=(n, B, I)).astype(np.float32)
            forward = block_lstm_v2(n, x, cs, h, w, **peepholes, b=b, use_peephole=True)
            fh["x"][lo:lo + n] = x
            for name, value in forward._asdict().items():
                fh[name][lo:lo + n] = value
            for name in ("cs_grad", "h_grad"):
                fh[name][lo:lo + n] = rng.normal(size=(n, B, C)).astype(np.float32)
            cs, h = forward.cs[-1], forward.h[-1]
        fh["cs_prev"], fh["h_prev"], fh["w"], fh["b"] = cs_prev, h_prev, w, b
        for name, value in peepholes.items():
            fh[name] = value
        fh.attrs["use_peephole"] = True
    tmp.rename(path)


IN_MEMORY = """
import sys, time, h5py
from lstmgrad_cli import block_lstm_grad_v2
with h5py.File(sys.argv[1], "r") as fh:
    t = {k: fh[k][()] for k in fh}
    peephole = bool(fh.attrs["use_peephole"])
start = time.perf_counter()
block_lstm_grad_v2(t["x"].shape[0], **t, use_peephole=peephole)
print(time.perf_counter() - start)
"""


def streamed(src: Path, out: Path, chunk_steps: int | None, baseline: Path | None = None) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of the whole command (of another checkout: ``baseline``)."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "lstmgrad_cli", "seq", str(src), "-o", str(out), "--force",
           "-q"]
    if chunk_steps:
        cmd += ["--chunk-steps", str(chunk_steps)]
    os.sync()  # the last run's output written back before the clock starts, not during this run
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(baseline.resolve())} if baseline else None
    # run from the data folder: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=src.parent)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(run.stderr)
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return wall, peak_kb / 1024


def in_memory(src: Path) -> float:
    run = subprocess.run([sys.executable, "-c", IN_MEMORY, str(src)], capture_output=True, text=True, check=True,
                         cwd=src.parent)
    return float(run.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lstmgrad-out-of-core"))
    parser.add_argument("--T", type=int, default=4000)
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--I", type=int, default=256)
    parser.add_argument("--C", type=int, default=256)
    parser.add_argument("--chunk-steps", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-in-memory", action="store_true", help="only the streamed run (memory-starved hosts)")
    parser.add_argument("--baseline", type=Path, help="another lstmgrad checkout (git worktree add DIR COMMIT), "
                        "its streamed run timed in the same rounds")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / f"lstm_T{args.T}_B{args.B}_I{args.I}_C{args.C}.h5"  # (big_*.h5: the random inputs before)
    if not src.exists():
        print(f"writing {src} ...", file=sys.stderr)
        write_input(src, args.T, args.B, args.I, args.C)
    size_gb = src.stat().st_size / 1e9
    compile_lstmgrad(*([args.baseline] if args.baseline else []))
    walls, peaks, floors, base_walls, base_peaks = [], [], [], [], []
    # every run writes an output of its own, all deleted at the end: replacing the last one would free its
    # blocks during the run, which a file system that discards them (this VM's ext4) makes slow
    outputs = [args.dir / f"big.grads.{run}.h5" for run in range(2 * args.repeats)]
    try:
        for k in range(args.repeats):
            wall, peak = streamed(src, outputs[2 * k], args.chunk_steps)
            walls.append(wall)
            peaks.append(peak)
            if args.baseline:
                wall, peak = streamed(src, outputs[2 * k + 1], args.chunk_steps, args.baseline)
                base_walls.append(wall)
                base_peaks.append(peak)
            if not args.no_in_memory:
                floors.append(in_memory(src))
    finally:
        for out in outputs:
            out.unlink(missing_ok=True)
    wall = statistics.median(walls)
    print(f"input {size_gb:.2f} GB (T={args.T}, B={args.B}, I={args.I}, C={args.C}, float32), median of "
          f"{args.repeats} alternating rounds")
    print(f"streamed `lstmgrad seq`: {wall:.1f} s, peak resident memory {max(peaks):.0f} MB")
    if base_walls:
        print(f"baseline {args.baseline}: {statistics.median(base_walls):.1f} s, peak resident memory "
              f"{max(base_peaks):.0f} MB")
    if floors:
        floor = statistics.median(floors)
        print(f"in-memory compute (block_lstm_grad_v2 alone): {floor:.1f} s; streamed / in-memory {wall / floor:.2f}"
              + (f", baseline / in-memory {statistics.median(base_walls) / floor:.2f}" if base_walls else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
