"""How many of this process's cores other processes leave free: the thread count a served engine steps with.

Two OpenMP threads on a 2-core host where another process keeps one core busy wait for each other in
every parallel region: one of them shares its core with the other process, and the region ends only
when it has had its turn.  SmolLM2 FP8 served 2.7-27 tokens/s that way against 99-155 on one thread
(docs/engine-measurements.md, "Served engines beside other load").  :class:`FreeCores` reads ``/proc/stat`` for the
cores this process may run on and this process's own CPU time, and gives the number of cores the others
left over the last window (a window the engine idled through is dropped: the first steps after it keep the
threads they had).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

# A window long enough for /proc/stat's ticks (10 ms each) to be counted in the hundreds.
WINDOW_S = 1.0
# Hysteresis, in cores: give a thread up when fewer than (threads - DROP) cores were free, take one back
# when at least (threads + 1 - RISE) were.  Tritonserver, the python stubs and the front door use 0.1-0.3 of a
# core while the engine serves, which must not make a 2-core engine drop to one thread.
DROP = 0.6
RISE = 0.4
# A window this many times window_s long spanned a stretch without steps: it is dropped, not judged.  What
# other processes did while the engine idled (served: the front door's and the benchmark client's start, 0.6-1
# of a core for seconds) held the first second of every burst after it on one thread, at 1.4-1.9x the step
# time (docs/engine-measurements.md, "A floor under the step budget").
STALE_WINDOWS = 2


def _proc_stat(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) ticks of ``cpus`` since boot, or None without a readable /proc/stat."""
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError):
        return None
    return (busy, total) if total else None


def free_cores(cores: int, busy_ticks: int, total_ticks: int, own_cpu_s: float, hz: int) -> float:
    """Cores other processes left free in a window: ``cores`` less what they used (every busy tick of the
    cores minus this process's CPU time; steal counts as used)."""
    if total_ticks <= 0:
        return float(cores)
    window_s = total_ticks / hz / cores
    others = max(0.0, busy_ticks / hz - own_cpu_s)
    return max(0.0, cores - others / window_s)


class FreeCores:
    """The most threads to step with: between 1 and ``max_threads`` (default: the cores this process may use),
    following the cores the others leave free.  ``threads()`` is cheap between windows (one clock read); at the
    end of a window it reads /proc/stat.
    """

    def __init__(self, max_threads: int | None = None, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.cpus = os.sched_getaffinity(0)
        # the engine's own count (a container's CPU quota may allow fewer than the mask's cores), so that the
        # hysteresis starts from the threads the engine really has
        self.max_threads = max(1, min(len(self.cpus), max_threads or len(self.cpus)))
        self.hz = os.sysconf("SC_CLK_TCK")
        self.current = self.max_threads
        self.free: float | None = None  # the last window's free cores
        self._start = self._sample()

    def _sample(self):
        stat = _proc_stat(self.cpus)
        return None if stat is None else (time.monotonic(), stat, time.process_time())

    def threads(self) -> int:
        if self._start is None or time.monotonic() - self._start[0] < self.window_s:
            return self.current
        end = self._sample()
        if end is None:
            return self.current
        (t0, (busy0, total0), own0), (t1, (busy1, total1), own1) = self._start, end
        self._start = end
        if t1 - t0 > STALE_WINDOWS * self.window_s:  # no steps for a while: judge the next window instead
            return self.current
        self.free = free_cores(len(self.cpus), busy1 - busy0, total1 - total0, own1 - own0, self.hz)
        if self.free < self.current - DROP and self.current > 1:
            self.current = max(1, min(self.current - 1, int(self.free + DROP)))
        elif self.free >= self.current + 1 - RISE and self.current < self.max_threads:
            self.current = min(self.max_threads, int(self.free + RISE))
        return self.current


@contextlib.contextmanager
def spinning_processes(count: int):
    """``count`` processes that each keep a core busy until the block ends: other load on the host, for the
    benchmarks and tests that measure how a served engine copes with it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
