"""The emitted repository's configs and the text handling its python models share (no server).

Configs are checked the way Triton reads them: ``config.pbtxt`` text parsed through tritonclient's
ModelConfig schema.  The ``tensorrt_llm`` tensor interface is compared with TensorRT-LLM 1.2.1's own
template (tests/data/trtllm_1_2_1_triton_models.json, recorded by the GPU tests from upstream), and
the ensemble's wiring is checked against the configs of the models it calls.  Detokenization is
checked against the tokenizer's own decoding of the whole sequence.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import spec_for
from tritonclient.grpc import model_config_pb2 as mc

from toolkit.triton import config as triton_config
from toolkit.triton.emit import TOKENIZER_IN_REPO, write_repository

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = json.loads((ROOT / "tests/data/trtllm_1_2_1_triton_models.json").read_text())

sys.path.insert(0, str(ROOT / "toolkit/triton/models"))
import rtk_text  # noqa: E402  (the file the emitter copies next to each model.py)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return rtk_text.load_tokenizer(str(smollm2_tokenizer_dir))


def read_repo(root: Path) -> dict[str, mc.ModelConfig]:
    out = {}
    for cfg in sorted(root.glob("*/config.pbtxt")):
        text = cfg.read_text()
        assert "${" not in text
        out[cfg.parent.name] = triton_config.parse(text)
    return out


@pytest.fixture(scope="module")
def cpu_repo(tmp_path_factory, tiny_llama_dir):
    spec = spec_for(
        "cfg",
        tiny_llama_dir,
        quantization={"format": "none"},
        build={"max_batch_size": 6, "max_input_len": 300, "max_seq_len": 512, "max_num_tokens": 128},
        serving={"max_queue_size": 5, "queue_timeout_ms": 2000, "instance_count": 2, "context_policy": "reject"},
    )
    root = tmp_path_factory.mktemp("repo")
    engine = tmp_path_factory.mktemp("engine")
    models = write_repository(spec, root, engine_dir=engine, tokenizer_src=tiny_llama_dir)
    return spec, root, engine, models


def test_cpu_repository_has_the_inflight_batcher_layout(cpu_repo):
    spec, root, _, models = cpu_repo
    assert models == ["preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"]
    configs = read_repo(root)
    assert sorted(configs) == sorted(models)
    assert (root / "ensemble/1").is_dir() and not any((root / "ensemble/1").iterdir())
    for name in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        assert (root / name / "1/model.py").is_file() and (root / name / "1/rtk_text.py").is_file()
    assert (root / TOKENIZER_IN_REPO / "tokenizer.json").is_file()


def test_cpu_tensorrt_llm_config_names_the_spec_values(cpu_repo):
    spec, root, engine, _ = cpu_repo
    cfg = read_repo(root)["tensorrt_llm"]
    assert cfg.backend == "python" and cfg.max_batch_size == 6
    assert cfg.model_transaction_policy.decoupled is True
    assert cfg.parameters["engine_dir"].string_value == str(engine)
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    # queue bounds are enforced by the model on the engine's queue, not by a Triton queue policy
    assert cfg.HasField("dynamic_batching") and not cfg.dynamic_batching.HasField("default_queue_policy")
    assert cfg.parameters["max_queue_size"].string_value == "5"
    assert cfg.parameters["queue_timeout_ms"].string_value == "2000"
    warm = cfg.model_warmup[0]
    assert set(warm.inputs) == {"input_ids", "input_lengths", "request_output_len"}
    for name, w in warm.inputs.items():
        data = (root / "tensorrt_llm/warmup" / w.input_data_file).read_bytes()
        assert len(data) == 4 * int(np.prod(w.dims)), name  # INT32 values, as many as the dims say
    ids = np.frombuffer((root / "tensorrt_llm/warmup/input_ids").read_bytes(), dtype="<i4")
    assert 0 < ids.size <= spec.build.max_input_len
    pre = read_repo(root)["preprocessing"]
    assert pre.parameters["context_policy"].string_value == "reject"
    assert pre.parameters["max_input_len"].string_value == "300"


def typed(tensors) -> dict[str, list]:
    return {t.name: [mc.DataType.Name(t.data_type), list(t.dims)] for t in tensors}


def upstream_typed(section: str, kind: str, resolve: dict[str, str]) -> dict[str, list]:
    """Upstream's tensors with placeholder dtypes ("$dtype", "$logits") resolved."""
    return {n: [resolve.get(v[0], v[0]), v[1]] for n, v in UPSTREAM[section][kind].items()}


