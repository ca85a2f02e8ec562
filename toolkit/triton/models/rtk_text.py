"""Text handling shared by the repository's python models: prompts, chat, context window, detokenization.

The emitter copies this file next to each ``model.py`` that needs it (``<repo>/<model>/1/``, which
is on the python backend stub's ``sys.path``), so the pre/postprocessing models need only
``transformers`` and ``numpy``, not rtk itself.  It must not import ``triton_python_backend_utils``:
the tests import it directly.

* :func:`parse_query` — a request's ``text_input`` is either a plain prompt (sent as is, like
  TensorRT-LLM's preprocessing) or a JSON chat: ``[{"role": ..., "content": ...}, ...]`` or
  ``{"messages": [...]}``, rendered with the tokenizer's chat template.
* :func:`encode_prompt` — applies the context-window policy: ``truncate_oldest`` keeps the system
  prompt(s) and the newest turns, dropping whole turns from the oldest end until the prompt fits;
  ``reject`` refuses a prompt that does not fit.
* :func:`decode_delta` — incremental detokenization without per-request state: the text that
  ``new`` adds after ``preceding``, holding back a trailing incomplete UTF-8 character (it is
  emitted with the token that completes it).  Decoding against the preceding tokens also keeps the
  leading space SentencePiece tokenizers drop from a sequence's first token.
* :func:`word_list` / :func:`parse_word_list` — TensorRT-LLM's ``[2, N]`` stop/bad words format
  (row 0 the concatenated token ids, row 1 the end offset of each word, padded with -1), as made
  by ``_to_word_list_format`` in TensorRT-LLM's ``triton_backend/all_models/inflight_batcher_llm/
  preprocessing/1/model.py``.
"""

from __future__ import annotations

import json
import math
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

REPLACEMENT = "\ufffd"
# The server timestamps TensorRT-LLM's backend returns with return_perf_metrics (one home: the configs,
# the models and the clients read this tuple).
PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
PRECEDING_WINDOW = 8  # tokens of context for decode_delta: covers a split 4-byte character and a space


def inputs_by_name(request) -> dict:
    """The request's input tensors by name, listed once: ``pb_utils.get_input_tensor_by_name`` lists them all
    again at each lookup (the cpu ``tensorrt_llm`` model looks up ~25 names a request)."""
    return {t.name(): t for t in request.inputs()}


def input_array(inputs: dict, name: str):
    """Input ``name`` of :func:`inputs_by_name`'s dict as a numpy array; None where the request left it out."""
    t = inputs.get(name)
    return None if t is None else t.as_numpy()


def input_scalar(inputs: dict, name: str, default=None, kind=None):
    """The first element of input ``name`` (``kind`` applied), or ``default`` where it is missing or empty."""
    a = input_array(inputs, name)
    if a is None or a.size == 0:
        return default
    v = a.reshape(-1)[0]
    return v if kind is None else kind(v)


def input_strings(inputs: dict, name: str) -> list[str]:
    """A BYTES input's elements as text; [] where the request left it out."""
    a = input_array(inputs, name)
    return [] if a is None else [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in a.reshape(-1)]


def requested_outputs(request) -> frozenset[str]:
    """The outputs ``request`` asked for: the only ones a decoupled model may send it.

    python_backend r24.10 (tritonserver 2.51, the bundled server) drops a response's other outputs in
    ``ResponseSender::Send`` with the GIL released, and its ``PbTensor`` destructor then frees their numpy
    arrays without the GIL (triton-inference-server/python_backend ``src/response_sender.cc``,
    ``src/pb_tensor.cc`` at r24.10; fixed upstream by 4e4d2c4, "Hold GIL when deleting numpy array").  With
    another thread of the model running Python meanwhile, that corrupts the stub's heap and kills it
    ("Stub process ... is not healthy").  A response that holds only requested outputs frees nothing there.
    """
    return frozenset(request.requested_output_names())


class PromptError(ValueError):
    """A request that cannot be served as sent; the message says what to change."""


def model_parameters(args) -> dict[str, str]:
    """The ``parameters`` of a python model's config, as strings (Triton's ``initialize`` args)."""
    cfg = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


def tokenizer_for(args, params: dict[str, str]):
    """The tokenizer named by ``tokenizer_dir``; a relative path is relative to the repository root
    (so a repository can be moved as a whole)."""
    import os

    path = params["tokenizer_dir"]
    if not os.path.isabs(path):
        path = os.path.normpath(os.path.join(args["model_repository"], "..", path))
    return load_tokenizer(path)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    # A local directory written by rtk's stages; never run code shipped with a model here.
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)


