"""The documentation's examples run as written, and show what they print.

* Every ```python block of README.md and docs/*.md runs, from the repository root, in a fresh interpreter
  (```py blocks are examples that need something not installed here: TensorFlow, PyTorch, a user's model).
* Every ``$ lstmgrad ...`` line of a ```console block runs, in the page's order, from the root of a fresh
  copy of the repository's fixtures, and exits 0 (or the status its trailing ``# exits N`` comment gives).
  The lines shown under it must match what it prints, with ``...`` for any number of lines and timings,
  backend versions, column widths and the last digits of numbers allowed to differ.
* docs/commands.md is what docs/make_commands.py makes from the commands' own --help.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lstmgrad_cli.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CONSOLE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)
EXITS = re.compile(r"\s+#\s*exits (\d+)\s*$")


def python_blocks():
    for page in PAGES:
        for k, match in enumerate(PYTHON.finditer(page.read_text())):
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}-{k}")


@pytest.mark.parametrize("code", list(python_blocks()))
def test_python_example_runs(code):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def console_examples(page: Path) -> list[tuple[str, list[str], int]]:
    """(command, the lines shown after it, expected exit status) of every ``$ `` line, in order."""
    examples = []
    for block in CONSOLE.finditer(page.read_text()):
        for line in block.group(1).splitlines():
            if line.startswith("$ "):
                assert line.startswith("$ lstmgrad "), f"{page.name}: a `$ ` line that is not lstmgrad: {line}"
                status = EXITS.search(line)
                command = EXITS.sub("", line)[2:]
                examples.append((command, [], int(status.group(1)) if status else 0))
            elif examples:
                examples[-1][1].append(line)
    return examples


def normalise(line: str) -> str:
    """What may differ between runs and machines: timings, backend versions, widths, the last digits."""
    line = re.sub(r"\b\d+\.\d+ s\b", "<t> s", line)
    line = re.sub(r"backend (\w+) [^·]*·", r"backend \1 ·", line)
    line = re.sub(r"-?\d+\.\d+(?:e[-+]?\d+)?", lambda m: f"{float(m.group()):.3g}", line)
    line = re.sub(r"([━─═])\1+", r"\1", line)
    return re.sub(r" +", " ", line).strip()


def assert_shows(expected: list[str], actual: list[str], command: str) -> None:
    """Each shown line in order; ``...`` skips any number of lines."""
    got = [normalise(line) for line in actual]
    at, skipping = 0, False
    for line in expected:
        if line.strip() == "...":
            skipping = True
            continue
        want = normalise(line)
        if skipping:
            while at < len(got) and got[at] != want:
                at += 1
        assert at < len(got) and got[at] == want, (
            f"`{command}` no longer shows:\n  {line}\nit printed:\n" + "\n".join(actual))
        at, skipping = at + 1, False


PAGES_WITH_EXAMPLES = [p for p in PAGES if console_examples(p)]


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_console_examples_run_and_show_what_they_print(page, tmp_path, monkeypatch):
    shutil.copytree(ROOT / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    for command, shown, status in console_examples(page):
        result = CliRunner().invoke(main, shlex.split(command)[1:], prog_name="lstmgrad")
        assert result.exit_code == status, f"`{command}` exited {result.exit_code}:\n{result.output}"
        assert_shows(shown, result.output.splitlines(), command)


def test_there_are_examples_to_run():
    assert list(python_blocks()) and ROOT / "README.md" in PAGES_WITH_EXAMPLES


def test_the_command_reference_is_the_commands_help():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from make_commands import page
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert (ROOT / "docs" / "commands.md").read_text() == page(), "docs/commands.md is stale: run `make docs`"
