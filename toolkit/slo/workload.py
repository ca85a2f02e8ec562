"""What the client sends: sessions of one or more turns, synthetic or from a JSONL file.

* **Synthetic**: input and output lengths drawn from normal distributions (mean, stddev; rounded,
  at least 1), the prompt a slice of rtk's offline text (toolkit/data/text.jsonl) cut to that many
  tokens *of the model's tokenizer*, all reproducible from the seed.  Without a tokenizer, lengths
  are counted in words (and ids for the ``tensorrt_llm`` endpoint are word indices); the report
  says so.
* **JSONL**: one session per line: ``{"text": …}`` (also ``prompt`` / ``text_input``),
  ``{"input_ids": […]}``, or ``{"turns": [text or {"text": …, "output_tokens": n}, …]}``; an optional
  ``output_tokens`` (or ``max_tokens``) per line or turn.
* **Multi-turn**: turn k's prompt is the whole history (every earlier user text and reply) plus the
  new user text, so servers with KV-cache reuse answer later turns faster.
"""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import UsageError

log = logging.getLogger(__name__)

CORPUS = Path(__file__).resolve().parent.parent / "data" / "text.jsonl"


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class WordTokenizer:
    """Stand-in when no model tokenizer is available: one "token" per whitespace-separated word."""

    name = "words (no model tokenizer)"

    def __init__(self, words: list[str]):
        self.vocab = sorted(set(words))
        self.index = {w: i for i, w in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        return [self.index.get(w, 0) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i % len(self.vocab)] for i in ids)


class HFTokenizer:
    def __init__(self, path: Path):
        from transformers import AutoTokenizer  # heavy: only when a tokenizer is used

        self.name = str(path)
        self._tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def find_tokenizer_dir(repository: str | Path | None) -> Path | None:
    """The tokenizer the repository's ``preprocessing`` model uses (its ``tokenizer_dir`` parameter)."""
    if not repository:
        return None
    pre = Path(repository) / "preprocessing"
    cfg = pre / "config.pbtxt"
    if cfg.is_file():
        m = re.search(r'key:\s*"tokenizer_dir"\s*value:\s*{\s*string_value:\s*"([^"]*)"', cfg.read_text())
        if m and m.group(1) and "${" not in m.group(1):
            p = Path(m.group(1))
            p = (
                p if p.is_absolute() else Path(repository) / p
            )  # relative to the repository root (toolkit/triton/emit.py)
            if p.is_dir():
                return p
    for cand in (pre / "1" / "tokenizer", pre / "tokenizer"):
        if (cand / "tokenizer_config.json").is_file() or (cand / "tokenizer.json").is_file():
            return cand
    return None


def load_tokenizer(path: str | Path | None, repository: str | Path | None = None) -> Tokenizer | None:
    """A model tokenizer from ``path`` or the repository's preprocessing model; None if neither has one."""
    if path:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise UsageError(
                f"tokenizer '{path}' is not a directory; "
                "pass a directory with tokenizer.json / tokenizer_config.json (slo.tokenizer)"
            )
        return HFTokenizer(p)
    found = find_tokenizer_dir(repository)
    return HFTokenizer(found) if found else None


@dataclass
class Turn:
    text: str | None  # the new user text (ensemble endpoint)
    ids: list[int] | None  # the new user ids (tensorrt_llm endpoint)
    input_tokens: int  # tokens of the new user part
    output_tokens: int  # tokens to ask for


@dataclass
class Session:
    index: int
    turns: list[Turn]


def _lengths(rng: random.Random, mean: int, std: float, n: int) -> list[int]:
    if std <= 0:
        return [mean] * n
    return [max(1, int(round(rng.gauss(mean, std)))) for _ in range(n)]


