"""``lstmgrad forward``, ``check`` and ``inspect``: for users who bring tensors dumped from TensorFlow.

Thin click layers over forward_job.py, diagnose.py and inspection.py; everything that computes or
decides lives there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np
from rich.table import Table

from .. import __version__
from ..diagnose import CAUSES, CheckOptions, CheckReport, check_dump, run_check
from ..dump_report import DumpReport, inspect_dump
from ..errors import InvalidArgumentError
from ..forward_job import ForwardOptions, ForwardResult, parse_grads, run_forward_file
from ..frameworks import FrameworkOptions
from ..inspection import InspectReport, inspect_file
from ..io import npydir, tfdbg
from ..problem import OPS
from ._common import (
    check_output_extension,
    handle_errors,
    is_terminal,
    one_line,
    plain,
    print_json,
    print_table,
    progress_bar,
    say,
    separator,
    silence_closed_stdout,
    stdout_console,
)
from ._words import words
from .grad_cmd import SOURCE_WORDS


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _fmt3(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# -- forward --------------------------------------------------------------------------------------

def _check_grads(ctx, param, value):
    try:
        parse_grads(value)
    except InvalidArgumentError as err:
        raise click.BadParameter(one_line(words(err).removeprefix("--grads ")), ctx=ctx, param=param) from None
    return value


# What --forget-bias and --cell-clip default to, in each forward command's help.
FORWARD_DEFAULT_WORDS = {
    "seq": ("the op's: 1.0 for BlockLSTM (--layout icfo); BlockLSTMV2 has none",
            "the op's: 0 for BlockLSTMV2, 3.0 for BlockLSTM (--layout icfo)"),
    "cell": ("LSTMBlockCell's 1.0", "LSTMBlockCell's 3.0"),
}


def _check_output_extension(ctx, param, value):
    check_output_extension(value, ctx, param)
    return value


def _forward_options(kind: str):
    forget_bias_default, cell_clip_default = FORWARD_DEFAULT_WORDS[kind]
    options = [
        click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path)),
        click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
                     callback=_check_output_extension, help="Output file (.npz, .h5, .hdf5, .safetensors)."),
        click.option("--forget-bias", type=float, help=f"Added to the forget gate (default: {forget_bias_default})."),
        click.option("--cell-clip", type=float,
                     help=f"Clip cs to +-CLIP; <= 0 means no clipping (default: {cell_clip_default})."),
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

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


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
            print_json({"lstmgrad": __version__, "command": "forward", "result": result.to_json()})
        elif not quiet:
            _render_forward(result)
    except BrokenPipeError:  # stdout's reader exited (| head): the output is written and complete, still a success
        silence_closed_stdout()
        click.echo(f"Warning: stdout was closed (its reader exited) before everything was printed; {result.output} "
                   "is written and complete", err=True)


def _render_forward(result: ForwardResult) -> None:
    console = stdout_console()
    table = Table()
    for name, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("L2 norm", "right"),
                          ("max |value|", "right"), ("finite", "center")):
        table.add_column(name, justify=justify)
    for t in result.tensors:
        table.add_row(plain(t.name), _shape(t.shape), t.dtype, _fmt(t.l2_norm), _fmt(t.max_abs),
                      "yes" if t.finite else f"[bold red]no ({t.nonfinite})[/]")
    print_table(console, table, f"{result.input} -> {result.output}")
    parts = [f"{result.op} (layout {result.layout})", f"{result.dtype} (computed in {result.compute_dtype})",
             f"forget_bias={result.forget_bias:g}", f"cell_clip={result.cell_clip:g}",
             f"use_peephole={str(result.use_peephole).lower()} ({result.sources.get('use_peephole')})"]
    if result.seq_len_max is not None:
        parts.append(f"seq_len_max={result.seq_len_max} ({result.sources.get('seq_len_max')})")
    parts.append(f"grads={result.grads}")
    say(console, separator(console).join(parts))
    for note in result.defaults:
        say(console, f"default used: {words(note)}", style="dim")
    say(console, f"next: {result.next_command}")


# -- check ----------------------------------------------------------------------------------------

@click.command("check")
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("-r", "--reference", type=click.Path(path_type=Path),
              help="Gradients to compare with (HDF5 or NPZ, TF's output names), e.g. dumped from TensorFlow.")
@click.option("--kind", type=click.Choice(["seq", "cell"]), help="Op family (default: from the rank of x).")
@click.option("--layout", type=click.Choice(["ifco", "icfo"]),
              help="seq gate layout: ifco = BlockLSTMGradV2, icfo = BlockLSTMGrad (V1).  Default: the layout the "
                   "stored activations fit, else ifco.")
@click.option("--peephole/--no-peephole", "use_peephole", default=None,
              help="Override use_peephole (default: from the file, else what the activations fit, else off).")
@click.option("--seq-len-max", type=click.IntRange(min=0),
              help="Override seq_len_max (default: from the file, else T).")
@click.option("--group", metavar="PATH", help="HDF5 group (NPZ key prefix, subdirectory) of the input tensors; in a "
              "TensorFlow debug dump, the execution to check.")
@click.option("--reference-group", metavar="PATH", help="HDF5 group (or NPZ key prefix) of the reference tensors.")
@click.option("--weights", type=click.Path(path_type=Path), metavar="FILE",
              help="Read the tensors INPUT lacks from FILE (any input format). INPUT's win.")
@click.option("--weights-group", metavar="PATH", help="Group (key prefix, subdirectory) of --weights.")
@click.option("--op", "dump_op", metavar="NAME",
              help="TensorFlow debug dumps: check the executions of this op (name or type) only.")
@click.option("--execution", "dump_execution", type=int, metavar="K",
              help="TensorFlow debug dumps: check the K-th execution of each op only (0 first, -1 last).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="TensorFlow debug dumps: check executions in N local processes.")
@click.option("--framework", type=click.Choice(["keras", "torch", "tf"]),
              help="Whose names INPUT and the reference use: Keras', PyTorch's or the TF op's (default: told from "
                   "the names).")
@click.option("--time-major", is_flag=True, help="Keras: x and h_grad are [T, B, ...].")
@click.option("--batch-first", is_flag=True, help="PyTorch: x and h_grad are [B, T, ...].")
@click.option("--layer", "torch_layer", type=click.IntRange(min=0), default=0, show_default=True,
              help="PyTorch: the layer K whose weights to use.")
@click.option("--reverse", is_flag=True, help="The backward direction of a bidirectional LSTM (PyTorch _reverse "
                                              "weights, a Keras Bidirectional's backward_layer).")
@click.option("--go-backwards", is_flag=True, help="Keras: a layer made with go_backwards=True.")
@click.option("--backend", metavar="NAME", help="Compute backend (env LSTMGRAD_BACKEND; default numpy).")
@click.option("--compute-dtype", type=click.Choice(["float16", "float32", "float64"]),
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@handle_errors
def check_command(input_path, reference, kind, layout, use_peephole, seq_len_max, group, reference_group, weights,
                  weights_group, dump_op, dump_execution, workers, framework, time_major, batch_first, torch_layer,
                  reverse, go_backwards, backend, compute_dtype, rtol, atol, gradcheck, samples, seed, forget_bias,
                  cell_clip, as_json):
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
                           FrameworkOptions(framework, time_major, batch_first, torch_layer, reverse, go_backwards))
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
        _render_check(report)
    if not report.passed:
        raise SystemExit(1)


def _check_dump(dump: Path, reference, options: CheckOptions, op, execution, workers: int, as_json: bool) -> None:
    """Every selected gradient-op execution of a dump, checked; a summary table; exit 1 if any fails."""
    index = tfdbg.index_dump(dump)
    tfdbg.check_values_recorded(index)
    members = [e.member for e in tfdbg.select_executions(index, options.kind, options.group, op, execution)]
    console = stdout_console()
    show = len(members) > 1 and not as_json and is_terminal(sys.stderr)
    with progress_bar(show, len(members), "executions") as advance:
        def on_report(k, report):
            if not as_json:
                if isinstance(report, CheckReport):
                    _render_check(report)
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
        _render_dump_summary(console, index, members, reports)
    if failed:
        raise SystemExit(1)


def _render_dump_summary(console, index, members: list[str], reports: list) -> None:
    table = Table()
    for name in ("execution", "TF ran", "on activations of", "right op", "result"):
        table.add_column(name, overflow="fold" if name == "execution" else "ellipsis")  # (--group takes it whole)
    executions = {e.member: e for e in index.executions}
    for member, report in zip(members, reports, strict=True):
        e = executions[member]
        if isinstance(report, CheckReport):
            result = "[green]pass[/]" if report.passed else "[bold red]FAIL[/]"
        else:
            result = "[bold red]error[/]"
        table.add_row(plain(member), e.op_type, e.forward_op or "?", e.right_op or "?", result)
    passed = sum(isinstance(r, CheckReport) and r.passed for r in reports)
    print_table(console, table, f"{index.path}: {len(members)} gradient-op execution{'s' * (len(members) != 1)}",
                f"{passed} passed, {len(members) - passed} failed")


def _render_check(report: CheckReport) -> None:
    console = stdout_console()
    source = f"{report.input} [{report.member}]" if report.member else report.input
    if report.member and report.reference == report.input:
        where = f"{source} vs the gradients TensorFlow recorded ({report.recorded_op})"
    else:
        where = f"{source} vs {report.reference}" if report.reference else source
    layout = f"layout {report.layout}"
    if report.sources.get("layout") in SOURCE_WORDS:
        layout += f", {SOURCE_WORDS[report.sources['layout']]}"
    peephole = report.sources.get("use_peephole")
    head = [f"{report.op} ({layout})", f"{report.dtype} (computed in {report.compute_dtype})",
            f"use_peephole={str(report.use_peephole).lower()} ({SOURCE_WORDS.get(peephole, peephole)})"]
    if report.seq_len_max is not None:
        head.append(f"seq_len_max={report.seq_len_max} ({report.sources.get('seq_len_max')})")
    if report.reference is not None:
        table = Table()
        for name, justify in (("tensor", "left"), ("shape", "left"), ("max abs err", "right"),
                              ("max err / max|ref|", "right"), ("ulps", "right"), ("tolerance", "right"),
                              ("result", "center")):
            table.add_column(name, justify=justify, no_wrap=True)
        for c in report.comparisons:
            result = "[green]pass[/]" if c.passed else "[bold red]FAIL[/]"
            table.add_row(plain(c.name), _shape(c.shape), _fmt3(c.max_abs_error), _fmt3(c.max_rel_error),
                          _fmt3(c.ulps), _fmt3(c.tolerance), result)
        print_table(console, table, where)
    else:
        say(console, where)
    say(console, separator(console).join([*head, f"rtol={report.rtol:g} atol={report.atol:g}"]))
    for note in report.notes:
        say(console, f"note: {words(note)}")
    for warning in report.warnings:
        say(console, f"warning: {words(warning)}", style="yellow")
    for c in report.comparisons:
        if c.note:
            say(console, f"{c.name}: {words(c.note)}")
        elif not c.passed and c.worst_index is not None:
            say(console, f"{c.name}: {_where(c)}")
    if report.not_in_reference:
        say(console, f"not in the reference (not compared): {', '.join(report.not_in_reference)}", style="dim")
    for note in report.defaults:
        say(console, f"default used: {words(note)}", style="dim")
    if report.reference is not None:
        _render_explanation(console, report)
    if report.forward is not None:
        _render_gradcheck(console, report)
    console.print("[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]")


def _where(c) -> str:
    """Where a tensor's difference is: how many elements, the worst one, the first failing step."""
    axes = c.axes or [f"axis{k}" for k in range(len(c.worst_index))]
    index = ", ".join(f"{a}={k}" for a, k in zip(axes, c.worst_index, strict=True))
    total = int(np.prod(c.shape)) if c.shape else 1
    text = (f"{c.out_of_tolerance} of {total} elements out of tolerance; the worst at [{index}]: "
            f"{c.worst_ours:.6g} here, {c.worst_reference:.6g} in the reference")
    if c.first_bad_step is not None:
        text += f"; the first failing time step is t={c.first_bad_step}"
    return text


