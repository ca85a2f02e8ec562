"""Host checks: `rtk doctor` on this CPU host, artifacts refused on the wrong GPU or stack, and the rule
that no rtk command imports ``tensorrt_llm``.

Hosts with GPUs are stood in by HostInfo dicts (``FAKE_H100_HOST``, ``FAKE_L40S_HOST``), named as
such; the doctor runs for real on this host. The import rule is tested with a sentinel
``tensorrt_llm`` package on PYTHONPATH that records any import, so the test fails if rtk imports it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.doctor import diagnose, run_doctor
from toolkit.errors import HostMismatchError
from toolkit.hostinfo import HostInfo, check_host_compatible, parse_nvidia_smi, probe_host

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3

# Stands in for the 26.04 NGC image on an H100 host.
FAKE_H100_HOST = HostInfo.from_dict(
    {
        "gpus": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * GiB, "compute_capability": [9, 0]}
        ],
        "driver_version": "590.44.01",
        "cuda_driver_version": "13.1",
        "cuda_runtime_version": "13.1",
        "packages": {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48", "nvidia-modelopt": "0.37.0", "mpi4py": "4.0.3"},
        "tritonserver": {
            "path": "/opt/tritonserver/bin/tritonserver",
            "version": "2.68.0",
            "source": "system",
            "backends": ["python", "tensorrtllm"],
        },
        "triton_container": "26.04",
        "executables": {"trtllm-build": "/usr/local/bin/trtllm-build", "mpirun": "/usr/local/mpi/bin/mpirun"},
    }
)
# Stands in for an L40S host with the 26.03 image (TensorRT-LLM 1.2.0).
FAKE_L40S_HOST = HostInfo.from_dict(
    {
        **FAKE_H100_HOST.to_dict(),
        "gpus": [{"index": 0, "name": "NVIDIA L40S", "memory_total_bytes": 48 * GiB, "compute_capability": [8, 9]}],
        "packages": {**FAKE_H100_HOST.packages, "tensorrt_llm": "1.2.0"},
        "triton_container": "26.03",
    }
)


def engine_manifest(**over) -> dict:
    runs_on = {
        "target": "trt-engine",
        "spec_name": "llama-3.1-8b-fp8",
        "tensorrt_llm": "1.2.1",
        "tensorrt": "10.14.1.48",
        "cuda": "13.1",
        "driver": "590.44.01",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "sm": 90, "compute_capability": "9.0"},
        "gpu_count": 1,
        "tp_size": 1,
        "pp_size": 1,
        "quantization": {"format": "fp8", "kv_cache": "fp8"},
    }
    runs_on.update(over)
    return {"stage": "build", "runs_on": runs_on}


# -- artifacts vs hosts -------------------------------------------------------------------------


def test_engine_runs_on_the_host_it_was_built_for():
    check_host_compatible(engine_manifest(), FAKE_H100_HOST)
    check_host_compatible({"stage": "build", "target": "cpu"}, HostInfo())  # cpu artifacts run anywhere


def test_engine_from_another_gpu_and_version_is_refused_with_what_to_rebuild():
    with pytest.raises(HostMismatchError) as e:
        check_host_compatible(engine_manifest(), FAKE_L40S_HOST)
    msg = str(e.value)
    assert (
        "engine built with TensorRT-LLM 1.2.1 on H100 80GB HBM3 (sm90); this host has TensorRT-LLM 1.2.0 on L40S (sm89)"
        in msg
    )
    assert "rtk build SPEC --force" in msg and "llama-3.1-8b-fp8" in msg


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"tensorrt_llm": "1.2.0"}, "only in the TensorRT-LLM version that built them"),
        ({"tensorrt": "10.13.3.9"}, "TensorRT 10.14.1.48 cannot load plans serialized by TensorRT 10.13.3.9"),
        ({"gpu_count": 4, "tp_size": 4}, "4 ranks (tp 4 x pp 1) and this host has 1 GPUs"),
        ({"cuda": "13.2"}, "supports CUDA 13.1 only: upgrade the driver"),
    ],
)
def test_each_mismatch_is_named(over, reason):
    with pytest.raises(HostMismatchError, match=re.escape(reason)):
        check_host_compatible(engine_manifest(**over), FAKE_H100_HOST)


def test_engine_on_a_host_without_gpu_is_refused():
    with pytest.raises(HostMismatchError, match="this host has no TensorRT-LLM on no NVIDIA GPU"):
        check_host_compatible(engine_manifest(), HostInfo())


def test_llmapi_artifact_needs_a_gpu_that_runs_its_format():
    runs_on = {
        "target": "llmapi",
        "spec_name": "q",
        "tensorrt_llm_min": "1.0",
        "min_sm": 89,
        "gpu_count": 1,
        "tp_size": 1,
        "pp_size": 1,
        "quantization": {"format": "fp8", "kv_cache": "none"},
    }
    check_host_compatible({"runs_on": runs_on}, FAKE_L40S_HOST)  # sm89 runs fp8
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
    with pytest.raises(
        HostMismatchError, match="'fp8' needs sm89 or newer and this host has A100-SXM4-80GB \\(sm80\\)"
    ):
        check_host_compatible({"runs_on": runs_on}, ampere)
    with pytest.raises(HostMismatchError, match="has none.*TensorRT-LLM >= 1.0 is not installed"):
        check_host_compatible({"runs_on": runs_on}, HostInfo())


# -- doctor ---------------------------------------------------------------------------------------


def test_doctor_on_a_stand_in_gpu_host_passes_the_gpu_targets():
    for target in ("trt-engine", "llmapi"):
        report = diagnose(target, FAKE_H100_HOST)
        assert report.ok, [c for c in report.checks if c.status == "fail"]
    old = diagnose("trt-engine", FAKE_L40S_HOST)  # TensorRT-LLM 1.2.0 is outside the matrix (1.2.1 only)
    assert [c.name for c in old.checks if c.status == "warn"] == ["TensorRT-LLM", "Triton container"]
    old_driver = HostInfo.from_dict({**FAKE_H100_HOST.to_dict(), "driver_version": "580.95.05"})
    (bad,) = diagnose("trt-engine", old_driver).failures
    assert bad.name == "NVIDIA driver" and "590.44" in bad.fix


def test_doctor_says_how_the_cpu_engine_computes_from_the_cpus_flags():
    def engine_check(flags):
        host = HostInfo.from_dict({**probe_host(triton_version=False).to_dict(), "cpu_flags": flags})
        (check,) = [c for c in diagnose("cpu", host).checks if c.name == "CPU engine"]
        return check

    zen4 = engine_check(["avx2", "fma", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi"])
    assert zen4.status == "ok" and "bf16" in zen4.found and "AMX" not in zen4.found
    sapphire_rapids_flags = ["avx2", "fma", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi", "amx_bf16"]
    sapphire_rapids_flags.append("amx_tile")
    sapphire_rapids = engine_check(sapphire_rapids_flags)
    assert sapphire_rapids.status == "ok" and "AMX's bf16 tiles, every row with oneDNN's bits" in sapphire_rapids.found
    assert "integer products" not in sapphire_rapids.found  # no AVX512-VNNI listed: rtk's VNNI build cannot run
    vnni = ["avx512f", "avx512_vnni"]
    zen4_vnni = engine_check(["avx2", "fma", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi", *vnni])
    assert "bf16" in zen4_vnni.found and "INT8-SQ / INT4-AWQ exports compute in float32" in zen4_vnni.found
    amx_vnni = engine_check([*sapphire_rapids_flags, *vnni])
    assert "AMX's bf16 tiles" in amx_vnni.found and "VNNI integer products" in amx_vnni.found
    assert "int8 tiles" not in amx_vnni.found  # no AMX-INT8 listed
    amx_int8 = engine_check([*sapphire_rapids_flags, *vnni, "amx_int8"])
    assert "INT4-AWQ prompt rows in AMX's int8 tiles" in amx_int8.found and "decode_batching" in amx_int8.found
    zen3 = engine_check(["avx2", "fma"])
    assert zen3.status == "warn" and "float32" in zen3.found and "AVX2 kernels" in zen3.found
    assert "int8_sq" in zen3.fix and "docs/engine-measurements.md" in zen3.fix and "VNNI" not in zen3.found
    ice_lake = engine_check(["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni"])
    assert ice_lake.status == "warn" and "float32" in ice_lake.found and "VNNI" in ice_lake.found
    assert "oneDNN's int8 GEMM" in ice_lake.found and ice_lake.fix == zen3.fix
    old = engine_check([])
    assert old.status == "warn" and "torch's operators only" in old.found
    assert diagnose("cpu", HostInfo.from_dict({**probe_host(triton_version=False).to_dict(), "cpu_flags": []})).ok
    # this host: what the probe read is what /proc/cpuinfo lists
    from toolkit.hostinfo import CPU_FLAGS, cpu_flags

    assert set(probe_host(triton_version=False).cpu_flags) == cpu_flags() & set(CPU_FLAGS)


def test_doctor_says_whether_the_cpu_engine_gets_huge_pages():
    def pages_check(mode):
        host = HostInfo.from_dict({**probe_host(triton_version=False).to_dict(), "transparent_hugepages": mode})
        (check,) = [c for c in diagnose("cpu", host).checks if c.name == "huge pages"]
        return check

    assert pages_check("madvise").status == "ok" and pages_check("always").status == "ok"
    never = pages_check("never")
    assert never.status == "warn" and "never" in never.found and "madvise" in never.fix
    assert pages_check(None).status == "warn"
    from toolkit.hostinfo import THP_SETTING, transparent_hugepages

    if THP_SETTING.exists():  # this host: the bracketed word of the kernel's setting
        text = THP_SETTING.read_text()
        assert transparent_hugepages() == text[text.index("[") + 1 : text.index("]")]
        assert probe_host(triton_version=False).transparent_hugepages == transparent_hugepages()


def test_doctor_cli_on_this_cpu_host(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    ok = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "doctor", "--target", "cpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "cpu: can run" in ok.stdout and "tritonserver" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "doctor", "--target", "trt-engine"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "GPU" in bad.stderr and "use a host with an NVIDIA GPU" in bad.stderr
    assert "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3" in bad.stderr
    js = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert js.returncode == 0  # without --target it reports and does not gate
    report = json.loads(js.stdout)
    verdict = {t["target"]: t["ok"] for t in report["targets"]}
    assert verdict == {"cpu": True, "trt-engine": False, "llmapi": False}
    assert report["host"]["gpus"] == [] and report["host"]["tritonserver"]["version"]


def test_doctor_checks_an_engine_against_this_host(tmp_path):
    from toolkit.artifacts import MANIFEST

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / MANIFEST).write_text(json.dumps(engine_manifest()))
    _, reports = run_doctor(["cpu"], engine_dir=eng, host=FAKE_L40S_HOST)
    (check,) = reports[-1].checks
    assert check.status == "fail" and "sm89" in check.fix


def test_probe_on_this_host_finds_no_gpu_and_the_bundled_server():
    host = probe_host()
    assert not host.has_gpu and host.packages["tensorrt_llm"] is None
    assert host.tritonserver is not None and host.tritonserver.version.count(".") == 2
    assert host.packages["numpy"].startswith("1.")


def test_nvidia_smi_parsing_from_recorded_output():
    # Recorded `nvidia-smi --query-gpu=index,name,memory.total,compute_cap,driver_version --format=csv,noheader,nounits`
    # on a two-GPU H100 host (stands in for the GPU this host lacks).
    text = "0, NVIDIA H100 80GB HBM3, 81559, 9.0, 590.44.01\n1, NVIDIA H100 80GB HBM3, 81559, 9.0, 590.44.01\n"
    gpus, driver = parse_nvidia_smi(text)
    assert driver == "590.44.01" and [g.sm for g in gpus] == [90, 90]
    assert gpus[1].index == 1 and gpus[0].memory_total_bytes == 81559 * 1024 * 1024


# -- never import tensorrt_llm ------------------------------------------------------------------

SENTINEL = """import os, sys, traceback
with open(os.environ["TRTLLM_SENTINEL_LOG"], "a") as f:
    f.write("imported by:\\n" + "".join(traceback.format_stack()))
