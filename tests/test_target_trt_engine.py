"""trt-engine build on a CPU host: the trtllm-build command line, the checks around it, the memory estimate.

Nothing here can run TensorRT-LLM (no GPU). Two stand-ins are used and named as such:
``FAKE_H100_HOST`` (a HostInfo saying "H100", standing in for a GPU host) and ``fake_trtllm_build``
(an executable standing in for TensorRT-LLM's GPU-only ``trtllm-build``). The stand-in parses its
command line with a parser built from tests/data/trtllm_1_2_1_trtllm_build.json (the flag set read
from TensorRT-LLM's build.py and plugin.py), so an invalid flag or value makes the build fail.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from toolkit.artifacts import read_manifest
from toolkit.errors import HostMismatchError, SpecError, StageError, UsageError
from toolkit.hostinfo import GPUInfo, HostInfo
from toolkit.spec import load_spec, spec_from_dict
from toolkit.targets import trt_engine
from toolkit.targets.gpu_memory import GiB, ModelShape, check_fits, estimate_memory

ROOT = Path(__file__).resolve().parent.parent
FLAGS = json.loads((ROOT / "tests/data/trtllm_1_2_1_trtllm_build.json").read_text())

# Stands in for a GPU host: what probe_host() returns inside the 26.04 NGC image on an H100.
FAKE_H100_HOST = HostInfo(
    gpus=[GPUInfo(0, "NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0))],
    driver_version="590.44.01",
    cuda_driver_version="13.1",
    cuda_runtime_version="13.1",
    packages={"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48", "nvidia-modelopt": "0.37.0"},
)

# SmolLM2-135M's TensorRT-LLM checkpoint config.json as ModelOpt 0.47 writes it (measured on this project's export).
SMOL_TRTLLM_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.47.0"},
    "architecture": "LlamaForCausalLM",
    "decoder": "llama",
    "dtype": "bfloat16",
    "logits_dtype": "float16",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "head_size": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "position_embedding_type": "rope_gpt_neox",
    "rotary_base": 100000.0,
    "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
}


def flag_parser() -> argparse.ArgumentParser:
    """argparse for trtllm-build 1.2.x, built from the flag data (not from rtk's code)."""
    p = argparse.ArgumentParser(prog="trtllm-build", add_help=False, exit_on_error=False)
    for flag, d in FLAGS["flags"].items():
        names = [flag, *d.get("aliases", [])]
        if d["type"] == "flag":
            p.add_argument(*names, action="store_true")
        elif d["type"] == "choice":
            p.add_argument(*names, choices=d["choices"])
        else:
            p.add_argument(*names, type=int if d["type"] == "int" else str, nargs=d.get("nargs"))
    return p


def parse_trtllm_build(argv: list[str]) -> argparse.Namespace:
    ns, unknown = flag_parser().parse_known_args(argv[1:])
    assert not unknown, f"flags trtllm-build 1.2.x does not have: {unknown}"
    return ns


def trt_spec(**build) -> object:
    return spec_from_dict({"name": "smol-trt", "build": {"target": "trt-engine", **build}})


def write_checkpoint(root: Path, config: dict = SMOL_TRTLLM_CONFIG) -> Path:
    ckpt = root / "quantized" / "trtllm"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(config))
    for r in range(config["mapping"]["world_size"]):
        (ckpt / f"rank{r}.safetensors").write_bytes(b"\0" * 8)
    return ckpt.parent


