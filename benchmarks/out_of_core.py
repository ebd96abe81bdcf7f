"""Peak memory of `lstmgrad seq` on an HDF5 input far larger than the memory it may use.

Writes (once) an HDF5 file with T=4000, B=64, I=C=256 float32 tensors (about 2.6 GB), then runs

    /usr/bin/time -v python -m lstmgrad_cli seq big.h5 -o big.grads.h5 --force -q

and prints the peak resident memory and the wall time.  HDF5 inputs are read a chunk of time steps at
a time (backwards) and x_grad is written chunk by chunk into the HDF5 output, so the peak does not
grow with T.  Usage:  python benchmarks/out_of_core.py [--dir DIR] [--T 4000] [--chunk-steps K]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np


def write_input(path: Path, T: int, B: int, I: int, C: int, block: int = 100) -> None:  # noqa: E741
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".partial")
    with h5py.File(tmp, "w") as fh:
        fh.create_dataset("x", (T, B, I), dtype=np.float32)
        for name in ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad"):
            fh.create_dataset(name, (T, B, C), dtype=np.float32)
        for lo in range(0, T, block):
            n = min(block, T - lo)
            fh["x"][lo:lo + n] = rng.normal(size=(n, B, I)).astype(np.float32)
            for name in ("i", "f", "o"):
                fh[name][lo:lo + n] = rng.uniform(size=(n, B, C)).astype(np.float32)
            for name in ("ci", "co"):
                fh[name][lo:lo + n] = rng.uniform(-1, 1, size=(n, B, C)).astype(np.float32)
            for name in ("cs", "h", "cs_grad", "h_grad"):
                fh[name][lo:lo + n] = rng.normal(size=(n, B, C)).astype(np.float32)
        fh["cs_prev"] = rng.normal(size=(B, C)).astype(np.float32)
        fh["h_prev"] = rng.normal(size=(B, C)).astype(np.float32)
        fh["w"] = (rng.normal(size=(I + C, 4 * C)) / np.sqrt(I + C)).astype(np.float32)
        for name in ("wci", "wcf", "wco"):
            fh[name] = rng.normal(size=C).astype(np.float32)
        fh["b"] = rng.normal(size=4 * C).astype(np.float32)
        fh.attrs["use_peephole"] = True
    tmp.rename(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lstmgrad-out-of-core"))
    parser.add_argument("--T", type=int, default=4000)
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--I", type=int, default=256)
    parser.add_argument("--C", type=int, default=256)
    parser.add_argument("--chunk-steps", type=int)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / f"big_T{args.T}_B{args.B}_I{args.I}_C{args.C}.h5"
    if not src.exists():
        print(f"writing {src} ...", file=sys.stderr)
        write_input(src, args.T, args.B, args.I, args.C)
    size_gb = src.stat().st_size / 1e9
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "lstmgrad_cli", "seq", str(src), "-o",
           str(args.dir / "big.grads.h5"), "--force", "-q"]
    if args.chunk_steps:
        cmd += ["--chunk-steps", str(args.chunk_steps)]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        print(run.stderr, file=sys.stderr)
        return 1
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    print(f"input {size_gb:.2f} GB (T={args.T}, B={args.B}, I={args.I}, C={args.C}, float32): "
          f"peak resident memory {peak_kb / 1024:.0f} MB, wall time {wall:.1f} s")
    print("command: " + " ".join(cmd[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
