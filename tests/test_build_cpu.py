"""The cpu build stage and `rtk build`'s pipeline (fetch → quantize → build → emit) on the tiny Llama."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict

import pytest
from click.testing import CliRunner
from conftest import spec_for

from toolkit.artifacts import read_manifest
from toolkit.errors import SourceError
from toolkit.runtime.engine import EngineConfig, GenerationRequest
from toolkit.targets import build
from toolkit.targets.cpu import ENGINE_CONFIG, SERVED_GOMP_SPINCOUNT, engine_config, load_engine

BUILD = {"max_batch_size": 4, "max_input_len": 200, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}


@pytest.fixture()
def quantized_dir(tmp_path, tiny_llama_dir):
    """A quantize-stage-shaped directory: hf/ holding an (unquantized) HF checkpoint."""
    d = tmp_path / "quantized"
    shutil.copytree(tiny_llama_dir, d / "hf")
    return d


def test_cpu_build_writes_engine_config_and_checkpoint_with_manifest(tmp_path, tiny_llama_dir, quantized_dir):
    spec = spec_for("b", tiny_llama_dir, quantization={"format": "none"}, build=BUILD)
    out = tmp_path / "engine"
    first = build(spec, quantized_dir, out)
    assert not first.skipped
    assert json.loads((out / ENGINE_CONFIG).read_text()) == asdict(EngineConfig.from_build(spec.build))
    m = read_manifest(out)
    assert m["complete"] and m["target"] == "cpu" and m["spec"] == spec.build.model_dump()
    assert m["model"]["architecture"] == "LlamaForCausalLM" and m["model"]["quant_algo"] is None
    for f in (quantized_dir / "hf").iterdir():  # linked, not re-encoded
        assert (out / "hf" / f.name).read_bytes() == f.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    assert build(spec, quantized_dir, out).skipped
    changed = spec_for("b", tiny_llama_dir, quantization={"format": "none"}, build={**BUILD, "max_batch_size": 2})
    again = build(changed, quantized_dir, out)
    assert not again.skipped and json.loads((out / ENGINE_CONFIG).read_text())["max_batch_size"] == 2


def test_a_changed_engine_config_schema_rebuilds(tmp_path, tiny_llama_dir, quantized_dir, monkeypatch):
    """An rtk whose EngineConfig gained a field must not reuse the engine_config.json an older one wrote."""
    from dataclasses import dataclass

    import toolkit.targets.cpu as cpu

    spec = spec_for("b", tiny_llama_dir, quantization={"format": "none"}, build=BUILD)
    out = tmp_path / "engine"
    build(spec, quantized_dir, out)
    assert build(spec, quantized_dir, out).skipped

    @dataclass
    class NewerConfig(EngineConfig):
        a_new_knob: int = 1

    monkeypatch.setattr(cpu, "engine_config", lambda s: NewerConfig(**asdict(EngineConfig.from_build(s.build))))
    again = build(spec, quantized_dir, out)
    assert not again.skipped and json.loads((out / ENGINE_CONFIG).read_text())["a_new_knob"] == 1


def test_a_manifestless_checkpoint_changed_within_the_same_second_rebuilds(tmp_path, tiny_llama_dir, quantized_dir):
    """Same file sizes and mtimes, other weights: the build must not reuse the old engine."""
    import os

    spec = spec_for("b", tiny_llama_dir, quantization={"format": "none"}, build=BUILD)
    out = tmp_path / "engine"
    build(spec, quantized_dir, out)
    weights = next((quantized_dir / "hf").glob("*.safetensors"))
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-2:] = bytes(b ^ 0xFF for b in data[-2:])  # the last tensor's last value, same length
    weights.unlink()  # the build linked it: write a new file, not through the link
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not build(spec, quantized_dir, out).skipped


def test_engine_loaded_from_the_build_generates_like_the_engine_itself(tmp_path, tiny_llama_dir, quantized_dir):
    spec = spec_for("b", tiny_llama_dir, quantization={"format": "none"}, build=BUILD)
    out = build(spec, quantized_dir, tmp_path / "engine").path
    from toolkit.runtime.engine import Engine

    req = dict(prompt_ids=[1, 5, 42, 7, 99], max_new_tokens=6, end_id=-1)
    built = load_engine(out).generate(GenerationRequest(**req))
    direct = Engine(tiny_llama_dir, EngineConfig.from_build(spec.build)).generate(GenerationRequest(**req))
    assert built == direct and len(built) == 6


def test_a_served_engine_takes_every_core_unless_the_spec_says(tmp_path, tiny_llama_dir, quantized_dir):
    import os

    import torch

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        unset = build(
            spec_for("t", tiny_llama_dir, quantization={"format": "none"}, build=BUILD),
            quantized_dir,
            tmp_path / "unset",
        ).path
        assert load_engine(unset).config.num_threads is None  # the engine alone: torch's default, all cores
        served = load_engine(unset, served=True)
        # served: every core for every step (docs/engine-measurements.md, "One OpenMP pool"); the step kinds' own
        # counts unset
        assert served.config.num_threads == cores and torch.get_num_threads() == cores
        assert served.config.follow_free_cores  # fewer while other processes take cores (test_runtime_free_cores)
        assert (served.config.prefill_threads, served.config.lone_decode_threads) == (None, None)
        assert load_engine(unset, served=True, lone_decode_threads=1).config.lone_decode_threads == 1
        spec = spec_for("t", tiny_llama_dir, quantization={"format": "none"}, build={**BUILD, "num_threads": 1})
        config = load_engine(build(spec, quantized_dir, tmp_path / "set").path, served=True).config
        # the spec's threads, for every step
        assert (config.num_threads, config.prefill_threads, config.lone_decode_threads) == (1, None, None)
        assert not config.follow_free_cores  # the spec's count, whatever the load
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "env, configured, spin",
    [
        ({}, None, "100000"),
        ({}, 10000, "10000"),
        ({"GOMP_SPINCOUNT": "5000"}, None, "5000"),
        ({"GOMP_SPINCOUNT": "5000"}, 10000, "5000"),
        ({"OMP_WAIT_POLICY": "active"}, None, None),
    ],
    ids=["unset", "spec", "user-spincount", "user-spincount-over-spec", "user-wait-policy"],
)
def test_a_served_engines_idle_openmp_workers_spin_about_a_millisecond_unless_the_spec_or_environment_says(
    env, configured, spin, tmp_path
):
    """libgomp reads GOMP_SPINCOUNT when torch loads it; OMP_DISPLAY_ENV=verbose makes it print what it read.
    The count comes from the engine config that ``build.openmp_spin_count`` writes."""
    import os
    import subprocess
    import sys

    spec = spec_for("t", tmp_path, build={"target": "cpu", "openmp_spin_count": configured})
    config = asdict(engine_config(spec))
    assert config["openmp_spin_count"] == configured
    (tmp_path / ENGINE_CONFIG).write_text(json.dumps(config))
    code = (
        "import sys\n"
        "from toolkit.targets.cpu import bound_openmp_spin\n"
        "print('set' if bound_openmp_spin(sys.argv[1]) else 'left', flush=True)\n"
        "import torch\n"
        "torch.ones(64).sum()\n"
        "print('late' if bound_openmp_spin(sys.argv[1]) else 'left', flush=True)\n"  # torch is loaded: too late
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env={**clean, **env, "OMP_DISPLAY_ENV": "verbose"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    shown = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    if shown is None:
        pytest.skip(f"torch's OpenMP runtime is not libgomp here: {out.stderr[-300:]!r}")
    assert out.stdout.split() == (["set", "left"] if not env else ["left", "left"])
    if spin is not None:
        assert shown.group(1) == spin
    else:  # the user's wait policy stands: libgomp's own spin for it, not rtk's
        assert shown.group(1) != str(SERVED_GOMP_SPINCOUNT)


def _cgroupfs(root, files: dict[str, str], proc: str):
    """A cgroup file system as the kernel lays it out: ``files`` relative to ``root``; /proc/self/cgroup's text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "proc-self-cgroup").write_text(proc)
    return root, root / "proc-self-cgroup"