def _changes(changes: dict) -> str:
    """A variant's changes in words: "layout icfo, use_peephole=true"."""
    words = []
    for key, value in changes.items():
        if key == "layout":
            words.append(f"layout {value} ({OPS[('seq', value)]})")
        elif key == "double_count":
            words.append("the peephole term counted twice")
        elif key == "half_inputs":
            words.append("inputs rounded to half")
        elif key == "compute_dtype":
            words.append(f"computed in {value}")
        else:
            words.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return ", ".join(words)


def _render_explanation(console, report: CheckReport) -> None:
    if report.comparisons_passed:
        say(console, f"All {len(report.comparisons)} compared tensors agree within tolerance.")
        return
    if report.explanations:
        console.print("[bold]Why they differ[/]")
        for text in report.explanations:
            say(console, f"  {words(text)}")
        return
    singles = list(dict.fromkeys(CAUSES[v.causes[0]] for v in report.variants if len(v.causes) == 1))
    pairs = any(len(v.causes) > 1 for v in report.variants)
    if not singles:
        console.print("[bold]No known cause applies:[/] the reference's tensors do not have this input's shapes; "
                      "it belongs to another problem (or another --group / --reference-group).", highlight=False)
        return
    console.print("[bold]No known cause reproduces the reference.[/] Tried: " + ", ".join(singles)
                  + (", and pairs of them." if pairs else "."), highlight=False)
    scored = [v for v in report.variants if v.worst is not None]  # most tensors matching, fewest causes, least error
    closest = max(scored, key=lambda v: (v.tensors_matching, -len(v.causes), -v.worst), default=None)
    if closest is not None:
        say(console, f"  closest: {_changes(closest.changes)} ({closest.tensors_matching} of "
                      f"{closest.tensors_compared} tensors match, worst error {closest.worst:.3g}x the tolerance)")
    say(console, "  If the reference comes from TensorFlow, check that it was computed from exactly these "
                  "activations and output gradients (--gradcheck tests the activations).")