# the tiny Llama is bf16; the cpu engine's logits are float32
CPU_PLACEHOLDERS = {"$dtype": "TYPE_BF16", "$logits": "TYPE_FP32"}


def test_cpu_tensorrt_llm_has_the_whole_cpp_backend_interface(cpu_repo):
    """Every input and output of TensorRT-LLM's template, with its type and shape (the model serves or
    refuses each), plus rtk's optional extensions."""
    cfg = read_repo(cpu_repo[1])["tensorrt_llm"]
    extensions = {"dropped_turns", "preceding_ids", "request_key"}
    ours_in, ours_out = typed(cfg.input), typed(cfg.output)
    assert {n: v for n, v in ours_in.items() if n not in extensions} == upstream_typed(
        "cpp", "inputs", CPU_PLACEHOLDERS
    )
    assert {n: v for n, v in ours_out.items() if n not in extensions} == upstream_typed(
        "cpp", "outputs", CPU_PLACEHOLDERS
    )
    required = {t.name for t in cfg.input if not t.optional}
    assert required == set(UPSTREAM["cpp"]["required_inputs"]) | {"input_ids"}
    assert all(t.optional for t in cfg.input if t.name in extensions)


def test_ensemble_and_bls_take_and_return_upstreams_whole_interface(cpu_repo):
    configs = read_repo(cpu_repo[1])
    llm_table_type = typed(configs["tensorrt_llm"].input)["prompt_embedding_table"][0]
    for model in ("ensemble", "tensorrt_llm_bls"):
        cfg = configs[model]
        want_in = upstream_typed(model, "inputs", CPU_PLACEHOLDERS)
        # The one deviation: upstream's template writes TYPE_FP16 for prompt_embedding_table, which
        # must equal the tensorrt_llm model's type (the model dtype) for the ensemble to load.
        want_in["prompt_embedding_table"][0] = llm_table_type
        assert typed(cfg.input) == want_in, model
        assert {n: v for n, v in typed(cfg.output).items() if n != "dropped_turns"} == upstream_typed(
            model, "outputs", CPU_PLACEHOLDERS
        ), model
        required = {t.name for t in cfg.input if not t.optional}
        assert required == {"text_input"}  # max_tokens defaults to serving.default_max_tokens
        assert required < set(UPSTREAM[model]["required_inputs"])
        ragged = {t.name for t in cfg.input if t.allow_ragged_batch}
        assert ragged == set(UPSTREAM[model]["ragged_inputs"]), model
    bls = configs["tensorrt_llm_bls"]
    assert {t.name for t in bls.input if t.HasField("reshape")} == set(UPSTREAM["tensorrt_llm_bls"]["reshaped_inputs"])
    assert not any(t.HasField("reshape") for t in configs["ensemble"].input)
    assert bls.model_transaction_policy.decoupled


def test_pre_and_postprocessing_tensors_are_upstream_ones(cpu_repo):
    configs = read_repo(cpu_repo[1])
    for model in ("preprocessing", "postprocessing"):
        cfg = configs[model]
        for kind, tensors in (("inputs", cfg.input), ("outputs", cfg.output)):
            rtk_only = {"DROPPED_TURNS", "PRECEDING_IDS", "REQUEST_KEY"}
            ours = {n: v for n, v in typed(tensors).items() if n not in rtk_only}
            assert ours.items() <= UPSTREAM[model][kind].items(), (model, kind)
    # everything upstream's ensemble feeds preprocessing exists here
    pre_inputs = {t.name for t in configs["preprocessing"].input}
    assert set(UPSTREAM["ensemble"]["steps"]["preprocessing"]["input_map"]) <= pre_inputs
    assert typed(configs["postprocessing"].input).items() >= UPSTREAM["postprocessing"]["inputs"].items()


