"""Stage 4, emit: write the Triton model repository for a built engine.

Layout (TensorRT-LLM's ``inflight_batcher_llm``, so existing clients work unchanged)::

    triton_repo/<name>/                  (or serving.repository)
      preprocessing/    config.pbtxt  1/model.py  1/rtk_text.py  tokenizer/  warmup/
      tensorrt_llm/     config.pbtxt  1/...       (per target)               warmup/
      postprocessing/   config.pbtxt  1/model.py  1/rtk_text.py              warmup/
      ensemble/         config.pbtxt  1/          (empty: Triton needs the version directory)
      tensorrt_llm_bls/ config.pbtxt  1/model.py  1/rtk_text.py
      rtk-manifest.json

Every config is built through Triton's protobuf schema (config.py).  The tokenizer is copied into
the repository; the cpu ``tensorrt_llm`` names the engine directory by absolute path.  The
repository is written to a temporary directory and renamed into place with its manifest last
(toolkit/artifacts.py), and skipped when its manifest matches.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np

from ..artifacts import atomic_stage, is_complete, read_manifest, sha256_file, stage_key, tool_versions
from ..errors import SourceError, UsageError
from ..spec import Spec
from ..stages import StageResult, default_output
from . import config as C

MODELS_SRC = Path(__file__).parent / "models"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
TOKENIZER_IN_REPO = "preprocessing/tokenizer"  # relative to the repository root
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
        raise SourceError(f"engine directory '{engine_dir}' does not exist; run `rtk build SPEC` first (or pass --engine)")
    engine_manifest = read_manifest(engine_dir)
    if not engine_manifest or not engine_manifest.get("complete"):
        raise SourceError(f"'{engine_dir}' has no complete build manifest; rebuild it with `rtk build SPEC`")
    if engine_manifest.get("target", spec.build.target) != spec.build.target:
        raise UsageError(
            f"'{engine_dir}' was built for target '{engine_manifest.get('target')}', but build.target is "
            f"'{spec.build.target}'; rebuild or fix the spec"
        )
    tok_src = Path(tokenizer_dir) if tokenizer_dir else _find_tokenizer(spec, engine_dir)
    section = {"build": spec.build.model_dump(), "serving": spec.serving.model_dump(exclude={"tritonserver"}), "name": spec.name}
    inputs = {
        "engine": engine_manifest.get("key"),
        "engine_dir": str(engine_dir.resolve()),
        "tokenizer": {f.name: sha256_file(f) for f in _tokenizer_files(tok_src)},
        # What renders the repository: configs, emitter and model sources.
        "sources": {p.relative_to(MODELS_SRC.parent).as_posix(): sha256_file(p) for p in sorted(MODELS_SRC.parent.rglob("*.py"))},
    }
    tools = tool_versions("tritonclient", "protobuf", "transformers")
    key = stage_key("emit", section, inputs, tools)
    if not force and is_complete(output, key) and (output / C.ENSEMBLE / "1").is_dir():
        return StageResult("emit", output, True, read_manifest(output))

    with atomic_stage("emit", output, key, inputs=inputs, spec_section=section, tools=tools) as out:
        models = write_repository(spec, out.tmp, engine_dir=engine_dir.resolve(), tokenizer_src=tok_src)
        out.manifest.update(target=spec.build.target, models=models)
    return StageResult("emit", output, False, read_manifest(output))


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
    target = spec.build.target
    if target == "llmapi":
        return _write_llmapi(spec, root, engine_dir)
    tok_dir = root / TOKENIZER_IN_REPO
    tok_dir.mkdir(parents=True)
    for f in _tokenizer_files(tokenizer_src):
        shutil.copy2(f, tok_dir / f.name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False, local_files_only=True)

    settings = C.RepoSettings(tokenizer_dir=TOKENIZER_IN_REPO, engine_dir=str(engine_dir), rtk_extensions=(target == "cpu"))
    warm = spec.serving.warmup
    pre = C.preprocessing(spec, settings)
    if warm:
        _warm_preprocessing(pre, root / C.PREPROCESSING, spec)
    _write_model(root, pre, "preprocessing.py")

    post = C.postprocessing(spec, settings)
    if warm:
        _warm_postprocessing(post, root / C.POSTPROCESSING, tokenizer, settings.rtk_extensions)
    _write_model(root, post, "postprocessing.py")

    if target == "cpu":
        llm = C.tensorrt_llm_cpu(spec, settings)
        if warm:
            _warm_tensorrt_llm(llm, root / C.TENSORRT_LLM, tokenizer, spec)
        _write_model(root, llm, "tensorrt_llm_cpu.py")
    else:  # trt-engine: the C++ tensorrtllm backend; its config and warm-up come from the GPU build module
        from ..targets import trt_engine

        trt_engine.write_triton_model(spec, root / C.TENSORRT_LLM, engine_dir)

    _write_config(root, C.ensemble(spec, settings))
    (root / C.ENSEMBLE / "1").mkdir(parents=True, exist_ok=True)
    _write_model(root, C.bls(spec, settings), "tensorrt_llm_bls.py")
    return [C.PREPROCESSING, C.TENSORRT_LLM, C.POSTPROCESSING, C.ENSEMBLE, C.BLS]


def _write_llmapi(spec: Spec, root: Path, engine_dir: Path) -> list[str]:
    """The llmapi target: one ``tensorrt_llm`` python model (text in, text out) with its model.yaml."""
    from ..targets import llmapi

    llmapi.write_triton_model(spec, root / C.TENSORRT_LLM, engine_dir)
    return [C.TENSORRT_LLM]


def _write_config(root: Path, cfg) -> None:
    d = root / cfg.name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(C.render(cfg))


def _write_model(root: Path, cfg, source: str) -> None:
    _write_config(root, cfg)
    version = root / cfg.name / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copy2(MODELS_SRC / source, version / "model.py")
    shutil.copy2(MODELS_SRC / "rtk_text.py", version / "rtk_text.py")


# -- warm-up samples --------------------------------------------------------------------------

def _write_raw(path: Path, array: np.ndarray) -> None:
    """A warm-up input file: raw little-endian values; strings as 4-byte length + bytes (Triton's BYTES)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if array.dtype == np.object_:
        data = b"".join(struct.pack("<I", len(b)) + b for b in (x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1)))
        path.write_bytes(data)
    else:
        path.write_bytes(array.astype(array.dtype.newbyteorder("<")).tobytes())


