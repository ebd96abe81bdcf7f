"""Pieces every command shares: consoles made per invocation, one mapping of errors to exit codes."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import sys
from typing import TYPE_CHECKING

import click

from ..errors import InvalidOptionError, LstmGradError, OutputFileError
from ..messages import escape_names, spelled
from ._words import flag, words

if TYPE_CHECKING:  # rich is imported when something is shown (~25 ms a quiet or --json command does not pay)
    from rich.console import Console
    from rich.text import Text

# Width of tables written to a pipe or file (a terminal gives its own): wide enough that no tensor name
# or number is cut, as rich would at its default of 80 columns.
PIPE_WIDTH = 200


@functools.cache
def _stdout_console_class() -> type[Console]:
    from rich.console import Console  # noqa: PLC0415

    class StdoutConsole(Console):
        """A rich console whose closed stdout (``| head``) is a BrokenPipeError for lstmgrad to handle (rich's own
        handling exits the process at once, mid-batch, without a word)."""

        def on_broken_pipe(self) -> None:
            silence_closed_stdout()
            self.quiet = True  # nothing more can be shown
            raise BrokenPipeError(errno.EPIPE, "stdout was closed")

    return StdoutConsole


def stdout_console() -> Console:
    # Made per invocation (not at import) so NO_COLOR and redirection are honoured each run.
    console_class = _stdout_console_class()
    console = console_class(soft_wrap=False, file=StdoutFile())
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = console_class(soft_wrap=False, width=PIPE_WIDTH, file=StdoutFile())
    return console


class StdoutError(OSError):
    """Writing to stdout failed other than by its reader closing it (a full disk, an I/O error): one line,
    ``cannot write to stdout: no space left on device``."""

    def __str__(self) -> str:
        reason = os.strerror(self.errno) if self.errno else (self.strerror or "an I/O error")
        return f"cannot write to stdout: {reason[:1].lower()}{reason[1:]}"


class StdoutFile:
    """The invocation's stdout as commands write to it: a write or flush that fails raises ``StdoutError`` (the
    file system's reason, told apart from a failing input or output file), a closed pipe ``BrokenPipeError``."""

    def __init__(self, stream=None) -> None:
        self._stream = stream if stream is not None else sys.stdout

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise StdoutError(err.errno, err.strerror) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise StdoutError(err.errno, err.strerror) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def stderr_console() -> Console:
    from rich.console import Console  # noqa: PLC0415

    return Console(stderr=True)


class _Documents:
    """Whether this invocation has printed its JSON document (``print_json``): a command that then fails prints no
    second one (the command line's ``json_error_document``)."""

    printed = False


documents = _Documents()


def print_json(document) -> None:
    """The invocation's one JSON document, on stdout."""
    from ..analysis.summary import json_safe  # noqa: PLC0415 - (numpy: not before the command needs it)

    documents.printed = True
    click.echo(json.dumps(spelled(json_safe(document), flag), indent=2, allow_nan=False, default=_jsonable),
               file=StdoutFile())