def test_ensemble_steps_map_tensors_as_upstreams_ensemble(cpu_repo):
    ens = read_repo(cpu_repo[1])["ensemble"]
    steps = {s.model_name: s for s in ens.ensemble_scheduling.step}
    up = UPSTREAM["ensemble"]["steps"]
    assert dict(steps["preprocessing"].input_map) == up["preprocessing"]["input_map"]
    llm_in = dict(steps["tensorrt_llm"].input_map)
    # decoder_input_ids / _lengths carry an encoder-decoder model's decoder prompt; preprocessing refuses
    # decoder_text_input (rtk serves decoder-only models), so they are not wired
    want = {k: v for k, v in up["tensorrt_llm"]["input_map"].items() if not k.startswith("decoder_input")}
    assert {k: v for k, v in llm_in.items() if k != "dropped_turns"} == want
    assert dict(steps["tensorrt_llm"].output_map).items() >= up["tensorrt_llm"]["output_map"].items()
    assert dict(steps["postprocessing"].output_map) == up["postprocessing"]["output_map"]


def test_ensemble_steps_wire_existing_tensors_of_matching_types(cpu_repo):
    """Every step maps to inputs/outputs its model declares, with the ensemble tensor's type."""
    check_wiring(read_repo(cpu_repo[1]))


def check_wiring(configs):
    ens = configs["ensemble"]
    types = {t.name: t.data_type for t in ens.input}
    produced = set(types)
    for step in ens.ensemble_scheduling.step:
        model = configs[step.model_name]
        m_in = {t.name: t for t in model.input}
        m_out = {t.name: t for t in model.output}
        for model_input, tensor in step.input_map.items():
            assert model_input in m_in, (step.model_name, model_input)
            assert tensor in produced, f"{tensor} is used by {step.model_name} before any step makes it"
            assert types[tensor] == m_in[model_input].data_type, (step.model_name, model_input)
        for model_output, tensor in step.output_map.items():
            assert model_output in m_out, (step.model_name, model_output)
            types[tensor] = m_out[model_output].data_type
            produced.add(tensor)
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), step.model_name
    for out in ens.output:
        assert out.name in produced and types[out.name] == out.data_type
    used = {tensor for step in ens.ensemble_scheduling.step for tensor in step.input_map.values()}
    assert {t.name for t in ens.input} <= used  # every client input reaches a model
    # Everything preprocessing makes for the response travels through tensorrt_llm (decoupled-origin rule).
    post_inputs = set(ens.ensemble_scheduling.step[2].input_map.values())
    assert post_inputs <= set(ens.ensemble_scheduling.step[1].output_map.values())


def test_trt_engine_repository_config_parses_and_names_the_spec(tiny_llama_dir, tmp_path):
    """The trt-engine target's repository: the C++ backend config (from toolkit/targets/trt_engine.py) with
    the spec's values, and an ensemble without the cpu model's extensions."""
    spec = spec_for(
        "trt",
        tiny_llama_dir,
        build={
            "target": "trt-engine",
            "max_batch_size": 16,
            "kv_cache_free_gpu_mem_fraction": 0.75,
            "enable_kv_cache_reuse": False,
            "enable_chunked_context": True,
        },
        serving={
            "batching_strategy": "inflight_batching",
            "batch_scheduler_policy": "max_utilization",
            "max_queue_size": 7,
            "instance_count": 1,
        },
    )
    engine = tmp_path / "engine"
    engine.mkdir()
    write_repository(spec, tmp_path / "repo", engine_dir=engine, tokenizer_src=tiny_llama_dir)
    configs = read_repo(tmp_path / "repo")
    llm = configs["tensorrt_llm"]
    p = {k: v.string_value for k, v in llm.parameters.items()}
    assert llm.backend == "tensorrtllm" and llm.max_batch_size == 16 and llm.model_transaction_policy.decoupled
    assert p["gpt_model_path"] == str(engine) and p["gpt_model_type"] == "inflight_batching"
    assert p["kv_cache_free_gpu_mem_fraction"] == "0.75" and p["enable_kv_cache_reuse"] == "false"
    assert p["enable_chunked_context"] == "true" and p["batch_scheduler_policy"] == "max_utilization"
    assert llm.dynamic_batching.default_queue_policy.max_queue_size == 7
    ens = configs["ensemble"]
    llm_step = ens.ensemble_scheduling.step[1]
    assert "dropped_turns" not in llm_step.input_map and "preceding_ids" not in llm_step.output_map
    assert {t.name for t in ens.output} >= {"text_output", "first_token_time_ns"}
    assert "dropped_turns" not in {t.name for t in ens.output}
    check_wiring({name: cfg for name, cfg in configs.items()})


