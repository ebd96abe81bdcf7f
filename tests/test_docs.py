"""The documentation's examples run as written: every ```python block of README.md and docs/*.md, from the
repository root, in a fresh interpreter (what a reader pasting it would do)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks():
    for page in PAGES:
        for k, match in enumerate(BLOCK.finditer(page.read_text())):
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}-{k}")


@pytest.mark.parametrize("code", list(python_blocks()))
def test_python_example_runs(code):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_there_are_examples_to_run():
    assert len(list(python_blocks())) >= 1
