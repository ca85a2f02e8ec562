"""The typed spec: every bad input is refused with the field named and exit code 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.cli import cli
from toolkit.errors import SpecError
from toolkit.spec import check_against_model, load_spec, resolve_group_size, spec_from_dict

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def run_cli(tmp_path, monkeypatch, *args):
    monkeypatch.chdir(tmp_path)
    return CliRunner().invoke(cli, list(args))


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path):
    spec = load_spec(path)
    assert spec.name and spec.build.target in ("cpu", "trt-engine", "llmapi")


@pytest.mark.parametrize(
    "text, field, hint",
    [
        ("name: x\nquantization: {format: fp8\n", None, "line"),  # malformed YAML names the place
        ("name: x\nquantisation: {format: fp8}\n", "quantisation", "unknown field"),
        ("name: x\nquantization: {format: fp9}\n", "quantization.format", "fp8"),
        ("name: x\nquantization: {group_size: 96}\n", "quantization.group_size", "power of two"),
        ("name: x\nbuild: {max_input_len: 4096, max_seq_len: 2048}\n", "build.max_input_len", "max_seq_len"),
        (
            "name: x\nquantization: {format: nvfp4}\nbuild: {target: cpu}\n",
            "quantization.format",
            "cannot run on build.target 'cpu'",
        ),
        ("name: ../../etc\n", "name", "safe directory name"),
        ("name: x\nserving: {streaming: true}\n", "serving", "a request asks for a stream with its 'stream' input"),
        ("name: x\nbuild: {enable_chunked_context: false, max_num_tokens: 256}\n", "build.max_num_tokens", "chunked"),
        (
            "name: x\nbuild: {max_num_tokens: 64, max_num_tokens_without_decode: 32}\n",
            "build.max_num_tokens_without_decode",
            "more tokens, not fewer",
        ),
        ("name: x\nbuild: {int4_gemv: fast}\n", "build.int4_gemv", "'dot' or 'exact'"),
        ("name: x\nbuild: {step_budget_ms: 0}\n", "build.step_budget_ms", "greater than 0"),
        (
            "name: x\nbuild: {step_budget_ms: 40, enable_chunked_context: false, max_num_tokens: 1024}\n",
            "build.step_budget_ms",
            "enable_chunked_context: true",
        ),
        ("name: x\nbuild: {target: llmapi, step_budget_ms: 40}\n", "build.step_budget_ms", "in tokens only"),
        ("name: x\nbuild: {step_budget_ratio: 1}\n", "build.step_budget_ratio", "greater than 1"),
        (
            "name: x\nbuild: {step_budget_ratio: 2, enable_chunked_context: false, max_num_tokens: 1024}\n",
            "build.step_budget_ratio",
            "enable_chunked_context: true",
        ),
        ("name: x\nbuild: {target: trt-engine, step_budget_ratio: 2}\n", "build.step_budget_ratio", "in tokens only"),
        ("name: x\nbuild: {context_chunk_unit: 12}\n", "build.context_chunk_unit", "power of two"),
        (
            "name: x\nbuild: {step_budget_ratio: 2, prompt_backlog_steps: -1}\n",
            "build.prompt_backlog_steps",
            "greater than or equal to 0",
        ),
        ("name: x\nbuild: {prompt_backlog_steps: 4}\n", "build.prompt_backlog_steps", "step_budget_ratio"),
        ("name: x\nbuild: {target: trt-engine, prompt_backlog_steps: 4}\n", "build.prompt_backlog_steps", "in tokens"),
        ("name: x\nbuild: {lm_head: fp8}\n", "build.lm_head", "'exported' or 'int8'"),
        ("name: x\nbuild: {target: trt-engine, lm_head: int8}\n", "build.lm_head", "quantize_lm_head"),
        ("name: x\nbuild: {compute_dtype: float16}\n", "build.compute_dtype", "'auto', 'bfloat16' or 'float32'"),
        ("name: x\nbuild: {target: llmapi, compute_dtype: float32}\n", "build.compute_dtype", "model.dtype"),
        (
            "name: x\nbuild: {decode_batching: batched}\n",
            "build.decode_batching",
            "'auto', 'exact', 'attention' or 'full'",
        ),
        ("name: x\nbuild: {target: trt-engine, decode_batching: full}\n", "build.decode_batching", "in-flight"),
        (
            "name: x\nbuild: {context_chunk_unit: 16, max_num_tokens: 20, max_batch_size: 8}\n",
            "build.context_chunk_unit",
            "= 13",
        ),
        ("name: x\nquantization: {quantize_lm_head: true}\n", "quantization.quantize_lm_head", "not fp8"),
        ("name: x\nquantization: {weight_only_modules: [down_proj]}\n", "quantization.weight_only_modules", "not fp8"),
        (
            "name: x\nquantization: {format: int8_sq, weight_only_modules: ['*down*']}\n",
            "quantization.weight_only_modules",
            "'*down*' is not a module name",
        ),
        ("name: x\nslo: {objectives: [{metric: ttft, stat: p99}]}\n", "slo.objectives.0", "'max' or 'min'"),
        ("[1, 2]\n", None, "mapping"),
    ],
)
def test_bad_spec_is_refused_with_field_exit_2_and_nothing_written(tmp_path, monkeypatch, text, field, hint):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    msg = str(exc.value)
    assert hint in msg
    if field:
        assert f"'{field}'" in msg
    result = run_cli(tmp_path, monkeypatch, "fetch", str(path))
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and hint in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # no engines/ dir, nothing half-written


def test_missing_spec_file(tmp_path, monkeypatch):
    result = run_cli(tmp_path, monkeypatch, "fetch", "nope.yaml")
    assert result.exit_code == 2
    assert "nope.yaml" in result.output and "does not exist" in result.output


def test_overrides_from_the_command_line(tmp_path):
    path = write(tmp_path, "name: x\n")
    spec = load_spec(
        path,
        [
            "quantization.format=int4_awq",
            "quantization.group_size=64",
            "build.max_batch_size=4",
            "serving.warmup=false",
        ],
    )
    assert spec.quantization.format == "int4_awq"
    assert spec.quantization.group_size == 64
    assert spec.build.max_batch_size == 4
    assert spec.serving.warmup is False
    with pytest.raises(SpecError, match="build.nonsense"):
        load_spec(path, ["build.nonsense=1"])
    with pytest.raises(SpecError, match="KEY=VALUE"):
        load_spec(path, ["quantization.format"])


def test_defaults_are_secure():
    spec = spec_from_dict({"name": "x"})
    assert spec.serving.host == "127.0.0.1"
    assert spec.model.trust_remote_code is False


SMOL = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
}


def test_group_size_rules_against_the_model():
    auto = spec_from_dict({"name": "x", "quantization": {"format": "int4_awq"}})
    assert resolve_group_size(auto, 576, 1536) == 64  # 128 does not divide 576: fall back
    assert resolve_group_size(auto, 4096, 14336) == 128
    bad = spec_from_dict({"name": "x", "quantization": {"format": "int4_awq", "group_size": 128}})
    with pytest.raises(SpecError) as exc:
        check_against_model(bad, SMOL)
    assert "quantization.group_size" in str(exc.value) and "576" in str(exc.value) and "use 64" in str(exc.value)
    fp8 = spec_from_dict({"name": "x", "quantization": {"format": "fp8", "group_size": 128}})
    check_against_model(fp8, SMOL)  # group size is irrelevant to fp8


def test_unsupported_architecture_and_too_long_sequences():
    spec = spec_from_dict({"name": "x"})
    with pytest.raises(SpecError, match="GPT2LMHeadModel"):
        check_against_model(spec, {**SMOL, "architectures": ["GPT2LMHeadModel"]})
    long = spec_from_dict({"name": "x", "build": {"max_seq_len": 16384, "max_input_len": 8192}})
    with pytest.raises(SpecError, match="build.max_seq_len"):
        check_against_model(long, SMOL)
