"""The command line the GPU scripts share: ``[--repeats N] [T,B,I,C ...]``."""

from __future__ import annotations


def repeats_and_shapes(argv: list[str], repeats: int, shapes) -> tuple[int, list[tuple[int, ...]]]:
    """``--repeats N`` (else ``repeats``) and the shapes named (else ``shapes``)."""
    from lstmgrad_cli.operations.bench import parse_shape

    if argv[:1] == ["--repeats"]:
        repeats, argv = int(argv[1]), argv[2:]
    return repeats, [parse_shape(a) for a in argv] or list(shapes)
