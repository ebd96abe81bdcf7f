"""``lstmgrad backends``: what is registered, what is usable here, and how to install the rest."""

from __future__ import annotations

import click
from rich.table import Table

from .. import backends as registry
from ._common import handle_errors, print_json, stdout_console


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handle_errors
def backends_command(as_json: bool) -> None:
    """List compute backends: availability, library version, source, install hints."""
    rows = registry.statuses()
    default = registry.resolve_name(None)
    if as_json:
        print_json({"default": default, "backends": [
            {"name": r.name, "available": r.available, "reason": r.reason or None, "version": r.version,
             "source": r.source} for r in rows]})
        return
    table = Table(title="lstmgrad backends")
    for col in ("backend", "available", "version", "source", "notes"):
        table.add_column(col)
    for r in rows:
        mark = "[green]yes[/]" if r.available else "[red]no[/]"
        name = f"{r.name} (default)" if r.name == default else r.name
        table.add_row(name, mark, r.version or "-", r.source, r.reason)
    stdout_console().print(table)