@pytest.mark.parametrize(
    "files, proc, cores",
    [
        ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # v2 without a limit
        ({"cpu.max": "200000 100000\n"}, "0::/\n", 2.0),  # a container's own cgroup (cgroup namespace)
        # the pod's limit on the parent, none on the container: the parent's applies
        (
            {"kubepods/pod1/cpu.max": "150000 100000\n", "kubepods/pod1/c1/cpu.max": "max 100000\n"},
            "0::/kubepods/pod1/c1\n",
            1.5,
        ),
        # v1: a host path that is not under the container's mount: the mount's own files
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            "12:memory:/kubepods/x\n4:cpu,cpuacct:/kubepods/x\n0::/\n",
            0.5,
        ),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n", None),  # this host's
    ],
    ids=["v2-none", "v2-limit", "v2-parent", "v1-limit", "v1-none"],
)
def test_a_cpu_quota_is_read_from_the_cgroup_files(tmp_path, files, proc, cores):
    from toolkit.targets.cpu import cpu_quota_cores

    assert cpu_quota_cores(*_cgroupfs(tmp_path, files, proc)) == cores
    assert cpu_quota_cores(tmp_path, tmp_path / "absent") is None
    (tmp_path / "odd").write_text(f"not a cgroup line\n{proc}")  # a line it cannot read is passed over
    assert cpu_quota_cores(tmp_path, tmp_path / "odd") == cores


