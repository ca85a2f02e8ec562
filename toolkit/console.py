"""Progress and messages on stderr (stdout stays free for results people pipe)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

err = Console(stderr=True, highlight=False)
_verbosity = 0


def set_verbosity(level: int) -> None:
    """``rtk -v``: 0 keeps third-party output in the stage logs, 1 or more shows it on the console."""
    global _verbosity
    _verbosity = level


def _from_rtk(record: logging.LogRecord) -> bool:
    return record.name == "toolkit" or record.name.startswith("toolkit.")


@contextlib.contextmanager
def third_party_output(log_path: Path) -> Iterator[None]:
    """Send what libraries print, warn or log (ModelOpt's quantizer counts, warnings, tqdm bars) to ``log_path``.

    rtk's own progress (:data:`err`) and log records stay on the console.  With ``rtk -v`` nothing
    is redirected.  Output that native code writes straight to file descriptor 1 is not caught.
    """
    if _verbosity > 0:
        yield
        return
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    with open(log_path, "a", encoding="utf-8") as f, warnings.catch_warnings():
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        warnings.showwarning = lambda msg, cat, fn, ln, file=None, line=None: f.write(
            warnings.formatwarning(msg, cat, fn, ln, line)
        )
        to_log = logging.StreamHandler(f)
        to_log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        console_handlers = list(root.handlers)
        for h in console_handlers:
            h.addFilter(_from_rtk)
        root.addHandler(to_log)
        err.file = sys.stderr  # rtk's own progress keeps the real stderr while libraries' goes to the log
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield
        finally:
            err.file = None  # back to following sys.stderr
            root.removeHandler(to_log)
            for h in console_handlers:
                h.removeFilter(_from_rtk)


@contextlib.contextmanager
def step(title: str) -> Iterator[None]:
    """A spinner for a step whose length is unknown; prints the time taken when it ends."""
    t = time.perf_counter()
    with err.status(f"{title} …", spinner="dots"):
        yield
    err.print(f"[green]✓[/] {title} [dim]({time.perf_counter() - t:.1f} s)[/]")


def progress() -> Progress:
    """A bar for steps with a known count (calibration batches, evaluation texts)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


def info(msg: str) -> None:
    err.print(msg)


def quiet_libraries() -> None:
    """Silence transformers' / huggingface_hub's own progress bars and warnings; rtk shows progress."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
