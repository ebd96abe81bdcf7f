"""A batch of small files as users run it: `lstmgrad seq DIR --out-dir OUT -q`, serial and with --workers 2,
side by side with the floor (one Python process: np.load + block_lstm_grad_v2 + np.savez per file; with
``--format hdf5``, HDF5 files in and out, the floor reading and writing them with h5py).

Every contender is a fresh process (interpreter start and imports included, as a user's run pays them, from
compiled bytecode as an installed copy has it: _installed.py), timed in alternating rounds (every other one in
the opposite order), once per BLAS library installed (LSTMGRAD_BLAS). Medians and ratios.

"Two serial halves at once" is what two cores give this work with nothing shared between the processes: two
commands started together, each on every other file.  It is the practical ceiling of --workers 2 on the machine.

A second table gives each contender's CPU seconds (user and system, of the process and everything it started:
getrusage of the children) and the cores it kept busy on average (CPU / wall): how much of the machine the
workers use, and how much CPU running in parallel adds to the serial run's.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_batch.py --repeats 5

``--baseline DIR`` times another checkout of lstmgrad in the same rounds (``git worktree add DIR COMMIT``;
it runs from DIR through PYTHONPATH, with this environment's packages), for before/after tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _installed import compile_lstmgrad

from lstmgrad_cli import block_lstm_v2
from lstmgrad_cli.backends import _xp, cpu_blas, overlap_calibration
from lstmgrad_cli.backends.blas_calibration import processor
from lstmgrad_cli.backends.cpu_blas import other_libraries

FLOOR = """
import sys, pathlib, numpy as np
from lstmgrad_cli import block_lstm_grad_v2
out = pathlib.Path(sys.argv[2])
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.npz")):
    with np.load(path) as f:
        t = {k: f[k] for k in f.files}
    seq_len_max, peep = int(t.pop("seq_len_max")), bool(t.pop("use_peephole"))
    g = block_lstm_grad_v2(seq_len_max, **t, use_peephole=peep)
    np.savez(out / (path.stem + ".grads.npz"), **g._asdict())
"""

FLOOR_HDF5 = """
import sys, pathlib, h5py
from lstmgrad_cli import block_lstm_grad_v2
out = pathlib.Path(sys.argv[2])
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.h5")):
    with h5py.File(path, "r") as f:
        t = {k: f[k][()] for k in f}
    seq_len_max, peep = int(t.pop("seq_len_max")), bool(t.pop("use_peephole"))
    g = block_lstm_grad_v2(seq_len_max, **t, use_peephole=peep)
    with h5py.File(out / (path.stem + ".grads.h5"), "w") as f:
        for k, v in g._asdict().items():
            f[k] = v