def test_trt_engine_ensemble_types_follow_the_engine(tiny_llama_dir, tmp_path):
    """The ensemble's logits outputs take the engine's logits dtype and its prompt table the model dtype,
    as the C++ tensorrt_llm model does: the ensemble loads only when the types agree."""
    spec = spec_for("trt", tiny_llama_dir, build={"target": "trt-engine"}, model={"dtype": "float16"})
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"pretrained_config": {"logits_dtype": "bfloat16"}}))
    write_repository(spec, tmp_path / "repo", engine_dir=engine, tokenizer_src=tiny_llama_dir)
    configs = read_repo(tmp_path / "repo")
    for model in ("ensemble", "tensorrt_llm_bls", "tensorrt_llm"):
        io = {t.name: mc.DataType.Name(t.data_type) for t in [*configs[model].input, *configs[model].output]}
        assert io["context_logits"] == io["generation_logits"] == "TYPE_BF16", model
        assert io["prompt_embedding_table"] == "TYPE_FP16", model
    check_wiring(configs)


# -- text handling ------------------------------------------------------------------------------

MULTIBYTE = "Paris is nice 🙂 and 東京 has café, ñandú and naïve ümlauts; €5 ≈ 5.4$."


def test_streamed_chunks_join_to_the_full_decoding_with_whole_characters(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    singles = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in singles), "the text should split some character across tokens"
    chunks = [
        rtk_text.decode_delta(tokenizer, ids[max(0, k - rtk_text.PRECEDING_WINDOW) : k], ids[k : k + 1])
        for k in range(len(ids))
    ]
    assert "".join(chunks) == tokenizer.decode(ids) == MULTIBYTE
    assert all("\ufffd" not in c for c in chunks)
    for c in chunks:
        c.encode("utf-8")  # each chunk is valid text on its own


def test_decode_delta_of_several_tokens_and_of_a_prompt_tail(tokenizer):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    answer = tokenizer.encode(" Paris, 東京", add_special_tokens=False)
    assert rtk_text.decode_delta(tokenizer, prompt[-8:], answer) == " Paris, 東京"
    assert rtk_text.decode_delta(tokenizer, prompt, []) == ""


def test_chat_is_rendered_with_the_template_and_plain_text_is_not(tokenizer):
    chat = json.dumps([{"role": "user", "content": "What is the capital of France?"}])
    ids, dropped = rtk_text.encode_prompt(tokenizer, chat, window=512, policy="reject")
    text = tokenizer.decode(ids)
    assert dropped == 0
    assert text == tokenizer.apply_chat_template(json.loads(chat), tokenize=False, add_generation_prompt=True)
    plain, _ = rtk_text.encode_prompt(tokenizer, "What is the capital of France?", window=512, policy="reject")
    assert tokenizer.decode(plain) == "What is the capital of France?"
    assert rtk_text.parse_query('{"messages": [{"role": "user", "content": "hi"}]}') == [
        {"role": "user", "content": "hi"}
    ]
    assert rtk_text.parse_query("[1, 2] is a list") is None


