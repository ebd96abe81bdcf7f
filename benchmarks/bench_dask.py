"""Whole batches on a Dask cluster: lstmgrad's DaskExecutor (a file handed out only when a worker thread is free,
so stopping early loses nothing) against distributed's own ClientExecutor (every file queued on the scheduler
at once), side by side, alternating, on one LocalCluster of worker processes on 127.0.0.1.

What users run: ``run_batch`` over N files, from handing out the first to the last result.  Small files show
the cost of the extra round trip per file; larger ones show it vanish.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_dask.py --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from lstmgrad_cli import block_lstm_v2
from lstmgrad_cli.execution.dask_executor import DaskExecutor
from lstmgrad_cli.io import write_outputs
from lstmgrad_cli.operations import batch, bench
from lstmgrad_cli.operations.grad import GradOptions


def write_inputs(folder: Path, shape, count: int) -> list[Path]:
    inputs = bench.make_inputs(shape, seed=1)
    weights = {k: inputs[k] for k in ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")}
    inputs.update(block_lstm_v2(shape[0], **weights, use_peephole=False)._asdict())
    folder.mkdir()
    return [write_outputs(folder / f"run{k:04d}.npz", inputs, {}) for k in range(count)]


def timed_batch(client, executor_kind: str, paths: list[Path], out: Path) -> float:
    for old in out.glob("*.npz"):
        old.unlink()
    tasks = batch.plan_tasks(paths, None, out)

    @contextlib.contextmanager
    def executor(workers=1, dask_address=None):
        chosen = DaskExecutor(client) if executor_kind == "lstmgrad" else client.get_executor(pure=False)
        with chosen:
            yield chosen, 1

    real = batch.make_executor
    batch.make_executor = executor
    try:
        start = time.perf_counter()
        results = batch.run_batch(tasks, GradOptions("seq", layout="ifco", use_peephole=False), dask_address="x")
        seconds = time.perf_counter() - start
    finally:
        batch.make_executor = real
    assert all(r is not None and r.status == "ok" for r in results), [r.error for r in results if r]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from distributed import Client, LocalCluster

    cases = [("tiny", (4, 3, 5, 4), 200), ("small", (50, 16, 64, 64), 100), ("standard", (50, 32, 128, 128), 40)]
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None)
    with tempfile.TemporaryDirectory() as tmp, cluster, Client(cluster) as client:
        print(f"LocalCluster: {args.workers} worker processes x 1 thread; median of {args.repeats} batches, "
              "alternating\n")
        print("| files of T,B,I,C | files | ClientExecutor | DaskExecutor | ratio |")
        print("|---|---|---|---|---|")
        for name, shape, count in cases:
            paths = write_inputs(Path(tmp) / name, shape, count)
            out = Path(tmp) / f"{name}-out"
            out.mkdir()
            timed_batch(client, "lstmgrad", paths[:4], out)  # warm the workers' imports
            times = {"distributed": [], "lstmgrad": []}
            for _ in range(args.repeats):
                for kind in times:
                    times[kind].append(timed_batch(client, kind, paths, out))
            old, new = (statistics.median(times[k]) for k in ("distributed", "lstmgrad"))
            print(f"| {','.join(map(str, shape))} | {count} | {old:.2f} s ({count / old:.0f}/s) | "
                  f"{new:.2f} s ({count / new:.0f}/s) | {new / old:.2f} |")


if __name__ == "__main__":
    main()
