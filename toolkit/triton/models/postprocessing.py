"""Triton python model ``postprocessing``: token ids in, text out.

Tensor names are those of TensorRT-LLM's ``inflight_batcher_llm/postprocessing`` (``TOKENS_BATCH``
``[beams, tokens]``, ``SEQUENCE_LENGTH``, ``OUTPUT``).  When the ``tensorrt_llm`` model also sends
``PRECEDING_IDS`` (the cpu target does), each streamed chunk is decoded against the tokens before
it, so a character split across tokens is emitted whole and a SentencePiece leading space is kept
(rtk_text.decode_delta); no state is kept between requests, so any number of instances works.
Without it, each chunk is decoded on its own, like TensorRT-LLM's model.

Triton 2.51 does not tell a running decoupled step of an ensemble that the client cancelled; it
marks the *next* step's request instead.  So a cancelled postprocessing request stops the engine
request named by ``REQUEST_KEY`` (sent by the cpu ``tensorrt_llm``) with a ``stop`` request.
"""

import numpy as np
import rtk_text
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        p = rtk_text.model_parameters(args)
        self.tokenizer = rtk_text.tokenizer_for(args, p)
        self.skip_special = p.get("skip_special_tokens", "true").lower() == "true"
        self.llm = p.get("tensorrt_llm_model_name", "tensorrt_llm")

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():
                responses.append(self._cancelled(request))
                continue
            inputs = rtk_text.inputs_by_name(request)  # once a token on the ensemble's stream: listed once
            tokens = inputs["TOKENS_BATCH"].as_numpy()
            lengths = inputs["SEQUENCE_LENGTH"].as_numpy()
            prev = inputs.get("PRECEDING_IDS")
            preceding = [] if prev is None else prev.as_numpy().reshape(-1).tolist()
            # [batch=1, beams, tokens] with the batch dimension; [beams] lengths.
            tokens = tokens[0] if tokens.ndim == 3 else tokens.reshape(1, -1) if tokens.ndim < 2 else tokens
            lengths = lengths.reshape(-1)
            texts = []
            for beam, n in zip(tokens, lengths, strict=False):
                ids = beam[: int(n)].tolist()
                texts.append(
                    rtk_text.decode_delta(self.tokenizer, preceding, ids, skip_special_tokens=self.skip_special).encode(
                        "utf-8"
                    )
                )
            # One-dimensional, as upstream's ``np.array(req_outputs)``: clients read ``text_output[0]``.
            out = np.array(texts, dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses

    def _cancelled(self, request):
        """The client cancelled: stop the engine request this response came from (see the module doc)."""
        key = pb_utils.get_input_tensor_by_name(request, "REQUEST_KEY")
        if key is not None:
            key = key.as_numpy().reshape(-1)[0]
            stop = pb_utils.InferenceRequest(
                model_name=self.llm,
                request_id=key.decode() if isinstance(key, bytes) else str(key),
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
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
        )