@pytest.mark.parametrize("special", [False, True])
def test_encoding_through_the_backend_is_transformers_encoding(tokenizer, special):
    """``rtk_text.encode`` calls the fast tokenizer's backend directly; it must give what transformers'
    ``encode`` gives, special-token text, multi-byte text and an empty string included, and fall back to
    transformers when truncation is set (which the backend call would not reset)."""
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": MULTIBYTE}],
        tokenize=False,
        add_generation_prompt=True,
    )
    for text in (chat, MULTIBYTE, "  leading and trailing  ", "<|im_start|>user\n", "", "a" * 3000):
        want = tokenizer.encode(text, add_special_tokens=special)
        assert rtk_text.encode(tokenizer, text, add_special_tokens=special) == want, text[:40]
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    try:
        got = rtk_text.encode(tokenizer, MULTIBYTE, add_special_tokens=special)
    finally:
        tokenizer.backend_tokenizer.no_truncation()
    assert got == tokenizer.encode(MULTIBYTE, add_special_tokens=special) and len(got) > 4


def test_a_chat_from_its_kept_pieces_is_encoded_as_the_whole_text(tokenizer):
    """``rtk_text.PieceIds``: the ids of the pieces between added tokens, kept from earlier texts, give the ids
    the tokenizer gives the whole text, for texts made at random of added tokens, whitespace (next to the
    added tokens too), digits, punctuation and multi-byte text; the kept pieces stay within their bound."""
    import random

    backend = tokenizer.backend_tokenizer
    pieces = rtk_text.PieceIds.of(backend)
    assert pieces is not None, "SmolLM2's ByteLevel tokenizer encodes piece by piece"
    assert rtk_text.PieceIds.of(backend) is pieces
    small = rtk_text.PieceIds(backend, max_chars=400)
    parts = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<reponame>",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        " \n ",
        "user",
        "assistant",
        "system",
        "Hello",
        " world",
        "12",
        "3.5",
        ",",
        "!?",
        "'s",
        "é",
        "東京",
        "🙂",
        "x" * 40,
    ]
    rng = random.Random(7)
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(1, 24))) for _ in range(400)]
    for text in texts + texts[:50]:  # the repeats come from kept pieces
        want = backend.encode(text, add_special_tokens=False).ids
        assert pieces.ids(text) == want, repr(text)
        assert small.ids(text) == want, repr(text)
        assert small.chars <= 400
    assert rtk_text.encode(tokenizer, texts[0], add_special_tokens=False) == tokenizer.encode(
        texts[0], add_special_tokens=False
    )


