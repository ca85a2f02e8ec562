"""A served engine's threads follow the cores other processes leave free (toolkit/runtime/free_cores.py).

The contention is real: processes that spin on the CPU, as many as leave this process one core.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from toolkit.runtime.engine import Engine
from toolkit.runtime.free_cores import FreeCores, free_cores, spinning_processes

CORES = len(os.sched_getaffinity(0))
needs_cores = pytest.mark.skipif(not 2 <= CORES <= 8, reason=f"needs 2 to 8 cores to take all but one ({CORES})")


def wait_for(cond, timeout_s: float = 15.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_free_cores_are_the_cores_less_what_other_processes_used():
    # 2 cores for 1 s at 100 ticks a second: 200 ticks, 150 busy, 0.5 s of them this process's
    assert free_cores(2, busy_ticks=150, total_ticks=200, own_cpu_s=0.5, hz=100) == pytest.approx(1.0)
    assert free_cores(2, busy_ticks=60, total_ticks=200, own_cpu_s=0.6, hz=100) == pytest.approx(2.0)  # only us
    assert free_cores(4, busy_ticks=400, total_ticks=400, own_cpu_s=0.0, hz=100) == 0.0  # all taken by others
    assert free_cores(2, busy_ticks=0, total_ticks=0, own_cpu_s=0.0, hz=100) == 2.0  # no window yet


@needs_cores
def test_the_threads_drop_while_other_processes_take_the_cores_and_come_back_after():
    cores = FreeCores(window_s=0.3)
    assert cores.threads() == CORES
    with spinning_processes(CORES - 1):
        assert wait_for(lambda: cores.threads() == 1), f"still {cores.current} threads, {cores.free} cores free"
    assert wait_for(lambda: cores.threads() == CORES), f"still {cores.current} threads, {cores.free} cores free"


@needs_cores
def test_what_other_processes_did_while_the_engine_idled_does_not_take_its_threads():
    """A window without steps (here 0.9 s of 0.3 s windows) is dropped: a burst after idling keeps its threads."""
    cores = FreeCores(window_s=0.3)
    assert cores.threads() == CORES
    with spinning_processes(CORES - 1):
        time.sleep(0.9)  # the engine idles while the others take every core but one
    assert cores.threads() == CORES and cores.free is None
    with spinning_processes(CORES - 1):  # while it steps, the same load takes them within a window or two
        assert wait_for(lambda: cores.threads() == 1), f"still {cores.current} threads, {cores.free} cores free"


@needs_cores
def test_an_engine_that_follows_the_free_cores_keeps_its_tokens_on_fewer_threads(tiny_llama_dir, monkeypatch):
    """Sampling too runs on the step's threads: its parallel regions would otherwise wake the OpenMP worker on a
    core the free-core count gave away."""
    from test_runtime_engine import config, greedy, prompt

    import toolkit.runtime.engine as engine_module

    before = torch.get_num_threads()
    try:
        engine = Engine(tiny_llama_dir, config(num_threads=CORES, follow_free_cores=True))
        engine.free_cores = FreeCores(window_s=0.3)
        reference = engine.generate(greedy(prompt(30, 1), n=24))  # every core free
        seen = []
        forward = engine.model.forward

        def record(ids, plan, pool):
            seen.append(torch.get_num_threads())
            return forward(ids, plan, pool)

        engine.model.forward = record
        sampled = []  # (the step's forward threads, the sampling's)
        sample_sequences = engine_module.sample_sequences

        def sample(logits, seqs, argmax_rows=None):
            sampled.append((seen[-1], torch.get_num_threads()))
            return sample_sequences(logits, seqs, argmax_rows)

        monkeypatch.setattr(engine_module, "sample_sequences", sample)
        with spinning_processes(CORES - 1):
            end = time.monotonic() + 15
            while 1 not in seen and time.monotonic() < end:
                assert engine.generate(greedy(prompt(30, 1), n=24)) == reference
            assert 1 in seen, f"every step on {set(seen)} threads; {engine.free_cores.free} cores free"
            assert engine.generate(greedy(prompt(30, 1), n=24)) == reference
        assert (1, 1) in sampled and all(step == sampling for step, sampling in sampled), set(sampled)
        assert torch.get_num_threads() == CORES  # each step's own count; the engine's stays
    finally:
        torch.set_num_threads(before)
