"""How the commands show their results: every table and summary line, in one place.

Each renderer takes the console to print on (the command makes it: ``_common.stdout_console``) and a result of
the library (operations: grad.GradResult, forward.ForwardResult, check.CheckReport, inspect.InspectReport,
inspect_dump.DumpReport).  Library text reaches the user through ``say`` and ``words``, which spell its
parameters as flags.  rich's table module is imported on first use (``new_table``): a quiet run prints none.
"""

from __future__ import annotations

import math

import numpy as np

from ..analysis.decide import SOURCE_WORDS
from ..analysis.perstep import ASCII_SPARK, SPARK, sparkline
from ..io import describe_keys
from ..spec import OPS
from ._common import new_table, plain, print_rows, print_table, printable, say, separator, unicode_console
from ._words import words

# How the summary names a Keras or PyTorch layer whose gradients were computed.
FRAMEWORK_WORDS = {"keras": "Keras LSTM layer", "torch": "PyTorch nn.LSTM layer"}


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _fmt3(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


TENSOR_COLUMNS = (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("L2 norm", "right"),
                  ("max |value|", "right"), ("finite", "center"))


def tensor_rows(tensors) -> list[tuple[str, ...]]:
    """A row per tensor summary (summary.TensorSummary): its name, shape, dtype, L2 norm, max |value|, finite."""
    return [(printable(t.name), _shape(t.shape), t.dtype, _fmt(t.l2_norm), _fmt(t.max_abs),
             "yes" if t.finite else f"no ({t.nonfinite})") for t in tensors]


def tensor_table(tensors):
    """``tensor_rows`` as a rich table, a tensor that is not finite in bold red."""
    table = new_table()
    for name, justify in TENSOR_COLUMNS:
        table.add_column(name, justify=justify)
    for t, row in zip(tensors, tensor_rows(tensors), strict=True):
        table.add_row(plain(t.name), *row[1:5], row[5] if t.finite else f"[bold red]{row[5]}[/]")
    return table


def print_tensors(console, tensors, heading: str) -> None:
    """The tensor table of a run under its heading (``print_rows``: drawn without rich's layout where it can)."""
    print_rows(console, TENSOR_COLUMNS, tensor_rows(tensors), heading, lambda: tensor_table(tensors))


# -- seq, cell -----------------------------------------------------------------------------------

def grad_result(console, result) -> None:
    """The rich summary of one run: a header line of what was computed, a row per output tensor."""
    source = f"{result.input} [{result.member}]" if result.member else result.input
    dims = result.dims or {}
    shape = ", ".join(f"{k}={v}" for k, v in dims.items() if not (k == "T" and result.seq_len_max is None))
    layout = f"layout {result.layout}"
    if result.sources.get("layout") in SOURCE_WORDS:
        layout += f", {SOURCE_WORDS[result.sources['layout']]}"
    what = [f"{result.op} ({layout})", f"backend {result.backend} {result.backend_version or ''}".strip(),
            f"{result.dtype} (computed in {result.compute_dtype})", f"{result.seconds:.3f} s"]
    peephole = result.sources.get("use_peephole")
    how = [shape, f"use_peephole={str(result.use_peephole).lower()} ({SOURCE_WORDS.get(peephole, peephole)})"]
    if result.seq_len_max is not None:
        origin = result.sources.get("seq_len_max")
        how.append(f"seq_len_max={result.seq_len_max} ({SOURCE_WORDS.get(origin, origin)})")
    if result.framework:  # a Keras or PyTorch layer: the op is how it is computed, not what the user gave
        what[0] = f"{result.module or FRAMEWORK_WORDS[result.framework]}, computed as {result.computed_as}"
        how = [shape]
    print_tensors(console, result.tensors, f"{source} -> {result.output}")
    say(console, separator(console).join(what))
    say(console, separator(console).join(how))
    for note in result.notes:
        say(console, f"note: {words(note)}")
    for note in result.defaults:
        say(console, f"default used: {words(note)}", style="dim")
    if result.per_step is not None:
        per_step(console, result.per_step)


def per_step(console, report: dict) -> None:
    """Per-step norms as sparklines (log scale, step 0 on the left) and the growth/decay in words."""
    names = {"x_grad": "|x_grad[t]|", "h_prev_grad": "|dh carried|", "cs_prev_grad": "|dcs carried|",
             "last_step": "|last-step grad at t|"}
    width = max(10, min(80, console.width - 40))
    table = new_table(show_header=True)
    for col, justify in (("norm", "left"), ("chart", "left"), ("min", "right"), ("max", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for key, values in report["norms"].items():
        finite = [v for v in values if math.isfinite(v)]
        table.add_row(plain(names[key]), sparkline(values, width, SPARK if unicode_console(console) else ASCII_SPARK),
                      _fmt(min(finite) if finite else None),
                      _fmt(max(finite) if finite else None))
    print_table(console, table, f"gradients through time ({report['steps']} steps, log scale, step 0 on the left)")
    for line in report["summary"]:
        say(console, line)


def batch_summary(console, files: int, counts: dict, not_run: int) -> None:
    """The counts of a batch of several files (lost only when a Dask scheduler lost some)."""
    columns = {"files": files, "done": counts["ok"], "failed": counts["failed"], "skipped": counts["skipped"],
               "lost": counts["lost"], "not run": not_run}
    if not counts["lost"]:
        del columns["lost"]
    table = new_table()
    for col in columns:
        table.add_column(col, justify="right")
    table.add_row(*map(str, columns.values()))
    print_table(console, table, "batch")


# -- forward --------------------------------------------------------------------------------------

# The command that computes the gradient of a forward op's output file.
GRAD_COMMAND = {"BlockLSTMV2": "lstmgrad seq", "BlockLSTM": "lstmgrad seq --layout icfo",
                "LSTMBlockCell": "lstmgrad cell"}


def forward_next_command(result) -> str:
    return f"{GRAD_COMMAND[result.op]} {result.output}"


def forward_result(console, result) -> None:
    print_tensors(console, result.tensors, f"{result.input} -> {result.output}")
    parts = [f"{result.op} (layout {result.layout})", f"{result.dtype} (computed in {result.compute_dtype})",
             f"forget_bias={result.forget_bias:g}", f"cell_clip={result.cell_clip:g}",
             f"use_peephole={str(result.use_peephole).lower()} ({result.sources.get('use_peephole')})"]
    if result.seq_len_max is not None:
        parts.append(f"seq_len_max={result.seq_len_max} ({result.sources.get('seq_len_max')})")
    parts.append(f"grads={result.grads}")
    say(console, separator(console).join(parts))
    for note in result.defaults:
        say(console, f"default used: {words(note)}", style="dim")
    say(console, f"next: {forward_next_command(result)}")


# -- check ----------------------------------------------------------------------------------------

def dump_check_summary(console, index, members: list[str], reports: list) -> None:
    table = new_table()
    for name in ("execution", "TF ran", "on activations of", "right op", "result"):
        table.add_column(name, overflow="fold" if name == "execution" else "ellipsis")  # (--group takes it whole)
    executions = {e.member: e for e in index.executions}
    for member, report in zip(members, reports, strict=True):
        e = executions[member]
        if not isinstance(report, str):
            result = "[green]pass[/]" if report.passed else "[bold red]FAIL[/]"
        else:
            result = "[bold red]error[/]"
        table.add_row(plain(member), e.op_type, e.forward_op or "?", e.right_op or "?", result)
    passed = sum(not isinstance(r, str) and r.passed for r in reports)
    print_table(console, table, f"{index.path}: {len(members)} gradient-op execution{'s' * (len(members) != 1)}",
                f"{passed} passed, {len(members) - passed} failed")


def check_report(console, report) -> None:
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
    if report.framework:  # a Keras or PyTorch layer: the op is how it is computed, not what the user gave
        head = [f"{report.module or FRAMEWORK_WORDS[report.framework]}, computed as {report.computed_as}",
                head[1]]
    if report.reference is not None:
        table = new_table()
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
        _explanation(console, report)
    if report.forward is not None:
        _gradcheck(console, report)
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


def _explanation(console, report) -> None:
    from ..operations.check import CAUSES  # noqa: PLC0415 - (not imported by seq and cell, which render no check)

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
    if report.whole:
        console.print(f"[bold]No known cause was tried:[/] the known causes are variants of one op's computation, "
                      f"and this is {report.module}.", highlight=False)
        say(console, "  Check that the reference was computed from exactly these weights, inputs and output gradients "
                     "(and, for PyTorch, without dropout between layers).")
        return
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


def _gradcheck(console, report) -> None:
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

def dump_report(console, report) -> None:
    table = new_table()
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


def inspect_report(console, report) -> None:
    title = f"{report.path} ({report.format}{', group ' + report.group if report.group else ''})"
    table = new_table()
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
    if report.not_read:
        say(console, f"not read: {len(report.not_read)} more entries no command reads "
                     f"({describe_keys(report.not_read, limit=5)})", style="dim")
    for g in report.groups:
        say(console, f"group {g}/ (inspect it with --group {g})")
    if report.kind is not None:
        fits = {"seq": "sequence", "cell": "one cell step", "forward-seq": "forward input (sequence)",
                "forward-cell": "forward input (one cell step)", "gradients": "gradients",
                "keras": "a Keras LSTM layer's tensors", "torch": "a PyTorch nn.LSTM layer's tensors",
                "keras-weights": "a Keras weights file", "torch-weights": "a PyTorch state_dict"}[report.kind]
        parts = [f"fits: {report.op or fits}"]  # (with --weights, what seq computes of the two together)
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
        say(console, f"unused: {describe_keys(report.unused)}")
    for p in report.problems:
        style = "bold red" if p.severity == "error" else "yellow"
        say(console, f"{p.severity}: {words(p.message)}", style=style)
    for note in report.notes:
        say(console, f"note: {words(note)}", style="dim")
    n_err, n_warn = len(report.errors), len(report.problems) - len(report.errors)
    say(console, f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}")
