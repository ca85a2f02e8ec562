"""Names of the engine's threads as the OS sees them, and CPU time per thread name.

A served engine runs inside Triton's python-backend stub, where ``top -H``, py-spy and ``/proc`` show every thread
as ``triton_python_b``: the thread stepping the engine, the OpenMP workers it starts, and the threads sending the
responses.  :func:`name_this_thread` gives the calling thread a name of its own (Linux ``prctl(PR_SET_NAME)``,
15 bytes); threads it creates afterwards (libgomp's workers, created at the first parallel region of the thread
that enters it) inherit that name.  :func:`cpu_by_thread_name` sums a process's CPU time per thread name from
``/proc``, which is how ``scripts/bench_serving.py`` tells the engine's time from the serving threads'.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from pathlib import Path

ENGINE_THREAD = "rtk-engine"  # BackgroundEngine's thread and the OpenMP workers it starts
SENDER_THREAD = "rtk-sender"  # the cpu tensorrt_llm model's response senders

_PR_SET_NAME = 15
_libc = None


def name_this_thread(name: str) -> bool:
    """Set the calling thread's OS name (at most 15 bytes are kept); False where the OS has no such call."""
    global _libc
    if not Path("/proc/self/task").is_dir():
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)  # the process's C library
        return _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat_cpu(stat: str) -> tuple[str, float]:
    """The name and user + system CPU seconds in a ``/proc/.../stat`` line (the name may hold spaces and
    parentheses: it runs to the last ``)``)."""
    name, rest = stat[stat.index("(") + 1 :].rsplit(")", 1)
    fields = rest.split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, its threads included (those that ended too)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())[1]


def cpu_by_thread_name(pid: int) -> Counter[str]:
    """Process ``pid``'s user + system CPU seconds per thread name, its live threads only (a thread that
    ended took its time with it); empty when the process is gone."""
    out: Counter[str] = Counter()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            name, seconds = _stat_cpu((task / "stat").read_text())
        except OSError:  # the thread ended between the listing and the read
            continue
        out[name] += seconds
    return out
