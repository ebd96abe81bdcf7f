"""``lstmgrad check``: compare gradients with a reference (or a dump's own) and explain the differences.  A thin
click layer over operations/check.py."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import __version__
from ..errors import ExitCode
from ..frameworks import FrameworkOptions
from ..io import npydir, tfdbg
from ..operations.check import CheckOptions, CheckReport, check_dump, run_check
from . import _options as opt
from . import render
from ._common import handle_errors, is_terminal, one_line, print_json, progress_bar, say, stdout_console


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
    options = CheckOptions(kind, layout, backend, use_peephole, seq_len_max, group, compute_dtype,
                           weights=None if weights is None else str(weights), weights_group=weights_group,
                           forget_bias=forget_bias, cell_clip=cell_clip,
                           framework=FrameworkOptions(framework, time_major, batch_first, torch_layer, reverse,
                                                      go_backwards, inference),
                           reference_group=reference_group, rtol=rtol, atol=atol, gradcheck=gradcheck,
                           samples=samples, seed=seed)
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
        raise SystemExit(ExitCode.ERROR)


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
        raise SystemExit(ExitCode.ERROR)