# -- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["examples/llama-3.1-8b-trt-engine.yaml"])
def test_example_command_uses_only_trtllm_1_2_flags_with_valid_values(example):
    spec = load_spec(ROOT / example)
    config = {
        **SMOL_TRTLLM_CONFIG,
        "max_position_embeddings": 131072,
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
    }
    argv = trt_engine.trtllm_build_command(spec, "/q/trtllm", "/e", config)
    assert argv[0] == "trtllm-build"
    ns = parse_trtllm_build(argv)  # raises on an unknown flag or a value outside the choices
    b = spec.build
    assert (ns.max_batch_size, ns.max_input_len, ns.max_seq_len, ns.max_num_tokens, ns.max_beam_width) == (
        b.max_batch_size,
        b.max_input_len,
        b.max_seq_len,
        b.max_num_tokens,
        b.max_beam_width,
    )
    assert (ns.kv_cache_type, ns.tokens_per_block) == ("paged", b.tokens_per_block)
    assert ns.use_paged_context_fmha == "enable" and ns.multiple_profiles == "enable"
    assert ns.gpt_attention_plugin == "auto" and ns.remove_input_padding == "enable"  # in-flight batching needs both
    assert ns.gemm_plugin == "auto" and ns.use_fused_mlp == "enable"
    assert "--build_config" not in argv  # with it, trtllm-build ignores the shape flags
    assert ns.opt_num_tokens is None  # conflicts with --multiple_profiles enable
    assert not any(a.startswith("--tp") or a.startswith("--pp") for a in argv)  # parallelism comes from the checkpoint


def test_every_spec_choice_maps_to_a_valid_flag_value():
    for gemm in ("auto", "disable", "bfloat16"):
        for on in (True, False):
            spec = trt_spec(gemm_plugin=gemm, multiple_profiles=on, use_fused_mlp=on, use_paged_context_fmha=True)
            ns = parse_trtllm_build(trt_engine.trtllm_build_command(spec, "c", "o", SMOL_TRTLLM_CONFIG))
            assert ns.gemm_plugin == gemm and ns.multiple_profiles == ("enable" if on else "disable")


def test_fused_mlp_is_spelled_off_where_trtllm_build_would_force_it_off():
    int4 = {**SMOL_TRTLLM_CONFIG, "quantization": {"quant_algo": "W4A16_AWQ", "group_size": 64}}
    spec = spec_from_dict({"name": "x", "build": {"target": "trt-engine"}, "quantization": {"format": "int4_awq"}})
    assert parse_trtllm_build(trt_engine.trtllm_build_command(spec, "c", "o", int4)).use_fused_mlp == "disable"


@pytest.mark.parametrize(
    "build, field",
    [
        (
            {"max_batch_size": 1, "max_seq_len": 256, "max_input_len": 128, "max_num_tokens": 512},
            "build.max_num_tokens",
        ),
        ({"max_num_tokens": 16, "max_batch_size": 8, "tokens_per_block": 64}, "build.max_num_tokens"),
        ({"max_seq_len": 16384, "max_input_len": 1024}, "build.max_seq_len"),
        ({"gemm_plugin": "nvfp4"}, "build.gemm_plugin"),
        ({"gemm_plugin": "float16"}, "build.gemm_plugin"),
    ],
)
def test_limits_trtllm_build_would_rewrite_are_refused(build, field):
    with pytest.raises(SpecError) as e:
        trt_engine.check_limits(trt_spec(**build), SMOL_TRTLLM_CONFIG)
    assert e.value.field == field


