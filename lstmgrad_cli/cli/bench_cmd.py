"""``lstmgrad bench``: time the backends on standard shapes (placeholder until the benchmark lands)."""

from __future__ import annotations

import click


@click.command("bench")
def bench_command() -> None:
    """Time each usable backend on standard shapes."""
    raise click.ClickException("the benchmark is not implemented yet")
