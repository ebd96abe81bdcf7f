"""``lstmgrad bench``: time the backends on standard shapes against the machine's GEMM rate."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from ._common import handle_errors, one_line, print_json, print_table, say, stderr_console, stdout_console


def _shape(ctx, param, values):
    from ..errors import InvalidArgumentError
    from ..operations.bench import parse_shape

    try:
        return tuple(parse_shape(v) for v in values)
    except InvalidArgumentError as err:
        raise click.BadParameter(one_line(err)) from None


@click.command("bench")
@click.option("--backend", "backends", multiple=True, metavar="NAME",
              help="Backend to time (repeatable; default: every usable built-in backend).")
@click.option("--shape", "shapes", multiple=True, callback=_shape, metavar="T,B,I,C",
              help="Problem size (repeatable; default: 50,32,128,128  100,64,256,256  200,128,512,512).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "float64"]), default="float32", show_default=True,
              help="Input dtype (float16 computes in float32).")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed rounds per engine, after one untimed warm-up call.")
@click.option("--peephole/--no-peephole", default=False, show_default=True, help="Time with peephole connections.")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also time TensorFlow and PyTorch when they are importable (never required).")
@click.option("--compare-python", multiple=True, metavar="PYTHON",
              help="Another interpreter that has TensorFlow or PyTorch, to time them on the same arrays.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--markdown", is_flag=True, help="Print a Markdown table (for a README) instead of the rich table.")
@handle_errors
def bench_command(backends, shapes, dtype, repeats, peephole, compare, compare_python, as_json, markdown) -> None:
    """Time each backend on standard shapes: median, GFLOP/s and the ratio to the GEMM limit.

    The backward pass is 16*T*B*C*(I+C) flops of matrix products; the GEMM limit is the time of
    those flops as two large products on the BLAS the numpy and numba backends use (MKL when the
    mkl wheel is installed), measured in the same run.  Engines
    are timed round-robin so machine noise hits them alike, each call 0.3 s after the one before
    (thread pools stop spinning), and again right after it, as a loop of calls runs them: the
    back-to-back median.  Engines run in another interpreter (--compare-python) are timed a
    round at a time between this one's rounds and rated against a GEMM limit timed in their own
    rounds.  "x framework, same rounds": a backend's time over TensorFlow's or PyTorch's in the
    same round, the median over rounds (below 1: faster), and the same of the back-to-back
    calls.  With the cupy backend on a GPU, the GPU's
    engines are rated against the GPU's own GEMM limit (gpu-gemm-limit): cupy from host arrays
    (copies included; cupy-pinned through pinned staging buffers, at once where the GPU holds
    the pass, else a chunk of steps at a time beside its work), cupy-device on arrays already
    there (cupy-device-steps and cupy-device-persistent: each of its time loops), cupy-files from
    one NPZ file to another, pcie-floor (the pass's bytes copied in from pinned memory and out to
    it), and PyTorch's cuDNN backward with TF32 off and on when a CUDA-enabled torch is
    importable; a second table gives, for each shape, the device time over cuDNN's and the host
    and file times over max(PCIe floor, device time).  For stable numbers on OpenBLAS, run with
    OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset.

    \b
    lstmgrad bench
    lstmgrad bench --backend numba --shape 100,64,256,256 --repeats 9 --json
    lstmgrad bench --compare-python /path/to/torch-venv/bin/python
    """
    from ..operations import bench

    err = stderr_console()
    progress = None if as_json else (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False))
    report = bench.run(list(backends) or None, shapes or bench.SHAPES, dtype, repeats, peephole, compare,
                       tuple(compare_python), progress)
    if as_json:
        print_json(report.to_json())
        return
    m = report.machine
    flags = ", ".join(m["processor"].get("flags", [])) or "no vector extension found"
    machine = (f"{m['cpu']} ({m['processor'].get('vendor') or 'vendor unknown'}; {flags}), {m['cores']} cores, numpy "
               f"{m['numpy']} ({m['blas']}), products on {m['host_blas']}; {m['host_schedule']}")
    if markdown:
        click.echo(f"{machine}; {dtype}, {'peephole' if peephole else 'no peephole'}, median of {repeats} rounds\n")
        click.echo(bench.markdown_table(report))
        gpu = bench.markdown_gpu_summary(bench.gpu_summary(report))
        if gpu:
            click.echo(f"\nOn the GPU (bound: max(PCIe floor, device time)):\n\n{gpu}")
        for note in report.notes:
            click.echo(f"Warning: not compared: {one_line(note)}", err=True)
        return
    table = Table()
    for col, justify in (("T,B,I,C", "left"), ("engine", "left"), ("version", "left"), ("median", "right"),
                         ("GFLOP/s", "right"), ("x GEMM limit", "right"), ("back-to-back", "right"),
                         ("x framework, same rounds", "right"), ("note", "left")):
        table.add_column(col, justify=justify)
    previous = None
    for r in report.results:
        shape = ",".join(map(str, r.shape))
        table.add_row(shape if shape != previous else "", r.engine, r.version or "-", bench.seconds_text(r.median),
                      f"{r.gflops:.0f}", f"{r.ratio_to_gemm:.2f}", bench.seconds_text(r.back_to_back_median),
                      bench.versus_text(r), r.note,
                      end_section=False)
        previous = shape
    console = stdout_console()
    print_table(console, table,
                f"lstmgrad bench: {dtype}, {'peephole' if peephole else 'no peephole'}, median of {repeats}", machine)
    gpu = bench.markdown_gpu_summary(bench.gpu_summary(report))
    if gpu:
        console.print(f"\nOn the GPU (bound: max(PCIe floor, device time)):\n\n{escape(gpu)}", highlight=False)
    for note in report.notes:
        say(console, f"not compared: {note}", style="yellow")
