"""``lstmgrad inspect``: what a file or a dump holds, which op it fits and everything wrong with it.  A thin click
layer over operations/inspect.py and inspect_dump.py."""

from __future__ import annotations

from pathlib import Path

import click

from .. import __version__
from ..errors import ExitCode
from ..frameworks import FrameworkOptions
from ..io import npydir
from ..operations.inspect import inspect_file
from ..operations.inspect_dump import inspect_dump
from . import _options as opt
from . import render
from ._common import handle_errors, print_json, stdout_console


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
        raise SystemExit(ExitCode.ERROR)