def test_chats_are_rendered_as_apply_chat_template_renders_them(tokenizer, smollm2_tokenizer_dir, monkeypatch):
    """``rtk_text.render_chat`` calls transformers' ``render_jinja_template`` directly for messages of plain
    strings: the text of ``apply_chat_template`` for chats made at random (with and without a system prompt,
    several turns, multi-byte and template-like text), with and without the generation prompt.  A direct render
    that disagrees on the probe chats is not used."""
    import random

    from transformers.utils import chat_template_utils

    assert rtk_text._direct_renderer(tokenizer) is not None
    rng = random.Random(3)
    words = ["Hello", "{{ x }}", "<|im_end|>", "\n", "東京 🙂", "  ", "café", "{% if %}", "ok."]
    for _ in range(60):
        msgs = [{"role": "system", "content": "Be terse."}] if rng.random() < 0.5 else []
        for turn in range(rng.randint(1, 4)):
            role = "user" if turn % 2 == 0 else "assistant"
            msgs.append({"role": role, "content": " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))})
        if msgs[-1]["role"] != "user":
            msgs.append({"role": "user", "content": "and?"})
        for gen in (True, False):
            want = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert rtk_text.render_chat(tokenizer, msgs, generation_prompt=gen) == want
    real = chat_template_utils.render_jinja_template
    monkeypatch.setattr(chat_template_utils, "render_jinja_template", lambda **kw: ([real(**kw)[0][0] + " "], []))
    other = rtk_text.load_tokenizer(str(smollm2_tokenizer_dir))
    assert rtk_text._direct_renderer(other) is None
    msgs = [{"role": "user", "content": "Hi"}]
    assert rtk_text.render_chat(other, msgs) == tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_tokenizers_whose_pieces_depend_on_their_place_are_encoded_whole():
    """A pre-tokenizer that treats a text's first word apart (Metaspace's "first"), a prefix space, or an
    added token that strips the spaces beside it: the pieces would not encode as the whole does, so
    ``PieceIds.of`` is None and ``encode`` encodes the whole text."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    def made(pre, strip=False):
        vocab = {"[UNK]": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4, "Ġa": 5, "Ġb": 6}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre
        tok.add_special_tokens([AddedToken("<s>", lstrip=strip, rstrip=strip)])
        return tok

    for tok in (
        made(pre_tokenizers.Metaspace(prepend_scheme="first")),
        made(pre_tokenizers.ByteLevel(add_prefix_space=True)),
        made(pre_tokenizers.ByteLevel(add_prefix_space=False), strip=True),
    ):
        assert rtk_text.PieceIds.of(tok) is None
    assert rtk_text.PieceIds.of(made(pre_tokenizers.ByteLevel(add_prefix_space=False))) is not None


def conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        msgs += [
            {"role": "user", "content": f"Question {i}: " + "tell me more " * 20},
            {"role": "assistant", "content": f"Answer {i}: " + "here is more " * 20},
        ]
    return msgs + [{"role": "user", "content": "And finally, what is the capital of France?"}]


def test_truncate_oldest_keeps_the_system_prompt_and_the_newest_turns(tokenizer):
    msgs = conversation(6)
    full = len(
        tokenizer.encode(
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
    )
    window = full // 2
    ids, dropped = rtk_text.encode_prompt(tokenizer, json.dumps(msgs), window=window, policy="truncate_oldest")
    assert len(ids) <= window and 1 <= dropped < 6
    text = tokenizer.decode(ids)
    assert "You are terse." in text and "what is the capital of France?" in text
    assert "Question 0:" not in text and f"Answer {5}:" in text
    # exactly the oldest `dropped` turns went: one more turn would have fitted otherwise
    kept = [msgs[0]] + msgs[1 + 2 * dropped :]
    assert ids == tokenizer.encode(
        tokenizer.apply_chat_template(kept, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    longer = [msgs[0]] + msgs[1 + 2 * (dropped - 1) :]
    assert (
        len(
            tokenizer.encode(
                tokenizer.apply_chat_template(longer, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
        )
        > window
    )


def test_reject_policy_and_impossible_prompts_get_clear_errors(tokenizer):
    msgs = json.dumps(conversation(6))
    with pytest.raises(rtk_text.PromptError, match="serving.context_policy: truncate_oldest"):
        rtk_text.encode_prompt(tokenizer, msgs, window=100, policy="reject")
    with pytest.raises(rtk_text.PromptError, match="newest message"):
        rtk_text.encode_prompt(tokenizer, msgs, window=10, policy="truncate_oldest")
    with pytest.raises(rtk_text.PromptError, match="text_input is empty"):
        rtk_text.encode_prompt(tokenizer, "  ", window=100, policy="reject")
    with pytest.raises(rtk_text.PromptError, match="over the engine limit"):
        rtk_text.prompt_window(1024, 2048, 5000)
    with pytest.raises(rtk_text.PromptError, match="last chat message"):
        rtk_text.parse_query('[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]')
    assert rtk_text.prompt_window(1024, 2048, 1500) == 548


def test_word_lists_round_trip_in_tensorrt_llm_format(tokenizer):
    arr = rtk_text.word_list(tokenizer, [["Paris", " France", ""]])
    assert arr.shape[:2] == (1, 2) and arr.dtype == np.int32
    words = rtk_text.parse_word_list(arr[0])
    assert words == [
        tokenizer.encode("Paris", add_special_tokens=False),
        tokenizer.encode(" France", add_special_tokens=False),
    ]
    empty = rtk_text.word_list(tokenizer, [[]])
    assert empty.tolist() == [[[0], [-1]]] and rtk_text.parse_word_list(empty[0]) == []
