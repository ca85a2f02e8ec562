"""Triton python model ``tensorrt_llm_bls``: the ensemble's job in one model, calling ``tensorrt_llm`` through BLS.

Same client interface as ``ensemble`` (``text_input``, ``max_tokens``, ``stream``, sampling, stop
words, ``return_*``; out ``text_output``, the ``*_time_ns`` stamps, token counts and
``dropped_turns``), like TensorRT-LLM's ``inflight_batcher_llm/tensorrt_llm_bls`` (NVIDIA/TensorRT-LLM
``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py``).  Because it
sees the whole request, it detokenizes incrementally from its own token history and reports
``dropped_turns`` whatever the target's ``tensorrt_llm`` model is, so it is the endpoint to use
for streaming on GPU targets, whose C++ ``tensorrt_llm`` has no ``preceding_ids``.

Each request runs in its own thread (the model is decoupled); when the client cancels, the inner
request is stopped with TensorRT-LLM's ``stop`` input under the same request id.

The client interface is upstream's whole ``tensorrt_llm_bls/config.pbtxt``: sampling, penalties,
``min_tokens``, ``num_return_sequences`` (one response per sequence, with ``sequence_index``),
``return_log_probs``, LoRA, prompt tables, guided decoding and embedding bias go to ``tensorrt_llm``,
which serves them or refuses them naming the input; the engine's outputs come back under their own
names.  The multimodal and draft-model inputs are refused here (rtk serves no encoder or draft model),
and invalid sampling values are refused before anything runs.
"""

import json
import threading
import uuid

import numpy as np
import rtk_text
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PERF = rtk_text.PERF_OUTPUTS
# client input -> (tensorrt_llm input, dtype), scalars
PASS_THROUGH = {
    "top_k": ("runtime_top_k", np.int32),
    "top_p": ("runtime_top_p", np.float32),
    "temperature": ("temperature", np.float32),
    "seed": ("seed", np.uint64),
    "length_penalty": ("len_penalty", np.float32),
    "repetition_penalty": ("repetition_penalty", np.float32),
    "min_tokens": ("min_tokens", np.int32),
    "presence_penalty": ("presence_penalty", np.float32),
    "frequency_penalty": ("frequency_penalty", np.float32),
    "beam_width": ("beam_width", np.int32),
    "num_return_sequences": ("num_return_sequences", np.int32),
    "prompt_vocab_size": ("prompt_vocab_size", np.int32),
    "lora_task_id": ("lora_task_id", np.uint64),
    "return_log_probs": ("return_log_probs", np.bool_),
    "return_context_logits": ("return_context_logits", np.bool_),
    "return_generation_logits": ("return_generation_logits", np.bool_),
    "return_perf_metrics": ("return_perf_metrics", np.bool_),
    "return_num_input_tokens": ("return_num_input_tokens", np.bool_),
    "return_num_output_tokens": ("return_num_output_tokens", np.bool_),
}
# client inputs handed to tensorrt_llm as they are (tensors)
PASS_THROUGH_TENSORS = (
    "prompt_embedding_table",
    "lora_weights",
    "lora_config",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
)
# tensorrt_llm outputs returned to the client under the same name (config.ENGINE_OUTPUTS)
ENGINE_OUTPUTS = (
    "cum_log_probs",
    "output_log_probs",
    "context_logits",
    "generation_logits",
    "batch_index",
    "sequence_index",
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    *PERF,
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
    "num_input_tokens",
    "num_output_tokens",
)
# sampling inputs checked here (rtk_text.SAMPLING_RULES), before anything runs
CHECKED = (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "beam_width",
    "num_return_sequences",
)
# inputs for models rtk does not serve: refused unless absent or empty
NOT_SERVED = {
    "decoder_text_input": "is for encoder-decoder models",
    "image_input": "needs a multimodal encoder",
    "image_bytes_input": "needs a multimodal encoder",
    "image_url_input": "needs a multimodal encoder",
    "video_bytes_input": "needs a multimodal encoder",
    "num_draft_tokens": "needs a draft model",
    "use_draft_logits": "needs a draft model",
}


class InnerError(Exception):
    def __init__(self, error):
        super().__init__(error.message())
        self.error = error