def test_checkpoint_must_match_the_spec(tmp_path):
    q = write_checkpoint(tmp_path)
    ckpt = q / "trtllm"
    trt_engine.check_checkpoint(trt_spec(), SMOL_TRTLLM_CONFIG, ckpt)
    with pytest.raises(UsageError, match="exported for tp_size 1, pp_size 1 but the spec asks for build.tp_size 2"):
        trt_engine.check_checkpoint(trt_spec(tp_size=2), SMOL_TRTLLM_CONFIG, ckpt)
    int4 = spec_from_dict({"name": "x", "build": {"target": "trt-engine"}, "quantization": {"format": "int4_awq"}})
    with pytest.raises(UsageError, match="quantized as FP8 but quantization.format is 'int4_awq'"):
        trt_engine.check_checkpoint(int4, SMOL_TRTLLM_CONFIG, ckpt)
    fp8kv = spec_from_dict(
        {"name": "x", "build": {"target": "trt-engine"}, "quantization": {"format": "fp8", "kv_cache": "fp8"}}
    )
    with pytest.raises(UsageError, match="KV-cache quantization none but quantization.kv_cache is 'fp8'"):
        trt_engine.check_checkpoint(fp8kv, SMOL_TRTLLM_CONFIG, ckpt)
    # quantize_lm_head under int8_sq: ModelOpt writes MIXED_PRECISION (a W8A16 head), which the plain spec refuses
    mixed = {**SMOL_TRTLLM_CONFIG, "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None}}
    int8 = {"name": "x", "build": {"target": "trt-engine"}, "quantization": {"format": "int8_sq"}}
    head = spec_from_dict({**int8, "quantization": {"format": "int8_sq", "quantize_lm_head": True}})
    trt_engine.check_checkpoint(head, mixed, ckpt)
    with pytest.raises(UsageError, match="quantized as MIXED_PRECISION but quantization.format is 'int8_sq'"):
        trt_engine.check_checkpoint(spec_from_dict(int8), mixed, ckpt)
    sq = {**SMOL_TRTLLM_CONFIG, "quantization": {"quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": None}}
    with pytest.raises(UsageError, match="'int8_sq' with quantize_lm_head"):
        trt_engine.check_checkpoint(head, sq, ckpt)
    # trtllm-build keeps the fused MLP for MIXED_PRECISION; its INT8-SQ MLPs do not take it, so rtk says off
    assert not trt_engine.fused_mlp_effective(head, mixed)
    (ckpt / "rank0.safetensors").unlink()
    with pytest.raises(UsageError, match="lacks rank0.safetensors"):
        trt_engine.check_checkpoint(trt_spec(), SMOL_TRTLLM_CONFIG, ckpt)


# -- the memory estimate ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, group, head, measured_mb",
    [
        ("fp8", None, False, 219.5),
        ("int4_awq", 64, False, 173.3),
        ("int8_sq", None, False, 220.4),
        ("int8_sq", None, True, 192.3),  # quantize_lm_head: a W8A16 head instead of bf16
    ],
)
def test_weight_estimate_matches_measured_checkpoint_sizes(fmt, group, head, measured_mb):
    # Independent reference: rank0.safetensors sizes of ModelOpt 0.47's SmolLM2-135M exports, measured
    # on disk (not derived from the estimate's formula).
    q = {"format": fmt, "group_size": group, "quantize_lm_head": head}
    spec = spec_from_dict({"name": "x", "quantization": q})
    est = estimate_memory(ModelShape.from_config(SMOL_TRTLLM_CONFIG), spec)
    assert est.weights_total / 1e6 == pytest.approx(measured_mb, rel=0.01)


def test_kv_and_weights_for_llama_3_1_8b_match_published_figures():
    # Llama-3.1-8B: 8.03e9 parameters; KV cache 128 KiB per token in 16-bit (32 layers x 8 KV heads x 128 x 2 x 2 B).
    hf_config = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    bf16 = spec_from_dict({"name": "x", "quantization": {"format": "none"}, "build": {"max_seq_len": 4096}})
    est = estimate_memory(ModelShape.from_config(hf_config), bf16)
    assert est.weights_total / 2 == pytest.approx(8.03e9, rel=0.005)
    assert est.kv_bytes_per_token == 128 * 1024
    assert est.kv_bytes_per_sequence == 4096 * 128 * 1024
    fp8kv = spec_from_dict(
        {
            "name": "x",
            "quantization": {"format": "fp8", "kv_cache": "fp8"},
            "build": {"tp_size": 2, "target": "trt-engine"},
        }
    )
    est2 = estimate_memory(ModelShape.from_config(hf_config), fp8kv)
    assert est2.kv_bytes_per_token == 128 * 1024 // 2 // 2  # one byte per value, half the KV heads per GPU
    assert est2.weights_per_gpu < est.weights_per_gpu / 3


def test_a_build_that_cannot_fit_is_refused_with_what_to_change():
    hf_config = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    spec = spec_from_dict(
        {
            "name": "x",
            "quantization": {"format": "none"},
            "build": {"target": "trt-engine", "max_seq_len": 8192, "max_input_len": 4096},
        }
    )
    est = estimate_memory(ModelShape.from_config(hf_config), spec)
    fit = check_fits(est, spec, 80 * GiB, "H100 (sm90)")  # stands in for an 80 GB GPU
    assert fit.full_sequences >= spec.build.max_batch_size and fit.note() is None
    tight = check_fits(est, spec, 22 * GiB, "L4 (sm89)")  # fits, but the KV pool holds only a few 8k sequences
    assert 1 <= tight.full_sequences < spec.build.max_batch_size and "holds" in tight.note()
    with pytest.raises(SpecError, match=r"cannot fit on the A2 \(sm86\) \(16.00 GiB\).*int4_awq.*build.tp_size"):
        check_fits(est, spec, 16 * GiB, "A2 (sm86)")  # 16 GB of bf16 weights alone


