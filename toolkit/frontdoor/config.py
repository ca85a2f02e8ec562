"""What a front door needs, from a spec or from an emitted repository's manifest."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..spec import CacheSpec, FilterSpec, FrontendSpec, GuardSpec, JobsSpec, SessionsSpec

TOKENIZER_IN_REPO = "preprocessing/tokenizer"
LLMAPI_MODEL_YAML = "tensorrt_llm/1/model.yaml"  # the llmapi target's one model: its `model` key is the checkpoint


@dataclass
class FrontDoorConfig:
    model_name: str
    frontend: FrontendSpec = field(default_factory=FrontendSpec)
    guard: GuardSpec = field(default_factory=GuardSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    filter: FilterSpec = field(default_factory=FilterSpec)
    sessions: SessionsSpec = field(default_factory=SessionsSpec)
    jobs: JobsSpec = field(default_factory=JobsSpec)
    triton_model: str = "ensemble"
    context_policy: str = "truncate_oldest"
    max_batch_size: int = 8
    max_seq_len: int = 2048
    max_input_len: int = 2048
    # Tokens an engine step takes (decode rows + a prompt chunk) when prompts are chunked; None: not chunked
    step_tokens: int | None = None
    default_max_tokens: int = 128
    # The engine's prefix cache, where it reuses KV blocks: (tokens per block, pool blocks); None: no reuse
    prefix_cache: tuple[int, int] | None = None
    tokenizer_dir: Path | None = None
    repository: Path | None = None  # sessions' SQLite file goes beside its state file

    @property
    def primary_ids(self) -> bool:
        """Requests for the ensemble go straight to ``tensorrt_llm`` as token ids: the front door does the
        pre- and postprocessing models' work (tokens.py), with their tokenizer (``serving.frontend.primary_model``)."""
        return (
            self.triton_model == "ensemble"
            and self.frontend.primary_model == "tensorrt_llm"
            and self.tokenizer_dir is not None
            and self.repository is not None
            and self.tokenizer_dir == self.repository / TOKENIZER_IN_REPO
        )

    @property
    def primary_model(self) -> str:
        """The Triton model the primary tier sends requests to."""
        return "tensorrt_llm" if self.primary_ids else self.triton_model


def config_from(source, *, triton_model: str = "ensemble") -> FrontDoorConfig:
    """A :class:`~toolkit.spec.Spec`, a repository directory, or a ready config."""
    if isinstance(source, FrontDoorConfig):
        return source
    from ..spec import Spec

    if isinstance(source, Spec):
        repo = source.repository_dir()
        triton_model = _model_of(source.build.target, triton_model)
        return _make(source.name, source.serving.model_dump(), source.build.model_dump(), repo, triton_model)
    repo = Path(source)
    from ..artifacts import read_manifest

    manifest = read_manifest(repo)
    if not manifest or not manifest.get("complete"):
        raise UsageError(
            f"'{repo}' is not an emitted rtk model repository (no complete rtk-manifest.json); run `rtk build SPEC`"
        )
    section = manifest.get("spec") or {}
    triton_model = _model_of(manifest.get("target"), triton_model)
    return _make(
        section.get("name") or repo.name, section.get("serving") or {}, section.get("build") or {}, repo, triton_model
    )


def _model_of(target: str | None, triton_model: str) -> str:
    """The llmapi target has no ensemble: its one model, ``tensorrt_llm``, takes the requests."""
    return "tensorrt_llm" if target == "llmapi" and triton_model == "ensemble" else triton_model


def _tokenizer_dir(repo: Path) -> Path | None:
    """The repository's tokenizer: the ensemble's preprocessing copy, or the llmapi model's checkpoint."""
    tok = repo / TOKENIZER_IN_REPO
    if tok.is_dir():
        return tok
    model_yaml = repo / LLMAPI_MODEL_YAML
    if model_yaml.is_file():
        import yaml

        model = (yaml.safe_load(model_yaml.read_text()) or {}).get("model")
        if model and (Path(model) / "tokenizer_config.json").is_file():
            return Path(model)
    return None


def _make(name: str, serving: dict, build: dict, repo: Path, triton_model: str) -> FrontDoorConfig:
    frontend = FrontendSpec(**serving.get("frontend", {}))
    return FrontDoorConfig(
        model_name=frontend.model_name or name,
        frontend=frontend,
        guard=GuardSpec(**serving.get("guard", {})),
        cache=CacheSpec(**serving.get("cache", {})),
        filter=FilterSpec(**serving.get("filter", {})),
        sessions=SessionsSpec(**serving.get("sessions", {})),
        jobs=JobsSpec(**serving.get("jobs", {})),
        triton_model=triton_model,
        context_policy=str(serving.get("context_policy", "truncate_oldest")),
        max_batch_size=int(build.get("max_batch_size", 8)),
        max_seq_len=int(build.get("max_seq_len", 2048)),
        max_input_len=int(build.get("max_input_len", build.get("max_seq_len", 2048))),
        step_tokens=int(build["max_num_tokens"])
        if build.get("enable_chunked_context", True) and build.get("max_num_tokens")
        else None,
        default_max_tokens=int(serving.get("default_max_tokens", 128)),
        prefix_cache=_prefix_cache(build),
        tokenizer_dir=_tokenizer_dir(repo),
        repository=repo,
    )


def _prefix_cache(build: dict) -> tuple[int, int] | None:
    """(tokens per block, pool blocks) of an engine that reuses KV blocks.  The pool: ``kv_cache_blocks``, else
    what the cpu engine takes by default (``max_batch_size`` sequences of ``max_seq_len``); a GPU engine sizes its
    pool from free memory, usually larger, so the mirror forgets sooner than the engine does."""
    if not build.get("enable_kv_cache_reuse", True):
        return None
    tpb = int(build.get("tokens_per_block", 32))
    blocks = build.get("kv_cache_blocks") or int(build.get("max_batch_size", 8)) * -(
        -int(build.get("max_seq_len", 2048)) // tpb
    )
    return tpb, int(blocks)
