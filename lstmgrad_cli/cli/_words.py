"""How the command line spells the parameters library messages refer to (messages.py): its flags.

Every library message reaches the user through ``words`` (and so through ``_common.one_line``, ``say`` and
``print_json``): ``Param("compute_dtype", "float64")`` is ``--compute-dtype float64`` here,
``compute_dtype='float64'`` in Python.
"""

from __future__ import annotations

from ..messages import Command, Message, Param, message_of

# Where a flag is not the parameter's name with dashes, takes a value shown by its metavar when none is given, or
# belongs to another command.
_FLAGS = {"use_peephole": ("--peephole", "--no-peephole"), "weights": "--weights FILE",
          "weights_group": "--weights-group PATH", "group": "--group PATH", "kind": "--kind",
          "seq_len_max": "--seq-len-max", "output": "-o", "gradcheck": "`lstmgrad check --gradcheck`",
          "reference_path": "`lstmgrad check INPUT -r`"}


def flag(param: Param | Command) -> str:
    """``--name`` (``--name VALUE`` with a value; ``--peephole``/``--no-peephole`` for use_peephole); a command
    as ``lstmgrad NAME``."""
    if isinstance(param, Command):  # a command line shown whole; a command named alone is quoted
        return f"lstmgrad {param.name} {param.args}" if param.args else f"`lstmgrad {param.name}`"
    spelt = _FLAGS.get(param.name, "--" + param.name.replace("_", "-"))
    if isinstance(spelt, tuple):  # a boolean flag pair: the one that gives the value
        return spelt[0] if param.value or param.value is None else spelt[1]
    if param.value is None or isinstance(param.value, bool):
        return spelt
    return f"{spelt.split(' ')[0]} {param.value}"


def words(text) -> str:
    """Library text (a ``Message``, an exception, anything) as the command line says it."""
    text = message_of(text) if isinstance(text, BaseException) else text
    return text.render(flag) if isinstance(text, Message) else str(text)
