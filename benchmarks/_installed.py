"""Benchmarks start lstmgrad as an installed copy starts: from compiled bytecode.

``pip install`` compiles a package's modules when it installs them.  An editable install compiles them on first
use, unless PYTHONDONTWRITEBYTECODE is set (as in some containers and CI images): then every process compiles
lstmgrad's ~40 modules again, ~0.05 s that users do not pay, and a benchmark of many short commands (or of a
command against an in-process floor that imports the same package) would count it.
"""

from __future__ import annotations

import compileall
from pathlib import Path

import lstmgrad_cli


def compile_lstmgrad(*checkouts: Path) -> None:
    """Write the bytecode of this lstmgrad (and of other ``checkouts``' ``lstmgrad_cli``) as an install would."""
    packages = [Path(lstmgrad_cli.__file__).parent, *(Path(c) / "lstmgrad_cli" for c in checkouts)]
    for package in packages:
        compileall.compile_dir(package, quiet=1)
