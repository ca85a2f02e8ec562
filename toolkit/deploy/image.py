"""Which image a pod runs, and the Dockerfile that builds rtk's own image for the cpu target."""

from __future__ import annotations

from .. import __version__
from ..spec import Spec
from ..targets import NGC_CONTAINER  # the NGC Triton + TensorRT-LLM image the GPU targets are built and served in

CPU_IMAGE = f"rtk-cpu:{__version__}"
DOCKERFILE = "Dockerfile"
TRITONSERVER_IN_NGC = "/opt/tritonserver/bin/tritonserver"


def default_image(spec: Spec) -> str:
    if spec.deploy.image:
        return spec.deploy.image
    return CPU_IMAGE if spec.build.target == "cpu" else NGC_CONTAINER


def cpu_dockerfile() -> str:
    """rtk with the bundled tritonserver (nvidia-pytriton) and CPU torch; build from the rtk checkout.

    ``python:3.11-slim-bookworm``: glibc 2.36 (the tritonserver in nvidia-pytriton needs >= 2.35) and
    a shared libpython (the python backend stub links it).  The model repository is not baked in:
    it comes from the deployment's storage like on the GPU targets.
    """
    return f"""\
# rtk {__version__} for the cpu target: rtk's CPU engine in the tritonserver bundled with nvidia-pytriton.
# Build from the root of an rtk checkout:
#   docker build -f {DOCKERFILE} -t {CPU_IMAGE} /path/to/rtk
# then push it where the cluster pulls from and set deploy.image to that name.
FROM python:3.11-slim-bookworm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1
WORKDIR /opt/rtk
COPY pyproject.toml README.md ./
COPY .ci/constraints.txt .ci/constraints.txt
COPY toolkit ./toolkit
# CPU torch first (the default torch wheel on Linux is a CUDA build); numpy<2 for Triton's python backend.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir --index-url "$TORCH_INDEX" -c .ci/constraints.txt torch \\
 && python -m pip install --no-cache-dir -c .ci/constraints.txt '.[cpu-serving]'
RUN useradd --uid 1000 --create-home rtk
USER 1000
EXPOSE 8000 8001 8002 8080
ENTRYPOINT ["rtk"]
"""
