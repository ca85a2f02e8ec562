"""Stage 4, emit: write the Triton model repository for a built engine.

Layout (TensorRT-LLM's ``inflight_batcher_llm``, so existing clients work unchanged)::

    triton_repo/<name>/                  (or serving.repository)
      preprocessing/    config.pbtxt  1/model.py  1/rtk_text.py  tokenizer/  warmup/
      tensorrt_llm/     config.pbtxt  1/...       (per target)               warmup/
      postprocessing/   config.pbtxt  1/model.py  1/rtk_text.py              warmup/
      ensemble/         config.pbtxt  1/          (empty: Triton needs the version directory)
      tensorrt_llm_bls/ config.pbtxt  1/model.py  1/rtk_text.py
      rtk-manifest.json

What serves the LLM depends on the target (``llm_backend`` in toolkit/targets/): rtk's CPU
engine in a python model (config.py), TensorRT-LLM's C++ backend, or Triton's llmapi python model
alone (gpu_models.py).  Every config is built through Triton's protobuf schema (config.py).  The
tokenizer is copied into the repository; ``tensorrt_llm`` names the engine directory by absolute
path.  The repository is written to a temporary directory and renamed into place with its manifest
last (toolkit/artifacts.py), and skipped when its manifest matches; the manifest records
:data:`REPOSITORY_FORMAT` so that ``rtk serve`` can refuse a repository an older rtk emitted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..artifacts import StageResult, default_output, read_manifest, run_stage, sha256_file, tool_versions
from ..errors import SourceError, UsageError
from ..hfcompat import TOKENIZER_FILES
from ..spec import Spec
from ..targets import target_of
from . import config as cfgs
from . import gpu_models

MODELS_SRC = Path(__file__).parent / "models"
TOKENIZER_IN_REPO = "preprocessing/tokenizer"  # relative to the repository root
# Bumped when what rtk writes into a repository changes incompatibly (2: the cpu model.py imports
# toolkit.targets.cpu; repositories from before import toolkit.build.cpu; 3: upstream's whole
# ensemble / BLS interface and a one-dimensional text_output).
REPOSITORY_FORMAT = 3
# serving fields that say how a server runs, not what the repository holds: not part of the emit key,
# and a repository served with other values for them needs no new emit.
SERVER_ONLY_FIELDS = frozenset(
    {
        "host",
        "http_port",
        "grpc_port",
        "metrics_port",
        "tritonserver",
        "server_niceness",
        "repository",
        "frontend",
        "guard",
        "cache",
        "filter",
        "sessions",
        "jobs",
    }
)
WARMUP_PROMPT = [{"role": "user", "content": "Warm-up: say hello."}]


def emit(
    spec: Spec,
    engine_dir: Path | str | None = None,
    output: Path | str | None = None,
    *,
    tokenizer_dir: Path | str | None = None,
    force: bool = False,
) -> StageResult:
    """Write the repository for ``spec`` from the build stage's ``engine_dir``."""
    engine_dir = Path(engine_dir) if engine_dir else default_output(spec, "build")
    output = Path(output) if output else spec.repository_dir()
    if not engine_dir.is_dir():
        raise SourceError(
            f"engine directory '{engine_dir}' does not exist; run `rtk build SPEC` first (or pass --engine)"
        )
    engine_manifest = read_manifest(engine_dir)
    if not engine_manifest or not engine_manifest.get("complete"):
        raise SourceError(f"'{engine_dir}' has no complete build manifest; rebuild it with `rtk build SPEC`")
    if engine_manifest.get("target", spec.build.target) != spec.build.target:
        raise UsageError(
            f"'{engine_dir}' was built for target '{engine_manifest.get('target')}', but build.target is "
            f"'{spec.build.target}'; rebuild or fix the spec"
        )
    tok_src = Path(tokenizer_dir) if tokenizer_dir else _find_tokenizer(spec, engine_dir)
    section = {
        "build": spec.build.model_dump(),
        "serving": spec.serving.model_dump(exclude=SERVER_ONLY_FIELDS),
        "name": spec.name,
    }
    inputs = {
        "engine": engine_manifest.get("key"),
        "engine_dir": str(engine_dir.resolve()),
        "tokenizer": {f.name: sha256_file(f) for f in _tokenizer_files(tok_src)},
        "sources": {p.relative_to(MODELS_SRC.parent).as_posix(): sha256_file(p) for p in render_sources()},
    }
    tools = tool_versions("tritonclient", "protobuf", "transformers")

    def write(out) -> None:
        models = write_repository(spec, out.tmp, engine_dir=engine_dir.resolve(), tokenizer_src=tok_src)
        out.manifest.update(target=spec.build.target, models=models, repository_format=REPOSITORY_FORMAT)

    return run_stage(
        "emit",
        output,
        section=section,
        inputs=inputs,
        tools=tools,
        write=write,
        force=force,
        complete=lambda d: not target_of(spec).ensemble or (d / cfgs.ENSEMBLE / "1").is_dir(),
    )


def render_sources() -> list[Path]:
    """What renders a repository (every config, for every target, and the model sources): the emit cache key."""
    here = MODELS_SRC.parent
    return [here / "config.py", here / "gpu_models.py", here / "emit.py", *sorted(MODELS_SRC.glob("*.py"))]


def _find_tokenizer(spec: Spec, engine_dir: Path) -> Path:
    for cand in (engine_dir / "hf", engine_dir, default_output(spec, "quantize") / "hf", default_output(spec, "fetch")):
        if (cand / "tokenizer_config.json").is_file() or (cand / "tokenizer.json").is_file():
            return cand
    raise SourceError(f"no tokenizer found in '{engine_dir}' or the quantize/fetch stage outputs; pass --tokenizer DIR")


