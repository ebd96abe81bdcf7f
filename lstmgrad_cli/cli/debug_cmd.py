"""``lstmgrad forward``, ``check`` and ``inspect``: for users who bring tensors dumped from TensorFlow.

Thin click layers over forward_job.py, diagnose.py and inspection.py; everything that computes or
decides lives there.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from .. import __version__
from ..errors import InvalidArgumentError
from ..forward_job import ForwardOptions, ForwardResult, parse_grads, run_forward_file
from ._common import handle_errors, print_json, stdout_console


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# -- forward --------------------------------------------------------------------------------------

def _check_grads(ctx, param, value):
    try:
        parse_grads(value)
    except InvalidArgumentError as err:
        raise click.BadParameter(str(err).removeprefix("--grads "), ctx=ctx, param=param) from None
    return value


def _forward_options(func):
    options = [
        click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path)),
        click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
                     help="Output file (.npz, .h5, .hdf5)."),
        click.option("--forget-bias", type=float,
                     help="Added to the forget gate (default: the op's, 1.0; BlockLSTMV2 has none)."),
        click.option("--cell-clip", type=float,
                     help="Clip cs to +-CLIP; <= 0 means no clipping (default: the op's, 3.0 for "
                          "BlockLSTM/LSTMBlockCell, 0 for BlockLSTMV2)."),
        click.option("--peephole/--no-peephole", "use_peephole", default=None,
                     help="Use the peepholes wci, wcf, wco (default: from the file, else off)."),
        click.option("--grads", metavar="zeros|ones|random[:SEED]|file", callback=_check_grads,
                     help="Output gradients cs_grad/h_grad to store (default: the input file's if it has "
                          "both, else ones)."),
        click.option("--group", metavar="PATH", help="HDF5 group (or NPZ key prefix) holding the tensors."),
        click.option("--compute-dtype", type=click.Choice(["float16", "float32", "float64"]),
                     help="Arithmetic precision (float16 inputs default to float32, rounded once)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table."),
        click.option("-q", "--quiet", is_flag=True, help="Print nothing on success."),
        click.option("--force", is_flag=True, help="Overwrite an existing output file."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.group("forward")
def forward_command() -> None:
    """Forward pass into a complete file that `lstmgrad seq` / `cell` read as it is.

    \b
    lstmgrad forward seq weights.h5 -o run.h5      BlockLSTMV2 (IFCO)
    lstmgrad forward seq w.npz --layout icfo -o run.npz   BlockLSTM (V1, ICFO)
    lstmgrad forward cell step.npz -o step_full.npz      LSTMBlockCell (ICFO)

    The INPUT needs x, cs_prev, h_prev, w, b (and wci, wcf, wco with peepholes).  The output holds
    them, the forward outputs i, cs, f, o, ci, co, h (zeros beyond seq_len_max), cs_grad, h_grad,
    seq_len_max and use_peephole.
    """


@forward_command.command("seq")
@_forward_options
@click.option("--layout", type=click.Choice(["ifco", "icfo"]), default="ifco", show_default=True,
              help="Gate layout: ifco = BlockLSTMV2, icfo = BlockLSTM (V1).")
@click.option("--seq-len-max", type=click.IntRange(min=0), help="Steps to run (default: from the file, else T).")
@handle_errors
def forward_seq_command(input_path, output, forget_bias, cell_clip, use_peephole, grads, group, compute_dtype,
                        as_json, quiet, force, layout, seq_len_max):
    """BlockLSTMV2 (or BlockLSTM with --layout icfo) on INPUT; x is [T, B, I]."""
    options = ForwardOptions("seq", layout, forget_bias, cell_clip, use_peephole, seq_len_max, grads, group,
                             compute_dtype, force)
    _forward(input_path, output, options, as_json, quiet)


@forward_command.command("cell")
@_forward_options
@handle_errors
def forward_cell_command(input_path, output, forget_bias, cell_clip, use_peephole, grads, group, compute_dtype,
                         as_json, quiet, force):
    """LSTMBlockCell (one step, ICFO) on INPUT; x is [B, I]."""
    options = ForwardOptions("cell", "icfo", forget_bias, cell_clip, use_peephole, None, grads, group,
                             compute_dtype, force)
    _forward(input_path, output, options, as_json, quiet)


def _forward(input_path, output, options: ForwardOptions, as_json: bool, quiet: bool) -> None:
    result = run_forward_file(input_path, output, options)
    if as_json:
        print_json({"lstmgrad": __version__, "command": "forward", "result": result.to_json()})
    elif not quiet:
        _render_forward(result)


def _render_forward(result: ForwardResult) -> None:
    console = stdout_console()
    table = Table(title=f"{result.input} -> {result.output}", title_justify="left")
    for name, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("L2 norm", "right"),
                          ("max |value|", "right"), ("finite", "center")):
        table.add_column(name, justify=justify)
    for t in result.tensors:
        table.add_row(t.name, _shape(t.shape), t.dtype, _fmt(t.l2_norm), _fmt(t.max_abs),
                      "yes" if t.finite else f"[bold red]no ({t.nonfinite})[/]")
    console.print(table)
    parts = [f"{result.op} (layout {result.layout})", f"{result.dtype} (computed in {result.compute_dtype})",
             f"forget_bias={result.forget_bias:g}", f"cell_clip={result.cell_clip:g}",
             f"use_peephole={str(result.use_peephole).lower()} ({result.sources.get('use_peephole')})"]
    if result.seq_len_max is not None:
        parts.append(f"seq_len_max={result.seq_len_max} ({result.sources.get('seq_len_max')})")
    parts.append(f"grads={result.grads}")
    console.print(" · ".join(parts), highlight=False)
    for note in result.defaults:
        console.print(f"default used: {note}", highlight=False, style="dim")
    console.print(f"next: {result.next_command}", highlight=False)


# -- check ----------------------------------------------------------------------------------------

@click.command("check")
def check_command() -> None:
    """Compare gradients with a reference file and explain differences."""
    raise click.ClickException("not implemented yet")


# -- inspect --------------------------------------------------------------------------------------

@click.command("inspect")
def inspect_command() -> None:
    """What is in a file, which op it fits, what is wrong with it."""
    raise click.ClickException("not implemented yet")
