"""``lstmgrad forward``, ``check`` and ``inspect`` (placeholders until issue 4 lands)."""

from __future__ import annotations

import click


@click.command("forward")
def forward_command() -> None:
    """Forward pass (BlockLSTMV2 / BlockLSTM / LSTMBlockCell) into a file seq/cell accept."""
    raise click.ClickException("not implemented yet")


@click.command("check")
def check_command() -> None:
    """Compare gradients with a reference file and explain differences."""
    raise click.ClickException("not implemented yet")


@click.command("inspect")
def inspect_command() -> None:
    """What is in a file, which op it fits, what is wrong with it."""
    raise click.ClickException("not implemented yet")