def _tokenizer_files(d: Path) -> list[Path]:
    files = [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
        raise SourceError(f"'{d}' has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return files


def write_repository(spec: Spec, root: Path, *, engine_dir: Path, tokenizer_src: Path) -> list[str]:
    """Write every model of the repository into ``root``; returns the model names."""
    backend = target_of(spec).llm_backend
    if backend == "llmapi":  # one python model, text in and text out: no ensemble
        gpu_models.write_tensorrt_llm_llmapi(spec, root / cfgs.TENSORRT_LLM, engine_dir)
        return [cfgs.TENSORRT_LLM]
    tok_dir = root / TOKENIZER_IN_REPO
    tok_dir.mkdir(parents=True)
    for f in _tokenizer_files(tokenizer_src):
        shutil.copy2(f, tok_dir / f.name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False, local_files_only=True)
    rtk_cpu = backend == "rtk-cpu"
    settings = cfgs.RepoSettings(
        tokenizer_dir=TOKENIZER_IN_REPO,
        engine_dir=str(engine_dir),
        rtk_extensions=rtk_cpu,
        logits_dtype="float32" if rtk_cpu else gpu_models.engine_logits_dtype(engine_dir),
    )
    warm = spec.serving.warmup

    pre = cfgs.preprocessing(spec, settings)
    _write_python_model(root, pre, "preprocessing.py", _warm_preprocessing(pre) if warm else {})
    post = cfgs.postprocessing(spec, settings)
    _write_python_model(root, post, "postprocessing.py", _warm_postprocessing(post, tokenizer, rtk_cpu) if warm else {})
    if rtk_cpu:
        llm = cfgs.tensorrt_llm_cpu(spec, settings)
        _write_python_model(root, llm, "tensorrt_llm_cpu.py", _warm_tensorrt_llm(llm, tokenizer, spec) if warm else {})
    else:
        gpu_models.write_tensorrt_llm_cpp(spec, root / cfgs.TENSORRT_LLM, engine_dir)
    cfgs.write_model_dir(root / cfgs.ENSEMBLE, cfgs.ensemble(spec, settings))
    _write_python_model(root, cfgs.bls(spec, settings), "tensorrt_llm_bls.py", {})
    return [cfgs.PREPROCESSING, cfgs.TENSORRT_LLM, cfgs.POSTPROCESSING, cfgs.ENSEMBLE, cfgs.BLS]


def _write_python_model(root: Path, cfg, source: str, warmup: dict[str, bytes]) -> None:
    """A python-backend model: its config, warm-up files, and ``1/model.py`` with the shared ``rtk_text.py``."""
    files = {"model.py": (MODELS_SRC / source).read_text(), "rtk_text.py": (MODELS_SRC / "rtk_text.py").read_text()}
    cfgs.write_model_dir(root / cfg.name, cfg, warmup=warmup, version_files=files)


# -- warm-up samples (each adds its sample to the config and returns the files it reads) -------


def _warm_preprocessing(cfg) -> dict[str, bytes]:
    cfgs.add_warmup(
        cfg,
        "chat_prompt",
        {
            "QUERY": ("STRING", (1,), "query"),
            "REQUEST_OUTPUT_LEN": ("INT32", (1,), "request_output_len"),
        },
    )
    return {
        "query": cfgs.raw_tensor(np.array([json.dumps(WARMUP_PROMPT).encode()], dtype=np.object_)),
        "request_output_len": cfgs.raw_tensor(np.array([4], dtype=np.int32)),
    }


def _warm_postprocessing(cfg, tokenizer, with_preceding: bool) -> dict[str, bytes]:
    ids = np.array(tokenizer.encode("Hello there", add_special_tokens=False), dtype=np.int32)
    inputs = {
        "TOKENS_BATCH": ("INT32", (1, int(ids.size)), "tokens"),
        "SEQUENCE_LENGTH": ("INT32", (1,), "length"),
    }
    if with_preceding:
        inputs["PRECEDING_IDS"] = ("INT32", (int(ids.size),), "tokens")
    cfgs.add_warmup(cfg, "tokens", inputs)
    return {"tokens": cfgs.raw_tensor(ids), "length": cfgs.raw_tensor(np.array([ids.size], dtype=np.int32))}


def _warm_tensorrt_llm(cfg, tokenizer, spec: Spec) -> dict[str, bytes]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(WARMUP_PROMPT, tokenize=False, add_generation_prompt=True)
    else:
        text = "Warm-up: say hello."
    ids = np.array(tokenizer.encode(text, add_special_tokens=False)[: spec.build.max_input_len], dtype=np.int32)
    out_len = min(4, spec.build.max_seq_len - ids.size)
    # Twice: the first pass pays for lazy initialisation, the second for the first decode batch.
    cfgs.add_warmup(
        cfg,
        "chat_prompt",
        {
            "input_ids": ("INT32", (int(ids.size),), "input_ids"),
            "input_lengths": ("INT32", (1,), "input_lengths"),
            "request_output_len": ("INT32", (1,), "request_output_len"),
        },
        count=2,
    )
    return {
        "input_ids": cfgs.raw_tensor(ids),
        "input_lengths": cfgs.raw_tensor(np.array([ids.size], dtype=np.int32)),
        "request_output_len": cfgs.raw_tensor(np.array([out_len], dtype=np.int32)),
    }
