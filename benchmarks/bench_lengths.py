"""The gradient of an nn.LSTM with per-example lengths (a packed batch) against the same batch padded, in lstmgrad
and in PyTorch, side by side (issue 32: lengths must cost lstmgrad no more than 1.1x the padded gradient; PyTorch's
packed backward is known to be several times slower than its padded one, pytorch/pytorch#149194).

lstmgrad: ``torch_lstm_grad(x, state_dict=..., h_grad=G[, lengths=...])``, the whole call a user makes (the forward
recomputed, then the backward pass), padded and with lengths alternating, in the opposite order every other round;
medians.  PyTorch: benchmarks/torch_packed_backward.py run in the dev-only PyTorch environment when there is one
(``--torch-python``; its forward is outside the timing, so its times are the backward pass alone).  The lengths are
drawn uniformly in [T/2, T]; the shape and the number of threads are the same for both.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_lengths.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lstmgrad_cli import torch_lstm_grad
from lstmgrad_cli.backends import status

HERE = Path(__file__).resolve().parent
TORCH_PYTHON = HERE.parent / ".venv-torch" / "bin" / "python"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=200)
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--I", type=int, default=256)
    p.add_argument("--C", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backends", default="numpy,numba", help="lstmgrad backends to time (those installed)")
    p.add_argument("--torch-python", type=Path, default=TORCH_PYTHON,
                   help="an interpreter with torch for the PyTorch side (skipped when it does not exist)")
    return p.parse_args()


def problem(args):
    rng = np.random.default_rng(0)
    D = 2 if args.bidirectional else 1
    k = 1 / np.sqrt(args.C)
    state = {}
    for layer in range(args.layers):
        for d in range(D):
            s = f"_l{layer}" + ("_reverse" if d else "")
            width = args.I if layer == 0 else D * args.C
            state["weight_ih" + s] = rng.uniform(-k, k, (4 * args.C, width)).astype(np.float32)
            state["weight_hh" + s] = rng.uniform(-k, k, (4 * args.C, args.C)).astype(np.float32)
            state["bias_ih" + s] = rng.uniform(-k, k, 4 * args.C).astype(np.float32)
            state["bias_hh" + s] = rng.uniform(-k, k, 4 * args.C).astype(np.float32)
    x = rng.standard_normal((args.T, args.B, args.I)).astype(np.float32)
    grad = rng.standard_normal((args.T, args.B, D * args.C)).astype(np.float32)
    lengths = rng.integers(args.T // 2, args.T + 1, args.B)
    lengths[0] = args.T
    return state, x, grad, lengths


def time_lstmgrad(args, backend: str) -> dict:
    state, x, grad, lengths = problem(args)
    calls = {"padded": lambda: torch_lstm_grad(x, state_dict=state, h_grad=grad, backend=backend),
             "lengths": lambda: torch_lstm_grad(x, state_dict=state, h_grad=grad, lengths=lengths, backend=backend)}
    for call in calls.values():  # warm up (numba compiles, BLAS starts its threads)
        call()
    times = {name: [] for name in calls}
    for round_ in range(args.rounds):
        for name in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    padded, packed = statistics.median(times["padded"]), statistics.median(times["lengths"])
    return {"padded_s": padded, "lengths_s": packed, "ratio": packed / padded, "mean_length": float(lengths.mean())}


def time_torch(args) -> dict | None:
    if not args.torch_python.exists():
        return None
    command = [str(args.torch_python), str(HERE / "torch_packed_backward.py"), "--T", str(args.T), "--B",
               str(args.B), "--I", str(args.I), "--C", str(args.C), "--layers", str(args.layers), "--rounds",
               str(args.rounds), "--threads", str(os.cpu_count() or 1)]
    if args.bidirectional:
        command.append("--bidirectional")
    proc = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    args = parse_args()
    rows = []
    for backend in args.backends.split(","):
        if status(backend, probe_device=False).available:
            rows.append((f"lstmgrad ({backend})", time_lstmgrad(args, backend)))
    theirs = time_torch(args)
    if theirs is not None:
        rows.append((f"PyTorch {theirs['torch']} (backward only)",
                     {"padded_s": theirs["padded_s"], "lengths_s": theirs["packed_s"], "ratio": theirs["ratio"]}))
    D = 2 if args.bidirectional else 1
    print(f"T={args.T}, B={args.B}, I={args.I}, C={args.C}, {args.layers} layer(s) x {D} direction(s), float32, "
          f"lengths uniform in [T/2, T], {os.cpu_count()} threads, medians of {args.rounds} alternating rounds")
    print(f"{'':34} {'padded':>9} {'lengths':>9} {'lengths/padded':>15}")
    for name, r in rows:
        print(f"{name:34} {r['padded_s']:9.3f} {r['lengths_s']:9.3f} {r['ratio']:14.2f}x")
    if theirs is None:
        print(f"(PyTorch not timed: no {args.torch_python}; `make fixtures` makes the dev-only .venv-torch)",
              file=sys.stderr)


if __name__ == "__main__":
    main()