class TritonPythonModel:
    def initialize(self, args):
        p = rtk_text.model_parameters(args)
        self.tokenizer = rtk_text.tokenizer_for(args, p)
        self.llm = p.get("tensorrt_llm_model_name", "tensorrt_llm")
        self.max_input_len = int(p["max_input_len"])
        self.max_seq_len = int(p["max_seq_len"])
        self.policy = p.get("context_policy", "truncate_oldest")
        self.default_max_tokens = int(p.get("default_max_tokens", "128"))
        self.skip_special = p.get("skip_special_tokens", "true").lower() == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.where = f"model 'tensorrt_llm_bls', target '{p.get('target', '?')}'"

    def execute(self, requests):
        if not self.decoupled:
            return [self._run(r, None) for r in requests]
        for r in requests:
            threading.Thread(target=self._run, args=(r, r.get_response_sender()), daemon=True).start()
        return None

    def _run(self, request, sender):
        try:
            return self._generate(request, sender)
        except rtk_text.PromptError as exc:
            error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
        except InnerError as exc:  # tensorrt_llm's error, with its code (INVALID_ARG stays INVALID_ARG)
            error = pb_utils.TritonError(exc.error.message(), exc.error.code())
        except pb_utils.TritonModelException as exc:
            error = pb_utils.TritonError(str(exc))
        except Exception as exc:  # report, never leave the client waiting
            error = pb_utils.TritonError(f"tensorrt_llm_bls: {type(exc).__name__}: {exc}")
        response = pb_utils.InferenceResponse(error=error)
        if sender is None:
            return response
        sender.send(response, flags=FINAL)
        return None

    def _refuse_not_served(self, inputs):
        for name, why in NOT_SERVED.items():
            a = rtk_text.input_array(inputs, name)
            if a is None or a.size == 0 or (a.dtype == np.object_ and not any(a.reshape(-1))) or not a.any():
                continue
            raise rtk_text.PromptError(f"input '{name}' {why}; {self.where} has none: leave it unset")

    def _generate(self, request, sender):
        given = rtk_text.inputs_by_name(request)  # the client's; `inputs` below are tensorrt_llm's
        self._refuse_not_served(given)
        rtk_text.check_sampling({name: rtk_text.input_scalar(given, name) for name in CHECKED}, self.where)
        texts = rtk_text.input_strings(given, "text_input")
        if not texts:
            raise rtk_text.PromptError("text_input is empty; send a prompt, or a JSON list of chat messages")
        max_tokens = rtk_text.input_scalar(given, "max_tokens", self.default_max_tokens, int)
        window = rtk_text.prompt_window(self.max_input_len, self.max_seq_len, max_tokens)
        prompt, dropped = rtk_text.encode_prompt(self.tokenizer, texts[0], window=window, policy=self.policy)
        stream = rtk_text.input_scalar(given, "stream", False, bool) and sender is not None
        want = rtk_text.requested_outputs(request)
        exclude_input = rtk_text.input_scalar(given, "exclude_input_in_output", False, bool)
        end_id = rtk_text.input_scalar(given, "end_id", rtk_text.end_id_of(self.tokenizer), int)

        i32 = lambda v: np.array([[v]], dtype=np.int32)  # noqa: E731
        inputs = [
            pb_utils.Tensor("input_ids", np.array([prompt], dtype=np.int32)),
            pb_utils.Tensor("input_lengths", i32(len(prompt))),
            pb_utils.Tensor("request_output_len", i32(max_tokens)),
            pb_utils.Tensor("end_id", i32(end_id)),
            pb_utils.Tensor(
                "pad_id", i32(rtk_text.input_scalar(given, "pad_id", rtk_text.pad_id_of(self.tokenizer), int))
            ),
            pb_utils.Tensor("streaming", np.array([[stream]], dtype=np.bool_)),
            pb_utils.Tensor("exclude_input_in_output", np.array([[True]], dtype=np.bool_)),
        ]
        stop_words = rtk_text.input_strings(given, "stop_words")
        if stop_words:
            inputs.append(pb_utils.Tensor("stop_words_list", rtk_text.word_list(self.tokenizer, [stop_words])))
        bad_words = rtk_text.input_strings(given, "bad_words")
        if bad_words:
            inputs.append(pb_utils.Tensor("bad_words_list", rtk_text.word_list(self.tokenizer, [bad_words])))
        weights = rtk_text.input_array(given, "embedding_bias_weights")
        bias = rtk_text.embedding_bias(
            self.tokenizer,
            rtk_text.input_strings(given, "embedding_bias_words"),
            [] if weights is None else weights.reshape(-1).tolist(),
        )
        if bias.size:
            inputs.append(pb_utils.Tensor("embedding_bias", bias.reshape(1, -1)))
        extra_id = rtk_text.input_array(given, "prompt_table_extra_id")
        if extra_id is not None and extra_id.size:
            ids = np.full((1, len(prompt)), int(extra_id.reshape(-1)[0]), dtype=np.uint64)
            inputs.append(pb_utils.Tensor("prompt_table_extra_ids", ids))
        for name, (target, dtype) in PASS_THROUGH.items():
            v = rtk_text.input_scalar(given, name)
            if v is not None:
                inputs.append(pb_utils.Tensor(target, np.array([[v]], dtype=dtype)))
        for name in PASS_THROUGH_TENSORS:  # handed on as they came (a BF16 table has no numpy type)
            t = given.get(name)
            if t is not None:
                inputs.append(t)
        inner_id = uuid.uuid4().hex  # never a client's id: two clients may reuse one
        outputs = ["output_ids", "sequence_length", *ENGINE_OUTPUTS]
        llm_request = pb_utils.InferenceRequest(
            model_name=self.llm, inputs=inputs, requested_output_names=outputs, request_id=inner_id
        )

        history = {}  # sequence index -> tokens decoded so far, for decode_delta
        collected, last_extras = {}, {}
        cancelled = False
        for response in llm_request.exec(decoupled=True):
            if response.has_error():
                raise InnerError(response.error())
            if sender is not None and not cancelled and sender.is_cancelled():
                cancelled = True
                self._stop(inner_id)
            ids_t = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids_t is None:
                continue  # the empty final response
            n = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            new = ids_t.as_numpy().reshape(-1)[:n].tolist()
            index_t = pb_utils.get_output_tensor_by_name(response, "sequence_index")
            index = 0 if index_t is None else int(index_t.as_numpy().reshape(-1)[0])
            extras = [
                t for t in (pb_utils.get_output_tensor_by_name(response, o) for o in ENGINE_OUTPUTS) if t is not None
            ]
            if stream:
                if cancelled:
                    continue
                seen = history.setdefault(index, list(prompt))
                text = rtk_text.decode_delta(
                    self.tokenizer, seen[-rtk_text.PRECEDING_WINDOW :], new, skip_special_tokens=self.skip_special
                )
                seen += new
                sender.send(self._response(want, text, extras, dropped))
            else:
                collected[index] = collected.get(index, []) + new  # non-streaming: one response per sequence
                last_extras[index] = extras
        if stream or cancelled:
            sender.send(flags=FINAL)
            return None
        responses = []
        for index in sorted(collected):
            text = rtk_text.decode_delta(
                self.tokenizer,
                prompt[-rtk_text.PRECEDING_WINDOW :],
                collected[index],
                skip_special_tokens=self.skip_special,
            )
            if not exclude_input:  # like TensorRT-LLM: the prompt comes back unless excluded
                text = rtk_text.decode_delta(self.tokenizer, [], prompt, skip_special_tokens=self.skip_special) + text
            responses.append(self._response(want, text, last_extras[index], dropped))
        if sender is None:
            return responses[0] if responses else pb_utils.InferenceResponse([])
        for i, response in enumerate(responses):
            sender.send(response, flags=FINAL if i == len(responses) - 1 else 0)
        if not responses:
            sender.send(flags=FINAL)
        return None

    def _response(self, want, text, extras, dropped):
        """Of these outputs, those in ``want`` (the request's requested outputs: rtk_text.requested_outputs)."""
        out = []
        if "text_output" in want:  # one-dimensional, as upstream's postprocessing returns it: clients read [0]
            out.append(pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)))
        out += [pb_utils.Tensor(t.name(), t.as_numpy()) for t in extras if t.name() in want]
        if "dropped_turns" in want:
            out.append(pb_utils.Tensor("dropped_turns", np.array([[dropped]], dtype=np.int32)))
        return pb_utils.InferenceResponse(out)

    def _stop(self, inner_id):
        stop = pb_utils.InferenceRequest(
            model_name=self.llm,
            request_id=inner_id,
            requested_output_names=["output_ids"],
            inputs=[
                pb_utils.Tensor("input_ids", np.zeros((1, 1), dtype=np.int32)),
                pb_utils.Tensor("input_lengths", np.ones((1, 1), dtype=np.int32)),
                pb_utils.Tensor("request_output_len", np.ones((1, 1), dtype=np.int32)),
                pb_utils.Tensor("stop", np.ones((1, 1), dtype=np.bool_)),
            ],
        )
        for _ in stop.exec(decoupled=True):
            pass