def error_document(command: str | None, error: str, exit_code: int) -> dict:
    """The JSON document of a command that ended without a result of its own: one line of ``error``, and the
    exit status it ends with."""
    from .. import __version__  # noqa: PLC0415

    return {"lstmgrad": __version__, "command": command, "error": error, "exit_code": exit_code}


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def printable(text: object) -> str:
    """Text from files and file names with control characters escaped (no raw escapes to the terminal); library
    messages with the command line's flags."""
    text = words(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def plain(text: object) -> Text:
    """Untrusted text (file names, key names) for rich tables: never parsed as markup."""
    from rich.text import Text  # noqa: PLC0415

    return Text(printable(text))


def unicode_console(console: Console) -> bool:
    """Whether the console's encoding shows any character (UTF-8); else decoration falls back to ASCII."""
    return console.encoding.lower().replace("-", "").replace("_", "").startswith("utf")


def separator(console: Console) -> str:
    """What stands between the parts of a summary line: a middle dot, or a bar where the encoding lacks it."""
    return " \u00b7 " if unicode_console(console) else " | "


def tolerate_unencodable_output() -> None:
    """Characters the terminal's encoding cannot show (a name in an ASCII or latin-1 terminal) are printed
    escaped, never an error: printing after an output was written must not turn the run into a failure."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            with contextlib.suppress(Exception):  # a stream that cannot change: leave it
                stream.reconfigure(errors="backslashreplace")


def say(console: Console, text: object, style: str | None = None) -> None:
    """Print one line of plain text: no markup parsing, no highlighting, no :emoji: codes, not wrapped (logs stay
    greppable)."""
    console.print(printable(text), markup=False, highlight=False, emoji=False, soft_wrap=True, style=style)


def new_table(**options):
    """A rich table (rich's table module imported on first use: a quiet batch prints none)."""
    from rich.table import Table  # noqa: PLC0415

    return Table(**options)


def table_text(console: Console, columns, rows) -> str | None:
    """The lines rich draws for ``new_table()`` with ``columns`` ((header, justify) pairs) and ``rows`` (cells of
    plain text, ``printable``), drawn here where that is all rich would draw: no colours, a UTF-8 console, at least
    one row, no cell with spaces at its edges, and none that must wrap (the table fits the console's width).
    ~0.05 ms where rich takes ~3 ms: a batch prints a table for every file, and that was 4.5 of a small file's
    9.6 ms.  None otherwise (rich draws the table then).  A test holds it to rich's own output."""
    if console.color_system is not None or not unicode_console(console) or not rows:
        return None
    from rich.box import HEAVY_HEAD as box  # noqa: PLC0415 - new_table's box
    from rich.cells import cell_len  # noqa: PLC0415

    headers = [header for header, _ in columns]
    if any(cell != cell.strip() for cell in (*headers, *(cell for row in rows for cell in row))):
        return None  # (rich strips a cell's edge spaces in some places; no name or number here has them)
    widths = [max(map(cell_len, cells)) for cells in zip(headers, *rows, strict=True)]
    if sum(widths) + 3 * len(widths) + 1 > console.width:
        return None

    def line(cells, left, vertical, right) -> str:
        parts = []
        for cell, width, (_, justify) in zip(cells, widths, columns, strict=True):
            space = width - cell_len(cell)
            before = space if justify == "right" else space // 2 if justify == "center" else 0
            parts.append(" " * (before + 1) + cell + " " * (space - before + 1))
        return left + vertical.join(parts) + right

    padded = [width + 2 for width in widths]
    return "\n".join([box.get_top(padded), line(headers, box.head_left, box.head_vertical, box.head_right),
                      box.get_row(padded, "head"),
                      *(line(row, box.mid_left, box.mid_vertical, box.mid_right) for row in rows),
                      box.get_bottom(padded)])


def print_rows(console: Console, columns, rows, heading: object, rich_table) -> None:
    """``print_table`` of a table of plain cells: ``table_text`` where it can, else ``rich_table()``, the same
    table for rich to draw."""
    text = table_text(console, columns, rows)
    if text is None:
        print_table(console, rich_table(), heading)
        return
    say(console, heading)
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def print_table(console: Console, table, heading: object = None, footer: object = None) -> None:
    """A table with its heading above and its footer below as plain lines (rich pads a table's own title
    and caption to the table's width, leaving trailing spaces, and wraps a long file name)."""
    if heading is not None:
        say(console, heading)
    console.print(table)
    if footer is not None:
        say(console, footer)


def one_line(message, names=()) -> str:
    """A message on one line: its runs of whitespace as one space, but for the ``names`` in it (file names),
    whose newlines, tabs and other control characters are escaped as the tables show them."""
    return printable(" ".join(escape_names(words(message), [str(n) for n in names if n is not None]).split())) \
        or "unknown error"


def paths_in(values) -> list[str]:
    """The file names among a command's arguments (its Path values, and those of its tuples: INPUT...)."""
    from pathlib import PurePath  # noqa: PLC0415

    found = []
    for value in values:
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, PurePath) or (isinstance(value, tuple) and isinstance(item, str)):
                found.append(str(item))
    return found


def check_output_extension(path, ctx=None, param=None) -> None:
    """An -o PATH whose extension no writer has is a usage error (exit 2), found before anything runs.  A directory,
    or a path the file system will not look at (a name too long), is left to the run, which says what is wrong."""
    from ..io import output_format  # noqa: PLC0415 - only for a command that writes one named output

    try:
        if path is None or path.is_dir():
            return
    except OSError:
        return
    try:
        output_format(path)
    except OutputFileError as err:
        raise click.BadParameter(one_line(err), ctx=ctx, param=param,
                                 param_hint=None if param is not None else "'-o' / '--output'") from None


def silence_closed_stdout() -> None:
    """After a BrokenPipeError (the reader of a pipe, ``| head``, has exited): send what is still to be printed to
    os.devnull, so flushing it later, at exit too, raises nothing more."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def handle_errors(func):
    """Library errors -> ``Error: ...`` on stderr and exit 1; a malformed option (an unknown backend) is a usage
    error (2)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        names = paths_in(kwargs.values())
        try:
            return func(*args, **kwargs)
        except InvalidOptionError as err:
            raise click.UsageError(one_line(err, names)) from None
        except LstmGradError as err:
            raise click.ClickException(one_line(err, names)) from None
        except MemoryError:
            raise click.ClickException("out of memory") from None
        except BrokenPipeError:  # stdout's reader exited: nothing more can reach it; say so where it can be seen
            silence_closed_stdout()
            raise click.ClickException("stdout was closed before everything was printed") from None
        except StdoutError as err:  # (a full disk): what is still to be printed goes nowhere
            silence_closed_stdout()
            raise click.ClickException(str(err)) from None
        except ImportError as err:  # a library that cannot load now ("failed to map segment": a memory limit)
            raise click.ClickException(one_line(f"cannot load {err.name or 'a library'}: {err}")) from None
        except OSError as err:  # an unexpected I/O failure is still one line, not a traceback
            where = f"{err.filename}: " if err.filename else ""
            raise click.ClickException(one_line(f"{where}{err.strerror or err}", names)) from None

    return wrapper


def is_terminal(stream=None) -> bool:
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, unit: str = "files"):
    """A rich progress bar on stderr (files done, rate, time left); a no-op when disabled (rich's progress module,
    ~11 ms to import with its table module, is imported only for a bar that is shown: _progress.py)."""
    if not enabled:
        yield lambda: None
        return
    from ._progress import drawn_progress  # noqa: PLC0415

    with drawn_progress(stderr_console(), total, unit) as advance:
        yield advance