"""


_RUNS = itertools.count()  # the runs timed so far, for the names of their spent output folders


def write_inputs(folder: Path, shape, count: int, form: str = "npz") -> None:
    """``count`` NPZ (or HDF5) files of consistent BlockLSTMV2 activations (the forward op run on random weights)."""
    T, B, I, C = shape  # noqa: E741
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for k in range(count):
        x = rng.standard_normal((T, B, I), dtype=np.float32)
        weights = dict(cs_prev=rng.standard_normal((B, C), dtype=np.float32) * 0.5,
                       h_prev=rng.uniform(-1, 1, (B, C)).astype(np.float32),
                       w=rng.standard_normal((I + C, 4 * C), dtype=np.float32) * (I + C) ** -0.5,
                       wci=np.zeros(C, np.float32), wcf=np.zeros(C, np.float32), wco=np.zeros(C, np.float32),
                       b=rng.standard_normal(4 * C, dtype=np.float32) * 0.5)
        forward = block_lstm_v2(T, x, **weights)
        tensors = dict(x=x, **weights, **forward._asdict(), seq_len_max=np.int64(T), use_peephole=np.bool_(False),
                       cs_grad=rng.standard_normal((T, B, C), dtype=np.float32),
                       h_grad=rng.standard_normal((T, B, C), dtype=np.float32))
        if form == "hdf5":
            import h5py  # noqa: PLC0415

            with h5py.File(folder / f"case{k:04d}.h5", "w") as fh:
                for name, value in tensors.items():
                    fh[name] = value
        else:
            np.savez(folder / f"case{k:04d}.npz", **tensors)


def timed(commands: list[list[str]], env: dict, out: Path) -> tuple[float, float]:
    """Wall seconds of ``commands`` started together (usually one), until the last ends, and the CPU seconds
    they and the processes they started used (those waited for: a command's workers are).

    Every run writes into the same folder ``out``, emptied first: the last run's outputs are moved aside into a
    folder of their own, not deleted (on a file system that discards freed blocks, as this VM's ext4 does,
    creating files in the seconds after hundreds were deleted costs up to 1 ms each, far more than they take to
    write), and everything is written to disk before the clock starts (the floor leaves its outputs for the
    kernel to write back, which would otherwise happen during the next contender's run).  They are all deleted
    when the benchmark ends.  One folder for every contender, because what creating a file costs depends on the
    folder: a new folder's files get their inodes from the block group ext4 put the folder in, and on this VM
    that cost 15 us a file in one group and 95-330 us in another (0.1 s of a 300-file batch, drawn at random
    for each run when each run had a new folder).
    """
    out.mkdir(exist_ok=True)
    spent = out.with_name(f"{out.name}.{next(_RUNS)}")
    spent.mkdir()
    for entry in os.scandir(out):
        os.rename(entry.path, spent / entry.name)
    os.sync()
    cpu_before = _children_cpu()
    start = time.perf_counter()
    running = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL) for command in commands]
    try:
        for proc in running:
            if proc.wait() != 0:
                raise subprocess.CalledProcessError(proc.returncode, proc.args)
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return time.perf_counter() - start, _children_cpu() - cpu_before


def _schedule(library: str, shape) -> str:
    """What ``lstmgrad seq`` runs with ``LSTMGRAD_BLAS=library``: the library and why, and each file's schedule."""
    env = {**os.environ, "LSTMGRAD_BLAS": library}
    lstmgrad = str(Path(sys.executable).with_name("lstmgrad"))
    said = json.loads(subprocess.run([lstmgrad, "backends", "--json"], env=env, capture_output=True, text=True,
                                     check=True).stdout)
    flops = overlap_calibration.flops(*shape)
    if flops < _xp.OVERLAP_MIN_FLOPS:
        threads = "one BLAS thread" if flops < cpu_blas.SMALL_PASS_FLOPS else "the library's threads"
        each = f"each file ({flops:.2g} flops) in one chunk, in sequence, on {threads}"
    else:
        each = f"each file ({flops:.2g} flops) in the overlapped schedule's chunks; {said['host_schedule']}"
    return f"products on {said['host_blas']} ({said['host_blas_why']}); {each}"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--shape", default="20,16,64,64", help="T,B,I,C of every file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another lstmgrad checkout, timed in the same rounds")
    parser.add_argument("--format", choices=("npz", "hdf5"), default="npz", help="the files' format, in and out")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    lstmgrad = str(Path(sys.executable).with_name("lstmgrad"))
    libraries = ["openblas", *other_libraries()]  # each installed library (mkl, onednn), by LSTMGRAD_BLAS
    compile_lstmgrad(*([args.baseline] if args.baseline else []))
    cpu = processor()
    print(f"{args.files} {args.format.upper()} files of T,B,I,C = {args.shape}, float32; median of {args.repeats} "
          f"alternating rounds; {cpu['model']} ({cpu['vendor']}; {', '.join(cpu['flags'])}), {os.cpu_count()} cores\n")
    for library in libraries:
        print(f"- {library}: {_schedule(library, shape)}")
    print()
    floor_words = "h5py in, grad, h5py out" if args.format == "hdf5" else "np.load + grad + np.savez"
    print(f"| BLAS | floor ({floor_words}) | lstmgrad seq, serial | x floor | --workers 2 | x floor | "
          "serial / workers 2 | two serial halves at once | serial / halves |")
    print("|---|---|---|---|---|---|---|---|---|")
    cpu_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs, out = Path(tmp) / "in", Path(tmp) / "out"
        write_inputs(inputs, shape, args.files, args.format)
        floor = FLOOR_HDF5 if args.format == "hdf5" else FLOOR
        files = sorted(str(f) for f in inputs.iterdir())
        for library in libraries:
            env = {**os.environ, "LSTMGRAD_BLAS": library}
            serial = [lstmgrad, "seq", str(inputs), "--out-dir", str(out), "-q"]
            commands = {
                "floor": ([[sys.executable, "-c", floor, str(inputs), str(out)]], env),
                "serial": ([serial], env),
                "workers": ([[*serial, "--workers", "2"]], env),
                # what two cores give this work with nothing shared: two commands, each on half of the files
                "halves": ([[lstmgrad, "seq", *files[k::2], "--out-dir", str(out), "-q"] for k in (0, 1)], env),
            }
            if args.baseline:
                base_env = {**env, "PYTHONPATH": str(args.baseline.resolve())}
                commands.update({"base serial": ([serial], base_env),
                                 "base workers": ([[*serial, "--workers", "2"]], base_env)})
            times: dict[str, list[float]] = {name: [] for name in commands}
            cpu: dict[str, list[float]] = {name: [] for name in commands}
            for round_ in range(args.repeats):
                # every other round in the opposite order: no contender always runs right after the same one
                for name in list(commands)[::-1 if round_ % 2 else 1]:
                    command, command_env = commands[name]
                    wall, seconds = timed(command, command_env, out)
                    times[name].append(wall)
                    cpu[name].append(seconds)
            m = {name: statistics.median(values) for name, values in times.items()}
            for name in commands:
                cores = statistics.median(c / t for c, t in zip(cpu[name], times[name], strict=True))
                cpu_rows.append(f"| {library} | {name} | {m[name]:.2f} s | {statistics.median(cpu[name]):.2f} s | "
                                f"{cores:.2f} |")
            rows = [("", "")] + ([(" (baseline)", "base ")] if args.baseline else [])
            for label, prefix in rows:
                s_, w_, h_ = m[prefix + "serial"], m[prefix + "workers"], m["halves"]
                halves = f"{h_:.2f} s | {s_ / h_:.2f}" if not prefix else "- | -"  # timed with this checkout only
                print(f"| {library}{label} | {m['floor']:.2f} s | {s_:.2f} s | {s_ / m['floor']:.2f} | {w_:.2f} s | "
                      f"{w_ / m['floor']:.2f} | {s_ / w_:.2f} | {halves} |", flush=True)
    print("\n| BLAS | contender | wall | CPU (user + system) | cores busy (CPU / wall) |\n|---|---|---|---|---|")
    print("\n".join(cpu_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
