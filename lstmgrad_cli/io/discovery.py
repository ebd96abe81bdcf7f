"""Which inputs the paths a user gives stand for: a file, a directory that is one input (of .npy files, a
TensorFlow debug dump), a quoted glob pattern, or a folder of inputs (its files of the formats ``FORMATS`` lists
with ``in_folders``, and its subfolders that are inputs; with ``recursive``, those below its other subfolders).
Earlier outputs (``OUTPUT_MARK`` in their names) are never inputs.  ``lstmgrad seq DIR`` and a Python batch
find the same files through ``expand_inputs``."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidOptionError
from . import FORMATS, input_directory_format, npydir
from .output import OUTPUT_MARK


@dataclass
class Inputs:
    """What the input paths give: the paths, each one's folder relative to the folder it was found in
    (``subdirs``, mirrored under an output folder), and the folders that gave nothing but subfolders."""

    paths: list[Path] = field(default_factory=list)
    subdirs: dict[Path, Path] = field(default_factory=dict)
    only_subfolders: list[Path] = field(default_factory=list)


def folder_suffixes() -> tuple[str, ...]:
    """The file names a folder gives as inputs: those of the formats read from folders."""
    return tuple(suffix for fmt in FORMATS.values() if fmt.in_folders for suffix in fmt.suffixes)


def expand_inputs(patterns, group: str | None = None, recursive: bool = False, exclude=()) -> Inputs:
    """Paths as given; quoted glob patterns expanded (InvalidOptionError when one matches nothing).  A directory that
    is itself one input (a directory of .npy files, a TensorFlow debug dump, or one whose ``group`` subdirectory
    is: npydir.sniff_group) stays one; any other directory gives its input files (``folder_suffixes``) and its
    subdirectories that are inputs, and with ``recursive`` those of its other subdirectories, depth first in name
    order.  Earlier outputs and the paths of ``exclude`` (a weights file, the output folder) are never inputs."""
    found = Inputs()
    excluded = {_resolved(p) for p in exclude if p is not None}
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir() and input_directory_format(path) is None and not npydir.sniff_group(path, group):
            before = len(found.paths)
            subfolders = _folder_inputs(path, Path(), recursive, excluded, found, folder_suffixes())
            if len(found.paths) == before and subfolders:
                found.only_subfolders.append(path)
        elif not path.exists() and glob.has_magic(str(pattern)):
            matches = sorted(glob.glob(str(pattern), recursive=True))
            if not matches:
                raise InvalidOptionError(f"no files match {str(pattern)!r}")
            found.paths.extend(Path(m) for m in matches if OUTPUT_MARK not in Path(m).name)
        else:
            found.paths.append(path)
    return found


def _folder_inputs(top: Path, relative: Path, recursive: bool, excluded: set, found: Inputs, suffixes) -> int:
    """Add the inputs of the folder ``top / relative`` to ``found`` (see expand_inputs); how many subfolders it
    holds that are not inputs themselves (looked in with ``recursive``; symbolic links to folders are not)."""
    folder = top / relative
    try:
        with os.scandir(folder) as listing:
            entries = sorted(listing, key=lambda e: e.name)
    except OSError:  # the run says what is wrong with it
        found.paths.append(folder)
        return 0
    subfolders = []
    for entry in entries:
        path = folder / entry.name
        if OUTPUT_MARK in entry.name or (excluded and _resolved(path) in excluded):
            continue
        try:
            is_file, is_dir = entry.is_file(), entry.is_dir()
        except OSError:
            continue
        if is_file and entry.name.lower().endswith(suffixes):
            found.paths.append(path)
            found.subdirs[path] = relative
        elif is_dir and input_directory_format(path) is not None:
            found.paths.append(path)
            found.subdirs[path] = relative
        elif is_dir and not entry.is_symlink():
            subfolders.append(entry.name)
    if recursive:
        for name in subfolders:
            _folder_inputs(top, relative / name, recursive, excluded, found, suffixes)
    return len(subfolders)


def _resolved(path) -> Path | None:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return None