# -- the stage, with stand-ins for the GPU ----------------------------------------------------

FAKE_TRTLLM_BUILD = r"""#!{python}
# fake_trtllm_build: stands in for TensorRT-LLM's trtllm-build, which needs a GPU. It validates its command line
# against the 1.2.x flag data and writes what Engine.save writes: config.json and one rank<N>.engine per rank.
import argparse, json, sys
from pathlib import Path
flags = json.loads(Path({flags!r}).read_text())["flags"]
p = argparse.ArgumentParser(prog="trtllm-build")
for flag, d in flags.items():
    names = [flag, *d.get("aliases", [])]
    if d["type"] == "flag": p.add_argument(*names, action="store_true")
    elif d["type"] == "choice": p.add_argument(*names, choices=d["choices"])
    else: p.add_argument(*names, type=int if d["type"] == "int" else str, nargs=d.get("nargs"))
a = p.parse_args()
print("[TensorRT-LLM] fake build of", a.checkpoint_dir, flush=True)
if {fail!r}:
    print("[TensorRT-LLM][ERROR] out of memory while building (stand-in failure)", flush=True); sys.exit(3)
cfg = json.loads((Path(a.checkpoint_dir) / "config.json").read_text())
out = Path(a.output_dir); out.mkdir(parents=True, exist_ok=True)
on = lambda v: v == "enable"
build_config = dict(max_batch_size=a.max_batch_size, max_input_len=a.max_input_len, max_seq_len=a.max_seq_len,
    max_num_tokens=a.max_num_tokens, max_beam_width=a.max_beam_width, kv_cache_type=a.kv_cache_type.upper(),
    plugin_config=dict(tokens_per_block=a.tokens_per_block, use_paged_context_fmha=on(a.use_paged_context_fmha),
        multiple_profiles=on(a.multiple_profiles), remove_input_padding=on(a.remove_input_padding),
        context_fmha=on(a.context_fmha), paged_kv_cache=True, gemm_plugin=a.gemm_plugin))
(out / "config.json").write_text(json.dumps(dict(version="1.2.1", pretrained_config=cfg, build_config=build_config)))
for r in range(cfg["mapping"]["world_size"]): (out / f"rank{{r}}.engine").write_bytes(b"plan")
Path(a.output_timing_cache).write_bytes(b"cache")
"""


