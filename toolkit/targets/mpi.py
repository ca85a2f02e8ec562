"""How ``tritonserver`` is launched for the GPU targets: one rank per GPU under MPI when the
engine spans several GPUs, the way TensorRT-LLM's ``triton_backend/scripts/launch_triton_server.py``
(NVIDIA/TensorRT-LLM, 0a2e2c1) does it:

* ``mpirun --allow-run-as-root -n 1 <tritonserver ...> : -n 1 <tritonserver ...> : ...``, one
  program per rank.  Every rank gets the same ports: only rank 0's server ever opens them, because
  the other ranks' ``tensorrt_llm`` model never finishes loading (its executor runs as an MPI worker
  of rank 0), so their servers never reach the point of listening.
* ranks > 0 load only the ``tensorrt_llm`` model (``--model-control-mode=explicit
  --load-model=tensorrt_llm``); preprocessing, postprocessing and ensemble live on rank 0.
* each rank gets its own python-backend shared-memory prefix, and auto-complete is disabled so the
  written ``config.pbtxt`` is what Triton uses.

Several instances of a one-GPU-per-instance engine (``serving.instance_count > 1``) run without
MPI in orchestrator mode (``TRTLLM_ORCHESTRATOR=1``, the launcher's ``--multi-model``), each
instance on the GPUs ``gpu_device_ids`` gives it.  The ``llmapi`` target is one process: the LLM API
starts its own MPI workers for tensor/pipeline parallelism.

The serving engineer's server launcher (toolkit/server.py) runs the returned command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..spec import Spec

LLM_MODEL = "tensorrt_llm"


@dataclass
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    world_size: int = 1


def rank_args(tritonserver: str, repository: str, rank: int, *, host: str, http_port: int, grpc_port: int,
              metrics_port: int, llm_model: str = LLM_MODEL, extra: tuple[str, ...] = ()) -> list[str]:
    """One rank's tritonserver command line."""
    argv = [
        tritonserver,
        f"--model-repository={repository}",
        f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
        f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
        *extra,
    ]
    if rank > 0:
        argv += ["--model-control-mode=explicit", f"--load-model={llm_model}"]
    return argv


def tritonserver_launch(spec: Spec, tritonserver: str, repository: str, *, extra: tuple[str, ...] = (),
                        allow_run_as_root: bool | None = None, llm_model: str = LLM_MODEL) -> LaunchCommand:
    """The command that serves ``repository`` for ``spec``'s target and parallel layout.

    ``extra`` holds flags every rank needs (e.g. the bundled server's backend directory).  Binding
    follows ``serving.host`` (127.0.0.1 unless the spec says otherwise).
    """
    s, b = spec.serving, spec.build
    common = dict(host=s.host, http_port=s.http_port, grpc_port=s.grpc_port, metrics_port=s.metrics_port,
                  llm_model=llm_model, extra=tuple(extra))
    if b.target == "trt-engine" and s.instance_count > 1:
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
        return LaunchCommand(rank_args(tritonserver, repository, 0, **common), env, world_size=1)
    if b.target != "trt-engine" or b.world_size == 1:
        return LaunchCommand(rank_args(tritonserver, repository, 0, **common), world_size=1)
    if allow_run_as_root is None:
        allow_run_as_root = os.geteuid() == 0  # NGC containers run as root; mpirun refuses without the flag
    argv = ["mpirun"] + (["--allow-run-as-root"] if allow_run_as_root else [])
    for rank in range(b.world_size):
        if rank:
            argv.append(":")
        argv += ["-n", "1", *rank_args(tritonserver, repository, rank, **common)]
    return LaunchCommand(argv, world_size=b.world_size)