def _render_gradcheck(console, report: CheckReport) -> None:
    fit, fd = report.forward, report.gradcheck
    console.print("[bold]Gradient check[/]")
    params = (f"forget_bias={fit.forget_bias:g} ({fit.forget_bias_source}), "
              f"cell_clip={fit.cell_clip:g} ({fit.cell_clip_source})")
    if fit.consistent:
        console.print(f"  stored activations: [green]consistent[/] with x, h_prev, w, b over {fit.steps} step(s) "
                      f"({params}; max deviation {fit.score * fit.tolerance:.2g})", highlight=False)
    else:
        console.print("  stored activations: [bold red]NOT consistent[/] with the inputs and weights "
                      f"({params}, tolerance {fit.tolerance:g}):", highlight=False)
        for t in fit.inconsistent():
            step = "" if t.first_bad_step is None else f", first at step {t.first_bad_step}"
            say(console, f"    {t.name}: {t.bad_entries} entries off, max deviation {t.max_deviation:.3g}{step}")
        alt = report.forward_alternative
        if alt is not None:
            say(console, f"  they do fit layout {alt.layout} with use_peephole={str(alt.use_peephole).lower()}: "
                          "check --layout and --peephole.")
        else:
            say(console, "  The activations were not computed from these weights and inputs (saved at a different "
                          "step, or from a different checkpoint?). The gradient ops use only the stored "
                          "activations, so every gradient here is the gradient of some other network.")
        worst = sorted(fd.stored_vs_recomputed.items(), key=lambda kv: -kv[1])[:3]
        if worst:
            say(console, "  gradients from the stored activations vs from recomputed ones (max diff / max value): "
                          + ", ".join(f"{n} {v:.3g}" for n, v in worst))
    if fit.nonzero_beyond_seq_len_max:
        say(console, f"  {', '.join(fit.nonzero_beyond_seq_len_max)} nonzero beyond seq_len_max={fit.steps}: "
                      "TF zeroes them; was the sequence run longer?")
    status = "[green]pass[/]" if fd.ok else "[bold red]FAIL[/]"
    bad = [e for e in fd.entries if not e.ok]
    console.print(f"  finite differences (float64, {len(fd.entries)} entries): max rel error {fd.max_rel_error:.2g} "
                  f"{status}", highlight=False)
    for e in bad[:5]:
        say(console, f"    {e.tensor}{e.index}: analytic {e.analytic:.6g}, numeric {e.numeric:.6g}")


