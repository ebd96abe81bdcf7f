"""``lstmgrad seq`` and ``lstmgrad cell``: gradients of files, a summary table (or JSON) for each."""

from __future__ import annotations

import glob
from pathlib import Path

import click
from rich.table import Table

from .. import __version__
from ..backends import get_backend, resolve_name
from ..errors import LstmGradError, UnknownBackendError
from ..jobs import GradOptions, GradResult, run_grad_file
from ._common import one_line, print_json, stdout_console

INPUT_SUFFIXES = (".h5", ".hdf5", ".npz")


def _shared_options(func):
    options = [
        click.argument("inputs", nargs=-1, required=True, metavar="INPUT..."),
        click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                     help="Output file (.npz, .h5, .hdf5); only with a single INPUT. "
                          "Default: <input stem>.grads.<input format> beside the input."),
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Write each output here as <input stem>.grads.<ext>."),
        click.option("--backend", metavar="NAME", help="Compute backend (env LSTMGRAD_BACKEND; default numpy; "
                                                       "'auto' picks the fastest usable). See `lstmgrad backends`."),
        click.option("--peephole/--no-peephole", "use_peephole", default=None,
                     help="Override use_peephole (default: from the file, else off)."),
        click.option("--group", metavar="PATH", help="HDF5 group (or NPZ key prefix) holding the tensors."),
        click.option("--compute-dtype", type=click.Choice(["float16", "float32", "float64"]),
                     help="Arithmetic precision. float16 inputs default to float32 (rounded once); "
                          "float16 reproduces TF CPU's per-step half rounding."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables."),
        click.option("-q", "--quiet", is_flag=True, help="Print nothing on success."),
        click.option("--force", is_flag=True, help="Overwrite existing output files."),
        click.option("--keep-going", is_flag=True, help="Report a bad file and go on with the rest (exit 1 at the end)."),
        click.option("--strict", is_flag=True, help="Treat NaN or Inf in inputs or gradients as a failure (exit 1)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.command("seq")
@_shared_options
@click.option("--layout", type=click.Choice(["ifco", "icfo"]), default="ifco", show_default=True,
              help="Gate layout: ifco = BlockLSTMGradV2, icfo = BlockLSTMGrad (V1).")
@click.option("--seq-len-max", type=click.IntRange(min=0), help="Override seq_len_max (default: from the file, else T).")
@click.option("--chunk-steps", type=click.IntRange(min=1), help="Time steps per batched matrix product "
                                                                "(default: from a 64 MiB budget).")
def seq_command(inputs, output, out_dir, backend, use_peephole, group, compute_dtype, as_json, quiet, force,
                keep_going, strict, layout, seq_len_max, chunk_steps):
    """BlockLSTMGradV2 (or BlockLSTMGrad with --layout icfo) of each INPUT (HDF5 or NPZ).

    Each INPUT holds the op's tensors under TF's names: x [T,B,I], cs_prev, h_prev [B,C], w [I+C,4C],
    wci, wcf, wco [C], b [4C], i, cs, f, o, ci, co, h, cs_grad, h_grad [T,B,C], and optionally
    seq_len_max and use_peephole (scalars or HDF5 attributes).
    """
    options = GradOptions("seq", layout, backend, use_peephole, seq_len_max, group, compute_dtype, chunk_steps, force)
    _run("seq", inputs, output, out_dir, options, as_json, quiet, keep_going, strict)


@click.command("cell")
@_shared_options
def cell_command(inputs, output, out_dir, backend, use_peephole, group, compute_dtype, as_json, quiet, force,
                 keep_going, strict):
    """LSTMBlockCellGrad of each INPUT, plus x_grad, h_prev_grad, w_grad and b_grad.

    Each INPUT holds one step: x [B,I], cs_prev, h_prev [B,C], w [I+C,4C], wci, wcf, wco [C], b [4C],
    i, cs, f, o, ci, co, cs_grad, h_grad [B,C], and optionally use_peephole.  dicfo is in ICFO order.
    """
    options = GradOptions("cell", "icfo", backend, use_peephole, None, group, compute_dtype, None, force)
    _run("cell", inputs, output, out_dir, options, as_json, quiet, keep_going, strict)


def expand_inputs(patterns) -> list[Path]:
    """Paths as given; directories give their .h5/.hdf5/.npz files; quoted glob patterns are expanded."""
    paths: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            paths.extend(sorted(p for p in path.iterdir() if p.suffix.lower() in INPUT_SUFFIXES and p.is_file()
                                and ".grads." not in p.name))
        elif not path.exists() and glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise click.BadParameter(f"no files match {pattern!r}", param_hint="INPUT")
            paths.extend(Path(m) for m in matches)
        else:
            paths.append(path)
    return paths


def _run(command, inputs, output, out_dir, options: GradOptions, as_json, quiet, keep_going, strict) -> None:
    paths = expand_inputs(inputs)
    if output is not None and (len(paths) != 1 or out_dir is not None):
        raise click.UsageError("-o/--output takes a single INPUT and no --out-dir; use --out-dir for several")
    if not paths:
        raise click.UsageError("no input files found")
    try:
        get_backend(resolve_name(options.backend))  # an unknown or missing backend fails once, up front
    except UnknownBackendError as err:
        raise click.UsageError(one_line(err)) from None
    except LstmGradError as err:
        raise click.ClickException(one_line(err)) from None
    if out_dir is not None and not out_dir.is_dir():
        raise click.ClickException(f"{out_dir}: output directory does not exist")

    console = stdout_console()
    results: list[GradResult] = []
    for path in paths:
        target = output
        if out_dir is not None:
            target = out_dir / _default_name(path)
        try:
            result = run_grad_file(path, target, options)
        except LstmGradError as err:
            result = GradResult(str(path), None, options.op, status="failed", error=one_line(err))
            click.echo(f"Error: {result.error}", err=True)
        if strict and result.status == "ok" and _nonfinite_note(result):
            result.status, result.error = "failed", f"{path}: {_nonfinite_note(result)} (--strict)"
            click.echo(f"Error: {result.error}", err=True)
        results.append(result)
        if result.status == "ok" and not (as_json or quiet):
            render(console, result)
        if result.status != "ok" and not keep_going:
            break
    failed = sum(r.status != "ok" for r in results)
    if as_json:
        print_json({
            "lstmgrad": __version__, "command": command, "results": [r.to_json() for r in results],
            "summary": {"done": len(results) - failed, "failed": failed,
                        "not_run": len(paths) - len(results)},
        })
    elif len(paths) > 1 and not quiet:
        console.print(f"{len(results) - failed} done, {failed} failed, {len(paths) - len(results)} not run")
    if failed:
        raise SystemExit(1)


def _default_name(path: Path) -> str:
    from ..io import default_output, sniff_format  # noqa: PLC0415

    try:
        return default_output(path, sniff_format(path)).name
    except LstmGradError:
        return path.name + ".grads.npz"  # the run itself reports why the input is unreadable


def _nonfinite_note(result: GradResult) -> str:
    """Words for NaN/Inf found in a run's inputs and outputs; empty when all is finite."""
    parts = [f"{n} ({c})" for n, c in result.nonfinite_inputs.items()]
    notes = []
    if parts:
        notes.append("NaN/Inf in inputs: " + ", ".join(parts))
    bad = [f"{t.name} ({t.nonfinite})" for t in result.tensors if not t.finite]
    if bad:
        notes.append("NaN/Inf in gradients: " + ", ".join(bad))
    return "; ".join(notes)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def render(console, result: GradResult) -> None:
    """The rich summary of one run: a header line of what was computed, a row per output tensor."""
    table = Table(title=f"{result.input} -> {result.output}", title_justify="left")
    for name, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("L2 norm", "right"),
                          ("max |value|", "right"), ("finite", "center")):
        table.add_column(name, justify=justify)
    for t in result.tensors:
        finite = "yes" if t.finite else f"[bold red]no ({t.nonfinite})[/]"
        table.add_row(t.name, "[" + ", ".join(map(str, t.shape)) + "]", t.dtype, _fmt(t.l2_norm), _fmt(t.max_abs),
                      finite)
    dims = result.dims or {}
    shape = ", ".join(f"{k}={v}" for k, v in dims.items() if not (k == "T" and result.seq_len_max is None))
    what = [f"{result.op} (layout {result.layout})", f"backend {result.backend} {result.backend_version or ''}".strip(),
            f"{result.dtype} (computed in {result.compute_dtype})", f"{result.seconds:.3f} s"]
    how = [shape, f"use_peephole={str(result.use_peephole).lower()} ({result.sources.get('use_peephole')})"]
    if result.seq_len_max is not None:
        how.append(f"seq_len_max={result.seq_len_max} ({result.sources.get('seq_len_max')})")
    console.print(table)
    console.print(" · ".join(what), highlight=False)
    console.print(" · ".join(how), highlight=False)
    if _nonfinite_note(result):
        console.print(f"warning: {_nonfinite_note(result)}", style="bold red", highlight=False)
    for note in result.defaults:
        console.print(f"default used: {note}", highlight=False, style="dim")