class SyntheticWorkload:
    def __init__(
        self,
        *,
        input_tokens: int,
        input_std: float,
        output_tokens: int,
        output_std: float,
        turns: int = 1,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        want_ids: bool = False,
    ):
        texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
        corpus = "\n".join(texts)
        self.tokenizer = tokenizer or WordTokenizer(corpus.split())
        self.corpus_ids = np.asarray(self.tokenizer.encode(corpus), dtype=np.int64)
        self.corpus_list = self.corpus_ids.tolist()
        self.args = (input_tokens, input_std, output_tokens, output_std, turns)
        self.seed = seed
        self.want_ids = want_ids

    def session(self, index: int) -> Session:
        n_in, s_in, n_out, s_out, turns = self.args
        # One small generator per session, seeded by (seed, session): any process can build any
        # session, in any order, and get the same prompt (Python's Random: a third of numpy's set-up cost).
        rng = random.Random(self.seed * 1_000_003 + index)
        ins, outs = _lengths(rng, n_in, s_in, turns), _lengths(rng, n_out, s_out, turns)
        out = []
        for k in range(turns):
            ids = self._slice(rng, ins[k])
            if self.want_ids:
                out.append(Turn(None, ids, len(ids), outs[k]))
            else:
                text = self.tokenizer.decode(ids)  # re-encoding may differ by a token or two: count it
                out.append(Turn(text, None, len(self.tokenizer.encode(text)), outs[k]))
        return Session(index, out)

    def _slice(self, rng: random.Random, n: int) -> list[int]:
        """``n`` consecutive corpus tokens from a random place (wrapping around)."""
        c = self.corpus_ids
        start = rng.randrange(len(c))
        if start + n <= len(c):  # the common case, without numpy's per-call cost
            return self.corpus_list[start : start + n]
        return c[(start + np.arange(n)) % len(c)].tolist()


class JsonlWorkload:
    def __init__(
        self, path: str | Path, *, output_tokens: int, tokenizer: Tokenizer | None = None, want_ids: bool = False
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise UsageError(f"dataset '{path}' does not exist; pass a JSONL file (slo.dataset)")
        self.sessions: list[list[dict]] = []
        for no, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"{self.path}:{no}: not valid JSON ({exc.msg}); one JSON object per line") from None
            self.sessions.append(self._turns(row, no, output_tokens))
        if not self.sessions:
            raise UsageError(f"dataset '{self.path}' has no rows")
        self.tokenizer = tokenizer
        self.want_ids = want_ids
        if want_ids and tokenizer is None and any(t.get("ids") is None for s in self.sessions for t in s):
            raise UsageError(
                f"dataset '{self.path}' has text but the tensorrt_llm endpoint takes ids; pass a tokenizer "
                "(slo.tokenizer / --tokenizer) or give input_ids in the file"
            )

    def _turns(self, row, no: int, default_out: int) -> list[dict]:
        where = f"{self.path}:{no}"
        if not isinstance(row, dict):
            raise UsageError(f"{where}: each line must be a JSON object")
        out_n = int(row.get("output_tokens", row.get("max_tokens", default_out)))
        if "turns" in row:
            turns = []
            for t in row["turns"]:
                if isinstance(t, str):
                    turns.append({"text": t, "ids": None, "out": out_n})
                elif isinstance(t, dict) and ("text" in t or "input_ids" in t):
                    turns.append(
                        {
                            "text": t.get("text"),
                            "ids": t.get("input_ids"),
                            "out": int(t.get("output_tokens", t.get("max_tokens", out_n))),
                        }
                    )
                else:
                    raise UsageError(f"{where}: each turn is a string or an object with 'text' or 'input_ids'")
            if not turns:
                raise UsageError(f"{where}: 'turns' is empty")
            return turns
        for key in ("text", "prompt", "text_input"):
            if isinstance(row.get(key), str):
                return [{"text": row[key], "ids": None, "out": out_n}]
        if isinstance(row.get("input_ids"), list):
            return [{"text": None, "ids": [int(i) for i in row["input_ids"]], "out": out_n}]
        raise UsageError(f"{where}: no prompt; give 'text' (or 'prompt'), 'input_ids' or 'turns'")

    def session(self, index: int) -> Session:
        turns = []
        for t in self.sessions[index % len(self.sessions)]:
            text, ids = t["text"], t["ids"]
            if self.want_ids:
                ids = ids if ids is not None else self.tokenizer.encode(text)
                turns.append(Turn(None, ids, len(ids), t["out"]))
            else:
                if text is None:
                    if self.tokenizer is None:
                        raise UsageError(
                            f"dataset '{self.path}' gives input_ids but the ensemble endpoint takes text; "
                            "pass a tokenizer"
                        )
                    text = self.tokenizer.decode(ids)
                n = len(self.tokenizer.encode(text)) if self.tokenizer else len(text.split())
                turns.append(Turn(text, None, n, t["out"]))
        return Session(index, turns)
