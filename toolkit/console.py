"""Progress and messages on stderr (stdout stays free for results people pipe)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

err = Console(stderr=True, highlight=False)


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
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True,
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
