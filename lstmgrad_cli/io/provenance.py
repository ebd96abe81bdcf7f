"""Whether an existing output is the one a run would write: same input (unchanged since), same request.

A finished output is a success whoever finished it: a rerun, a Dask task retried after its worker
died, or a second batch running over the same files at the same time.  Each output records, next
to its source path, what the run was asked (``request``) and the input's identity (size and
modification time, of every file for a directory input); a run whose output already exists and
matches all three keeps it instead of failing.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .. import io
from ..errors import LstmGradError


def file_identity(path: str | os.PathLike) -> str:
    """Size and modification time of a file, or a digest of those of a directory's files (npy directories,
    TensorFlow debug dumps): changes when the input is rewritten, not when it is read."""
    try:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            return f"{st.st_size}:{st.st_mtime_ns}"
        import hashlib  # noqa: PLC0415 - only for directory inputs (with OpenSSL, ~5 ms of every command's start)

        digest = hashlib.sha256()
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                digest.update(f"{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        return "dir:" + digest.hexdigest()[:32]
    except OSError:
        return ""


def is_complete_output(output: str | os.PathLike, source: str | os.PathLike | None = None) -> bool:
    """Whether ``output`` is a complete lstmgrad output (of ``source``, when given)."""
    return output_difference(output, source) is None


def output_difference(output: str | os.PathLike, source: str | os.PathLike | None,
                      request: dict | None = None) -> str | None:
    """None when ``output`` is a complete lstmgrad output of ``source`` (any input when None; made with ``request``,
    when given and recorded); otherwise why not, in words that follow the output's name.

    Outputs are renamed into place only when complete, so one that reads back with lstmgrad's provenance is
    whole.  Older outputs record no request: only their source is compared.
    """
    try:
        meta = io.read_metadata(output)
    except (LstmGradError, OSError, ValueError, KeyError):
        return "is not a complete lstmgrad output"
    if meta.get("tool") != "lstmgrad":
        return "is not an lstmgrad output"
    if source is None:
        return None
    recorded_source = meta.get("source")
    if recorded_source != str(Path(source).resolve()):
        return f"was made from another input ({recorded_source})"
    recorded = meta.get("request")
    if request is None or not isinstance(recorded, dict):
        return None
    if recorded.get("input_identity") != request.get("input_identity"):
        return f"was made from an earlier version of {source} (it has changed since)"
    changed = sorted(key for key in set(recorded) | set(request)
                     if key != "input_identity" and recorded.get(key) != request.get(key))
    if changed:
        return "was made with other options (" + ", ".join(
            f"{key}: was {_shown(recorded.get(key))}, now {_shown(request.get(key))}" for key in changed) + ")"
    return None


def records_request(output: str | os.PathLike) -> bool:
    """Whether an output records the request that made it (older outputs do not)."""
    try:
        return isinstance(io.read_metadata(output).get("request"), dict)
    except (LstmGradError, OSError, ValueError, KeyError):
        return False


def _shown(value) -> str:
    return "unset" if value is None else json.dumps(value, sort_keys=True)
