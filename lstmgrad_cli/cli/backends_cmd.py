"""``lstmgrad backends``: what is registered, what is usable here, and how to install the rest."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from .. import backends as registry
from ..backends import cpu_blas
from ._common import handle_errors, print_json, print_table, stdout_console


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handle_errors
def backends_command(as_json: bool) -> None:
    """List compute backends: availability, library version, source, install hints.

    Nothing is imported to find out: numba and cupy are looked up, not loaded (whether a CUDA
    device is usable is asked of a child process).  Choose one with --backend NAME or
    LSTMGRAD_BACKEND; `auto` means cupy with a usable GPU, else numba, else numpy.  The numpy and
    numba backends do their matrix products on MKL when the mkl wheel is installed
    (pip install 'lstmgrad[mkl]'), else on numpy's OpenBLAS; LSTMGRAD_BLAS=openblas|mkl|auto chooses.
    """
    rows = registry.statuses()
    default = registry.resolve_name(None)
    auto = registry.resolve_name("auto")
    blas = cpu_blas.describe()
    if as_json:
        print_json({"default": default, "auto": auto, "host_blas": blas, "backends": [
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
    print_table(stdout_console(), table, "lstmgrad backends", f"numpy and numba products on {blas}")
