"""``lstmgrad forward seq|cell``: TensorFlow's forward ops on a file's inputs, written with the output gradients the
gradient commands then take.  A thin click layer over operations/forward.py."""

from __future__ import annotations

from pathlib import Path

import click

from .. import __version__
from ..errors import InvalidArgumentError
from ..operations.forward import ForwardOptions, parse_grads, run_forward_file
from ..spec import CELL_LAYOUT, DEFAULT_LAYOUT
from . import _options as opt
from . import render
from ._common import (
    StdoutError,
    check_output_extension,
    handle_errors,
    one_line,
    print_json,
    silence_closed_stdout,
    stdout_console,
)
from ._words import words


def _check_grads(ctx, param, value):
    try:
        parse_grads(value)
    except InvalidArgumentError as err:
        raise click.BadParameter(one_line(words(err).removeprefix("--grads ")), ctx=ctx, param=param) from None
    return value


def _check_output_extension(ctx, param, value):
    check_output_extension(value, ctx, param)
    return value


def _forward_options(kind: str):
    forget_bias_default, cell_clip_default = opt.forward_default_words(kind, from_file=False)
    return opt.options(
        click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path)),
        click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
                     callback=_check_output_extension, help="Output file (.npz, .h5, .hdf5, .safetensors)."),
        click.option("--forget-bias", type=float, help=f"Added to the forget gate (default: {forget_bias_default})."),
        click.option("--cell-clip", type=float,
                     help=f"Clip cs to +-CLIP; <= 0 means no clipping (default: {cell_clip_default})."),
        opt.peephole_option("Use the peepholes wci, wcf, wco (default: from the file, else off)."),
        click.option("--grads", metavar="zeros|ones|random[:SEED]|file", callback=_check_grads,
                     help="Output gradients cs_grad/h_grad to store (default: the input file's if it has "
                          "both, else ones)."),
        opt.group_option(None),
        click.option("--compute-dtype", type=opt.COMPUTE_DTYPES,
                     help="Arithmetic precision (float16 inputs default to float32, rounded once)."),
        opt.backend_option(),
        opt.json_option("a table"),
        opt.quiet_option(),
        opt.force_option("an existing output file"),
    )


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
@_forward_options("seq")
@click.option("--layout", type=opt.LAYOUT_CHOICE, default=DEFAULT_LAYOUT, show_default=True,
              help=f"Gate layout: {opt.FORWARD_LAYOUTS}.")
@click.option("--seq-len-max", type=click.IntRange(min=0), help="Steps to run (default: from the file, else T).")
@handle_errors
def forward_seq_command(input_path, output, forget_bias, cell_clip, use_peephole, grads, group, compute_dtype,
                        backend, as_json, quiet, force, layout, seq_len_max):
    """BlockLSTMV2 (or BlockLSTM with --layout icfo) on INPUT; x is [T, B, I]."""
    options = ForwardOptions("seq", layout, use_peephole=use_peephole, seq_len_max=seq_len_max, group=group,
                             compute_dtype=compute_dtype, forget_bias=forget_bias, cell_clip=cell_clip, grads=grads,
                             force=force, backend=backend)
    _forward(input_path, output, options, as_json, quiet)


@forward_command.command("cell")
@_forward_options("cell")
@handle_errors
def forward_cell_command(input_path, output, forget_bias, cell_clip, use_peephole, grads, group, compute_dtype,
                         backend, as_json, quiet, force):
    """LSTMBlockCell (one step, ICFO) on INPUT; x is [B, I]."""
    options = ForwardOptions("cell", CELL_LAYOUT, use_peephole=use_peephole, group=group, compute_dtype=compute_dtype,
                             forget_bias=forget_bias, cell_clip=cell_clip, grads=grads, force=force, backend=backend)
    _forward(input_path, output, options, as_json, quiet)


def _forward(input_path, output, options: ForwardOptions, as_json: bool, quiet: bool) -> None:
    result = run_forward_file(input_path, output, options)
    try:
        if as_json:
            print_json({"lstmgrad": __version__, "command": "forward",
                        "result": {**result.to_json(), "next_command": render.forward_next_command(result)}})
        elif not quiet:
            render.forward_result(stdout_console(), result)
    except BrokenPipeError:  # stdout's reader exited (| head): the output is written and complete, still a success
        silence_closed_stdout()
        click.echo(f"Warning: stdout was closed (its reader exited) before everything was printed; {result.output} "
                   "is written and complete", err=True)
    except StdoutError as err:  # (a full disk): what was to be shown is lost, the output is not
        silence_closed_stdout()
        raise click.ClickException(one_line(f"{err}; {result.output} is written and complete",
                                            [result.output])) from None


# -- check ----------------------------------------------------------------------------------------