@pytest.mark.parametrize("quota, threads", [(None, None), (0.5, 1), (1.5, 1), (64.0, None)])
def test_a_served_engine_takes_no_more_threads_than_its_cpu_quota_allows(monkeypatch, quota, threads):
    import os

    from toolkit.targets import cpu

    monkeypatch.setattr(cpu, "cpu_quota_cores", lambda: quota)
    cores = len(os.sched_getaffinity(0))
    assert cpu.served_threads() == min(cores, threads or cores)


def test_a_failed_build_leaves_nothing_behind(tmp_path, tiny_llama_dir, quantized_dir):
    spec = spec_for("b", tiny_llama_dir, quantization={"format": "none"}, build=BUILD)
    with pytest.raises(SourceError, match="rtk quantize"):
        build(spec, tmp_path / "nowhere", tmp_path / "engine")
    (quantized_dir / "hf" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception, match="deserializing header"):  # safetensors' own error names the damage
        build(spec, quantized_dir, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".engine")]


def test_an_engine_config_from_another_rtk_is_refused_with_the_rebuild_command(tmp_path):
    from toolkit.errors import SourceError
    from toolkit.targets.cpu import ENGINE_CONFIG, load_engine

    (tmp_path / ENGINE_CONFIG).write_text(json.dumps({"batch_invariant": True}))  # a field no EngineConfig has
    with pytest.raises(SourceError, match="another rtk version.*rtk build SPEC --force build"):
        load_engine(tmp_path)


@pytest.mark.slow
def test_rtk_build_runs_every_stage_once_then_skips_them(tmp_path, tiny_llama_dir, monkeypatch):
    """`rtk build SPEC`: four stages, then all cached; a serving change redoes only the emit stage."""
    from toolkit.cli import cli

    monkeypatch.chdir(tmp_path)
    spec_path = tmp_path / "tiny.yaml"

    def write_spec(max_queue_size):
        spec_path.write_text(
            json.dumps(
                {
                    "name": "tiny",
                    "model": {"source": str(tiny_llama_dir)},
                    "quantization": {"format": "none", "eval_samples": 2},
                    "build": BUILD,
                    "serving": {"max_queue_size": max_queue_size},
                }
            )
        )

    write_spec(8)
    runner = CliRunner()
    first = runner.invoke(cli, ["build", str(spec_path)])
    assert first.exit_code == 0, first.output
    assert "repository: triton_repo/tiny" in first.output
    repo = tmp_path / "triton_repo/tiny"
    stamps = {
        d: read_manifest(tmp_path / "engines/tiny" / d)["created_unix"] for d in ("checkpoint", "quantized", "engine")
    }
    emitted = read_manifest(repo)["created_unix"]
    assert (repo / "ensemble/1").is_dir() and (repo / "tensorrt_llm/config.pbtxt").is_file()

    write_spec(9)
    second = runner.invoke(cli, ["build", str(spec_path)])
    assert second.exit_code == 0, second.output
    assert {d: read_manifest(tmp_path / "engines/tiny" / d)["created_unix"] for d in stamps} == stamps
    assert read_manifest(repo)["created_unix"] > emitted
    from toolkit.triton.config import parse

    assert parse((repo / "tensorrt_llm/config.pbtxt").read_text()).parameters["max_queue_size"].string_value == "9"

    bad = runner.invoke(cli, ["build", str(spec_path), "--force", "link"])
    assert bad.exit_code == 2 and "not a stage" in bad.output
    leftovers = [
        p for d in (tmp_path / "engines/tiny", tmp_path / "triton_repo") for p in d.iterdir() if p.name.startswith(".")
    ]
    assert leftovers == []
