"""The Triton side of the GPU targets: the C++ tensorrtllm backend config, the llmapi model and its
model.yaml, and the multi-GPU launch command, checked against TensorRT-LLM 1.2.x's own files (kept as
data in tests/data/trtllm_1_2_1_triton_models.json with their upstream paths and commits).

Configs are printed with protobuf text_format and parsed back through tritonclient's ModelConfig
schema, the way Triton reads config.pbtxt.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from toolkit.errors import SpecError
from toolkit.spec import load_spec, spec_from_dict
from toolkit.targets import TARGETS, llmapi
from toolkit.triton import gpu_models
from toolkit.triton.launch import ServeTarget, make_server
from toolkit.triton.server import TritonBinary

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = json.loads((ROOT / "tests/data/trtllm_1_2_1_triton_models.json").read_text())


def round_trip(config) -> mc.ModelConfig:
    text = text_format.MessageToString(config)
    assert "${" not in text
    return text_format.Parse(text, mc.ModelConfig())


def tensors(entries) -> dict:
    return {t.name: [mc.DataType.Name(t.data_type), list(t.dims)] for t in entries}


def gpu_spec(target="trt-engine", **sections):
    data = {"name": "t", "build": {"target": target}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return spec_from_dict(data)


# -- C++ backend --------------------------------------------------------------------------------


def test_cpp_config_carries_the_spec_values():
    spec = load_spec(
        ROOT / "examples/llama-3.1-8b-trt-engine.yaml",
        [
            "serving.batching_strategy=inflight_batching",
            "serving.batch_scheduler_policy=max_utilization",
            "build.enable_kv_cache_reuse=false",
            "serving.instance_count=1",
        ],
    )
    cfg = round_trip(gpu_models.tensorrt_llm_cpp(spec, "/srv/engines/llama/engine"))
    p = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.backend == "tensorrtllm" and cfg.name == "tensorrt_llm"
    assert cfg.max_batch_size == spec.build.max_batch_size == 64
    assert cfg.model_transaction_policy.decoupled is True
    assert list(cfg.dynamic_batching.preferred_batch_size) == [64]
    q = cfg.dynamic_batching.default_queue_policy
    # The backend forwards max_queue_size to its executor; it has no queue timeout to set.
    assert (q.max_queue_size, q.default_timeout_microseconds) == (256, 0)
    assert p["gpt_model_path"] == "/srv/engines/llama/engine"
    assert p["gpt_model_type"] == "inflight_batching"
    assert p["batch_scheduler_policy"] == "max_utilization"
    assert float(p["kv_cache_free_gpu_mem_fraction"]) == 0.9
    assert p["enable_kv_cache_reuse"] == "false" and p["enable_chunked_context"] == "true"
    assert p["max_beam_width"] == "1" and p["exclude_input_in_output"] == "true"
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, mc.ModelInstanceGroup.KIND_CPU)]
    assert "gpu_device_ids" not in p


def test_cpp_parameters_are_ones_the_backend_reads_with_values_it_accepts():
    cpp = UPSTREAM["cpp"]
    cfg = round_trip(gpu_models.tensorrt_llm_cpp(gpu_spec(), "/e"))
    p = {k: v.string_value for k, v in cfg.parameters.items()}
    assert set(p) <= set(cpp["parameter_keys"]), set(p) - set(cpp["parameter_keys"])
    assert set(cpp["parameters_read_without_default"]) <= set(p)  # absent, the backend fails to load
    allowed = cpp["parameter_values"]
    assert p["gpt_model_type"] in allowed["gpt_model_type"]
    assert p["batch_scheduler_policy"] in allowed["batch_scheduler_policy"]
    assert p["decoding_mode"] in allowed["decoding_mode"]
    for key in (
        "enable_kv_cache_reuse",
        "enable_chunked_context",
        "exclude_input_in_output",
        "normalize_log_probs",
        "multi_block_mode",
        "enable_context_fmha_fp32_acc",
    ):
        assert p[key] in allowed["bool"]
    for key in ("max_beam_width", "cancellation_check_period_ms", "stats_check_period_ms"):
        int(p[key])
    assert 0 < float(p["kv_cache_free_gpu_mem_fraction"]) <= 1


@pytest.mark.parametrize("dtype, triton", [("bfloat16", "TYPE_BF16"), ("float16", "TYPE_FP16")])
def test_cpp_tensor_interface_matches_the_upstream_template(dtype, triton):
    cpp = UPSTREAM["cpp"]
    cfg = round_trip(gpu_models.tensorrt_llm_cpp(gpu_spec(model={"dtype": dtype}), "/e"))
    want_in = {k: [triton if t == "$dtype" else t, d] for k, (t, d) in cpp["inputs"].items()}
    assert tensors(cfg.input) == want_in
    assert tensors(cfg.output) == cpp["outputs"]
    required = {t.name for t in cfg.input if not t.optional}
    assert required == set(cpp["required_inputs"])
    scalars = {t.name for t in cfg.input if t.HasField("reshape")}
    assert {"input_lengths", "request_output_len", "end_id", "streaming", "return_perf_metrics"} <= scalars
    assert all(list(t.dims) == [1] and not t.reshape.shape for t in cfg.input if t.name in scalars)


def test_cpp_warmup_requests_match_their_files():
    spec = gpu_spec(build={"max_input_len": 8, "max_seq_len": 10}, serving={"default_max_tokens": 2})
    cfg = round_trip(gpu_models.tensorrt_llm_cpp(spec, "/e"))
    (w,) = cfg.model_warmup
    files = gpu_models.cpp_warmup_files(spec, prompt_ids=[7, 8, 9])
    assert w.batch_size == 1 and set(w.inputs) == set(files) == {"input_ids", "input_lengths", "request_output_len"}
    declared = {t.name: t for t in cfg.input}
    for name, inp in w.inputs.items():
        assert inp.input_data_file == name and inp.data_type == declared[name].data_type
        assert len(files[name]) == 4 * (list(inp.dims)[0])  # INT32, Triton reads exactly dims x 4 bytes
    ids = struct.unpack(f"<{len(files['input_ids']) // 4}i", files["input_ids"])
    assert ids == (7, 8, 9, 9, 9, 9, 9, 9)  # padded to the warm-up length, capped by max_input_len
    assert struct.unpack("<i", files["input_lengths"]) == (8,)
    assert struct.unpack("<i", files["request_output_len"]) == (2,)  # max_seq_len - prompt
    assert not round_trip(gpu_models.tensorrt_llm_cpp(gpu_spec(serving={"warmup": False}), "/e")).model_warmup


def test_cpp_multi_instance_places_each_instance_on_its_own_gpus():
    spec = gpu_spec(build={"tp_size": 2}, serving={"instance_count": 2})
    cfg = round_trip(gpu_models.tensorrt_llm_cpp(spec, "/e"))
    assert cfg.parameters["gpu_device_ids"].string_value == "0,1;2,3"
    assert cfg.instance_group[0].count == 2


@pytest.mark.parametrize("logits_dtype, triton", [("float16", "TYPE_FP16"), ("float32", "TYPE_FP32")])
def test_cpp_logits_outputs_carry_the_engine_logits_dtype(tmp_path, logits_dtype, triton):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"pretrained_config": {"logits_dtype": logits_dtype}}))
    gpu_models.write_tensorrt_llm_cpp(gpu_spec(), tmp_path / "tensorrt_llm", engine)
    cfg = text_format.Parse((tmp_path / "tensorrt_llm" / "config.pbtxt").read_text(), mc.ModelConfig())
    out = tensors(cfg.output)
    assert out["context_logits"][0] == out["generation_logits"][0] == triton


@pytest.mark.parametrize(
    "target, field, value",
    [("trt-engine", "queue_timeout_ms", 2000), ("llmapi", "queue_timeout_ms", 2000), ("llmapi", "max_queue_size", 16)],
)
def test_queue_settings_a_target_cannot_enforce_are_refused_with_why(target, field, value):
    with pytest.raises(SpecError, match=f"serving.{field}.*cannot enforce it"):
        gpu_spec(target, serving={field: value})


def test_each_target_has_queue_defaults_it_enforces():
    assert gpu_spec("trt-engine").serving.max_queue_size == 64
    assert gpu_spec("cpu").serving.max_queue_size == 64
    assert gpu_spec("llmapi").serving.max_queue_size is None


def test_the_cpu_engine_yields_its_cores_to_the_front_door_by_default():
    # serving.server_niceness: 5 where the engine shares the cores with the front door, 0 for GPU engines
    assert [gpu_spec(t).serving.server_niceness for t in ("cpu", "trt-engine", "llmapi")] == [5, 0, 0]
    assert gpu_spec("cpu", serving={"server_niceness": 0}).serving.server_niceness == 0
    with pytest.raises(SpecError, match="server_niceness"):
        gpu_spec("cpu", serving={"server_niceness": 20})


# -- llmapi -------------------------------------------------------------------------------------


def test_llmapi_model_yaml_and_config_pbtxt_agree_and_carry_the_spec():
    spec = load_spec(ROOT / "examples/qwen2.5-7b-llmapi.yaml", ["quantization.kv_cache=fp8", "build.tp_size=2"])
    text = llmapi.model_yaml_text(spec, "/srv/engines/qwen/engine/hf")
    y = yaml.safe_load(text)
    up = UPSTREAM["llmapi"]
    assert set(y) - {"triton_config"} <= set(up["llm_args_fields"])
    assert set(y["triton_config"]) == set(up["triton_config_keys"])
    assert set(y["kv_cache_config"]) <= set(up["kv_cache_config_fields"])
    assert set(y["cuda_graph_config"]) <= set(up["cuda_graph_config_fields"])
    assert y["scheduler_config"]["capacity_scheduler_policy"] in up["scheduler_capacity_policies"]
    b = spec.build
    assert y["model"] == "/srv/engines/qwen/engine/hf" and y["backend"] == "pytorch"
    assert (y["tensor_parallel_size"], y["pipeline_parallel_size"]) == (2, 1)
    assert (y["max_batch_size"], y["max_num_tokens"], y["max_seq_len"], y["max_input_len"]) == (
        b.max_batch_size,
        b.max_num_tokens,
        b.max_seq_len,
        b.max_input_len,
    )
    assert y["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.85,
        "enable_block_reuse": True,
        "tokens_per_block": 32,
        "dtype": "fp8",
    }
    assert y["kv_cache_config"]["dtype"] in up["kv_cache_dtype_values"]
    assert y["enable_chunked_prefill"] is True and y["trust_remote_code"] is False
    assert y["cuda_graph_config"] == {"max_batch_size": 32, "enable_padding": True}
    cfg = round_trip(gpu_models.tensorrt_llm_llmapi(spec))
    assert cfg.backend == "python"
    # The launcher disables auto-complete, so config.pbtxt must say what model.yaml's triton_config says.
    assert cfg.max_batch_size == y["triton_config"]["max_batch_size"] == 0
    assert cfg.model_transaction_policy.decoupled is y["triton_config"]["decoupled"] is True
    assert not cfg.HasField("dynamic_batching")  # nothing waits in Triton's queue: no policy that does nothing
    assert tensors(cfg.input) == up["inputs"] and tensors(cfg.output) == up["outputs"]
    assert {t.name for t in cfg.input if not t.optional} == {"text_input"}


def test_llmapi_cuda_graphs_off_and_warmup_files():
    spec = gpu_spec("llmapi", build={"use_cuda_graph": False}, serving={"decoupled": False})
    y = llmapi.model_yaml(spec, "/m")
    assert y["cuda_graph_config"] is None  # TorchLlmArgs: None disables CUDA graphs
    assert y["triton_config"]["decoupled"] is False
    cfg = round_trip(gpu_models.tensorrt_llm_llmapi(spec))
    (w,) = cfg.model_warmup
    files = gpu_models.llmapi_warmup_files(spec)
    (n,) = struct.unpack("<I", files["text_input"][:4])
    assert files["text_input"][4:].decode() == "Hello" and n == 5  # Triton BYTES: length-prefixed
    assert struct.unpack("<i", files["sampling_param_max_tokens"]) == (4,)
    assert set(w.inputs) == set(files)


def test_llmapi_refuses_what_its_model_cannot_do():
    with pytest.raises(SpecError, match="serving.instance_count"):
        llmapi.model_yaml(gpu_spec("llmapi", serving={"instance_count": 2}), "/m")
    with pytest.raises(SpecError, match="build.target"):
        llmapi.model_yaml(gpu_spec("trt-engine"), "/m")


def test_llmapi_build_links_the_checkpoint_and_renders_model_yaml(tmp_path):
    from toolkit.hostinfo import HostInfo

    hf = tmp_path / "quantized" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"w" * 16)
    out = tmp_path / "engines" / "q" / "engine"
    host = HostInfo(packages={"tensorrt_llm": None})  # building the llmapi artifact needs no GPU
    res = llmapi.build(gpu_spec("llmapi"), tmp_path / "quantized", out, host=host)
    y = yaml.safe_load((out / "model.yaml").read_text())
    assert y["model"] == str((out / "hf").resolve()) and (out / "hf" / "model.safetensors").read_bytes() == b"w" * 16
    assert res.manifest["runs_on"]["target"] == "llmapi" and res.manifest["runs_on"]["min_sm"] == 89  # fp8
    assert llmapi.build(gpu_spec("llmapi"), tmp_path / "quantized", out, host=host).skipped


# -- multi-GPU launch ---------------------------------------------------------------------------


def launch_argv(spec, *, tritonserver="ts", repository="/repo", allow_run_as_root=None):
    """The command rtk serve runs for ``spec`` (the same path as serving it), with a stand-in binary path."""
    from dataclasses import replace

    t = ServeTarget(
        repository=Path(repository),
        target=TARGETS[spec.build.target],
        build=spec.build,
        serving=spec.serving,
        engine_dir=None,
        models=[],
    )
    server = make_server(t)
    server._binary = TritonBinary(path=Path(tritonserver), kind="configured")
    if allow_run_as_root is not None:
        server.launch = replace(server.launch, allow_run_as_root=allow_run_as_root)
    return server.command(), server.launch


def test_world_size_above_one_launches_one_rank_per_gpu_under_mpirun():
    spec = gpu_spec(
        build={"tp_size": 2, "pp_size": 2}, serving={"http_port": 9000, "grpc_port": 9001, "metrics_port": 9002}
    )
    argv, launch = launch_argv(spec, tritonserver="/opt/tritonserver/bin/tritonserver", allow_run_as_root=True)
    up = UPSTREAM["launcher"]
    assert argv[:2] == up["mpi_prefix"] and launch.ranks == 4 and launch.env == {}
    ranks, cur = [], []
    for a in argv[2:]:
        if a == up["rank_separator"]:
            ranks.append(cur)
            cur = []
        else:
            cur.append(a)
    ranks.append(cur)
    assert len(ranks) == 4
    for i, r in enumerate(ranks):
        assert r[:3] == ["-n", "1", "/opt/tritonserver/bin/tritonserver"]
        for flag in up["per_rank_flags"]:
            assert any(a.startswith(flag) for a in r), (i, flag)
        assert f"--backend-config=python,shm-region-prefix-name=prefix{i}_" in r
        assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--http-port=9000", "--grpc-port=9001"} <= set(
            r
        )
        assert ("--model-control-mode=explicit" in r) == (i > 0) and ("--load-model=tensorrt_llm" in r) == (i > 0)
        assert ("--model-control-mode=none" in r) == (i == 0)


def test_single_gpu_and_orchestrator_launch_without_mpirun_llmapi_under_mpirun_n1():
    one, _ = launch_argv(gpu_spec())
    assert one[0] == "ts" and "--model-control-mode=explicit" not in one
    # The llmapi target with tp x pp > 1 runs as one process under `mpirun -n 1` (launch_triton_server.py).
    llm, launch = launch_argv(gpu_spec("llmapi", build={"tp_size": 4}), allow_run_as_root=True)
    assert llm[:5] == ["mpirun", "--allow-run-as-root", "-n", "1", "ts"] and ":" not in llm and launch.ranks == 1
    single_llm, _ = launch_argv(gpu_spec("llmapi"))
    assert single_llm[0] == "ts"
    # Orchestrator mode: TRTLLM_ORCHESTRATOR, and the server gives the GPUs' memory pools up (--multi-model).
    multi, launch = launch_argv(gpu_spec(build={"tp_size": 2}, serving={"instance_count": 2}))
    up = UPSTREAM["launcher"]
    assert multi[0] == "ts" and launch.env == up["orchestrator_env"]
    assert set(up["multi_model_flags"]) <= set(multi)
    assert [a for a in multi if a.startswith("--cuda-memory-pool-byte-size=")] == [
        up["multi_model_flag_per_gpu"].format(gpu=g) for g in range(4)
    ]  # every GPU of the two 2-GPU instances
    no_root, _ = launch_argv(gpu_spec(build={"tp_size": 2}), repository="/r", allow_run_as_root=False)
    assert no_root[:3] == ["mpirun", "-n", "1"]


# -- written model directories ----------------------------------------------------------------


@pytest.mark.parametrize("target", ["trt-engine", "llmapi"])
def test_written_model_dir_parses_and_has_every_warmup_file(tmp_path, monkeypatch, target):
    upstream = tmp_path / "upstream"  # stands in for the NGC image's llmapi template directory
    upstream.mkdir()
    for name in gpu_models.UPSTREAM_MODEL_FILES:
        (upstream / name).write_text(f"# {name} from TensorRT-LLM\n")
    monkeypatch.setenv("RTK_LLMAPI_MODEL_DIR", str(upstream))
    spec = gpu_spec(target)
    model = tmp_path / "repo" / "tensorrt_llm"
    engine = tmp_path / "engines" / "t" / "engine"
    if target == "trt-engine":
        gpu_models.write_tensorrt_llm_cpp(spec, model, engine)
    else:  # the repository's model.yaml is the build stage's own
        engine.mkdir(parents=True)
        (engine / llmapi.MODEL_YAML).write_text(llmapi.model_yaml_text(spec, (engine / "hf").resolve()))
        gpu_models.write_tensorrt_llm_llmapi(spec, model, engine)
    cfg = text_format.Parse((model / "config.pbtxt").read_text(), mc.ModelConfig())
    assert cfg.name == "tensorrt_llm" and (model / "1").is_dir()
    files = [i.input_data_file for w in cfg.model_warmup for i in w.inputs.values()]
    assert files and all((model / "warmup" / f).is_file() for f in files)
    if target == "llmapi":
        y = yaml.safe_load((model / "1" / "model.yaml").read_text())
        assert y["model"] == str((tmp_path / "engines" / "t" / "engine" / "hf").resolve())
        assert (model / "1" / "model.py").read_text().startswith("# model.py from TensorRT-LLM")
