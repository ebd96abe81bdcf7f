"""Messages that name what the caller can change, spelt by whoever shows them.

The library says what it found; when a message tells the user what to give or change ("give a file holding
them with ..."), it refers to a parameter, and how a parameter is spelt depends on who called: the command
line has flags (``--weights FILE``), the Python API keyword arguments (``weights=``).  A ``Message`` is a
``str`` that reads as the Python API says it (``str(err)``, ``"; ".join(problem.warnings)``) and remembers
which of its parts are parameters (``Param``), so that the command line shows the same message with its
flags (cli/_words.py).  It survives pickling (batch workers, Dask) and ``dataclasses.asdict``.

No imports from the rest of the package: errors.py and every module below the command line use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """A parameter a message refers to: by name alone ("the seq_len_max argument", ``--seq-len-max``), or with
    the value to give (``compute_dtype='float64'``, ``--compute-dtype float64``)."""

    name: str
    value: object = None


@dataclass(frozen=True)
class Command:
    """A command a message points to (``seq``, ``cell``, ``forward seq``, ``check``), with what follows it on a
    command line (``args``, "DATA"): ``lstmgrad seq DATA`` there, the way to do the same in Python in the Python
    API's messages (``PYTHON_COMMANDS``)."""

    name: str
    args: str = ""


# What each command is in the Python API, as messages name it.
PYTHON_COMMANDS = {
    "seq": "the sequence gradient (kind='seq')", "cell": "one cell step's gradient (kind='cell')",
    "forward": "the forward ops (block_lstm_v2, block_lstm, lstm_block_cell)",
    "forward seq": "block_lstm_v2 (or block_lstm)", "forward cell": "lstm_block_cell",
    "check": "operations.check.run_check",
}


def python_spelling(part: Param | Command) -> str:
    """How the Python API names a parameter (or a command) in its messages."""
    if isinstance(part, Command):
        return PYTHON_COMMANDS.get(part.name, part.name)
    if part.value is None:
        return f"the {part.name} argument"
    return f"{part.name}={part.value!r}"


Spelling = Callable[["Param | Command"], str]


class Message(str):
    """Text whose ``Param`` parts are spelt when it is shown; as a ``str``, the Python API's spelling.

    ``Message("give a file holding it with ", Param("weights"))``; nested Messages keep their parameters.
    Operations of ``str`` (``+``, f-strings, ``split``) give plain text: build with ``Message``, ``format`` and
    ``join`` to keep the parameters."""

    parts: tuple

    def __new__(cls, *parts):
        flat: list = []
        for part in parts:
            pieces = part.parts if isinstance(part, Message) else (
                part if isinstance(part, Param | Command) else str(part),)
            for piece in pieces:
                if isinstance(piece, str) and flat and isinstance(flat[-1], str):
                    flat[-1] += piece
                elif not (isinstance(piece, str) and not piece):
                    flat.append(piece)
        self = super().__new__(cls, _render(flat, python_spelling))
        self.parts = tuple(flat)
        return self

    @classmethod
    def format(cls, template: str, *args) -> Message:
        """``template`` with each ``{}`` replaced by the next argument (text, a ``Param`` or a ``Message``).
        The template is the code's own words: braces in the arguments (file names) are never read."""
        pieces = template.split("{}")
        if len(pieces) != len(args) + 1:
            raise ValueError(f"{len(pieces) - 1} places for {len(args)} arguments in {template!r}")
        parts: list = [pieces[0]]
        for arg, piece in zip(args, pieces[1:], strict=True):
            parts += [arg, piece]
        return cls(*parts)

    @classmethod
    def join(cls, separator: str, items: Iterable) -> Message:
        parts: list = []
        for k, item in enumerate(items):
            parts += [separator, item] if k else [item]
        return cls(*parts)

    def render(self, spell: Spelling = python_spelling) -> str:
        return _render(self.parts, spell)

    def one_line(self, names: Iterable[str] = ()) -> Message:
        """Runs of whitespace (newlines included) as one space, none at the ends, as ``" ".join(text.split())``;
        but the ``names`` in it (file names) keep theirs, escaped (``escape_names``)."""
        names = list(names)
        parts = [re.sub(r"\s+", " ", escape_names(p, names)) if isinstance(p, str) else p for p in self.parts]
        if parts and isinstance(parts[0], str):
            parts[0] = parts[0].lstrip()
        if parts and isinstance(parts[-1], str):
            parts[-1] = parts[-1].rstrip()
        return Message(*parts)

    def __reduce__(self):
        return Message, self.parts

    def __repr__(self) -> str:
        return f"Message({str.__repr__(self)})"


def _render(parts, spell: Spelling) -> str:
    return "".join(p if isinstance(p, str) else spell(p) for p in parts)


def message_of(error: BaseException) -> Message | str:
    """What an exception says: its ``Message`` (parameters still to spell), else its text."""
    if len(error.args) == 1 and isinstance(error.args[0], Message):
        return error.args[0]
    return str(error)


def one_line(text, names: Iterable[object] = ()) -> Message | str:
    """An exception's or a text's words on one line, a ``Message``'s parameters kept.  The ``names`` in it (file
    names, which may hold a newline or a tab) have their control characters escaped instead (``escape_names``)."""
    text = message_of(text) if isinstance(text, BaseException) else text
    names = [str(n) for n in names if n is not None]
    if isinstance(text, Message):
        return text.one_line(names)
    return " ".join(escape_names(str(text), names).split())


TYPED = 1000  # characters of a name a message asks the user to type (a --weights-group): longer ones are cut too


def cut(text: str, width: int = 60) -> str:
    """``text`` (a name from a file, for a message) on one line and at most about ``width`` characters: control
    characters escaped, and a longer one cut, saying so: ``mmmm...(100013 characters)``.  A name the user is asked
    to type is cut at ``TYPED`` (no real name is that long; a crafted one would not fit a command line)."""
    text = text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= width else f"{text[:width]}...({len(text)} characters)"


def escape_names(text: str, names: Iterable[str]) -> str:
    """``text`` with each of ``names`` in it written with its control characters escaped as Python writes them
    (``a\\nb.npz``), the longest first: as the command line's tables show file names."""
    for name in sorted({n for n in names if n and not n.isprintable()}, key=len, reverse=True):
        if name in text:
            text = text.replace(name, "".join(c if c.isprintable() else repr(c)[1:-1] for c in name))
    return text


def prefixed(prefix: str, error: BaseException | str) -> Message:
    """``"{prefix}: {what the error says}"``, its parameters kept."""
    return Message.format("{}: {}", prefix, message_of(error) if isinstance(error, BaseException) else error)


def spelled(value, spell: Spelling):
    """``value`` (a JSON-ready document) with every ``Message`` in it spelt by ``spell``."""
    if isinstance(value, Message):
        return value.render(spell)
    if isinstance(value, dict):
        return {k: spelled(v, spell) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [spelled(v, spell) for v in value]
    return value
