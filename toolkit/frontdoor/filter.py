"""The content filter (``serving.filter``): keywords, regular expressions and an optional classifier model,
applied to a request's input before it costs compute and to the streamed output with a hold-back window.

Matching runs on normalised text: Unicode NFKC, then case folding, then NFKC again (so "Ｂａｄ", "BAD" and
"bad" are one word), with format characters (category Cf: zero-width spaces and joiners, soft hyphens)
removed and every run of white space made one space.  There is no confusables (homoglyph) mapping: a
Cyrillic "а" stays a different letter from a Latin "a".

The output side (:class:`StreamFilter`) keeps the newest ``hold_back`` normalised characters of the
stream on the server.  A match of up to that length that ends in a later token starts inside the held
text, so none of it has been sent when it is found: a phrase split across tokens is caught whole.
Text is released in the order it came, unchanged: when nothing matches, the joined output is
byte-identical to the model's (it arrives up to ``hold_back`` characters later).  A match that ends at
the very end of the text seen so far waits for the next token (or the end) before it counts, so
patterns with look-ahead or ``\\b`` at their end are judged on the text that follows them.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("rtk.frontdoor")

COMBINING_START = "\u0300"  # below this no character is a combining mark


def _norm_char(c: str) -> str:
    if c < "\x80":
        return " " if c.isspace() else c.lower()
    if unicodedata.category(c) == "Cf":
        return ""
    if c.isspace():
        return " "
    out = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", c).casefold())
    return re.sub(r"\s+", " ", out)


def normalise(text: str) -> str:
    """The form every rule is matched against (see the module docstring)."""
    out = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    out = "".join(c for c in out if unicodedata.category(c) != "Cf")
    return re.sub(r"\s+", " ", out)


class FilterHit(Exception):
    """A rule matched.  ``rule`` names the rule (never the matched text, which is not logged)."""

    def __init__(self, rule: str):
        super().__init__(f"content filter rule {rule} matched")
        self.rule = rule


Classify = Callable[[str], Awaitable[float]]


@dataclass
class Rules:
    """The compiled ``serving.filter``: patterns over normalised text, the hold-back length, a classifier."""

    patterns: list[tuple[str, re.Pattern]]
    hold_back: int
    check_input: bool = True
    check_output: bool = True
    classify: Classify | None = None
    threshold: float = 0.5
    classify_every: int = 64

    @classmethod
    def from_spec(cls, spec, classify: Classify | None = None) -> Rules | None:
        """None when the section asks for nothing."""
        if not (spec.keywords or spec.patterns or spec.classifier):
            return None
        patterns = []
        words = sorted({normalise(w) for w in spec.keywords}, key=len, reverse=True)
        if words:
            patterns.append(("keywords", re.compile("|".join(re.escape(w) for w in words))))
        for i, p in enumerate(spec.patterns):
            patterns.append((f"patterns[{i}]", re.compile(p, re.IGNORECASE)))
        longest = max((len(w) for w in words), default=0)
        c = spec.classifier
        return cls(
            patterns=patterns,
            hold_back=max(spec.hold_back_chars, longest),
            check_input=spec.input,
            check_output=spec.output,
            classify=classify if c else None,
            threshold=c.threshold if c else 0.5,
            classify_every=c.every_chars if c else 64,
        )

    def find(self, text: str, start: int = 0, *, final: bool = True) -> str | None:
        """The name of the first rule with a match in normalised ``text`` that ends after ``start``."""
        n = len(text)
        for name, pattern in self.patterns:
            for m in pattern.finditer(text):
                if m.end() <= start or (m.end() == m.start()):
                    continue
                if m.end() == n and not final:
                    continue  # may still grow or fail on what follows; the text is held until then
                return name
        return None

    async def check_text(self, text: str) -> None:
        """Raise :class:`FilterHit` when a whole text (an input message) breaks a rule."""
        norm = normalise(text)
        rule = self.find(norm)
        if rule is None and self.classify is not None:
            rule = await self._classify(text)
        if rule is not None:
            raise FilterHit(rule)

    async def _classify(self, text: str) -> str | None:
        score = await self.classify(text)
        return "classifier" if score >= self.threshold else None

    def stream(self) -> StreamFilter:
        return StreamFilter(self)


class StreamFilter:
    """One response's output filter: :meth:`push` each piece, then :meth:`finish`.

    Both return the text that may leave now and raise :class:`FilterHit` on a match; after a hit the
    text still held is dropped.
    """

    def __init__(self, rules: Rules):
        self.rules = rules
        self.raw: list[str] = []  # closed clusters not yet released ...
        self.norm: list[str] = []  # ... and their normalised forms
        self.norm_len = 0
        self.open = ""  # the newest cluster: a combining mark in the next piece may still join it
        self.context = ""  # the newest released normalised text (for look-behind and \b at a match's start)
        self.raw_context = ""  # the newest released text as sent, so the classifier's windows overlap
        self.classified = 0  # held normalised characters (from the oldest) the classifier has passed
        self.last_space = False
        self.hit: str | None = None

    def _close(self, text: str) -> None:
        s = self.open + text
        start = 0
        for i in range(1, len(s)):
            c = s[i]
            if c >= COMBINING_START and unicodedata.combining(c):
                continue
            self._add(s[start:i])
            start = i
        self.open = s[start:]

    def _add(self, cluster: str) -> None:
        if len(cluster) == 1:
            n = _norm_char(cluster)
        else:
            n = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", cluster).casefold()))
        if n:
            if self.last_space and n[0] == " ":
                n = n[1:]
            self.last_space = n.endswith(" ") if n else self.last_space
        self.raw.append(cluster)
        self.norm.append(n)
        self.norm_len += len(n)

    async def _check(self, final: bool) -> None:
        window = self.context + "".join(self.norm)
        rule = self.rules.find(window, len(self.context), final=final)
        if rule is None and self.rules.classify is not None:
            due = final or self.norm_len - self.rules.hold_back - self.classified >= self.rules.classify_every
            if due and self.norm_len > self.classified:
                rule = await self.rules._classify(self.raw_context + "".join(self.raw))
                self.classified = self.norm_len
        if rule is not None:
            self.hit = rule
            self.raw, self.norm, self.norm_len, self.open = [], [], 0, ""
            raise FilterHit(rule)

    def _release(self, keep: int) -> str:
        """Release the oldest clusters while at least ``keep`` normalised characters stay held."""
        if self.rules.classify is not None:
            keep = max(keep, self.norm_len - self.classified)  # only what the classifier has passed
        n, total = 0, 0
        while n < len(self.norm) and self.norm_len - total - len(self.norm[n]) >= keep:
            total += len(self.norm[n])
            n += 1
        if n == 0:
            return ""
        out = "".join(self.raw[:n])
        self.context = (self.context + "".join(self.norm[:n]))[-self.rules.hold_back :]
        if self.rules.classify is not None:
            self.raw_context = (self.raw_context + out)[-max(self.rules.hold_back, self.rules.classify_every) :]
        del self.raw[:n], self.norm[:n]
        self.norm_len -= total
        self.classified = max(0, self.classified - total)
        return out

    async def push(self, text: str) -> str:
        if self.hit is not None:
            raise FilterHit(self.hit)
        if not text:
            return ""
        self._close(text)
        await self._check(final=False)
        return self._release(self.rules.hold_back)

    async def finish(self) -> str:
        if self.hit is not None:
            raise FilterHit(self.hit)
        if self.open:
            self._add(self.open)
            self.open = ""
        await self._check(final=True)
        return self._release(0)


async def filtered(pieces: AsyncIterator[str], flt: StreamFilter | None) -> AsyncIterator[str]:
    """``pieces`` through ``flt`` (unchanged when None); ends early on a hit, with ``flt.hit`` set."""
    if flt is None:
        async for p in pieces:
            yield p
        return
    try:
        async for p in pieces:
            out = await flt.push(p)
            if out:
                yield out
        out = await flt.finish()
        if out:
            yield out
    except FilterHit as hit:
        log.info("front door: output stopped by content filter rule %s", hit.rule)


class TritonClassifier:
    """A classifier model in the same Triton repository: ``text_input`` (BYTES) in, ``score`` (FP32) out.
    ``backend_of()`` gives the Triton backend to ask (the front door's first ready replica)."""

    def __init__(self, backend_of, model: str, timeout_s: float = 5.0):
        self.backend_of, self.model, self.timeout_s = backend_of, model, timeout_s
        self.batched: bool | None = None

    async def __call__(self, text: str) -> float:
        import numpy as np
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb
        from tritonclient.utils import serialize_byte_tensor

        stub = self.backend_of()._stub
        if self.batched is None:
            cfg = (await stub.ModelConfig(pb.ModelConfigRequest(name=self.model), timeout=self.timeout_s)).config
            self.batched = int(json_format.MessageToDict(cfg).get("maxBatchSize") or 0) > 0
        arr = np.array([text.encode("utf-8")], dtype=np.object_)
        if self.batched:
            arr = arr[np.newaxis, ...]
        msg = pb.ModelInferRequest(model_name=self.model)
        msg.inputs.add(name="text_input", datatype="BYTES", shape=list(arr.shape))
        msg.raw_input_contents.append(serialize_byte_tensor(arr).item())
        msg.outputs.add(name="score")
        r = await stub.ModelInfer(msg, timeout=self.timeout_s)
        return float(np.frombuffer(r.raw_output_contents[0], dtype=np.float32).reshape(-1)[0])


async def check_request(rules: Rules | None, req) -> str | None:
    """The input side: None when the request passes, else raise a 400 naming the message (or prompt)."""
    from .protocol import APIError

    if rules is None or not rules.check_input:
        return None
    texts = (
        [("prompt", req.prompt)]
        if req.kind == "completion"
        else [(f"messages[{i}].content", m["content"]) for i, m in enumerate(req.messages)]
    )
    for param, text in texts:
        try:
            await rules.check_text(text)
        except FilterHit as hit:
            raise APIError(
                400,
                f"'{param}' was refused by the content filter (serving.filter {hit.rule}); change the text",
                param=param,
                code="content_filter",
                headers={"x-rtk-filter": hit.rule},
            ) from None
    return None
