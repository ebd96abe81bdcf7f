"""``lstmgrad forward``, ``check`` and ``inspect``: for users who bring tensors dumped from TensorFlow.

Thin click layers over forward_job.py, diagnose.py and inspection.py; everything that computes or
decides lives there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import __version__
from ..diagnose import CheckOptions, CheckReport, check_dump, run_check
from ..dump_report import inspect_dump
from ..errors import InvalidArgumentError
from ..forward_job import ForwardOptions, parse_grads, run_forward_file
from ..frameworks import FrameworkOptions
from ..inspection import inspect_file
from ..io import npydir, tfdbg
from . import _options as opt
from . import render
from ._common import (
    StdoutError,
    check_output_extension,
    handle_errors,
    is_terminal,
    one_line,
    print_json,
    progress_bar,
    say,
    silence_closed_stdout,
    stdout_console,
)
from ._words import words

# -- forward --------------------------------------------------------------------------------------

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
@click.option("--layout", type=opt.LAYOUT_CHOICE, default="ifco", show_default=True,
              help=f"Gate layout: {opt.FORWARD_LAYOUTS}.")
@click.option("--seq-len-max", type=click.IntRange(min=0), help="Steps to run (default: from the file, else T).")
@handle_errors
def forward_seq_command(input_path, output, forget_bias, cell_clip, use_peephole, grads, group, compute_dtype,
                        as_json, quiet, force, layout, seq_len_max):
    """BlockLSTMV2 (or BlockLSTM with --layout icfo) on INPUT; x is [T, B, I]."""
    options = ForwardOptions("seq", layout, forget_bias, cell_clip, use_peephole, seq_len_max, grads, group,
                             compute_dtype, force)
    _forward(input_path, output, options, as_json, quiet)


@forward_command.command("cell")
@_forward_options("cell")
@handle_errors
def forward_cell_command(input_path, output, forget_bias, cell_clip, use_peephole, grads, group, compute_dtype,
                         as_json, quiet, force):
    """LSTMBlockCell (one step, ICFO) on INPUT; x is [B, I]."""
    options = ForwardOptions("cell", "icfo", forget_bias, cell_clip, use_peephole, None, grads, group,
                             compute_dtype, force)
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

@click.command("check")
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("-r", "--reference", type=click.Path(path_type=Path),
              help="Gradients to compare with (HDF5 or NPZ, TF's output names), e.g. dumped from TensorFlow.")
@click.option("--kind", type=click.Choice(["seq", "cell"]), help="Op family (default: from the rank of x).")
@opt.layout_option("seq gate layout")
@opt.peephole_option()
@opt.seq_len_max_option()
@opt.group_option("check")
@click.option("--reference-group", metavar="PATH", help="HDF5 group (or NPZ key prefix) of the reference tensors.")
@opt.weights_options("INPUT lacks")
@opt.dump_selection_options("check")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="TensorFlow debug dumps: check executions in N local processes.")
@opt.framework_options("INPUT and the reference use")
@opt.backend_option()
@click.option("--compute-dtype", type=opt.COMPUTE_DTYPES,
              help="Arithmetic precision (float16: TF CPU's per-step half rounding).")
@click.option("--rtol", type=click.FloatRange(min=0), help="Relative tolerance, times max|reference| "
              "(default by dtype: float16 1e-2, float32 1e-5, float64 1e-10).")
@click.option("--atol", type=click.FloatRange(min=0), help="Absolute tolerance (default by dtype: float16 1e-3, "
              "float32 1e-6, float64 1e-12).")
@click.option("--gradcheck", is_flag=True, help="Check that the stored activations fit the weights (float64 "
              "forward pass) and the gradient against central finite differences.")
@click.option("--samples", type=click.IntRange(min=1), default=24, show_default=True,
              help="Entries checked by finite differences.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for choosing those entries.")
@click.option("--forget-bias", type=float, help="Forward forget_bias for --gradcheck (default: inferred from f).")
@click.option("--cell-clip", type=float, help="Forward cell_clip for --gradcheck (default: inferred from cs).")
@opt.json_option()
@handle_errors
def check_command(input_path, reference, kind, layout, use_peephole, seq_len_max, group, reference_group, weights,
                  weights_group, dump_op, dump_execution, workers, framework, time_major, batch_first, torch_layer,
                  reverse, go_backwards, inference, backend, compute_dtype, rtol, atol, gradcheck, samples, seed,
                  forget_bias, cell_clip, as_json):
    """Compare INPUT's gradients with --reference and explain the differences.

    INPUT may be a TensorFlow debug dump (tfdbg2): every recorded gradient-op execution in it is
    recomputed as the gradient of the forward op that made its activations, and compared with the
    gradients TensorFlow recorded (no --reference needed).

    Computes the gradients of INPUT (as `seq`/`cell` would: the gradient of the op that made its
    activations), compares each tensor that is also in the reference (max absolute and relative
    error, error in ulps of the dtype, where the worst element is) and, when some disagree, tries
    the known causes and says which one reproduces the reference: TF's BlockLSTMV2 autodiff
    gradient using the V1 (ICFO) kernel, peepholes on/off, another seq_len_max, TF's GPU
    LSTMBlockCellGrad peephole double count, half precision op by op.

    Exit status 0 when everything passes, 1 otherwise.
    """
    options = CheckOptions(kind, layout, backend, use_peephole, seq_len_max, group, reference_group, compute_dtype,
                           rtol, atol, gradcheck, samples, seed, forget_bias, cell_clip,
                           None if weights is None else str(weights), weights_group,
                           FrameworkOptions(framework, time_major, batch_first, torch_layer, reverse, go_backwards,
                                            inference))
    if npydir.input_format(input_path, group) == "tfdbg2":
        _check_dump(input_path, reference, options, dump_op, dump_execution, workers, as_json)
        return
    if dump_op is not None or dump_execution is not None or workers > 1:
        raise click.UsageError("--op, --execution and --workers choose and share out the executions of a TensorFlow "
                               "debug dump; INPUT is not one")
    if reference is None and not gradcheck:
        raise click.UsageError("give --reference REF, --gradcheck, or both")
    report = run_check(input_path, reference, options)
    if as_json:
        print_json({"lstmgrad": __version__, "command": "check", "result": report.to_json()})
    else:
        render.check_report(stdout_console(), report)
    if not report.passed:
        raise SystemExit(1)


def _check_dump(dump: Path, reference, options: CheckOptions, op, execution, workers: int, as_json: bool) -> None:
    """Every selected gradient-op execution of a dump, checked; a summary table; exit 1 if any fails."""
    index = tfdbg.index_dump(dump)
    tfdbg.check_values_recorded(index)
    if index.dropped:
        click.echo(f"Warning: {one_line(f'{dump}: {index.dropped}', [dump])}", err=True)
    members = [e.member for e in tfdbg.select_executions(index, options.kind, options.group, op, execution)]
    console = stdout_console()
    show = len(members) > 1 and not as_json and is_terminal(sys.stderr)
    with progress_bar(show, len(members), "executions") as advance:
        def on_report(k, report):
            if not as_json:
                if isinstance(report, CheckReport):
                    render.check_report(console, report)
                    say(console, "")
                else:
                    click.echo(f"Error: {one_line(report)}", err=True)
            advance()

        reports = check_dump(dump, reference, options, members, workers=workers, on_report=on_report)
    failed = [m for m, r in zip(members, reports, strict=True) if not (isinstance(r, CheckReport) and r.passed)]
    if as_json:
        print_json({"lstmgrad": __version__, "command": "check", "input": str(dump),
                    "results": [r.to_json() if isinstance(r, CheckReport) else {"member": m, "error": r}
                                for m, r in zip(members, reports, strict=True)],
                    "summary": {"executions": len(members), "passed": len(members) - len(failed),
                                "failed": len(failed)}})
    else:
        render.dump_check_summary(console, index, members, reports)
    if failed:
        raise SystemExit(1)


# -- inspect --------------------------------------------------------------------------------------

@click.command("inspect")
@click.argument("input_path", metavar="FILE", type=click.Path(path_type=Path))
@opt.group_option("inspect", " (default: a table of them all)")
@click.option("--weights", type=click.Path(path_type=Path), metavar="FILE",
              help="Check FILE together with the model or weights file seq would read beside it (seq --weights).")
@click.option("--weights-group", metavar="PATH", help="Group (key prefix, subdirectory) of --weights.")
@opt.framework_options()
@opt.json_option()
@handle_errors
def inspect_command(input_path, group, weights, weights_group, framework, time_major, batch_first, torch_layer,
                    reverse, go_backwards, inference, as_json):
    """What is in FILE, which op it fits, and every problem with it (no gradients computed).

    Lists the tensors (shape, dtype, min, max, finite), tells seq from cell by the rank of x,
    finds the gate layout from the file's metadata or by recomputing the gates in both layouts,
    names missing and unused tensors, and reports every validation problem at once.

    Exit status 1 when the gradient commands would refuse the file, else 0 (warnings included).
    """
    if npydir.input_format(input_path, group) == "tfdbg2" and group is None:
        report = inspect_dump(input_path)
        show = render.dump_report
    else:
        options = FrameworkOptions(framework, time_major, batch_first, torch_layer, reverse, go_backwards, inference)
        report = inspect_file(input_path, group, weights=weights, weights_group=weights_group, framework=options)
        show = render.inspect_report
    if as_json:
        print_json({"lstmgrad": __version__, "command": "inspect", "result": report.to_json()})
    else:
        show(stdout_console(), report)
    if report.errors:
        raise SystemExit(1)


