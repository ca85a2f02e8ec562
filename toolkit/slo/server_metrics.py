"""Triton's Prometheus ``/metrics``, read before and after a run and subtracted.

Counters (``nv_inference_request_success``, ``…_failure``, ``…_count``, ``…_exec_count``, the
``…_duration_us`` sums, cache hits/misses) become per-run deltas; the report derives the average
queue and compute time per request from them.  Gauges are kept as read after the run.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+([^\s]+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """``{'name{k="v",…}': value}`` and ``{family: type}`` from Prometheus text format."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        try:
            v = float(value)
        except ValueError:
            continue
        key = name + (
            "{" + ",".join(f'{k}="{val}"' for k, val in sorted(_LABEL.findall(labels))) + "}" if labels else ""
        )
        samples[key] = v
    return samples, types


def scrape(url: str | None, timeout: float = 5.0, attempts: int = 3) -> tuple[dict[str, float], dict[str, str]] | None:
    """The samples and types at ``url``; None when no read succeeded in ``attempts`` (a busy server can let one
    read time out or reset, and one lost read would leave the run's report without server counters)."""
    if not url:
        return None
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.2 * attempt)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return parse_prometheus(r.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return None


def family(key: str) -> str:
    return key.split("{", 1)[0]


def label(key: str, name: str) -> str | None:
    m = re.search(r"[{,]" + re.escape(name) + r'="([^"]*)"', key)
    return m.group(1) if m else None


def diff(before, after) -> dict:
    """Counter deltas and gauges after the run; {} when either read failed."""
    if not before or not after:
        return {}
    (b, types), (a, types_after) = before, after
    types = {**types, **types_after}
    counters, gauges = {}, {}
    for key, v in a.items():
        if not key.startswith("nv_"):
            continue
        if types.get(family(key)) == "counter":
            counters[key] = v - b.get(key, 0.0)
        else:
            gauges[key] = v
    return {"counters": counters, "gauges": gauges}


def per_model(delta: dict) -> dict[str, dict[str, float]]:
    """Per model: requests succeeded/failed, executions, average queue and compute time (µs)."""
    out: dict[str, dict[str, float]] = {}
    for key, v in (delta.get("counters") or {}).items():
        model = label(key, "model")
        if model is None:
            continue
        fam = family(key).removeprefix("nv_inference_")
        row = out.setdefault(model, {})
        if fam in (
            "request_success",
            "request_failure",
            "count",
            "exec_count",
            "request_duration_us",
            "queue_duration_us",
            "compute_input_duration_us",
            "compute_infer_duration_us",
            "compute_output_duration_us",
        ):
            row[fam] = row.get(fam, 0.0) + v
    for row in out.values():
        n = row.get("request_success", 0.0) + row.get("request_failure", 0.0)
        if n:
            for f in ("queue_duration_us", "compute_infer_duration_us", "request_duration_us"):
                if f in row:
                    row["avg_" + f] = row[f] / n
    return out


# -- checking that a metric moves under load (``rtk slo --check-metric``) ------------------------

_SELECTOR = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$")


def parse_selector(text: str) -> tuple[str, dict[str, str]]:
    """``'nv_trt_llm_request_metrics{request_type="waiting"}'`` → (family, {label: value})."""
    m = _SELECTOR.match(text)
    if not m:
        raise ValueError(f"'{text}' is not NAME or NAME{{label=\"value\",…}}")
    labels = dict(_LABEL.findall(m.group(2) or ""))
    if m.group(2) and not labels:
        raise ValueError(f"'{text}': labels are written label=\"value\"")
    return m.group(1), labels


def select(samples: dict[str, float], family_name: str, labels: dict[str, str]) -> float | None:
    """The sum of every series of ``family_name`` that carries ``labels``; None when none is exported."""
    found = None
    for key, v in samples.items():
        if family(key) != family_name:
            continue
        if all(label(key, k) == want for k, want in labels.items()):
            found = (found or 0.0) + v
    return found


class MetricWatcher:
    """Reads ``/metrics`` every ``interval_s`` on a thread while the load runs; keeps each watched
    metric's highest value (a gauge) or its largest increase since the first read (a counter).
    A signal that never rose above zero under load cannot drive an autoscaler."""

    def __init__(self, url: str | None, selectors: list[str], interval_s: float = 0.2):
        import threading

        self.url, self.interval_s = url, interval_s
        self.parsed = {s: parse_selector(s) for s in selectors}
        self.peak: dict[str, float | None] = {s: None for s in selectors}
        self.first: dict[str, float] = {}  # counters: the value at the first read
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtk-slo-metrics", daemon=True)

    def __enter__(self) -> MetricWatcher:
        if self.url and self.parsed:
            self._read()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
            self._read()  # one last look: a gauge may still be up at the end of the load

    def _read(self) -> None:
        got = scrape(self.url, timeout=2.0, attempts=1)  # the next read is 0.2 s away
        if got is None:
            return
        self.scrapes += 1
        samples, types = got
        for text, (fam, labels) in self.parsed.items():
            v = select(samples, fam, labels)
            if v is None:
                continue
            if types.get(fam) == "counter":
                v -= self.first.setdefault(text, v)
            self.peak[text] = v if self.peak[text] is None else max(self.peak[text], v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()
