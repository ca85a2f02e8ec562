"""Triton python model ``tensorrt_llm`` for the ``cpu`` target: rtk's CPU engine behind the C++ backend's interface.

Inputs and outputs are those of TensorRT-LLM's ``tensorrtllm`` backend (NVIDIA/TensorRT-LLM
``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt`` and
``triton_backend/inflight_batcher_llm/src/utils.cc``): ``input_ids``, ``input_lengths``,
``request_output_len``, ``end_id``, ``pad_id``, ``streaming``, ``runtime_top_k`` / ``runtime_top_p``
/ ``temperature`` / ``seed``, ``stop_words_list``, ``stop``, ``exclude_input_in_output``,
``return_perf_metrics`` (the four ``*_time_ns``), ``return_num_input_tokens`` /
``return_num_output_tokens``; out come ``output_ids`` ``[beams, tokens]`` and ``sequence_length``.
A ``stop`` request cancels the request with the same Triton request id (or rtk ``request_key``).
Streaming responses carry only the new tokens; a non-streaming one carries the prompt too unless
``exclude_input_in_output``.  rtk adds ``preceding_ids`` and passes ``dropped_turns`` through
and ``request_key`` (see toolkit/triton/config.py).

The model is decoupled: ``execute`` hands every request to one :class:`BackgroundEngine` and
returns at once, so requests from any number of Triton calls share the engine's in-flight batch;
responses are made on the engine's thread as tokens come and sent from sender threads (:class:`_Sender`; each
request's in order), so the engine's next step never waits for tritonserver to take them.
A request the client cancels (or stops with ``stop``) is cancelled in the engine, which frees its
KV blocks.  A bad request gets an INVALID_ARG error; the others keep being served.

Sampling follows TensorRT-LLM: greedy unless ``runtime_top_k`` > 1, ``runtime_top_p`` in (0, 1)
or ``temperature`` > 0 is sent (temperature defaults to 1.0 when only top-k/top-p are sent).
``min_tokens``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and
``embedding_bias`` are applied as TensorRT-LLM applies them (toolkit/runtime/sampling.py);
``return_log_probs`` adds ``output_log_probs`` (the new tokens') and ``cum_log_probs`` (their running
sum); ``num_return_sequences`` n > 1 runs n engine requests (seeds ``seed``, ``seed + 1``, ...) whose
responses carry ``sequence_index``; ``return_perf_metrics`` adds the ``kv_cache_*`` counters.  The
model declares every input of the C++ backend: one it does not serve (beam search, LoRA, prompt
tables, guided decoding, logits outputs, draft / encoder / multimodal inputs) is accepted absent,
empty or at its default value, and any other value is refused with INVALID_ARG naming the input
and the target, never ignored.  Invalid sampling values (NaN or negative temperature, top_p outside
(0, 1], ...) are refused the same way.
"""

import json
import os
import queue
import threading
import time
import uuid
from typing import NamedTuple

import numpy as np
import rtk_text
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PERF = rtk_text.PERF_OUTPUTS
# Inputs this model reads; every other input must be absent, empty, or equal to its entry in DEFAULTS.
SERVED = frozenset(
    {
        "input_ids",
        "input_lengths",
        "request_output_len",
        "end_id",
        "pad_id",
        "streaming",
        "stop",
        "exclude_input_in_output",
        "return_perf_metrics",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "runtime_top_k",
        "runtime_top_p",
        "temperature",
        "seed",
        "min_tokens",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "return_log_probs",
        "num_return_sequences",
        "stop_words_list",
        "bad_words_list",
        "embedding_bias",
        "dropped_turns",
    }
)
# TensorRT-LLM's defaults of the inputs it does not serve (tensorrt_llm/layers/defaultDecodingParams.h).
DEFAULTS = {
    "beam_width": 1,
    "len_penalty": 1.0,
    "early_stopping": 1,
    "beam_search_diversity_rate": 0.0,
    "runtime_top_p_min": 1e-6,
    "runtime_top_p_decay": 1.0,
    "runtime_top_p_reset_ids": -1,
    "return_context_logits": False,
    "return_generation_logits": False,
    "prompt_vocab_size": 0,
}