def end_id_of(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise PromptError("the tokenizer has no end-of-sequence token; send end_id with the request")
    return int(tokenizer.eos_token_id)


def pad_id_of(tokenizer) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id_of(tokenizer))


# -- prompts and chat -------------------------------------------------------------------------


def parse_query(text: str) -> list[dict] | None:
    """The chat messages in ``text``, or None when it is a plain prompt."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        data = json.loads(stripped)
    except ValueError:
        return None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not data or not all(isinstance(m, dict) and "role" in m for m in data):
        return None
    for i, m in enumerate(data):
        if not isinstance(m.get("content"), str):
            raise PromptError(f"chat message {i} ('{m.get('role')}') needs a string 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise PromptError(f"chat message {i} has role '{m['role']}'; use 'system', 'user' or 'assistant'")
    if data[-1]["role"] != "user":
        raise PromptError("the last chat message must come from the 'user' (it is what the model answers)")
    return data


def encode(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``.  For a fast tokenizer with no truncation or padding set
    that is its ``backend_tokenizer.encode`` (transformers 5.24 ``tokenization_utils_tokenizers.py``,
    ``_encode_plus``: a batch of one through ``encode_batch`` after setting both off), called here directly:
    ~50 µs less for a chat prompt, on every request.  Without special tokens added, a text with special tokens
    in it (a rendered chat) goes through :class:`PieceIds`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        if not add_special_tokens:
            pieces = PieceIds.of(backend)
            if pieces is not None:
                return pieces.ids(text)
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


# Pre-tokenizers whose split of a text does not depend on where the text starts (no "first word" rule, no
# prefix space), and normalizers that work character by character: a piece between added tokens then gets the
# same ids alone as inside the whole text.
_PIECEWISE_PRE = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "Sequence"}
_PIECEWISE_NORM = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Sequence"}


class PieceIds:
    """Token ids of a text with added tokens in it, put together from the ids of the pieces between them.

    A fast tokenizer splits its input at its added tokens (``<|im_start|>``, ``<|im_end|>``) before anything
    else and encodes each piece on its own (huggingface/tokenizers ``tokenizers/src/tokenizer/
    added_vocabulary.rs``, ``extract_and_normalize``; the added tokens matched leftmost-longest).  So the
    ids of a rendered chat are the added tokens' ids and each piece's ids in turn, and the pieces that come
    back on every request (the template's system prompt, the role headers, a conversation's earlier turns)
    are encoded once and kept: the most recently used, up to ``max_chars`` characters of pieces.  Only for
    tokenizers where that holds: no added token strips spaces or matches single words, the pre-tokenizer and
    normalizer act on each piece alike wherever it starts (not Metaspace's "first" rule, not a prefix
    space), and a probe text encodes the same both ways."""

    _of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> its PieceIds, or None: not piecewise
    _PROBE = "a b<|x|>\n  c\t\n<|x|> 12,3 é!<|x|><|x|>\n"

    def __init__(self, backend, max_chars: int = 1 << 20):
        self.backend, self.max_chars, self.chars = backend, max_chars, 0
        self.lock = threading.Lock()  # the python models call from more than one thread
        added = list(backend.get_added_tokens_decoder().values())
        self.special = {t.content: backend.token_to_id(t.content) for t in added}
        alternatives = sorted(self.special, key=len, reverse=True)  # longest first: leftmost-longest, as upstream
        self.split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")").split
        self.pieces: OrderedDict[str, list[int]] = OrderedDict()

    @classmethod
    def of(cls, backend) -> PieceIds | None:
        try:
            return cls._of[backend]
        except KeyError:
            cls._of[backend] = pieces = cls._checked(backend)
            return pieces

    @classmethod
    def _checked(cls, backend) -> PieceIds | None:
        added = list(backend.get_added_tokens_decoder().values())
        if not added or any(t.lstrip or t.rstrip or t.single_word for t in added):
            return None
        cfg = json.loads(backend.to_str())
        if not _only(cfg.get("pre_tokenizer"), "pretokenizers", _PIECEWISE_PRE) or not _only(
            cfg.get("normalizer"), "normalizers", _PIECEWISE_NORM
        ):
            return None
        if cfg.get("normalizer") and any(t.normalized for t in added):
            return None
        pieces = cls(backend, max_chars=4096)
        for t in sorted(pieces.special, key=len)[:4]:
            probe = cls._PROBE.replace("<|x|>", t)
            if pieces.ids(probe) != backend.encode(probe, add_special_tokens=False).ids:
                return None
        return cls(backend)

    def ids(self, text: str) -> list[int]:
        out: list[int] = []
        kept = self.pieces
        for i, piece in enumerate(self.split(text)):
            if i & 1:  # the split's odd items are the added tokens it matched
                out.append(self.special[piece])
            elif piece:
                with self.lock:
                    got = kept.get(piece)
                    if got is not None:
                        kept.move_to_end(piece)
                if got is None:
                    got = self.backend.encode(piece, add_special_tokens=False).ids
                    self._keep(piece, got)
                out += got
        return out

    def _keep(self, piece: str, ids: list[int]) -> None:
        if len(piece) > self.max_chars // 4:
            return
        with self.lock:
            if piece in self.pieces:
                return
            self.pieces[piece] = ids
            self.chars += len(piece)
            while self.chars > self.max_chars:
                old, _ = self.pieces.popitem(last=False)
                self.chars -= len(old)


def _only(cfg: dict | None, nested: str, allowed: set[str]) -> bool:
    """Whether a tokenizer.json ``pre_tokenizer`` / ``normalizer`` entry uses only ``allowed`` types (ByteLevel
    without a prefix space)."""
    if cfg is None:
        return True
    kind = cfg.get("type")
    if kind not in allowed or (kind == "ByteLevel" and cfg.get("add_prefix_space")):
        return False
    return all(_only(c, nested, allowed) for c in cfg.get(nested, []) if kind == "Sequence")


def render_chat(tokenizer, messages: list[dict], *, generation_prompt: bool = True) -> str:
    """The chat as the model's chat template renders it.  A conversation the template refuses (its
    ``raise_exception``: roles that must alternate, a system message it does not take) is the request's fault:
    a :class:`PromptError` that names the chat messages, not a failed model."""
    from jinja2 import TemplateError

    try:
        direct = _direct_renderer(tokenizer)
        if direct is not None and all(type(m) is dict and all(type(v) is str for v in m.values()) for m in messages):
            return direct(messages, generation_prompt)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as exc:
        raise PromptError(f"the model's chat template refused these chat messages: {exc}") from None


_DIRECT_RENDERERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> renderer, or None


def _direct_renderer(tokenizer):
    """``apply_chat_template(messages, tokenize=False)`` for dicts of strings only: transformers'
    ``render_jinja_template`` with what ``apply_chat_template`` passes it (the tokenizer's template and special
    tokens), without its copies and checks of the messages first (transformers 5.x
    ``tokenization_utils_base.py`` ``apply_chat_template``, ``utils/chat_template_utils.py``): ~35 µs less a
    request.  None where that function is missing or renders a probe chat otherwise than
    ``apply_chat_template`` does; the tokenizer is then asked each time."""
    try:
        return _DIRECT_RENDERERS[tokenizer]
    except KeyError:
        pass
    render = None
    try:
        from transformers.utils.chat_template_utils import render_jinja_template

        template = tokenizer.get_chat_template(None, None)
        context = dict(tokenizer.special_tokens_map)

        def render(messages: list[dict], generation_prompt: bool) -> str:
            rendered, _ = render_jinja_template(
                conversations=[messages], chat_template=template, add_generation_prompt=generation_prompt, **context
            )
            return rendered[0]

        probes = [
            [{"role": "user", "content": "Hi é"}],
            [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "One?"},
                {"role": "assistant", "content": "1"},
                {"role": "user", "content": "Two?"},
            ],
        ]
        for messages in probes:
            for generation_prompt in (True, False):
                try:
                    want = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=generation_prompt
                    )
                except Exception:  # noqa: BLE001 — a chat this template refuses proves nothing either way
                    continue
                if render(messages, generation_prompt) != want:
                    render = None
                    break
            if render is None:
                break
    except Exception:  # noqa: BLE001 — no direct path: apply_chat_template each time
        render = None
    _DIRECT_RENDERERS[tokenizer] = render
    return render


def _render_chat(tokenizer, messages: list[dict]) -> list[int]:
    return encode(tokenizer, render_chat(tokenizer, messages), add_special_tokens=False)


def _drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """``messages`` without its oldest non-system turn (a user message and the replies to it)."""
    n_system = 0
    while n_system < len(messages) and messages[n_system]["role"] == "system":
        n_system += 1
    rest = messages[n_system:]
    # The newest user message is what is being answered: never drop it.
    if len(rest) <= 1:
        return None
    cut = 1
    while cut < len(rest) - 1 and rest[cut]["role"] != "user":
        cut += 1
    return messages[:n_system] + rest[cut:]


def encode_prompt(
    tokenizer, text: str, *, window: int, policy: str, add_special_tokens: bool = True
) -> tuple[list[int], int]:
    """Token ids for ``text`` (plain prompt or JSON chat) within ``window`` tokens, and the number of turns dropped."""
    messages = parse_query(text)
    if messages is None:
        return encode_plain(tokenizer, text, window=window, add_special_tokens=add_special_tokens), 0
    return encode_chat(tokenizer, messages, window=window, policy=policy)


def encode_plain(tokenizer, text: str, *, window: int, add_special_tokens: bool = True) -> list[int]:
    """Token ids for a plain prompt of at most ``window`` tokens."""
    if not text or not text.strip():
        raise PromptError("text_input is empty; send a prompt, or a JSON list of chat messages")
    ids = encode(tokenizer, text, add_special_tokens=add_special_tokens)
    if len(ids) > window:
        raise PromptError(
            f"the prompt has {len(ids)} tokens, more than the {window} that fit the context window "
            "(build.max_input_len, and max_seq_len minus max_tokens); shorten it or send it as chat messages"
        )
    return ids


def encode_chat(tokenizer, messages: list[dict], *, window: int, policy: str) -> tuple[list[int], int]:
    """Token ids for checked chat ``messages`` (:func:`parse_query`'s rules) rendered with the chat template,
    within ``window`` tokens by ``policy``, and the number of turns dropped."""
    ids = _render_chat(tokenizer, messages)
    dropped = 0
    if len(ids) > window and policy == "reject":
        raise PromptError(
            f"the conversation has {len(ids)} tokens, more than the {window} that fit the context window "
            "(build.max_input_len, and max_seq_len minus max_tokens); shorten it, or serve with "
            "serving.context_policy: truncate_oldest to drop the oldest turns"
        )
    while len(ids) > window:
        shorter = _drop_oldest_turn(messages)
        if shorter is None:
            raise PromptError(
                f"the newest message (with the system prompt) has {len(ids)} tokens, more than the {window} "
                "that fit the context window; shorten it or lower max_tokens"
            )
        dropped += 1
        messages = shorter
        ids = _render_chat(tokenizer, messages)
    return ids, dropped


def prompt_window(max_input_len: int, max_seq_len: int, max_tokens: int) -> int:
    """How many prompt tokens a request asking for ``max_tokens`` may have."""
    if max_tokens < 1:
        raise PromptError(f"max_tokens is {max_tokens}; ask for at least 1 token")
    if max_tokens > max_seq_len - 1:
        raise PromptError(
            f"max_tokens {max_tokens} is over the engine limit: prompt and output must fit build.max_seq_len "
            f"({max_seq_len}), so at most {max_seq_len - 1} tokens can be generated"
        )
    return min(max_input_len, max_seq_len - max_tokens)


# -- stop / bad words -------------------------------------------------------------------------


def word_list(tokenizer, words_per_request: Sequence[Sequence[str]]) -> np.ndarray:
    """``[batch, 2, N]`` int32 in TensorRT-LLM's word-list format (``[[0], [-1]]`` for no words)."""
    flat_ids, offsets = [], []
    for words in words_per_request:
        ids, offs = [], []
        for w in words:
            if not w:
                continue
            tok = list(tokenizer.encode(w, add_special_tokens=False))
            if not tok:
                continue
            ids += tok
            offs.append(len(ids))
        flat_ids.append(ids)
        offsets.append(offs)
    width = max(1, max(len(i) for i in flat_ids) if flat_ids else 1)
    out = np.zeros((len(flat_ids), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for b, (ids, offs) in enumerate(zip(flat_ids, offsets, strict=True)):
        out[b, 0, : len(ids)] = ids
        out[b, 1, : len(offs)] = offs
    return out


def parse_word_list(arr: np.ndarray) -> list[list[int]]:
    """One request's ``[2, N]`` word list back into token sequences."""
    arr = np.asarray(arr).reshape(2, -1)
    ids, ends = arr[0].tolist(), [int(e) for e in arr[1].tolist() if e >= 0]
    out, start = [], 0
    for end in ends:
        if end > start:
            out.append([int(i) for i in ids[start:end]])
        start = end
    return out


# -- detokenization ---------------------------------------------------------------------------


def _complete(text: str) -> str:
    """``text`` without a trailing incomplete UTF-8 character (decoded as U+FFFD)."""
    return text.rstrip(REPLACEMENT)


def _decode(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """``tokenizer.decode(ids, clean_up_tokenization_spaces=False)``.  For a fast tokenizer that is its
    ``backend_tokenizer.decode`` (transformers ``tokenization_utils_tokenizers.py``, ``_decode``), called here
    directly: ~4 µs for a few ids instead of ~12 through transformers' argument handling, on every token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def decode_delta(tokenizer, preceding: Sequence[int], new: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """The text ``new`` adds after ``preceding`` (see the module doc); needs no state across calls.

    A character split across tokens comes out whole with the token that completes it: every chunk
    is valid UTF-8 on its own, and the chunks of a stream join to the decoding of the whole.
    """
    if len(new) == 0:
        return ""
    preceding = [int(t) for t in preceding]
    base = _complete(_decode(tokenizer, preceding, skip_special_tokens)) if preceding else ""
    full = _complete(_decode(tokenizer, preceding + [int(t) for t in new], skip_special_tokens))
    if full.startswith(base):
        return full[len(base) :]
    # A tokenizer whose decoding of a prefix is not a prefix of the decoding (rare cleanup rules):
    # fall back to the longest common prefix so nothing is repeated.
    i = 0
    while i < min(len(base), len(full)) and base[i] == full[i]:
        i += 1
    return full[i:]


# -- request values ---------------------------------------------------------------------------


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# What a valid value of each sampling input is (TensorRT-LLM's names; the client names of
# ensemble / BLS are aliases).  The CPU engine checks the same rules (toolkit/runtime/sampling.py).
SAMPLING_RULES = {
    "temperature": ("a number >= 0 (0 = greedy)", lambda v: _finite(v) and v >= 0),
    "runtime_top_p": ("a number in (0, 1]", lambda v: _finite(v) and 0 < v <= 1),
    "runtime_top_k": ("an integer >= 0 (0 = no limit)", lambda v: v >= 0),
    "seed": ("an unsigned 64-bit integer", lambda v: 0 <= v < 2**64),
    "min_tokens": ("an integer >= 0", lambda v: v >= 0),
    "repetition_penalty": ("a number > 0 (1 = off)", lambda v: _finite(v) and v > 0),
    "presence_penalty": ("a finite number (0 = off)", _finite),
    "frequency_penalty": ("a finite number (0 = off)", _finite),
    "len_penalty": ("a finite number (1 = off)", _finite),
    "beam_width": ("an integer >= 1", lambda v: v >= 1),
    "num_return_sequences": ("an integer >= 1", lambda v: v >= 1),
}
CLIENT_ALIASES = {"top_p": "runtime_top_p", "top_k": "runtime_top_k", "length_penalty": "len_penalty"}
LLM_TO_CLIENT = {v: k for k, v in CLIENT_ALIASES.items()}


def input_name(name: str) -> str:
    """``'runtime_top_p' (the client's 'top_p')``: a tensorrt_llm input as a client of ensemble / BLS knows it."""
    client = LLM_TO_CLIENT.get(name)
    return f"'{name}'" + (f" (the client's '{client}')" if client else "")


def check_sampling(values: dict, where: str) -> None:
    """Raise PromptError naming the first input of ``values`` (name -> value or None) that is invalid."""
    for name, value in values.items():
        if value is None:
            continue
        what, ok = SAMPLING_RULES[CLIENT_ALIASES.get(name, name)]
        number = value.item() if hasattr(value, "item") else value
        if not ok(float(number) if isinstance(number, float) else number):
            raise PromptError(f"input {input_name(name)} is {number}; it must be {what} ({where})")


def embedding_bias(tokenizer, words: Sequence[str], weights: Sequence[float]) -> np.ndarray:
    """TensorRT-LLM's ``EMBEDDING_BIAS``: a ``[vocab]`` float32 vector adding each word's weight to
    each of its tokens (preprocessing's ``_get_embedding_bias``; here the words are encoded without
    special tokens, so a BOS token is never biased); empty when no words are given."""
    if len(words) != len(weights):
        raise PromptError(
            f"embedding_bias_words has {len(words)} words but embedding_bias_weights has {len(weights)} "
            "weights; send one weight per word"
        )
    if not len(words):
        return np.zeros((0,), dtype=np.float32)
    bias = np.zeros((len(tokenizer),), dtype=np.float32)
    for word, weight in zip(words, weights, strict=True):
        if not math.isfinite(float(weight)):
            raise PromptError(f"embedding_bias_weights has {weight} for '{word}'; send finite numbers")
        for t in tokenizer.encode(word, add_special_tokens=False):
            bias[t] += float(weight)
    return bias
