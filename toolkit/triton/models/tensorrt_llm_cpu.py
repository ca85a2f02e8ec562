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
responses are sent from the engine's thread as tokens come.  A request the client cancels (or
stops with ``stop``) is cancelled in the engine, which frees its KV blocks.  A bad request gets an
INVALID_ARG error; the others keep being served.

Sampling follows TensorRT-LLM: greedy unless ``runtime_top_k`` > 1, ``runtime_top_p`` in (0, 1)
or ``temperature`` > 0 is sent (temperature defaults to 1.0 when only top-k/top-p are sent).
"""

import json
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

import rtk_text

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PERF = rtk_text.PERF_OUTPUTS


class BadRequest(ValueError):
    pass


def _opt(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _scalar(request, name, default=None, kind=int):
    a = _opt(request, name)
    if a is None or a.size == 0:
        return default
    return kind(a.reshape(-1)[0])


class _Stream:
    """One Triton request in the engine."""

    __slots__ = ("request", "sender", "triton_id", "engine_id", "prompt", "streaming", "exclude_input", "want_perf",
                 "want_in", "want_out", "dropped", "end_id", "generated", "sent", "arrival_ns", "first_token_ns",
                 "last_token_ns", "done", "finished_event", "final_response", "stop_sequences", "lock", "closed")

    def __init__(self, request, sender, triton_id, prompt):
        self.request, self.sender, self.triton_id, self.prompt = request, sender, triton_id, prompt
        self.engine_id = None
        self.generated = []
        self.sent = 0
        self.arrival_ns = time.time_ns()
        self.first_token_ns = self.last_token_ns = None
        self.done = False
        self.finished_event = threading.Event()
        self.final_response = None
        # Guards the sender: is_cancelled() on a sender whose final response has gone crashes
        # tritonserver 2.51 (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled), so the cancel
        # watcher and the final send never overlap, and nothing touches the sender after it.
        self.lock = threading.Lock()
        self.closed = False


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.max_queue = int(p.get("max_queue_size") or 0)
        self.queue_timeout_ns = int(float(p.get("queue_timeout_ms") or 0) * 1e6)
        self.check_period = float(p.get("cancellation_check_period_ms") or 50) / 1e3
        self.logger = pb_utils.Logger

        from toolkit.targets.cpu import load_engine
        from toolkit.runtime.engine import BackgroundEngine

        self.engine = load_engine(p["engine_dir"], scheduler_policy=p.get("batch_scheduler_policy") or "guaranteed_no_evict")
        self.config = self.engine.config
        self.background = BackgroundEngine(self.engine)
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
                code = pb_utils.TritonError.INVALID_ARG if type(exc).__name__ in ("UsageError", "SpecError") else pb_utils.TritonError.INTERNAL
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
        from toolkit.runtime.engine import GenerationRequest, SamplingParams

        triton_id = request.request_id()
        if _scalar(request, "stop", False, bool):
            self._stop(triton_id)
            if sender is not None:
                sender.send(flags=FINAL)
            return None
        ids = _opt(request, "input_ids")
        if ids is None:
            raise BadRequest("input 'input_ids' is required")
        ids = ids.reshape(-1)
        n = _scalar(request, "input_lengths", ids.size)
        if n is None or n < 1 or n > ids.size:
            raise BadRequest(f"input_lengths {n} does not match input_ids ({ids.size} ids); send the number of prompt tokens")
        prompt = [int(t) for t in ids[:n]]
        max_new = _scalar(request, "request_output_len")
        if max_new is None or max_new < 1:
            raise BadRequest(f"request_output_len is {max_new}; ask for at least 1 token")
        for name in ("beam_width", "num_return_sequences"):
            v = _scalar(request, name, 1)
            if v != 1:
                raise BadRequest(f"{name} {v} is not supported by the cpu target; send 1")
        if _scalar(request, "min_tokens", 0) > 1:
            raise BadRequest("min_tokens is not supported by the cpu target; leave it unset")
        bad = _opt(request, "bad_words_list")
        if bad is not None and rtk_text.parse_word_list(bad):
            raise BadRequest("bad_words_list is not supported by the cpu target; leave bad_words unset")

        top_k = _scalar(request, "runtime_top_k", 0)
        top_p = _scalar(request, "runtime_top_p", 1.0, float)
        temperature = _scalar(request, "temperature", None, float)
        sample = (top_k or 0) > 1 or 0.0 < top_p < 1.0 or (temperature or 0.0) > 0.0
        if not sample:
            sampling = SamplingParams(temperature=0.0)
        else:
            sampling = SamplingParams(
                temperature=1.0 if temperature is None or temperature <= 0 else temperature,
                top_k=max(0, top_k or 0), top_p=top_p if 0.0 < top_p <= 1.0 else 1.0,
                seed=_scalar(request, "seed", None),
            )
        stop_words = _opt(request, "stop_words_list")

        s = _Stream(request, sender, triton_id, prompt)
        s.streaming = bool(_scalar(request, "streaming", False, bool)) and self.decoupled
        s.exclude_input = bool(_scalar(request, "exclude_input_in_output", False, bool))
        s.want_perf = bool(_scalar(request, "return_perf_metrics", False, bool))
        s.want_in = bool(_scalar(request, "return_num_input_tokens", False, bool))
        s.want_out = bool(_scalar(request, "return_num_output_tokens", False, bool))
        s.dropped = _scalar(request, "dropped_turns", None)
        s.end_id = _scalar(request, "end_id", None)
        s.stop_sequences = rtk_text.parse_word_list(stop_words) if stop_words is not None else []

        req = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=int(max_new), end_id=s.end_id, stop_sequences=s.stop_sequences,
            sampling=sampling, request_id=uuid.uuid4().hex,
        )
        with self.lock:
            if self.max_queue and len(self.streams) >= self.config.max_batch_size + self.max_queue:
                raise _QueueFull("Exceeds maximum queue size (serving.max_queue_size); retry later")
            # Registered before submit: the engine thread may call back before submit returns.
            s.engine_id = req.request_id
            self.streams[s.engine_id] = s
        try:
            self.background.submit(req, lambda event, _s=s: self._on_event(_s, event))
        except BaseException:
            with self.lock:
                self.streams.pop(s.engine_id, None)
            raise
        return s

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
            self._send(s, pb_utils.InferenceResponse(error=pb_utils.TritonError(event.error, pb_utils.TritonError.INTERNAL)), final=True)
            return
        now = event.time_ns
        new = []
        if event.token_id is not None and event.finish_reason != "end_id":  # TensorRT-LLM leaves end_id out
            s.generated.append(int(event.token_id))
            new = [int(event.token_id)]
        if event.token_id is not None:
            s.first_token_ns = s.first_token_ns or now
            s.last_token_ns = now
        if not event.finished:
            if s.streaming and new:
                self._send(s, self._response(s, new, len(s.prompt) + len(s.generated) - len(new)), final=False)
            return
        self._finish(s)
        if event.finish_reason == "cancelled":
            if s.streaming:
                self._send(s, None, final=True)
            else:
                self._send(s, pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)), final=True)
            return
        if s.streaming:
            self._send(s, self._response(s, new, len(s.prompt) + len(s.generated) - len(new)), final=True)
        elif s.exclude_input:
            self._send(s, self._response(s, s.generated, len(s.prompt)), final=True)
        else:
            self._send(s, self._response(s, s.prompt + s.generated, 0), final=True)

    def _finish(self, s):
        s.done = True
        with self.lock:
            self.streams.pop(s.engine_id, None)

    def _response(self, s, tokens, start):
        """A response carrying ``tokens``, which sit at position ``start`` of prompt + generated."""
        everything = s.prompt + s.generated
        out = [
            pb_utils.Tensor("output_ids", np.array([[tokens]], dtype=np.int32).reshape(1, 1, len(tokens))),
            pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
            pb_utils.Tensor("preceding_ids", np.array([everything[max(0, start - rtk_text.PRECEDING_WINDOW):start]], dtype=np.int32)),
        ]
        if s.want_perf:
            t = self._times(s)
            out += [pb_utils.Tensor(name, np.array([[t[name]]], dtype=np.int64)) for name in PERF]
        if s.want_in:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([[len(s.prompt)]], dtype=np.int32)))
        if s.want_out:
            out.append(pb_utils.Tensor("num_output_tokens", np.array([[len(s.generated)]], dtype=np.int32)))
        out.append(pb_utils.Tensor("request_key", np.array([[s.engine_id.encode()]], dtype=np.object_)))
        if s.dropped is not None:
            out.append(pb_utils.Tensor("dropped_turns", np.array([[s.dropped]], dtype=np.int32)))
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

    def _send(self, s, response, *, final):
        if not self.decoupled:
            if final:
                s.final_response = response
                s.finished_event.set()
            return
        with s.lock:
            if s.closed:
                return
            s.closed = final
            try:
                if response is None:
                    s.sender.send(flags=FINAL)
                else:
                    s.sender.send(response, flags=FINAL if final else 0)
            except Exception as exc:  # the client went away
                self.logger.log_warn(f"tensorrt_llm: could not send a response: {exc}")
                failed = True
            else:
                failed = False
        if failed and not s.done:
            self.background.cancel(s.engine_id)

    def _client_cancelled(self, s):
        with s.lock:
            if s.closed:
                return False
            try:
                return s.sender.is_cancelled()
            except Exception:
                return False

    # -- metrics ------------------------------------------------------------------------------
    def _init_metrics(self, args):
        """KV-cache and request gauges on Triton's /metrics, named as TensorRT-LLM's backend names them
        (``nv_trt_llm_kv_cache_block_metrics``, ``nv_trt_llm_request_metrics``), per instance."""
        base = {"model": args["model_name"], "version": args["model_version"], "instance": args["model_instance_name"]}
        kv = pb_utils.MetricFamily(
            name="nv_trt_llm_kv_cache_block_metrics", description="KV cache blocks of rtk's CPU engine",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        req = pb_utils.MetricFamily(
            name="nv_trt_llm_request_metrics", description="requests in rtk's CPU engine", kind=pb_utils.MetricFamily.GAUGE
        )
        self.metric_families = (kv, req)  # keep them alive
        self.kv_gauges = {t: kv.Metric(labels={**base, "kv_cache_block_type": t}) for t in ("max", "free", "used", "tokens_per")}
        self.req_gauges = {t: req.Metric(labels={**base, "request_type": t}) for t in ("active", "max", "scheduled", "waiting")}
        self.last_metrics = {}
        self.metrics_failed = False
        self.kv_gauges["tokens_per"].set(self.config.tokens_per_block)
        self.req_gauges["max"].set(self.config.max_batch_size)

    def _update_metrics(self, active):
        """Set the gauges that changed (each set is a message to the server process)."""
        stats = self.engine.kv_stats()
        values = {
            ("kv", "max"): stats["blocks_total"], ("kv", "free"): stats["blocks_free"], ("kv", "used"): stats["blocks_used"],
            ("req", "active"): active, ("req", "scheduled"): stats.get("running", 0), ("req", "waiting"): stats.get("waiting", 0),
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
                        self._send(s, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            "Request timeout expired (serving.queue_timeout_ms)", pb_utils.TritonError.UNAVAILABLE)), final=True)

    def finalize(self):
        self.closing.set()
        with self.lock:
            ids = list(self.streams)
        for engine_id in ids:
            self.background.cancel(engine_id)
        self.background.close()


class _QueueFull(Exception):
    pass