raise ImportError("tensorrt_llm sentinel: rtk must not import tensorrt_llm on a CPU host")
"""

PROBE = """import sys
from click.testing import CliRunner
from toolkit.cli import cli
runner = CliRunner()
every_help = [[name, "--help"] for name in cli.commands]  # every registered command, whoever wrote it
doctor = [["doctor"], ["doctor", "--target", "trt-engine"], ["doctor", "--target", "llmapi", "--json"]]
for args in (["--help"], *every_help, *doctor):
    r = runner.invoke(cli, args)
    assert r.exit_code in (0, 2), (args, r.output, r.exception)
import toolkit.targets.trt_engine, toolkit.targets.llmapi, toolkit.doctor, toolkit.hostinfo, toolkit.triton.launch
from toolkit.spec import load_spec
from toolkit.targets import TARGETS, llmapi
from toolkit.triton import gpu_models
spec = load_spec("examples/llama-3.1-8b-trt-engine.yaml")
gpu_models.tensorrt_llm_cpp(spec, "/e")
TARGETS["trt-engine"].triton_launch(spec.build, spec.serving)
qwen = load_spec("examples/qwen2.5-7b-llmapi.yaml")
llmapi.model_yaml(qwen, "/m")
gpu_models.tensorrt_llm_llmapi(qwen)
print("TRTLLM_IMPORTED" if "tensorrt_llm" in sys.modules else "TRTLLM_NOT_IMPORTED")
"""


def test_no_rtk_command_imports_tensorrt_llm(tmp_path):
    pkg = tmp_path / "site" / "tensorrt_llm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(SENTINEL)
    log = tmp_path / "imports.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
        "TRTLLM_SENTINEL_LOG": str(log),
    }
    # The sentinel really is importable: a check that would catch an import.
    seen = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('tensorrt_llm').origin)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert str(pkg) in seen.stdout
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TRTLLM_NOT_IMPORTED" in r.stdout
    assert not log.exists(), log.read_text()
