"""The cost of finding layout and peepholes from the activations (detect.py), side by side with it off.

Two measurements per standard shape, alternating on and off in one process, each call 0.3 s after the one
before (as ``lstmgrad bench`` does, so no call runs against the thread pools of the last):

* the op: ``detect.fit_activations`` + the backward pass, against the backward pass alone;
* what users run: ``run_grad_file`` on an NPZ file of the shape (read, check, detect, compute, write),
  against the same with detection switched off (``--no-file`` skips it).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_detection.py --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lstmgrad_cli import block_lstm_v2
from lstmgrad_cli.analysis import detect
from lstmgrad_cli.backends import get_backend
from lstmgrad_cli.operations import bench
from lstmgrad_cli.operations.grad import GradOptions, run_grad_file
from lstmgrad_cli.ops import block_lstm_grad_checked
from lstmgrad_cli.problem import reading as problem

PAUSE = 0.3


def consistent_inputs(shape, seed=0):
    """bench.make_inputs with the activations of BlockLSTMV2 (what detection meets in real files)."""
    T = shape[0]
    inputs = bench.make_inputs(shape, seed=seed)
    weights = {k: inputs[k] for k in ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")}
    inputs.update(block_lstm_v2(T, **weights, use_peephole=False)._asdict())
    return inputs


def timed(call):
    time.sleep(PAUSE)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--backend", action="append", help="backend(s) to time (default: numpy, numba)")
    parser.add_argument("--no-file", action="store_true", help="time the op only, not whole files")
    args = parser.parse_args()
    backends = args.backend or ["numpy", "numba"]
    print(f"{bench.machine_info()['cpu']}; float32, no peephole, median of {args.repeats}, alternating\n")
    print("| T,B,I,C | backend | what | detection off | detection on | detection alone | on / off |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    real_fit = detect.fit_activations
    for shape in bench.SHAPES:
        inputs = consistent_inputs(shape)
        T = shape[0]
        for name in backends:
            backend = get_backend(name)

            def grad(backend=backend, inputs=inputs, T=T):
                block_lstm_grad_checked(backend, "ifco", T, inputs, False, np.float32)

            def fit(inputs=inputs, T=T):
                assert real_fit(inputs, "seq", T).layout == "ifco"

            grad()  # warm up (numba compiles and loads its kernels once)
            off, on, alone = [], [], []
            for _ in range(args.repeats):
                off.append(timed(grad))
                on.append(timed(lambda: (fit(), grad())))
                alone.append(timed(fit))
            report(shape, name, "op", off, on, alone)
        if args.no_file:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "run.npz"
            np.savez(src, **inputs, seq_len_max=np.int64(T), use_peephole=np.array(False))
            for name in backends:
                options = GradOptions("seq", None, name, force=True)
                out = Path(tmp) / "run.grads.npz"

                def run(options=options, src=src, out=out):
                    run_grad_file(src, out, options)

                def without_detection(run=run):
                    problem.detect.fit_activations = lambda *a, **k: None
                    try:
                        run()
                    finally:
                        problem.detect.fit_activations = real_fit

                run()
                off, on = [], []
                for _ in range(args.repeats):
                    off.append(timed(without_detection))
                    on.append(timed(run))
                report(shape, name, "lstmgrad seq file.npz", off, on, None)


def report(shape, backend, what, off, on, alone) -> None:
    med_off, med_on = statistics.median(off), statistics.median(on)
    alone_text = "-" if alone is None else ms(statistics.median(alone))
    print(f"| {','.join(map(str, shape))} | {backend} | {what} | {ms(med_off)} | {ms(med_on)} | {alone_text} | "
          f"{med_on / med_off:.3f} |", flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


if __name__ == "__main__":
    main()
