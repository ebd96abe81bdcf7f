"""Where the cupy backend's time goes on a GPU, per shape: the whole pass on device arrays, its persistent time loop
alone, and that loop's parts (the grid barrier alone, with the elementwise phase, with the product phase), per step;
and the persistent loop's answers against the loop of steps' (both on the GPU).  Issue 39's six shapes by default.

    python benchmarks/gpu_loop_anatomy.py [--repeats N] [T,B,I,C ...]

The parts are timed by building the loop kernel's text with a phase's call left out (the results of those
variants are wrong by design and never compared); each launch is timed with CUDA events, medians of ``--repeats``.
Then the loop by its split into row groups, and by the loads a thread of the product has in flight (the kernel
text built with another ``LOOP_LOADS``), and a profile of the host's time in a small pass.
Runs on a machine with a CUDA GPU and cupy, from the repository root (PYTHONPATH=.); prints markdown.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from gpu_args import repeats_and_shapes

SHAPES = ((50, 32, 128, 128), (100, 64, 256, 256), (200, 128, 512, 512), (100, 256, 1024, 1024),
          (500, 16, 256, 256), (1000, 64, 512, 512))


def main(argv: list[str]) -> int:
    import cupy as cp

    from lstmgrad_cli.backends import _cupy_kernels as kernels
    from lstmgrad_cli.backends._cupy import CupyBackend, DeviceLauncher
    from lstmgrad_cli.operations.bench import make_inputs
    from lstmgrad_cli.spec import LAYOUT_V2, SeqTensors

    repeats, shapes = repeats_and_shapes(argv, 5, SHAPES)

    variants = {"loop": kernels.source()}
    for label, left_out in (("barrier only", ("a", "b")), ("barrier + elementwise", ("b",)),
                            ("barrier + product", ("a",))):
        text = kernels.source()
        for part in left_out:
            for dtype in kernels.DTYPES:
                for peephole in (False, True):
                    name = kernels.loop_name(dtype, peephole)
                    call = f"        {name}_{part}(blockIdx.x, gridDim.x, row_groups, k, shared,"
                    assert call in text, call
                    text = text.replace(call, f"        if (0) {name}_{part}(blockIdx.x, gridDim.x, row_groups, k, "
                                              "shared,")
        variants[label] = text

    class Timed(DeviceLauncher):
        """The device launcher, its loop launches timed with events (on a variant's module, when given one)."""

        def __init__(self, code=None):
            super().__init__(cp)
            if code is not None:
                self._module = cp.RawModule(code=code, options=kernels.OPTIONS)
            self.seconds = []

        def loop(self, name, batch, columns, params, args, barrier):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            super().loop(name, batch, columns, params, args, barrier)
            end.record()
            end.synchronize()
            self.seconds.append(cp.cuda.get_elapsed_time(start, end) / 1e3)

    class Split(Timed):
        """The loop split into ``groups`` row groups (the columns over the rest of the multiprocessors), or None
        where a block's share of w_rec would not fit."""

        def __init__(self, groups):
            super().__init__()
            self.groups = groups

        def loop_grid(self, B, C, dtype):
            sms, limit = (int(cp.cuda.Device().attributes[k])
                          for k in ("MultiProcessorCount", "MaxSharedMemoryPerBlockOptin"))
            return kernels.loop_grid(B, C, dtype, sms, limit - kernels.LOOP_STATIC_SHARED_MOST, self.groups)

    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"{props['name'].decode() if isinstance(props['name'], bytes) else props['name']}, "
          f"{props['multiProcessorCount']} SMs, cupy {cp.__version__}; float32, no peepholes; medians of {repeats}\n")
    print("| T,B,I,C | grid (blocks, row groups) | pass, persistent | pass, steps | loop | barrier only | "
          "+ elementwise | + product | per step: loop, barrier, elementwise, product | max rel. diff vs steps |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for shape in shapes:
        T, B, I, C = shape  # noqa: E741
        tensors = SeqTensors(**{k: cp.asarray(v) for k, v in make_inputs(shape, "float32").items()})
        kw = dict(seq_len_max=T, use_peephole=False, layout=LAYOUT_V2, compute_dtype=np.dtype("float32"))
        launchers = {label: Timed(code if label != "loop" else None) for label, code in variants.items()}
        grid = launchers["loop"].loop_grid(B, C, np.float32)
        if grid is None:
            print(f"| {','.join(map(str, shape))} | does not fit | | | | | | | | |")
            continue
        persistent = CupyBackend(cp, launcher=launchers["loop"], loop="persistent")
        steps = CupyBackend(cp, loop="steps")
        answers = {}

        def whole(backend, key, answers=answers, tensors=tensors, kw=kw):
            start = time.perf_counter()
            answers[key] = backend.block_lstm_grad(tensors, **kw)
            cp.cuda.get_current_stream().synchronize()
            return time.perf_counter() - start

        timings = {"persistent": [], "steps": [], **{label: [] for label in variants if label != "loop"}}
        for k in range(repeats + 1):  # the first round compiles and warms up, untimed
            for label, launcher in launchers.items():
                launcher.seconds.clear()
                if label == "loop":
                    seconds = whole(persistent, "persistent")
                    timings["steps"].append(whole(steps, "steps"))
                    timings["persistent"].append(seconds)
                else:
                    CupyBackend(cp, launcher=launcher, loop="persistent").block_lstm_grad(tensors, **kw)
                    timings[label].append(sum(launcher.seconds))
                if label == "loop":
                    timings.setdefault("loop", []).append(sum(launcher.seconds))
            if not k:
                for values in timings.values():
                    values.clear()
        med = {key: float(np.median(v)) for key, v in timings.items()}
        worst = 0.0
        for a, b in zip(answers["persistent"], answers["steps"], strict=True):
            a, b = cp.asnumpy(a).astype(np.float64), cp.asnumpy(b).astype(np.float64)
            worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0)
        barrier = med["barrier only"] / T
        per_step = (f"{med['loop'] / T * 1e6:.1f}, {barrier * 1e6:.1f}, "
                    f"{(med['barrier + elementwise'] / T - barrier) * 1e6:.1f}, "
                    f"{(med['barrier + product'] / T - barrier) * 1e6:.1f} us")
        print(f"| {','.join(map(str, shape))} | {grid.blocks}, {grid.row_groups} | {med['persistent'] * 1e3:.2f} ms | "
              f"{med['steps'] * 1e3:.2f} ms | {med['loop'] * 1e3:.2f} ms | {med['barrier only'] * 1e3:.2f} ms | "
              f"{med['barrier + elementwise'] * 1e3:.2f} ms | {med['barrier + product'] * 1e3:.2f} ms | {per_step} | "
              f"{worst:.1e} |", flush=True)
    def by_launcher(title, columns, launchers):
        """A table of the loop's time a step for each shape (rows) and launcher (columns; "-" where its split
        does not fit), medians of ``repeats`` passes after an untimed one."""
        print(f"\n{title}, per step:\n\n| T,B,I,C | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
        for shape in shapes:
            T, B, I, C = shape  # noqa: E741
            tensors = SeqTensors(**{k: cp.asarray(v) for k, v in make_inputs(shape, "float32").items()})
            kw = dict(seq_len_max=T, use_peephole=False, layout=LAYOUT_V2, compute_dtype=np.dtype("float32"))
            cells = []
            for launcher in launchers:
                if launcher.loop_grid(B, C, np.float32) is None:
                    cells.append("-")
                    continue
                totals = []
                for _ in range(repeats + 1):
                    launcher.seconds.clear()
                    CupyBackend(cp, launcher=launcher, loop="persistent").block_lstm_grad(tensors, **kw)
                    totals.append(sum(launcher.seconds))
                cells.append(f"{np.median(totals[1:]) / T * 1e6:.1f} us")
            print(f"| {','.join(map(str, shape))} | " + " | ".join(cells) + " |", flush=True)

    groups = (1, 2, 4, 8)
    by_launcher("The persistent loop by its split (row groups x column groups)",
                [f"{n} row groups" for n in groups], [Split(n) for n in groups])
    loads = (4, 8, 16)  # a thread's gate gradients loaded before their terms are added (LOOP_LOADS)
    built = f"#define LOOP_LOADS {kernels.LOOP_LOADS}\n"
    assert built in kernels.source()
    by_launcher(f"The persistent loop by the loads a thread has in flight (LOOP_LOADS, {kernels.LOOP_LOADS} built)",
                [f"{n} loads" for n in loads],
                [Timed(kernels.source().replace(built, f"#define LOOP_LOADS {n}\n")) for n in loads])
    profile_small(cp, shapes[0], CupyBackend, make_inputs, LAYOUT_V2, SeqTensors)
    return 0


def profile_small(cp, shape, CupyBackend, make_inputs, layout, SeqTensors) -> None:  # noqa: N803
    """What the host does during a pass of ``shape`` on device arrays, the loop the backend chooses: cProfile of
    20 passes, the functions that took most time themselves."""
    import cProfile
    import pstats

    T = shape[0]  # noqa: N806
    tensors = SeqTensors(**{k: cp.asarray(v) for k, v in make_inputs(shape, "float32").items()})
    backend = CupyBackend(cp)
    kw = dict(seq_len_max=T, use_peephole=False, layout=layout, compute_dtype=np.dtype("float32"))
    backend.block_lstm_grad(tensors, **kw)
    cp.cuda.get_current_stream().synchronize()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(20):
        backend.block_lstm_grad(tensors, **kw)
    cp.cuda.get_current_stream().synchronize()
    profile.disable()
    print(f"\n{','.join(map(str, shape))}: 20 passes in {(time.perf_counter() - start) * 1e3:.1f} ms (profiled); "
          "the host's time by function:\n```")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(14)
    print("```", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
