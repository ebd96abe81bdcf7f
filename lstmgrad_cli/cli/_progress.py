"""The progress bar of batches (``_common.progress_bar``), in a module of its own: rich's progress module is imported
only when a bar is shown."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text


class _RateColumn(ProgressColumn):
    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        return Text("" if task.speed is None else f"{task.speed:.2f} {self.unit}/s", style="progress.data.speed")


@contextlib.contextmanager
def drawn_progress(console: Console, total: int, unit: str):
    """A progress bar on ``console``, and the function that advances it by one.

    It is drawn again as each file finishes, not by a refreshing thread: everything it shows changes only
    then, and a process with no other thread can fork its workers (local_workers.start_method).
    """
    progress = Progress(TextColumn("lstmgrad"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                        _RateColumn(unit), TimeRemainingColumn(), console=console, transient=True,
                        auto_refresh=False)

    def advance() -> None:
        progress.advance(job)
        progress.refresh()

    with progress:
        job = progress.add_task(unit, total=total)
        progress.refresh()
        yield advance
