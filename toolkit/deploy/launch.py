"""The command each pod runs.

GPU targets run Triton exactly as ``rtk serve`` does: the argv is the one
:class:`toolkit.triton.server.TritonServer` builds from the target's
:class:`~toolkit.triton.server.Launch` (one rank per GPU under ``mpirun`` when the engine spans GPUs,
orchestrator mode for several instances), with the binary at its place in the NGC image and every
endpoint bound to 0.0.0.0.
A multi-node group's leader adds ``--host`` with every pod of its group (addresses from the
LeaderWorkerSet's ``LWS_LEADER_ADDRESS`` / ``LWS_GROUP_SIZE``) and reaches the workers over ssh
on port 2222; the workers only run ``sshd``.  The cpu target runs ``rtk serve`` on the spec the
ConfigMap holds.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path

import yaml

from ..spec import Spec
from ..targets import TARGETS
from ..triton.server import Launch, TritonBinary, TritonServer
from .image import TRITONSERVER_IN_NGC
from .layout import SSH_PORT, Layout, frontend_exposed

SPEC_MOUNT = "/etc/rtk"
SPEC_FILE = "spec.yaml"
SSH_SECRET_MOUNT = "/etc/rtk-ssh"
ANY_ADDRESS = "0.0.0.0"
# What toolkit.triton.launch.make_server adds to every server (tests/test_deploy_k8s.py compares the two commands).
SERVE_EXTRA_ARGS = ["--disable-auto-complete-config"]


def repository_in_pod(spec: Spec) -> str:
    """The model repository below the storage mount (build with the working directory = mount_path)."""
    repo = spec.repository_dir()
    if repo.is_absolute():
        return repo.as_posix()
    return f"{spec.deploy.storage.mount_path}/{repo.as_posix()}"


def pod_spec(spec: Spec) -> Spec:
    """The spec as the pod serves it: endpoints on all addresses, the repository on the volume."""
    serving = spec.serving.model_copy(update={"host": ANY_ADDRESS, "repository": repository_in_pod(spec)})
    if frontend_exposed(spec):
        serving = serving.model_copy(update={"frontend": serving.frontend.model_copy(update={"host": ANY_ADDRESS})})
    return spec.model_copy(update={"serving": serving})


def spec_yaml(spec: Spec) -> str:
    """The in-pod spec for the cpu target's ConfigMap (it holds no secret: keys are 'env:'/'file:' references)."""
    data = pod_spec(spec).model_dump(mode="json", exclude={"deploy"})
    return yaml.safe_dump(data, sort_keys=False)


def server_command(spec: Spec, layout: Layout) -> tuple[list[str], dict[str, str]]:
    """(container command, extra environment) of the pod that serves requests (the leader when multi-node)."""
    if layout.target == "cpu":
        return ["rtk", "serve", f"{SPEC_MOUNT}/{SPEC_FILE}", "--timeout", str(spec.deploy.startup_timeout_s)], {}
    argv, env = triton_command(pod_spec(spec))
    # rtk serve sets the niceness after the start (TritonServer(niceness=)); the pod starts the server under it.
    nice = ["nice", "-n", str(spec.serving.server_niceness)] if spec.serving.server_niceness else []
    if not layout.multi_node:
        return [*nice, *argv], env
    return ["bash", "-c", leader_script(argv, layout, nice)], env


def triton_command(spec: Spec) -> tuple[list[str], dict[str, str]]:
    """The tritonserver (or mpirun) argv and environment ``rtk serve`` would use, for the NGC image's binary."""
    target = TARGETS[spec.build.target]
    launch = target.triton_launch(spec.build, spec.serving) if target.triton_launch else Launch()
    launch = dataclasses.replace(launch, allow_run_as_root=True)  # NGC images run as root; mpirun needs the flag
    s = spec.serving
    server = TritonServer(
        spec.serving.repository,
        binary=TritonBinary(Path(TRITONSERVER_IN_NGC), "system"),
        host=s.host,
        http_port=s.http_port,
        grpc_port=s.grpc_port,
        metrics_port=s.metrics_port,
        launch=launch,
        extra_args=SERVE_EXTRA_ARGS,
    )
    return server.command(), dict(launch.env)


def leader_script(argv: list[str], layout: Layout, nice: Sequence[str] = ()) -> str:
    """Wait for every worker's sshd, then ``exec`` rtk's mpirun line with the group's hosts (under ``nice``: the
    leader's ranks; the workers' ranks, started by sshd, keep their niceness)."""
    assert argv[0] == "mpirun"
    flags = [a for a in argv[1:] if a == "--allow-run-as-root"]
    programs = argv[1 + len(flags) :]
    ssh = f"ssh -p {SSH_PORT} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes"
    mpirun = [
        *nice,
        "mpirun",
        *flags,
        "--host",
        "$RTK_MPI_HOSTS",
        "--mca",
        "plm_rsh_agent",
        "ssh",
        "--mca",
        "plm_rsh_args",
        ssh.removeprefix("ssh "),
        *programs,
    ]
    line = " ".join('"$RTK_MPI_HOSTS"' if a == "$RTK_MPI_HOSTS" else shlex.quote(a) for a in mpirun)
    return "\n".join(
        [
            "set -euo pipefail",
            _install_ssh_keys(),
            'leader="${LWS_LEADER_ADDRESS%%.*}"; domain="${LWS_LEADER_ADDRESS#*.}"',
            f'RTK_MPI_HOSTS="$LWS_LEADER_ADDRESS:{layout.gpus_per_pod}"',
            "for i in $(seq 1 $((LWS_GROUP_SIZE - 1))); do",
            '  worker="$leader-$i.$domain"',
            f'  until {ssh} "$worker" true 2>/dev/null; do echo "waiting for $worker"; sleep 5; done',
            f'  RTK_MPI_HOSTS="$RTK_MPI_HOSTS,$worker:{layout.gpus_per_pod}"',
            "done",
            f"exec {line}",
        ]
    )


def worker_command() -> list[str]:
    """A worker runs sshd; the leader's mpirun starts its ranks."""
    script = "\n".join(
        [
            "set -euo pipefail",
            _install_ssh_keys(),
            # ssh sessions do not inherit the image's environment: hand the ranks the same PATH and libraries.
            'printf "PATH=%s\\nLD_LIBRARY_PATH=%s\\n" "$PATH" "${LD_LIBRARY_PATH:-}" > ~/.ssh/environment',
            "mkdir -p /run/sshd && ssh-keygen -A",
            f"exec /usr/sbin/sshd -D -e -p {SSH_PORT} -o PermitUserEnvironment=yes",
        ]
    )
    return ["bash", "-c", script]


def _install_ssh_keys() -> str:
    """Copy the group's key pair from the Secret (mounted read-only) with the modes ssh insists on."""
    return (
        f"install -d -m 700 ~/.ssh && install -m 600 {SSH_SECRET_MOUNT}/id_rsa ~/.ssh/id_rsa && "
        f"install -m 644 {SSH_SECRET_MOUNT}/id_rsa.pub ~/.ssh/id_rsa.pub && "
        f"install -m 600 {SSH_SECRET_MOUNT}/authorized_keys ~/.ssh/authorized_keys"
    )