def _warm_preprocessing(cfg, model_dir: Path, spec: Spec) -> None:
    import json

    query = json.dumps(WARMUP_PROMPT).encode()
    _write_raw(model_dir / "warmup" / "query", np.array([query], dtype=np.object_))
    _write_raw(model_dir / "warmup" / "request_output_len", np.array([4], dtype=np.int32))
    C.add_warmup(cfg, "chat_prompt", {
        "QUERY": ("STRING", (1,), "query"),
        "REQUEST_OUTPUT_LEN": ("INT32", (1,), "request_output_len"),
    })


def _warm_postprocessing(cfg, model_dir: Path, tokenizer, with_preceding: bool) -> None:
    ids = np.array(tokenizer.encode("Hello there", add_special_tokens=False), dtype=np.int32)
    _write_raw(model_dir / "warmup" / "tokens", ids)
    _write_raw(model_dir / "warmup" / "length", np.array([ids.size], dtype=np.int32))
    inputs = {
        "TOKENS_BATCH": ("INT32", (1, int(ids.size)), "tokens"),
        "SEQUENCE_LENGTH": ("INT32", (1,), "length"),
    }
    if with_preceding:
        inputs["PRECEDING_IDS"] = ("INT32", (int(ids.size),), "tokens")
    C.add_warmup(cfg, "tokens", inputs)


def _warm_tensorrt_llm(cfg, model_dir: Path, tokenizer, spec: Spec) -> None:
    text = tokenizer.apply_chat_template(WARMUP_PROMPT, tokenize=False, add_generation_prompt=True) if tokenizer.chat_template else "Warm-up: say hello."
    ids = np.array(tokenizer.encode(text, add_special_tokens=False)[: spec.build.max_input_len], dtype=np.int32)
    out_len = min(4, spec.build.max_seq_len - ids.size)
    _write_raw(model_dir / "warmup" / "input_ids", ids)
    _write_raw(model_dir / "warmup" / "input_lengths", np.array([ids.size], dtype=np.int32))
    _write_raw(model_dir / "warmup" / "request_output_len", np.array([out_len], dtype=np.int32))
    # Twice: the first pass pays for lazy initialisation, the second for the first decode batch.
    C.add_warmup(cfg, "chat_prompt", {
        "input_ids": ("INT32", (int(ids.size),), "input_ids"),
        "input_lengths": ("INT32", (1,), "input_lengths"),
        "request_output_len": ("INT32", (1,), "request_output_len"),
    }, count=2)

