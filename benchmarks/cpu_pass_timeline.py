"""Where the time of one numba backward pass goes, thread by thread (issue 42).

Times the pass's parts on each thread that runs them: the time loop (``_steps``), the fills of [x, h_prev, 1]
(``_fill_xh``), the w/b products (``_wb_product``) and the x products (``_x_grad_product``), by wrapping those
methods of the shared algorithm (``backends._xp``).  Prints the last of ``--repeats`` back-to-back passes part by
part (A: the calling thread, B: the overlapped schedule's second thread), then each thread's busy time by part,
when it ended and its waits over 1 ms, and the median pass.  The BLAS is the one ``LSTMGRAD_BLAS`` chooses.

    LSTMGRAD_BLAS=onednn python benchmarks/cpu_pass_timeline.py 100,64,256,256 [--schedule on|off] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from lstmgrad_cli.backends._numba import NumbaBackend, NumbaGradient
from lstmgrad_cli.backends._xp import XpGradient
from lstmgrad_cli.operations.bench import _backend_call, make_inputs

PARTS = ((NumbaGradient, "_steps", "loop"), (XpGradient, "_fill_xh", "fill"), (XpGradient, "_wb_product", "wb"),
         (XpGradient, "_x_grad_product", "x"))


def record(events: list) -> None:
    """Wrap each part so that it appends (thread, part, start, end) to ``events``."""
    for cls, name, part in PARTS:
        method = getattr(cls, name)

        def timed(self, *args, _method=method, _part=part, **kwargs):
            start = time.perf_counter()
            try:
                return _method(self, *args, **kwargs)
            finally:
                events.append((threading.get_ident(), _part, start, time.perf_counter()))

        setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="T,B,I,C")
    parser.add_argument("--schedule", choices=("on", "off", "auto"), default="auto",
                        help="overlapped (on), in sequence (off), or as measured here (auto)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    events: list = []
    record(events)
    overlap = {"on": True, "off": False, "auto": None}[args.schedule]
    call = _backend_call(NumbaBackend(overlap=overlap), make_inputs(tuple(map(int, args.shape.split(",")))), False)
    call()
    call()
    times = []
    for _ in range(args.repeats):
        events.clear()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    caller = threading.get_ident()
    ms = 1e3
    for thread, part, a, b in sorted(events, key=lambda e: e[2]):
        print(f"{'A' if thread == caller else 'B'} {part:4s} {ms * (a - start):8.2f} {ms * (b - start):8.2f} "
              f"({ms * (b - a):6.2f} ms)")
    for name in ("A", "B"):
        mine = sorted((a, b, part) for thread, part, a, b in events if (thread == caller) == (name == "A"))
        if not mine:
            continue
        busy: dict[str, float] = {}
        for a, b, part in mine:
            busy[part] = busy.get(part, 0.0) + b - a
        waits = [(ms * (mine[k + 1][0] - mine[k][1]), ms * (mine[k][1] - start)) for k in range(len(mine) - 1)
                 if mine[k + 1][0] - mine[k][1] > 1e-3]
        parts = ", ".join(f"{p} {ms * t:.1f}" for p, t in busy.items())
        print(f"{name}: busy {ms * sum(busy.values()):.1f} ms ({parts}), first part at {ms * (mine[0][0] - start):.2f}"
              f" ms, ended at {ms * (mine[-1][1] - start):.2f} ms"
              + "".join(f"; waited {w:.1f} ms at {at:.1f}" for w, at in waits))
    print(f"pass: last {ms * times[-1]:.1f} ms, median of {len(times)} {ms * statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