# -- inspect --------------------------------------------------------------------------------------

@click.command("inspect")
@click.argument("input_path", metavar="FILE", type=click.Path(path_type=Path))
@click.option("--group", metavar="PATH", help="HDF5 group (NPZ key prefix, subdirectory) holding the tensors; in a "
              "TensorFlow debug dump, the execution to inspect (default: a table of them all).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@handle_errors
def inspect_command(input_path, group, as_json):
    """What is in FILE, which op it fits, and every problem with it (no gradients computed).

    Lists the tensors (shape, dtype, min, max, finite), tells seq from cell by the rank of x,
    finds the gate layout from the file's metadata or by recomputing the gates in both layouts,
    names missing and unused tensors, and reports every validation problem at once.

    Exit status 1 when the gradient commands would refuse the file, else 0 (warnings included).
    """
    if npydir.input_format(input_path, group) == "tfdbg2" and group is None:
        report = inspect_dump(input_path)
        render = _render_dump
    else:
        report = inspect_file(input_path, group)
        render = _render_inspect
    if as_json:
        print_json({"lstmgrad": __version__, "command": "inspect", "result": report.to_json()})
    else:
        render(report)
    if report.errors:
        raise SystemExit(1)


def _render_dump(report: DumpReport) -> None:
    console = stdout_console()
    table = Table()
    for name in ("execution", "op", "where", "run", "dtype", "sizes", "inputs recorded", "activations of",
                 "use_peephole"):
        table.add_column(name, overflow="fold" if name == "execution" else "ellipsis")  # (--group takes it whole)
    for e in report.executions:
        recorded = f"{len(e.recorded)} of {len(e.recorded) + len(e.missing)}"
        if e.missing:
            recorded += f" [red](no {', '.join(e.missing)})[/]"
        peephole = "-" if e.use_peephole is None else str(e.use_peephole).lower()
        if e.peephole_note.startswith("irrelevant"):
            peephole += " (irrelevant)"
        sizes = ", ".join(f"{k}={v}" for k, v in (e.dims or {}).items()) or "-"
        table.add_row(plain(e.member), e.op_type, plain(e.where), str(e.execution), e.dtype or "-", sizes, recorded,
                      plain(e.forward_execution or e.forward_op or "-"), peephole)
    modes = ", ".join(f"{m} ({n})" for m, n in report.modes.items()) or "none"
    print_table(console, table, f"{report.path} (TensorFlow debug dump, TF {report.tensorflow_version or '?'}, "
                                f"{report.records} records; tensor_debug_mode: {modes})")
    for e in report.executions:
        if e.forward_fit:
            say(console, f"{e.member}: {e.forward_fit} (from the recorded values)", style="dim")
        if e.peephole_note and e.peephole_note != "inferred from the activations":
            say(console, f"{e.member}: use_peephole {e.peephole_note}", style="dim")
    for problem in report.errors:
        say(console, f"error: {words(problem)}", style="bold red")
    for problem in report.warnings:
        say(console, f"warning: {words(problem)}", style="yellow")
    gradients = [e for e in report.executions if e.right_op]
    if gradients:
        say(console, "next: lstmgrad check " + report.path + "   (recompute each gradient and compare with TF's)")
    n_err, n_warn = len(report.errors), len(report.warnings)
    say(console, f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}")


def _render_inspect(report: InspectReport) -> None:
    console = stdout_console()
    title = f"{report.path} ({report.format}{', group ' + report.group if report.group else ''})"
    table = Table()
    for name, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("min", "right"),
                          ("max", "right"), ("finite", "center"), ("role", "left")):
        table.add_column(name, justify=justify)
    for t in report.tensors:
        finite = "-" if t.finite is None else ("yes" if t.finite else f"[bold red]no ({t.nonfinite})[/]")
        role = t.role if t.role in ("used", "scalar", "weights") else f"[yellow]{t.role}[/]"
        key = t.key if t.name in (None, t.key.removeprefix("@")) else f"{t.key} ({t.name})"
        table.add_row(plain(key), "-" if t.shape is None else _shape(t.shape), t.dtype or "-", _fmt3(t.min),
                      _fmt3(t.max), finite, role)
    print_table(console, table, title)
    for g in report.groups:
        say(console, f"group {g}/ (inspect it with --group {g})")
    if report.kind is not None:
        fits = {"seq": "sequence", "cell": "one cell step", "forward-seq": "forward input (sequence)",
                "forward-cell": "forward input (one cell step)", "gradients": "gradients",
                "keras": "a Keras LSTM layer's tensors", "torch": "a PyTorch nn.LSTM layer's tensors",
                "keras-weights": "a Keras weights file", "torch-weights": "a PyTorch state_dict"}[report.kind]
        parts = [f"fits: {report.op or fits}"]
        if report.layout:
            parts.append(f"layout {report.layout} ({report.layout_source})")
        if report.dims:
            parts.append(", ".join(f"{k}={v}" for k, v in report.dims.items()))
        if report.use_peephole is not None and report.kind != "gradients":
            parts.append(f"use_peephole={str(report.use_peephole).lower()} ({report.use_peephole_source})")
        if report.seq_len_max is not None:
            parts.append(f"seq_len_max={report.seq_len_max}")
        say(console, separator(console).join(parts))
    if report.metadata:
        say(console, "lstmgrad metadata: " + ", ".join(f"{k}={v}" for k, v in report.metadata.items()), style="dim")
    if report.missing:
        say(console, f"missing: {', '.join(report.missing)}", style="bold red")
    if report.unused:
        say(console, f"unused: {', '.join(report.unused)}")
    for p in report.problems:
        style = "bold red" if p.severity == "error" else "yellow"
        say(console, f"{p.severity}: {words(p.message)}", style=style)
    for note in report.notes:
        say(console, f"note: {words(note)}", style="dim")
    n_err, n_warn = len(report.errors), len(report.problems) - len(report.errors)
    say(console, f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}")