# Threads sending responses (_Sender): at 8 streams, 4 took a new request's first token to the client a median 3.6 ms
# after the step that made it, one 6.6 ms (seven runs each; docs/engine-measurements.md, "The served stub's own time").
SENDER_LANES = 4


class BadRequest(ValueError):
    pass


class _Group:
    """One Triton request: its response sender, shared by the ``num_return_sequences`` engine requests."""

    __slots__ = ("sender", "outputs", "lock", "closed", "pending", "streams", "lane")

    def __init__(self, sender, n, outputs, lane=0):
        self.sender, self.pending, self.streams, self.lane = sender, n, [], lane
        self.outputs = outputs  # the request's requested outputs: responses carry no other (rtk_text.requested_outputs)
        # Guards the sender: is_cancelled() on a sender whose final response has gone crashes
        # tritonserver 2.51 (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled), so the cancel
        # watcher and the final send never overlap, and nothing touches the sender after it.
        self.lock = threading.Lock()
        self.closed = False


class _Sender:
    """Sends the decoupled responses from threads of their own: each Triton request's in the order they were
    handed over, different requests' side by side.

    python_backend's ``InferenceResponseSender.send`` puts the response in shared memory, messages
    tritonserver and waits until the server has sent it on, with the GIL released
    (triton-inference-server/python_backend ``src/response_sender.cc``, ``ResponseSender::Send``; the server
    answers from its thread pool once ``TRITONBACKEND_ResponseSend`` has returned, ``src/python_be.cc``,
    ``ResponseSendDecoupled``).  On the engine thread that round trip held the next step back once per stream
    and step; here the engine thread only queues, and the wait overlaps the next forward pass (which runs
    without the GIL).  A step ends with a response for every running stream: through one thread their round
    trips queue one behind another (the last stream's token waits for all the others'), so each request is
    given one of ``lanes`` threads in turn and the round trips of a step's responses overlap.
    """

    def __init__(self, logger, lanes: int = 1):
        self.logger = logger
        self._queues = [queue.SimpleQueue() for _ in range(max(1, lanes))]
        self._next = 0
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"rtk-response-sender-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def lane(self) -> int:
        """The lane of a new Triton request (each in turn)."""
        self._next = (self._next + 1) % len(self._queues)
        return self._next

    def put(self, lane: int, deliver, *args) -> None:
        self._queues[lane].put((deliver, args))

    def close(self) -> None:
        """Send what is queued, then stop."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)

    def _run(self, q) -> None:
        from toolkit.runtime.os_threads import SENDER_THREAD, name_this_thread

        name_this_thread(SENDER_THREAD)  # apart from the engine's threads in top -H, py-spy and bench_serving.py
        while (item := q.get()) is not None:
            deliver, args = item
            try:
                deliver(*args)
            except Exception as exc:  # one failed send must not stop the others'
                self.logger.log_error(f"tensorrt_llm: sending a response failed: {exc!r}")


class _Reply(NamedTuple):
    """A response's values, read from its stream on the engine thread (``TritonPythonModel._response``)."""

    tokens: list
    window: list | None  # preceding_ids, when asked for
    log_probs: list | None  # the new tokens' log-probabilities, when asked for
    cum_log_prob: float | None
    times: dict | None  # the perf outputs, when asked for
    kv: tuple | None  # (reused, total) KV blocks
    prompt_tokens: int
    generated_tokens: int


