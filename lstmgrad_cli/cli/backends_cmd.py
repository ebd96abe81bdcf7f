"""``lstmgrad backends``: what is registered, what is usable here, and how to install the rest."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from .. import backends as registry
from ..backends import cpu_blas, overlap_calibration
from ..errors import ExitCode
from ._common import handle_errors, print_json, print_table, stdout_console


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--check", is_flag=True, help="Build every kernel of every installed backend, hold every usable one to "
              "the backend contract on small problems, and say which failed (exit 1 if any did); it also fills the "
              "kernel caches before a long job.")
@click.option("--arch", metavar="SM", help="With --check and no usable GPU: the GPU architecture to compile the "
              "cupy kernels for (sm_90, sm_75, ...), with NVRTC (pip install cuda-bindings nvidia-cuda-nvrtc).")
@handle_errors
def backends_command(as_json: bool, check: bool, arch: str | None) -> None:
    """List compute backends: availability, library version, source, install hints.

    Nothing is imported to find out: numba and cupy are looked up, not loaded (whether a CUDA
    device is usable is asked of a child process, once a boot: then cached).  Choose one with
    --backend NAME or LSTMGRAD_BACKEND; `auto` means cupy with a usable GPU, else numba, else numpy.  The numpy and
    numba backends do their matrix products on numpy's OpenBLAS, or on MKL or oneDNN where its wheel
    is installed (pip install 'lstmgrad[mkl]' or 'lstmgrad[onednn]') and a backward pass on it is
    faster on this processor (timed once, then cached); LSTMGRAD_BLAS=openblas|mkl|onednn|auto
    chooses.  On a GPU,
    LSTMGRAD_CUPY_LOOP=auto|steps|persistent chooses how cupy runs the time loop and
    LSTMGRAD_CUPY_COPIES=auto|pageable|pinned how it copies host arrays.
    """
    if arch is not None and not check:
        raise click.UsageError("--arch names what --check compiles the cupy kernels for: give --check too")
    if check:
        _check(as_json, arch)
        return
    rows = registry.statuses()
    default = registry.resolve_name(None)
    auto = registry.resolve_name("auto")
    blas, why = cpu_blas.describe(), cpu_blas.why_chosen()
    schedule = overlap_calibration.describe()
    gpu = _gpu_schedule(rows)
    if as_json:
        print_json({"default": default, "auto": auto, "host_blas": blas, "host_blas_why": why,
                    "host_schedule": schedule, "gpu_schedule": gpu, "backends": [
            {"name": r.name, "available": r.available, "reason": r.reason or None, "version": r.version,
             "source": r.source} for r in rows]})
        return
    table = Table()
    for col in ("backend", "available", "version", "source", "notes"):
        table.add_column(col)
    for r in rows:
        mark = "[green]yes[/]" if r.available else "[red]no[/]"
        tags = [t for t, on in (("default", r.name == default), ("auto", r.name == auto)) if on]
        name = f"{r.name} ({', '.join(tags)})" if tags else r.name
        table.add_row(name, mark, r.version or "-", r.source, escape(r.reason))  # hints hold [extras]
    print_table(stdout_console(), table, "lstmgrad backends", f"numpy and numba products on {blas}: {escape(why)}; "
                f"{escape(schedule)}" + (f"; {escape(gpu)}" if gpu else ""))


def _gpu_schedule(rows) -> str | None:
    """The cupy backend's time loop and copies, in words, where cupy is installed (None elsewhere)."""
    if not any(r.name == "cupy" and r.version is not None for r in rows):
        return None
    from ..backends import _cupy  # noqa: PLC0415 - its settings only: cupy itself is not imported

    return _cupy.describe()


def _check(as_json: bool, arch: str | None) -> None:
    """``--check``: every backend's kernels built; exit 1 when one failed."""
    from ..backends import kernel_check  # noqa: PLC0415 - imports numba when it is installed

    try:
        builds = kernel_check.build_all(arch)
    except ValueError as err:  # an architecture NVRTC does not know
        raise click.BadParameter(str(err), param_hint="--arch") from None
    failed = [b for b in builds if b.ok is False]
    if as_json:
        print_json({"ok": not failed, "builds": [
            {"backend": b.backend, "target": b.target, "kernels": b.kernels, "ok": b.ok, "detail": b.detail}
            for b in builds], "host_schedule": overlap_calibration.describe()})
    else:
        table = Table()
        for col in ("backend", "target", "kernels", "result"):
            table.add_column(col)
        for b in builds:
            mark = {True: "[green]built[/]", False: "[red]FAILED[/]", None: "[yellow]skipped[/]"}[b.ok]
            table.add_row(b.backend, escape(b.target), str(b.kernels), f"{mark}: {escape(b.detail)}")
        print_table(stdout_console(), table, "lstmgrad backends --check",
                    (f"{len(failed)} failed" if failed else "every kernel that could be built here was built, and "
                     "every usable backend meets the backend contract") + f"; {escape(overlap_calibration.describe())}")
    if failed:
        raise SystemExit(ExitCode.ERROR)
