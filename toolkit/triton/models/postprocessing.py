"""Triton python model ``postprocessing``: token ids in, text out.

Tensor names are those of TensorRT-LLM's ``inflight_batcher_llm/postprocessing`` (``TOKENS_BATCH``
``[beams, tokens]``, ``SEQUENCE_LENGTH``, ``OUTPUT``).  When the ``tensorrt_llm`` model also sends
``PRECEDING_IDS`` (the cpu target does), each streamed chunk is decoded against the tokens before
it, so a character split across tokens is emitted whole and a SentencePiece leading space is kept
(rtk_text.decode_delta); no state is kept between requests, so any number of instances works.
Without it, each chunk is decoded on its own, like TensorRT-LLM's model.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

import rtk_text


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        path = p["tokenizer_dir"]
        if not path.startswith("/"):
            import os

            path = os.path.normpath(os.path.join(args["model_repository"], "..", path))
        self.tokenizer = rtk_text.load_tokenizer(path)
        self.skip_special = p.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            prev = pb_utils.get_input_tensor_by_name(request, "PRECEDING_IDS")
            preceding = [] if prev is None else prev.as_numpy().reshape(-1).tolist()
            # [batch=1, beams, tokens] with the batch dimension; [beams] lengths.
            tokens = tokens[0] if tokens.ndim == 3 else tokens.reshape(1, -1) if tokens.ndim < 2 else tokens
            lengths = lengths.reshape(-1)
            texts = []
            for beam, n in zip(tokens, lengths):
                ids = beam[: int(n)].tolist()
                texts.append(rtk_text.decode_delta(self.tokenizer, preceding, ids, skip_special_tokens=self.skip_special).encode("utf-8"))
            out = np.array([texts], dtype=np.object_)  # [batch=1, beams]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
