"""Triton python model ``preprocessing``: text (or chat messages) in, token ids out.

Tensor names are those of TensorRT-LLM's ``inflight_batcher_llm/preprocessing`` (NVIDIA/TensorRT-LLM
``triton_backend/all_models/inflight_batcher_llm/preprocessing/``), plus ``DROPPED_TURNS``.
``QUERY`` is a plain prompt or a JSON chat (see rtk_text.py); the prompt is fitted to the context
window with the ``context_policy`` parameter.  ``EMBEDDING_BIAS_WORDS`` / ``_WEIGHTS`` become
``EMBEDDING_BIAS`` (empty when not sent) and ``PROMPT_TABLE_EXTRA_ID`` is passed on as
``OUT_PROMPT_TABLE_EXTRA_IDS``; ``DECODER_QUERY`` (encoder-decoder models) is refused: rtk's targets
serve decoder-only models.  Bad requests get an INVALID_ARG error naming the input and what to
change; the other requests of the batch are served.
"""

import numpy as np
import rtk_text
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        p = rtk_text.model_parameters(args)
        self.tokenizer = rtk_text.tokenizer_for(args, p)
        self.add_special_tokens = p.get("add_special_tokens", "true").lower() == "true"
        self.max_input_len = int(p["max_input_len"])
        self.max_seq_len = int(p["max_seq_len"])
        self.policy = p.get("context_policy", "truncate_oldest")
        self.default_max_tokens = int(p.get("default_max_tokens", "128"))
        self.end_id = rtk_text.end_id_of(self.tokenizer)
        self.pad_id = rtk_text.pad_id_of(self.tokenizer)
        self.target = p.get("target", "?")

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            inputs = rtk_text.inputs_by_name(request)
            texts = rtk_text.input_strings(inputs, "QUERY")
            if any(rtk_text.input_strings(inputs, "DECODER_QUERY")):
                raise rtk_text.PromptError(
                    f"input 'decoder_text_input' is for encoder-decoder models; target '{self.target}' serves "
                    "decoder-only models: leave it unset"
                )
            if not texts:
                raise rtk_text.PromptError("text_input is empty; send a prompt, or a JSON list of chat messages")
            max_tokens = rtk_text.input_scalar(inputs, "REQUEST_OUTPUT_LEN", self.default_max_tokens, int)
            window = rtk_text.prompt_window(self.max_input_len, self.max_seq_len, max_tokens)
            ids, dropped = rtk_text.encode_prompt(
                self.tokenizer, texts[0], window=window, policy=self.policy, add_special_tokens=self.add_special_tokens
            )
            end_id = rtk_text.input_scalar(inputs, "END_ID", self.end_id, int)
            pad_id = rtk_text.input_scalar(inputs, "PAD_ID", self.pad_id, int)
            stop = rtk_text.word_list(self.tokenizer, [rtk_text.input_strings(inputs, "STOP_WORDS_DICT")])
            bad = rtk_text.word_list(self.tokenizer, [rtk_text.input_strings(inputs, "BAD_WORDS_DICT")])
            weights = rtk_text.input_array(inputs, "EMBEDDING_BIAS_WEIGHTS")
            bias = rtk_text.embedding_bias(
                self.tokenizer,
                rtk_text.input_strings(inputs, "EMBEDDING_BIAS_WORDS"),
                [] if weights is None else weights.reshape(-1).tolist(),
            )
            extra_id = rtk_text.input_array(inputs, "PROMPT_TABLE_EXTRA_ID")
        except rtk_text.PromptError as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
        i32 = lambda v: np.array([[v]], dtype=np.int32)  # noqa: E731 - [batch=1, 1]
        outputs = [
            pb_utils.Tensor("INPUT_ID", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", i32(len(ids))),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", i32(max_tokens)),
            pb_utils.Tensor("BAD_WORDS_IDS", bad),
            pb_utils.Tensor("STOP_WORDS_IDS", stop),
            pb_utils.Tensor("OUT_END_ID", i32(end_id)),
            pb_utils.Tensor("OUT_PAD_ID", i32(pad_id)),
            pb_utils.Tensor("EMBEDDING_BIAS", bias.reshape(1, -1)),
            pb_utils.Tensor("DROPPED_TURNS", i32(dropped)),
        ]
        if extra_id is not None:  # like upstream: only when sent, one extra id per prompt token
            extra = int(extra_id.reshape(-1)[0])
            outputs.append(
                pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", np.full((1, len(ids)), extra, dtype=np.uint64))
            )
        return pb_utils.InferenceResponse(outputs)