class _Stream:
    """One engine request (one returned sequence of a Triton request)."""

    __slots__ = (
        "request",
        "sender",
        "group",
        "index",
        "triton_id",
        "engine_id",
        "prompt",
        "streaming",
        "exclude_input",
        "want_perf",
        "want_in",
        "want_out",
        "want_log_probs",
        "dropped",
        "end_id",
        "generated",
        "log_probs",
        "kv",
        "sent",
        "arrival_ns",
        "first_token_ns",
        "last_token_ns",
        "done",
        "finished_event",
        "final_response",
        "stop_sequences",
    )

    def __init__(self, request, group, index, triton_id, prompt):
        self.request, self.group, self.index, self.triton_id, self.prompt = request, group, index, triton_id, prompt
        self.sender = group.sender
        self.engine_id = None
        self.generated = []
        self.log_probs = []
        self.kv = None  # (reused, total) blocks, from the engine while the request runs
        self.sent = 0
        self.arrival_ns = time.time_ns()
        self.first_token_ns = self.last_token_ns = None
        self.done = False
        self.finished_event = threading.Event()
        self.final_response = None


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.max_queue = int(p.get("max_queue_size") or 0)
        self.queue_timeout_ns = int(float(p.get("queue_timeout_ms") or 0) * 1e6)
        self.check_period = float(p.get("cancellation_check_period_ms") or 50) / 1e3
        self.logger = pb_utils.Logger
        self.where = f"model 'tensorrt_llm', target '{p.get('target') or 'cpu'}'"

        from toolkit.targets.cpu import bound_openmp_spin, load_engine

        bound_openmp_spin(p["engine_dir"])  # before the engine's import loads torch and its libgomp
        spin = ", ".join(f"{k}={os.environ[k]}" for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ)
        from toolkit.runtime.engine import BackgroundEngine

        policy = p.get("batch_scheduler_policy") or "guaranteed_no_evict"
        # loaded on the thread that steps it: one OpenMP pool (BackgroundEngine)
        self.background = BackgroundEngine(lambda: load_engine(p["engine_dir"], served=True, scheduler_policy=policy))
        self.engine = self.background.engine
        self.config = self.engine.config
        self.logger.log_info(f"{self.where}: {self.engine.model.kernels}; {spin or 'libgomp default wait'}")
        self.sender = _Sender(self.logger, SENDER_LANES)
        self.lock = threading.Lock()
        self.streams = {}  # engine request id -> _Stream
        self.closing = threading.Event()
        self._init_metrics(args)
        self.watcher = threading.Thread(target=self._watch, name="rtk-cancel-watch", daemon=True)
        self.watcher.start()

    # -- requests in ------------------------------------------------------------------------
    def execute(self, requests):
        streams = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            stream = None
            try:
                stream = self._submit(request, sender)
            except BadRequest as exc:
                self._reply_error(request, sender, str(exc), pb_utils.TritonError.INVALID_ARG, streams)
            except _QueueFull as exc:
                self._reply_error(request, sender, str(exc), pb_utils.TritonError.UNAVAILABLE, streams)
            except Exception as exc:  # the engine refused it (toolkit.errors.UsageError) or failed
                code = (
                    pb_utils.TritonError.INVALID_ARG
                    if type(exc).__name__ in ("UsageError", "SpecError")
                    else pb_utils.TritonError.INTERNAL
                )
                self._reply_error(request, sender, f"{exc}", code, streams)
            else:
                streams.append(stream)
        if self.decoupled:
            return None
        responses = []
        for s in streams:
            if isinstance(s, pb_utils.InferenceResponse):
                responses.append(s)
                continue
            if s is None:
                responses.append(pb_utils.InferenceResponse([]))  # a `stop` request
                continue
            s.finished_event.wait()
            responses.append(s.final_response)
        return responses

    def _reply_error(self, request, sender, message, code, streams):
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        if sender is not None:
            sender.send(response, flags=FINAL)
        else:
            streams.append(response)

    def _submit(self, request, sender):
        triton_id = request.request_id()
        inputs = rtk_text.inputs_by_name(request)
        if rtk_text.input_scalar(inputs, "stop", False, bool):
            self._stop(triton_id)
            if sender is not None:
                sender.send(flags=FINAL)
            return None
        ids = rtk_text.input_array(inputs, "input_ids")
        if ids is None:
            raise BadRequest("input 'input_ids' is required")
        ids = ids.reshape(-1)
        n = rtk_text.input_scalar(inputs, "input_lengths", ids.size, int)
        if n is None or n < 1 or n > ids.size:
            raise BadRequest(
                f"input_lengths {n} does not match input_ids ({ids.size} ids); send the number of prompt tokens"
            )
        prompt = [int(t) for t in ids[:n]]
        max_new = rtk_text.input_scalar(inputs, "request_output_len", None, int)
        if max_new is None or max_new < 1:
            raise BadRequest(f"request_output_len is {max_new}; ask for at least 1 token")
        self._refuse_unserved(inputs)
        bad = rtk_text.input_array(inputs, "bad_words_list")
        if bad is not None and rtk_text.parse_word_list(bad):
            raise BadRequest(f"input 'bad_words_list' is not supported ({self.where}); leave bad_words unset")
        num_sequences = rtk_text.input_scalar(inputs, "num_return_sequences", 1, int)
        sampling = self._sampling(inputs)
        if num_sequences > 1 and not self.decoupled:
            raise BadRequest(
                f"num_return_sequences {num_sequences} needs the decoupled model ({self.where}); "
                "serve with streaming enabled, or send 1"
            )
        stop_words = rtk_text.input_array(inputs, "stop_words_list")

        group = _Group(sender, num_sequences, rtk_text.requested_outputs(request), self.sender.lane())
        streaming = bool(rtk_text.input_scalar(inputs, "streaming", False, bool)) and self.decoupled
        stop_sequences = rtk_text.parse_word_list(stop_words) if stop_words is not None else []
        end_id = rtk_text.input_scalar(inputs, "end_id", None, int)
        exclude_input = bool(rtk_text.input_scalar(inputs, "exclude_input_in_output", False, bool))
        want_perf = bool(rtk_text.input_scalar(inputs, "return_perf_metrics", False, bool))
        want_in = bool(rtk_text.input_scalar(inputs, "return_num_input_tokens", False, bool))
        want_out = bool(rtk_text.input_scalar(inputs, "return_num_output_tokens", False, bool))
        dropped = rtk_text.input_scalar(inputs, "dropped_turns", None, int)
        for i in range(num_sequences):
            s = _Stream(request, group, i, triton_id, prompt)
            s.streaming, s.exclude_input, s.want_log_probs = streaming, exclude_input, sampling.log_probs
            s.want_perf, s.want_in, s.want_out = want_perf, want_in, want_out
            s.dropped, s.end_id, s.stop_sequences = dropped, end_id, stop_sequences
            group.streams.append(s)
        reqs = [self._engine_request(prompt, int(max_new), s, sampling, i) for i, s in enumerate(group.streams)]
        with self.lock:
            if self.max_queue and len(self.streams) + num_sequences > self.config.max_batch_size + self.max_queue:
                raise _QueueFull("Exceeds maximum queue size (serving.max_queue_size); retry later")
            # Registered before submit: the engine thread may call back before submit returns.
            for s, req in zip(group.streams, reqs, strict=True):
                s.engine_id = req.request_id
                self.streams[s.engine_id] = s
        try:
            for s, req in zip(group.streams, reqs, strict=True):
                self.background.submit(req, lambda event, _s=s: self._on_event(_s, event))
        except BaseException:
            for s in group.streams:  # a request starts whole or not at all
                self._finish(s)
                self.background.cancel(s.engine_id)
            raise
        return group.streams[0]

    def _engine_request(self, prompt, max_new, s, sampling, index):
        import dataclasses

        from toolkit.runtime.engine import GenerationRequest

        if index and sampling.seed is not None:  # sequence i draws with seed + i
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**64)
        return GenerationRequest(
            prompt_ids=prompt,
            max_new_tokens=max_new,
            end_id=s.end_id,
            stop_sequences=s.stop_sequences,
            sampling=sampling,
            request_id=uuid.uuid4().hex,
        )

    def _refuse_unserved(self, inputs):
        """INVALID_ARG for an input this model does not serve sent with a value other than its default."""
        for name, tensor in inputs.items():
            if name in SERVED:
                continue
            try:
                value = tensor.as_numpy()
            except Exception:  # a type numpy lacks (the BF16 prompt_embedding_table): never the default
                raise BadRequest(
                    f"input {rtk_text.input_name(name)} is not supported ({self.where}); leave it unset"
                ) from None
            if value.size == 0 or (value.dtype == np.object_ and not any(value.reshape(-1))):
                continue
            if name in DEFAULTS and value.size == 1:
                v, default = value.reshape(-1)[0], DEFAULTS[name]
                if isinstance(default, float) and np.isclose(float(v), default, rtol=1e-6, atol=0.0):
                    continue
                if not isinstance(default, float) and v == default:
                    continue
                raise BadRequest(
                    f"input {rtk_text.input_name(name)} is {v.item() if hasattr(v, 'item') else v}; "
                    f"only {default} is supported ({self.where})"
                )
            raise BadRequest(f"input {rtk_text.input_name(name)} is not supported ({self.where}); leave it unset")

    def _sampling(self, inputs):
        """SamplingParams from the request, every value checked (INVALID_ARG naming the input)."""
        from toolkit.runtime.engine import SamplingParams

        values = {
            "temperature": rtk_text.input_scalar(inputs, "temperature", None, float),
            "runtime_top_k": rtk_text.input_scalar(inputs, "runtime_top_k", None, int),
            "runtime_top_p": rtk_text.input_scalar(inputs, "runtime_top_p", None, float),
            "seed": rtk_text.input_scalar(inputs, "seed", None, int),
            "min_tokens": rtk_text.input_scalar(inputs, "min_tokens", None, int),
            "repetition_penalty": rtk_text.input_scalar(inputs, "repetition_penalty", None, float),
            "presence_penalty": rtk_text.input_scalar(inputs, "presence_penalty", None, float),
            "frequency_penalty": rtk_text.input_scalar(inputs, "frequency_penalty", None, float),
            "num_return_sequences": rtk_text.input_scalar(inputs, "num_return_sequences", None, int),
        }
        try:
            rtk_text.check_sampling(values, self.where)
        except rtk_text.PromptError as exc:
            raise BadRequest(str(exc)) from None
        top_k = values["runtime_top_k"] or 0
        top_p = 1.0 if values["runtime_top_p"] is None else values["runtime_top_p"]
        temperature = values["temperature"]
        penalties = dict(
            min_tokens=values["min_tokens"] or 0,
            repetition_penalty=1.0 if values["repetition_penalty"] is None else values["repetition_penalty"],
            presence_penalty=values["presence_penalty"] or 0.0,
            frequency_penalty=values["frequency_penalty"] or 0.0,
            embedding_bias=self._embedding_bias(inputs),
            log_probs=bool(rtk_text.input_scalar(inputs, "return_log_probs", False, bool)),
        )
        if not (top_k > 1 or top_p < 1.0 or (temperature or 0.0) > 0.0):
            return SamplingParams(temperature=0.0, **penalties)
        return SamplingParams(
            temperature=1.0 if not temperature else temperature,
            top_k=top_k,
            top_p=top_p,
            seed=values["seed"],
            **penalties,
        )

    def _embedding_bias(self, inputs):
        bias = rtk_text.input_array(inputs, "embedding_bias")
        if bias is None or bias.size == 0 or not bias.any():
            return None
        import torch

        bias = bias.reshape(-1).astype(np.float32)
        vocab = self.engine.model_config.vocab_size
        if bias.size > vocab or not np.isfinite(bias).all():
            raise BadRequest(
                f"input 'embedding_bias' has {bias.size} values; send at most {vocab} finite values, "
                f"one per token id ({self.where})"
            )
        return torch.from_numpy(bias)

    def _stop(self, triton_id):
        if not triton_id:
            return
        with self.lock:
            targets = [s.engine_id for s in self.streams.values() if triton_id in (s.triton_id, s.engine_id)]
        for engine_id in targets:
            self.background.cancel(engine_id)

    # -- tokens out -------------------------------------------------------------------------
    def _on_event(self, s, event):
        """Called from the engine thread for each TokenEvent of ``s``."""
        if s.done:
            return
        if event.error:
            self._finish(s)
            self._fail(
                s, pb_utils.InferenceResponse(error=pb_utils.TritonError(event.error, pb_utils.TritonError.INTERNAL))
            )
            return
        now = event.time_ns
        new = []
        if event.token_id is not None and event.finish_reason != "end_id":  # TensorRT-LLM leaves end_id out
            s.generated.append(int(event.token_id))
            new = [int(event.token_id)]
            if s.want_log_probs:
                lp = getattr(event, "log_prob", None)
                s.log_probs.append(float("nan") if lp is None else lp)
        if event.token_id is not None:
            s.first_token_ns = s.first_token_ns or now
            s.last_token_ns = now
        if not event.finished:
            if s.want_perf:
                try:  # this runs on the engine thread, between steps
                    stats = self.engine.request_stats(s.engine_id)
                    s.kv = (stats["reused_blocks"], stats["blocks"])
                except Exception:
                    pass
            if s.streaming and new:
                self._send(
                    s, self._response(s, new, len(s.prompt) + len(s.generated) - len(new), len(new)), final=False
                )
            return
        self._finish(s)
        if event.finish_reason == "cancelled":
            if s.streaming:
                self._send(s, None, final=True)
            else:
                self._fail(
                    s,
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                    ),
                )
            return
        if s.streaming:
            self._send(s, self._response(s, new, len(s.prompt) + len(s.generated) - len(new), len(new)), final=True)
        elif s.exclude_input:
            self._send(s, self._response(s, s.generated, len(s.prompt), len(s.generated)), final=True)
        else:
            self._send(s, self._response(s, s.prompt + s.generated, 0, len(s.generated)), final=True)

    def _finish(self, s):
        s.done = True
        with self.lock:
            self.streams.pop(s.engine_id, None)

    def _response(self, s, tokens, start, new_count):
        """What a response carrying ``tokens`` reports, read from ``s`` now (on the engine thread: ``s`` moves on
        with the next step); :meth:`_build` makes it a response, on the response's sender thread (decoupled)
        or here.  ``tokens`` sit at position ``start`` of prompt + generated; the last ``new_count`` generated
        tokens are the ones it reports log-probabilities of.  Only the outputs the request asked for are read
        (rtk_text.requested_outputs)."""
        want = s.group.outputs
        window = log_probs = cum_log_prob = times = None
        if "preceding_ids" in want:
            # (prompt + generated)[start - PRECEDING_WINDOW : start], without copying the whole sequence each token
            lo, n = max(0, start - rtk_text.PRECEDING_WINDOW), len(s.prompt)
            window = s.prompt[lo : min(start, n)] + s.generated[max(0, lo - n) : max(0, start - n)]
        if s.want_log_probs:
            log_probs = s.log_probs[len(s.log_probs) - new_count :] if new_count else []
            cum_log_prob = sum(s.log_probs) if "cum_log_probs" in want else None
        if s.want_perf:
            times = self._times(s)
        return _Reply(list(tokens), window, log_probs, cum_log_prob, times, s.kv, len(s.prompt), len(s.generated))

    def _build(self, s, r):
        """:meth:`_response`'s reply as the ``InferenceResponse`` it is sent as.  Making the python backend's
        tensors and response costs more than the rest of a token's callback (175-265 us a token when served at
        8 streams, a few tensors each), so a decoupled stream's are made on its sender thread, beside the next
        step, not on the engine thread between steps."""
        want = s.group.outputs
        i32 = lambda v: np.array([[v]], dtype=np.int32)  # noqa: E731 - [batch=1, 1]
        out = []
        if "output_ids" in want:
            out.append(pb_utils.Tensor("output_ids", np.array(r.tokens, dtype=np.int32).reshape(1, 1, len(r.tokens))))
        if "sequence_length" in want:
            out.append(pb_utils.Tensor("sequence_length", i32(len(r.tokens))))
        if r.window is not None:
            out.append(pb_utils.Tensor("preceding_ids", np.array([r.window], dtype=np.int32)))
        if "batch_index" in want:
            out.append(pb_utils.Tensor("batch_index", i32(0)))
        if "sequence_index" in want:
            out.append(pb_utils.Tensor("sequence_index", i32(s.index)))
        if r.log_probs is not None:
            if "output_log_probs" in want:
                lp = np.array(r.log_probs, dtype=np.float32).reshape(1, 1, len(r.log_probs))
                out.append(pb_utils.Tensor("output_log_probs", lp))
            if "cum_log_probs" in want:
                out.append(pb_utils.Tensor("cum_log_probs", np.array([[r.cum_log_prob]], dtype=np.float32)))
        if r.times is not None:
            out += [pb_utils.Tensor(name, np.array([[r.times[name]]], dtype=np.int64)) for name in PERF if name in want]
            if r.kv is not None:
                reused, total = r.kv
                kv = {
                    "kv_cache_alloc_new_blocks": total - reused,
                    "kv_cache_reused_blocks": reused,
                    "kv_cache_alloc_total_blocks": total,
                }
                out += [pb_utils.Tensor(name, i32(v)) for name, v in kv.items() if name in want]
        if s.want_in and "num_input_tokens" in want:
            out.append(pb_utils.Tensor("num_input_tokens", i32(r.prompt_tokens)))
        if s.want_out and "num_output_tokens" in want:
            out.append(pb_utils.Tensor("num_output_tokens", i32(r.generated_tokens)))
        if "request_key" in want:
            out.append(pb_utils.Tensor("request_key", np.array([[s.engine_id.encode()]], dtype=np.object_)))
        if s.dropped is not None and "dropped_turns" in want:
            out.append(pb_utils.Tensor("dropped_turns", i32(s.dropped)))
        return pb_utils.InferenceResponse(out)

    def _times(self, s):
        try:
            t = self.engine.times(s.engine_id)
            scheduled = t.first_scheduled_ns or 0
        except Exception:  # the engine forgot a finished request
            scheduled = 0
        return {
            "arrival_time_ns": s.arrival_ns,
            "first_scheduled_time_ns": scheduled,
            "first_token_time_ns": s.first_token_ns or 0,
            "last_token_time_ns": s.last_token_ns or 0,
        }

    def _send(self, s, response, *, final, fail=False):
        """Send ``response`` of stream ``s``; ``final``: ``s`` is done (the Triton request is done when all
        its streams are); ``fail``: ``response`` is an error that ends the whole Triton request."""
        if not self.decoupled:
            if final:
                s.final_response = self._build(s, response) if isinstance(response, _Reply) else response
                s.finished_event.set()
            return
        self.sender.put(s.group.lane, self._deliver, s, response, final, fail)

    def _deliver(self, s, response, final, fail):
        """On the sender thread: ``_send``'s response (or :meth:`_response`'s reply, made a response here) to
        tritonserver."""
        if isinstance(response, _Reply):
            response = self._build(s, response)
        g = s.group
        with g.lock:
            if g.closed:
                return
            if fail:  # counted here, after the responses queued before it: the error is the request's last
                g.pending = 1
            last = False
            if final:
                g.pending -= 1
                last = g.pending <= 0
            g.closed = last
            try:
                if response is not None:
                    g.sender.send(response, flags=FINAL if last else 0)
                elif last:
                    g.sender.send(flags=FINAL)
            except Exception as exc:  # the client went away
                self.logger.log_warn(f"tensorrt_llm: could not send a response: {exc}")
                failed = True
            else:
                failed = False
        if failed:
            for other in g.streams:
                if not other.done:
                    self.background.cancel(other.engine_id)

    def _fail(self, s, response):
        """End the whole Triton request of ``s`` with the error ``response`` (its other streams are cancelled)."""
        for other in s.group.streams:
            if other is not s and not other.done:
                self._finish(other)
                self.background.cancel(other.engine_id)
        self._send(s, response, final=True, fail=True)

    def _client_cancelled(self, s):
        g = s.group
        with g.lock:
            if g.closed:
                return False
            try:
                return g.sender.is_cancelled()
            except Exception:
                return False

    # -- metrics ------------------------------------------------------------------------------
    def _init_metrics(self, args):
        """KV-cache and request gauges on Triton's /metrics, named as TensorRT-LLM's backend names them
        (``nv_trt_llm_kv_cache_block_metrics``, ``nv_trt_llm_request_metrics``), per instance."""
        base = {"model": args["model_name"], "version": args["model_version"], "instance": args["model_instance_name"]}
        kv = pb_utils.MetricFamily(
            name="nv_trt_llm_kv_cache_block_metrics",
            description="KV cache blocks of rtk's CPU engine",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        req = pb_utils.MetricFamily(
            name="nv_trt_llm_request_metrics",
            description="requests in rtk's CPU engine",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.metric_families = (kv, req)  # keep them alive
        self.kv_gauges = {
            t: kv.Metric(labels={**base, "kv_cache_block_type": t}) for t in ("max", "free", "used", "tokens_per")
        }
        self.req_gauges = {
            t: req.Metric(labels={**base, "request_type": t}) for t in ("active", "max", "scheduled", "waiting")
        }
        self.last_metrics = {}
        self.metrics_failed = False
        self.kv_gauges["tokens_per"].set(self.config.tokens_per_block)
        self.req_gauges["max"].set(self.config.max_batch_size)

    def _update_metrics(self, active):
        """Set the gauges that changed (each set is a message to the server process)."""
        stats = self.engine.kv_stats()
        values = {
            ("kv", "max"): stats["blocks_total"],
            ("kv", "free"): stats["blocks_free"],
            ("kv", "used"): stats["blocks_used"],
            ("req", "active"): active,
            ("req", "scheduled"): stats.get("running", 0),
            ("req", "waiting"): stats.get("waiting", 0),
        }
        for key, value in values.items():
            if self.last_metrics.get(key) != value:
                (self.kv_gauges if key[0] == "kv" else self.req_gauges)[key[1]].set(value)
                self.last_metrics[key] = value

    # -- cancellation and queue timeouts ----------------------------------------------------
    def _watch(self):
        """Cancel requests whose client cancelled, and queued requests past the queue timeout."""
        while not self.closing.wait(self.check_period):
            try:
                self._update_metrics(len(self.streams))
            except Exception as exc:  # never let metrics stop cancellation; say so once
                if not self.metrics_failed:
                    self.metrics_failed = True
                    self.logger.log_warn(f"tensorrt_llm: updating the engine gauges failed: {exc!r}")
            with self.lock:
                streams = list(self.streams.values())
            now = time.time_ns()
            for s in streams:
                if s.done:
                    continue
                if s.sender is not None and self._client_cancelled(s):
                    self.background.cancel(s.engine_id)
                    continue
                if self.queue_timeout_ns and s.first_token_ns is None and now - s.arrival_ns > self.queue_timeout_ns:
                    try:
                        scheduled = self.engine.times(s.engine_id).first_scheduled_ns
                    except Exception:
                        scheduled = None
                    if scheduled is None:
                        self._finish(s)
                        self.background.cancel(s.engine_id)
                        self._fail(
                            s,
                            pb_utils.InferenceResponse(
                                error=pb_utils.TritonError(
                                    "Request timeout expired (serving.queue_timeout_ms)",
                                    pb_utils.TritonError.UNAVAILABLE,
                                )
                            ),
                        )

    def finalize(self):
        self.closing.set()
        with self.lock:
            ids = list(self.streams)
        for engine_id in ids:
            self.background.cancel(engine_id)
        self.background.close()
        self.sender.close()


class _QueueFull(Exception):
    pass