def fake_trtllm_build(bin_dir: Path, *, fail: bool = False) -> str:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "trtllm-build"
    exe.write_text(
        FAKE_TRTLLM_BUILD.format(
            python=sys.executable, flags=str(ROOT / "tests/data/trtllm_1_2_1_trtllm_build.json"), fail=fail
        )
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_build_stage_with_stand_ins_writes_engine_log_and_runs_on_record(tmp_path):
    q = write_checkpoint(tmp_path)
    exe = fake_trtllm_build(tmp_path / "bin")
    spec = trt_spec(max_batch_size=4, max_num_tokens=256)
    out = tmp_path / "engines" / "smol-trt" / "engine"
    result = trt_engine.build(spec, q, out, host=FAKE_H100_HOST, exe=exe)
    assert not result.skipped
    assert (out / "rank0.engine").is_file() and not (out / "model.cache").exists()
    log = (out / "build.log").read_text()
    assert log.startswith("$ " + exe) and "fake build of" in log
    m = read_manifest(out)
    r = m["runs_on"]
    assert (r["target"], r["tensorrt_llm"], r["tensorrt"], r["cuda"]) == ("trt-engine", "1.2.1", "10.14.1.48", "13.1")
    assert (r["gpu"]["sm"], r["gpu"]["name"], r["tp_size"], r["pp_size"]) == (90, "NVIDIA H100 80GB HBM3", 1, 1)
    assert r["quantization"]["quant_algo"] == "FP8" and len(r["spec_hash"]) == 64
    assert str(out.resolve()) in m["build_command"]  # the recorded command names the final directory
    again = trt_engine.build(spec, q, out, host=FAKE_H100_HOST, exe=exe)
    assert again.skipped  # same inputs, same stack: cached
    other_gpu = HostInfo.from_dict(
        {
            **FAKE_H100_HOST.to_dict(),
            "gpus": [{"index": 0, "name": "NVIDIA L40S", "memory_total_bytes": 48 * GiB, "compute_capability": [8, 9]}],
        }
    )
    assert not trt_engine.build(spec, q, out, host=other_gpu, exe=exe).skipped  # another GPU: rebuilt


def test_failed_build_keeps_its_log_and_leaves_no_engine(tmp_path):
    q = write_checkpoint(tmp_path)
    exe = fake_trtllm_build(tmp_path / "bin", fail=True)
    out = tmp_path / "engines" / "smol-trt" / "engine"
    with pytest.raises(StageError, match="(?s)exit code 3.*out of memory"):
        trt_engine.build(trt_spec(), q, out, host=FAKE_H100_HOST, exe=exe)
    assert not out.exists() and not list(out.parent.glob(".engine.tmp-*"))
    assert "out of memory" in (out.parent / "engine.build-failed.log").read_text()


def test_engine_that_lost_a_spec_value_is_refused(tmp_path):
    eng = tmp_path / "e"
    eng.mkdir()
    (eng / "rank0.engine").write_bytes(b"x")
    spec = trt_spec()
    built = trt_engine.expected_build_config(spec)
    built["max_num_tokens"] = 128  # what trtllm-build's clamping would leave behind
    (eng / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": built}))
    with pytest.raises(StageError, match=r"max_num_tokens=128 \(spec: 512\)"):
        trt_engine.verify_engine(eng, spec)


def test_build_refuses_a_host_without_gpu_or_with_too_old_a_gpu(tmp_path):
    q = write_checkpoint(tmp_path)
    exe = fake_trtllm_build(tmp_path / "bin")
    with pytest.raises(HostMismatchError, match="needs an NVIDIA GPU and this host has none.*26.04-trtllm-python-py3"):
        trt_engine.build(trt_spec(), q, tmp_path / "e", host=HostInfo(), exe=exe)
    ampere = HostInfo.from_dict(
        {
            **FAKE_H100_HOST.to_dict(),
            "gpus": [
                {
                    "index": 0,
                    "name": "NVIDIA A100-SXM4-80GB",
                    "memory_total_bytes": 80 * GiB,
                    "compute_capability": [8, 0],
                }
            ],
        }
    )
    with pytest.raises(HostMismatchError, match="'fp8'.*needs compute capability sm89.*A100-SXM4-80GB \\(sm80\\)"):
        trt_engine.build(trt_spec(), q, tmp_path / "e", host=ampere, exe=exe)
    assert not (tmp_path / "e").exists()


def test_examples_validate():
    for path in ("examples/llama-3.1-8b-trt-engine.yaml", "examples/qwen2.5-7b-llmapi.yaml"):
        spec = load_spec(ROOT / path)
        assert spec.build.target in ("trt-engine", "llmapi") and spec.model.source.startswith("hf:")
    assert os.path.isfile(ROOT / "tests/data/trtllm_1_2_1_trtllm_build.json")


def test_rtk_build_on_a_host_without_gpu_refuses_before_the_first_stage(tmp_path, monkeypatch):
    """Without the fail-fast check, this would start by downloading 16 GB and quantizing an 8B model on the CPU."""
    from click.testing import CliRunner

    from toolkit.cli import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(cli, ["build", str(ROOT / "examples/llama-3.1-8b-trt-engine.yaml")])
    assert r.exit_code == 2, r.output
    assert "cannot build the trt-engine target" in r.output and "needs an NVIDIA GPU" in r.output
    assert "rtk quantize SPEC" in r.output and "26.04-trtllm-python-py3" in r.output
    assert not (tmp_path / "engines").exists()  # not even the fetch stage started
