"""The typed spec: one YAML file that drives every stage and every artifact.

``load_spec(path, overrides)`` reads YAML, applies ``section.field=value`` overrides, validates
every field and the cross-field rules, and raises :class:`~toolkit.errors.SpecError` naming the
field and what to change.  Rules that need the model's own config (group size vs hidden size,
supported architecture) live in :func:`check_against_model`, run by each stage before it works.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import SpecError
from .net import Endpoints, http_url
from .slo.metrics import FRACTION_METRICS, LATENCY_OBJECTIVES, OBJECTIVE_METRICS, OBJECTIVE_STATS
from .targets import TARGET_NAMES, TARGETS

BUILTIN_MODEL = "builtin:smollm2-135m-instruct"
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

QuantFormat = Literal["none", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"]
LM_HEAD_FORMATS = ("int8_sq", "int4_awq")  # quantization.quantize_lm_head
KVCacheQuant = Literal["none", "fp8", "int8"]
TargetName = Literal[TARGET_NAMES]  # the rows of toolkit/targets/ TARGETS
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


class Section(BaseModel):
    """Base for every spec section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(Section):
    source: str = Field(
        BUILTIN_MODEL,
        description="'builtin:smollm2-135m-instruct', 'hf:ORG/NAME[@REVISION]', or a local checkpoint directory",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of every checkpoint rtk writes (fetch, both exports) and of TensorRT engines"
    )
    trust_remote_code: bool = Field(False, description="run code shipped with a hub model (off by default)")

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str) -> str:
        if v.startswith("builtin:") and v != BUILTIN_MODEL:
            raise ValueError(f"unknown builtin model '{v}'; the embedded model is '{BUILTIN_MODEL}'")
        if v.startswith("hf:"):
            repo = v[3:].split("@", 1)[0]
            if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo):
                raise ValueError(f"'{v}' is not of the form hf:ORG/NAME[@REVISION]")
        if not v.strip():
            raise ValueError("must not be empty")
        return v


class CalibrationSpec(Section):
    dataset: str = Field(
        "builtin:rtk-calib",
        description="'builtin:rtk-calib' (offline text shipped with rtk) or 'hf:DATASET[:SPLIT][#COLUMN]'",
    )
    num_samples: int = Field(128, ge=1, le=4096)
    max_length: int = Field(256, ge=16, le=8192, description="tokens per calibration sample")
    batch_size: int = Field(8, ge=1, le=256)


class QuantizationSpec(Section):
    format: QuantFormat = "fp8"
    kv_cache: KVCacheQuant = Field("none", description="KV-cache quantization")
    group_size: int | None = Field(
        None,
        ge=16,
        description="block size for int4_awq / w4a8_awq; default: 128, or 64 when 128 does not divide the model",
    )
    calibration: CalibrationSpec = CalibrationSpec()
    max_perplexity_increase: float = Field(
        0.10,
        ge=0.0,
        description="quality gate: largest allowed relative perplexity increase of the export (0.10 = +10 %)",
    )
    max_kl_divergence: float | None = Field(
        None,
        ge=0.0,
        description="quality gate on how far the export's next-token distributions moved: the largest allowed mean "
        "KL divergence from the unquantized model's per held-out position (quality.json kl_divergence.mean); off "
        "by default. On SmolLM2-135M: FP8 0.049, INT8-SQ 0.081 (the export that answered 'France'), INT8-SQ with "
        "W8A16 down projections 0.034 (docs/engine-measurements.md)",
    )
    eval_samples: int = Field(32, ge=1, le=1024, description="held-out texts for the perplexity report")
    quantize_lm_head: bool = Field(
        False,
        description="int8_sq, int4_awq: quantize the LM head's weights too (TensorRT-LLM's quantize.py "
        "--quantize_lm_head): W8A16 under int8_sq, W4A16 AWQ under int4_awq; its input stays unquantized. A head "
        "tied to the embedding is untied, so the embedding stays as it is. The head is the largest weight of a "
        "small model: SmolLM2-135M's is a fifth of its bytes per token",
    )

    weight_only_modules: list[str] = Field(
        [],
        description="int8_sq: linear layers (by name, e.g. down_proj) whose inputs stay unquantized, so they are "
        "W8A16 (int8 weights, a scale per output channel) among W8A8 layers; ModelOpt's input_quantizer of "
        "*<name>* off, exported as MIXED_PRECISION. SmoothQuant's one static input scale per layer clips the "
        "down projections' activation outliers: SmolLM2-135M's INT8-SQ export answered 'France' for the capital "
        "of France until its down_proj stayed W8A16 (docs/engine-measurements.md)",
    )

    @field_validator("weight_only_modules")
    @classmethod
    def _weight_only_names(cls, v: list[str], info) -> list[str]:
        fmt = info.data.get("format")
        if v and fmt != "int8_sq":
            raise ValueError(
                f"is for quantization.format int8_sq, not {fmt}; drop weight_only_modules or change the format"
            )
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.]+", name):
                raise ValueError(
                    f"'{name}' is not a module name: use letters, digits, '_' and '.', e.g. down_proj or "
                    "layers.0.mlp.down_proj"
                )
        return v

    @field_validator("quantize_lm_head")
    @classmethod
    def _lm_head_formats(cls, v: bool, info) -> bool:
        fmt = info.data.get("format")
        if v and fmt not in LM_HEAD_FORMATS:
            raise ValueError(
                f"is for quantization.format int8_sq or int4_awq, not {fmt}: ModelOpt 0.47 exports a weight-only "
                "fp8 / w4a8_awq head under the layers' algorithm (which TensorRT-LLM reads with a quantized input) "
                "and rtk does not read its nvfp4 one; drop quantize_lm_head or change the format"
            )
        return v

    @field_validator("group_size")
    @classmethod
    def _power_of_two(cls, v: int | None) -> int | None:
        if v is not None and v & (v - 1):
            raise ValueError(f"{v} is not a power of two; use 64 or 128")
        return v


class BuildSpec(Section):
    target: TargetName = "cpu"
    max_batch_size: int = Field(8, ge=1, le=4096)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_num_tokens: int = Field(512, ge=16, description="tokens per engine step (prefill chunks + decodes)")
    max_num_tokens_without_decode: int | None = Field(
        None,
        ge=16,
        description="cpu: tokens of an engine step in which no request is generating, i.e. nobody waits "
        "for a token (default: the larger of max_num_tokens and max_input_len: a prompt arriving at an idle "
        "engine runs whole)",
    )
    step_budget_ms: float | None = Field(
        None,
        gt=0,
        description="cpu: a time budget for engine steps in which a request is generating: prompt chunks are "
        "cut so the step's predicted time (fitted to the last steps' measured times) stays within it, at least "
        "one attention unit a step. Set it below the ITL p99 objective; max_num_tokens still caps the rows "
        "(docs/engine-measurements.md, 'A step budget in time')",
    )
    step_budget_ratio: float | None = Field(
        None,
        gt=1,
        description="cpu: the time budget of a step in which a request is generating, as a multiple of the "
        "predicted time of its decode rows alone: prompt chunks are cut so the step stays within it, at least one "
        "attention unit a step. Bounds the ITL tail against the ITL median at any load: a step with prompt rows "
        "takes about this multiple of a decode step, so ITL p99/p50 lands near it plus the host's spread (the "
        "example's 1.6: 1.3-2.0 at 4 and 8 streams); with step_budget_ms too, the smaller budget applies "
        "(docs/engine-measurements.md, 'A step budget relative to the decode step', 'A ratio budget in the example')",
    )
    prompt_backlog_steps: int | None = Field(
        None,
        ge=0,
        description="cpu: under step_budget_ms or step_budget_ratio, a step with a request generating still takes "
        "the prompt tokens waiting divided by this many steps (in whole attention units), so prompts that arrive "
        "faster than the budget's cut lets through wait about this many steps instead of queueing behind a unit a "
        "step (TTFT at 8 streams under a ratio budget); 0: the cut alone; default 6 (docs/engine-measurements.md, 'A "
        "floor under the step budget')",
    )
    context_chunk_unit: int | None = Field(
        None,
        ge=1,
        description="cpu: prompt chunks end on multiples of this many tokens and prefill attention runs this many "
        "query rows a call, so a prompt's numbers never depend on how it was split; a power of two up to "
        "tokens_per_block (default: tokens_per_block, halved until it fits max_num_tokens - max_batch_size + 1). "
        "Smaller gives step_budget_ms finer chunks to cut to, at a few per cent of prefill speed",
    )
    max_beam_width: Literal[1] = 1
    tokens_per_block: int = Field(32, ge=1, le=1024)
    kv_cache_blocks: int | None = Field(
        None, ge=1, description="cpu: KV pool size in blocks; default fits max_batch_size full sequences"
    )
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0.0, le=1.0)
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    use_paged_context_fmha: bool = True
    use_fused_mlp: bool = True
    gemm_plugin: Literal["auto", "disable", "float16", "bfloat16", "fp8", "nvfp4"] = "auto"
    multiple_profiles: bool = False
    use_cuda_graph: bool = Field(True, description="llmapi target: capture CUDA graphs for decode")
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    num_threads: int | None = Field(None, ge=1, description="cpu: the engine's torch threads (default: every core)")
    prefill_threads: int | None = Field(
        None,
        ge=1,
        description="cpu: torch threads for engine steps that prefill prompts (default: num_threads)",
    )
    lone_decode_threads: int | None = Field(
        None,
        ge=1,
        description="cpu: torch threads for decode steps of a single sequence (default: num_threads)",
    )
    openmp_spin_count: int | None = Field(
        None,
        ge=0,
        description="cpu, served: rounds an idle OpenMP worker of the engine spins before it sleeps (libgomp's "
        "GOMP_SPINCOUNT; default 100,000, about 1 ms: longer than the gaps between a step's parallel regions). "
        "10000 lets the worker sleep sooner, for a host whose other processes want the cores more than the engine's "
        "tokens do, at 8-34 % of its tok/s on a quiet host (docs/serving.md, 'Threads and the host's other work'). "
        "GOMP_SPINCOUNT or OMP_WAIT_POLICY in tritonserver's environment overrides it",
    )
    int4_gemv: Literal["dot", "exact"] = Field(
        "dot",
        description="cpu, INT4-AWQ exports: the decode GEMV. dot = per-group sums of code x activation, scaled "
        "(about 1.9x bf16's decode speed; within a stated tolerance of the float32 product, docs/engine.md); on a "
        "float32 (AVX2) engine, every row as integer products over inputs quantized per block of 32 (about 2.2x); "
        "exact = the dense path's weights, bit for bit (about 1.1x)",
    )
    float32_prompt_rows: Literal["auto", "mkl", "gemv"] = Field(
        "auto",
        description="cpu, float32 engines (no native bf16): the kernel of prompt rows in projections whose decode rows "
        "take rtk's AVX2 GEMV (bf16 and FP8 weights). mkl = MKL's GEMM over float32 copies packed at load, in calls of "
        "32 rows (a call of 8 rows costs as much as 32); gemv = rtk's GEMV for every row, reading the weights as "
        "stored (half or a quarter of the bytes, no float32 copies: one kernel and one rounding for prompt and decode "
        "rows alike). auto = gemv where rtk's 256-bit build runs (AVX2 without AVX512-VNNI: there it took 0.19-0.42x "
        "MKL's time at 8-16 rows and 0.8-1.03x at 32-448), mkl on AVX512 hosts (docs/engine-measurements.md, "
        "'Prompt rows through the GEMV on AVX2 hosts')",
    )

    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="cpu: the dtype the engine computes in (its activations, K/V cache and prompt-row GEMMs); the "
        "weights stay as exported. auto = float32 where the CPU has no native bf16, and for INT8-SQ / INT4-AWQ / "
        "W8A16 exports where rtk's integer products run (AVX512-VNNI), which only a float32 engine calls; else "
        "bfloat16 (docs/engine-measurements.md, 'The engine's dtype on AVX512-VNNI hosts'). float32 holds twice the "
        "K/V bytes",
    )

    decode_batching: Literal["auto", "exact", "attention", "full"] = Field(
        "auto",
        description="cpu: how decoding sequences share a step. exact / attention = a request's numbers never depend "
        "on what else its step holds (attention: one attention call for all decode rows); full = calls may pick "
        "their kernel by the step's row count, so a request's last bits may depend on the batch: faster where a "
        "batched kernel pays (INT4-AWQ on CPUs with AMX: a step of 8 rows or more through AMX's int8 tiles, decode "
        "rows too); auto = full where that kernel runs, else attention (docs/engine.md, 'Configuration')",
    )

    decode_attention: Literal["auto", "sdpa", "in_place"] = Field(
        "auto",
        description="cpu: decode rows' attention. in_place = rtk's kernel over each row's context where it lies in "
        "the KV pool (no copy per layer, no SDPA call per row: SmolLM2 FP8 on a bf16 engine decoded 10-20 % faster "
        "alone and 7-18 % at 8 streams; within float32 rounding of SDPA, so greedy replies may take the other token "
        "of a bf16 tie); sdpa = transformers' SDPA call, its bits; auto = in_place on float32 engines, sdpa on bf16 "
        "engines (docs/engine-measurements.md, 'Decode attention read in place on bf16 engines')",
    )

    lm_head: Literal["exported", "int8"] = Field(
        "exported",
        description="cpu: the LM head the engine reads. exported = as the export holds it (bf16 unless "
        "quantization.quantize_lm_head); int8 = a bf16 head quantized by the engine at load, int8 codes per output "
        "row (weight-only, as quantize_lm_head's W8A16 head): half its bytes a token, the largest weight of a small "
        "model (SmolLM2-135M: 57 -> 28 MB, as llama.cpp's Q8_0 file holds it). The export and its quality report "
        "are unchanged; the head's rounding is a stated difference (docs/engine-measurements.md, 'An int8 LM head at "
        "load')",
    )

    @field_validator("tokens_per_block")
    @classmethod
    def _tpb_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two (TensorRT-LLM requires it); use 16, 32 or 64")
        return v

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


SECRET_SOURCE = re.compile(r"^(env:[A-Za-z_][A-Za-z0-9_]*|file:.+)$")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _secret_source(v: str | None) -> str | None:
    if v is not None and not SECRET_SOURCE.fullmatch(v):
        raise ValueError("give where the secret is, not the secret: 'env:VARIABLE' or 'file:PATH'")
    return v


class FrontendSpec(Section):
    """The OpenAI-compatible HTTP front door in front of Triton (toolkit/frontdoor, docs/guard.md)."""

    enabled: bool = Field(True, description="start the front door with the server")
    host: str = Field("127.0.0.1", description="address it binds to; any other than loopback needs api_keys")
    port: int = Field(8080, ge=1, le=65535)
    api_keys: str | None = Field(
        None, description="'env:VARIABLE' or 'file:PATH' holding accepted keys (one per line or comma-separated)"
    )
    model_name: str | None = Field(None, description="model id in /v1/models and requests; default: the spec name")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="larger request bodies are refused (413)")
    primary_model: Literal["tensorrt_llm", "ensemble"] = Field(
        "tensorrt_llm",
        description="where the front door sends requests on the cpu and trt-engine targets: straight to the "
        "tensorrt_llm model, tokenised and detokenised in the front door (one python-stub hop less per token), or "
        "through the repository's ensemble (its pre- and postprocessing models); the llmapi target has one model",
    )

    @field_validator("api_keys")
    @classmethod
    def _keys_source(cls, v: str | None) -> str | None:
        return _secret_source(v)

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


class FallbackTier(Section):
    """One tier of ``serving.guard.fallbacks``, tried in order when the primary cannot meet the deadline."""

    kind: Literal["deployment", "cache", "rule"]
    name: str | None = Field(None, description="label in the tier header and /metrics; default: the kind")
    url: str | None = Field(None, description="deployment: base URL of an OpenAI-compatible server (…/v1)")
    spec: str | None = Field(None, description="deployment: another rtk spec; its running front door is used")
    model: str | None = Field(None, description="deployment: model id to ask for (default: the one it lists first)")
    api_key: str | None = Field(None, description="deployment: 'env:VARIABLE' or 'file:PATH'")
    template: str | None = Field(None, description="rule: the answer; {model} and {deadline_ms} are filled in")

    @field_validator("api_key")
    @classmethod
    def _key_source(cls, v: str | None) -> str | None:
        return _secret_source(v)

    @model_validator(mode="after")
    def _fields_for_kind(self) -> FallbackTier:
        if self.kind == "deployment" and (self.url is None) == (self.spec is None):
            raise ValueError(
                "a 'deployment' fallback needs exactly one of 'url' (OpenAI-compatible) or 'spec' (an rtk spec)"
            )
        if self.kind == "rule" and not self.template:
            raise ValueError("a 'rule' fallback needs a 'template' (the answer text)")
        if self.kind != "deployment" and (self.url or self.spec or self.model or self.api_key):
            raise ValueError(
                f"'url', 'spec', 'model' and 'api_key' belong to a 'deployment' fallback, not '{self.kind}'"
            )
        if self.kind != "rule" and self.template:
            raise ValueError(f"'template' belongs to a 'rule' fallback, not '{self.kind}'")
        return self

    @property
    def label(self) -> str:
        return self.name or self.kind


class GuardSpec(Section):
    """Deadline-aware admission: predict each request's TTFT at arrival and degrade before the first byte."""

    ttft_deadline_ms: float | None = Field(
        None,
        gt=0,
        description="TTFT deadline; a request predicted to miss it falls back or is refused (none: no deadline)",
    )
    fallbacks: list[FallbackTier] = Field(default_factory=list, description="tiers tried in order; then 429")
    retry_after_s: int = Field(1, ge=1, le=3600, description="least Retry-After on a refusal (seconds)")
    metrics_poll_ms: int = Field(100, ge=10, le=10_000, description="how often the engine's gauges are read")
    prediction_quantile: float | None = Field(
        0.9,
        gt=0,
        lt=1,
        description="the deadline is checked against the predicted TTFT times this quantile of its recent error "
        "(measured / predicted, at least 1); none: against the prediction alone",
    )


class CacheSpec(Section):
    """The response cache tier (deterministic requests: temperature 0 or a fixed seed)."""

    url: str | None = Field(None, description="redis://HOST:PORT/DB for a shared cache; default: in-process")
    ttl_s: float = Field(300.0, gt=0, description="seconds an answer stays valid")
    max_entries: int = Field(4096, ge=1, description="in-process cache: least recently used beyond this are dropped")


class ClassifierSpec(Section):
    """A classifier model served in the same repository: ``text_input`` (BYTES) in, ``score`` (FP32, 0..1) out."""

    model: str = Field(..., min_length=1, description="the classifier's model name in the repository")
    threshold: float = Field(0.5, ge=0, le=1, description="a score at or above this is a hit")
    every_chars: int = Field(64, ge=1, description="output: classify the held text after this many new characters")


class FilterSpec(Section):
    """The content filter on input and streamed output (toolkit/frontdoor/filter.py, docs/guard.md)."""

    keywords: list[str] = Field(default_factory=list, description="phrases refused anywhere in the text")
    patterns: list[str] = Field(default_factory=list, description="regular expressions (Python re, case-insensitive)")
    hold_back_chars: int = Field(
        32,
        ge=1,
        le=4096,
        description="output kept back so a phrase split across tokens is caught (at least the "
        "longest keyword; a pattern match longer than this may be partly sent before it is found)",
    )
    input: bool = Field(True, description="refuse a request whose messages or prompt break a rule (400)")
    output: bool = Field(
        True, description="end a response before text that breaks a rule (finish_reason content_filter)"
    )
    classifier: ClassifierSpec | None = None

    @field_validator("keywords")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        for i, w in enumerate(v):
            if not w.strip():
                raise ValueError(f"keywords[{i}] is empty; remove it")
        return v

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for i, p in enumerate(v):
            try:
                if re.compile(p).match(""):
                    raise ValueError(f"patterns[{i}] {p!r} matches the empty text, so it would match everything")
            except re.error as exc:
                raise ValueError(f"patterns[{i}] {p!r} is not a valid regular expression: {exc}") from None
        return v


class SessionsSpec(Section):
    """Conversations kept by the front door for requests with ``session_id`` (toolkit/frontdoor/sessions.py)."""

    enabled: bool = True
    url: str | None = Field(None, description="redis://HOST:PORT/DB; default: SQLite beside the server's state file")
    path: str | None = Field(None, description="the SQLite file (default: .rtk-triton/<repository>.sessions.sqlite)")
    ttl_s: float = Field(86_400.0, gt=0, description="a session is forgotten this long after its last turn")
    max_tokens: int = Field(
        32_768, ge=16, description="per-session size cap in stored token ids; beyond it the oldest turns are dropped"
    )
    admin_key: str | None = Field(
        None, description="'env:VARIABLE' or 'file:PATH': the key that may list, read and delete every session"
    )
    exact_ids: bool = Field(
        True, description="send the stored token ids (hits the engine's KV reuse); false: re-tokenise the history"
    )
    window_policy: Literal["truncate_oldest", "summarize"] = Field(
        "truncate_oldest",
        description="turns that no longer fit the window are dropped, or (summarize) replaced "
        "by a summary the served model writes after the response",
    )
    summary_max_tokens: int = Field(128, ge=8, le=1024, description="summarize: the longest summary")

    @field_validator("admin_key")
    @classmethod
    def _admin_source(cls, v: str | None) -> str | None:
        return _secret_source(v)

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^rediss?://", v):
            raise ValueError(f"'{v}' is not a Redis URL; use redis://HOST:PORT/DB (or leave it unset for SQLite)")
        return v


class JobsSpec(Section):
    """Async jobs: POST /v1/jobs, GET /v1/jobs/{id}, signed callbacks (toolkit/frontdoor/jobs.py)."""

    enabled: bool = True
    path: str | None = Field(None, description="the SQLite file (default: .rtk-triton/<repository>.jobs.sqlite)")
    ttl_s: float = Field(86_400.0, gt=0, description="finished jobs and their results are kept this long")
    max_concurrent: int = Field(2, ge=1, description="jobs run at once (each is one request to the model)")
    poll_s: float = Field(0.5, gt=0, le=60, description="how often due jobs and callbacks are looked for")
    callback_secret: str | None = Field(
        None,
        description="'env:VARIABLE' or 'file:PATH': the HMAC-SHA256 key callbacks are signed with; "
        "without it a callback_url is refused",
    )
    allow_private_callbacks: bool = Field(
        False, description="allow callback URLs on loopback, private, link-local and other non-public addresses"
    )
    callback_max_attempts: int = Field(8, ge=1, le=100)
    callback_backoff_s: float = Field(1.0, gt=0, description="first retry delay; doubled each attempt")
    callback_max_backoff_s: float = Field(300.0, gt=0)
    callback_timeout_s: float = Field(10.0, gt=0)

    @field_validator("callback_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        return _secret_source(v)


class ServingSpec(Section, Endpoints):
    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "streaming" in data:
            raise ValueError(
                "'serving.streaming' is gone: a request asks for a stream with its 'stream' input, and "
                "serving.decoupled says whether the models can send one; remove the line"
            )
        return data

    repository: str | None = Field(None, description="model repository directory; default triton_repo/<name>")
    host: str = Field("127.0.0.1", description="address tritonserver binds to; loopback unless told otherwise")
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(8001, ge=1, le=65535)
    metrics_port: int = Field(8002, ge=1, le=65535)
    decoupled: bool = Field(
        True,
        description="models may send one response per token (a request asks with its 'stream' input); "
        "false: one response per request",
    )
    instance_count: int = Field(1, ge=1, description="instances of the tensorrt_llm model")
    preprocessing_instances: int = Field(1, ge=1)
    postprocessing_instances: int = Field(1, ge=1)
    max_queue_size: int | None = Field(
        None,
        ge=0,
        description="requests waiting beyond this are refused (0 = unbounded); default 64 where the target enforces it "
        "(cpu, trt-engine; the llmapi target cannot)",
    )
    queue_timeout_ms: int | None = Field(
        None,
        ge=1,
        description="refuse requests not scheduled within this time (cpu only: the GPU backends cannot enforce it)",
    )
    server_niceness: int | None = Field(
        None,
        ge=0,
        le=19,
        description="CPU niceness of tritonserver and its model processes (their session's autogroup too): above 0, "
        "the front door and clients on the same cores run first when the engine saturates them; default 5 on the "
        "cpu target, 0 on GPU targets (docs/guard.md)",
    )
    batching_strategy: Literal["inflight_fused_batching", "inflight_batching", "V1"] = "inflight_fused_batching"
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    warmup: bool = Field(True, description="send warm-up requests at load so no user meets a cold start")
    context_policy: Literal["truncate_oldest", "reject", "summarize"] = Field(
        "truncate_oldest",
        description="long conversations: drop the oldest turns (keeping the system prompt), refuse, or (summarize) "
        "drop them and, in a session, replace them with the served model's summary (serving.sessions.window_policy)",
    )
    default_max_tokens: int = Field(128, ge=1)
    tritonserver: str | None = Field(
        None, description="path to a tritonserver binary; default: found on PATH or bundled"
    )
    frontend: FrontendSpec = FrontendSpec()
    guard: GuardSpec = GuardSpec()
    cache: CacheSpec = CacheSpec()
    filter: FilterSpec = FilterSpec()
    sessions: SessionsSpec = SessionsSpec()
    jobs: JobsSpec = JobsSpec()

    @model_validator(mode="after")
    def _summarize_sessions(self) -> ServingSpec:
        """``context_policy: summarize`` is the sessions' window policy unless they name their own (requests
        without a session have no state to keep a summary in: the models drop the oldest turns for them)."""
        if self.context_policy == "summarize" and "window_policy" not in self.sessions.model_fields_set:
            self.sessions = self.sessions.model_copy(update={"window_policy": "summarize"})
        return self


class Objective(Section):
    """One latency / throughput objective, e.g. ``{metric: ttft, stat: p99, max: 300}`` (ms)."""

    metric: Literal[OBJECTIVE_METRICS]  # the names live with the metrics registry (toolkit/slo/metrics.py)
    stat: Literal[(*OBJECTIVE_STATS, "value")] = "value"
    max: float | None = Field(
        None, description="upper bound: ms for latencies, a fraction for error_rate, per second for throughputs"
    )
    min: float | None = Field(None, description="lower bound (attainment as a fraction, e.g. 0.99; throughputs)")

    @model_validator(mode="after")
    def _one_bound(self) -> Objective:
        if (self.max is None) == (self.min is None):
            raise ValueError(f"objective '{self.metric}' needs exactly one of 'max' or 'min'")
        per_request = self.metric in LATENCY_OBJECTIVES
        if per_request and self.stat == "value":
            raise ValueError(f"objective '{self.metric}' is a distribution; give a stat: {', '.join(OBJECTIVE_STATS)}")
        if not per_request and self.stat != "value":
            raise ValueError(f"objective '{self.metric}' is one number for the run; drop 'stat' (or use stat: value)")
        bound = self.max if self.max is not None else self.min
        if self.metric in FRACTION_METRICS and not 0.0 <= bound <= 1.0:
            raise ValueError(f"objective '{self.metric}' is a fraction between 0 and 1 (0.99 = 99 %), got {bound}")
        return self


class SLOSpec(Section):
    objectives: list[Objective] = Field(default_factory=list)
    transport: Literal["grpc", "http", "openai"] = Field(
        "grpc",
        description="Triton's gRPC stream, Triton's HTTP generate_stream (SSE), or an OpenAI-compatible server (SSE)",
    )
    endpoint: Literal["ensemble", "tensorrt_llm", "chat", "completions"] = Field(
        "ensemble",
        description="interface: Triton's ensemble (text) or tensorrt_llm model (ids); openai: chat or completions",
    )
    concurrency: int | None = Field(None, ge=1, description="closed loop: requests in flight")
    request_rate: float | None = Field(None, gt=0, description="open loop: requests per second")
    arrival: Literal["constant", "poisson", "gamma"] = Field("poisson", description="open loop: arrival process")
    burstiness: float = Field(1.0, gt=0, description="gamma shape; 1.0 = Poisson")
    num_requests: int | None = Field(200, ge=1, description="measured requests (warm-up not counted)")
    duration_s: float | None = Field(None, gt=0, description="stop sending new requests after this many seconds")
    warmup_requests: int = Field(5, ge=0, description="requests sent first and left out of the results")
    input_tokens: int = Field(128, ge=1, description="synthetic prompt length, mean (tokens)")
    input_tokens_stddev: float = Field(0.0, ge=0, description="synthetic prompt length, standard deviation")
    output_tokens: int = Field(64, ge=1, description="tokens to generate per request, mean")
    output_tokens_stddev: float = Field(0.0, ge=0, description="tokens to generate, standard deviation")
    dataset: str | None = Field(None, description="JSONL prompts instead of synthetic ones")
    seed: int = Field(0, description="seed for prompts, lengths and arrival times")
    model: str | None = Field(None, description="model name on the server (default: the endpoint's name)")
    max_inflight: int | None = Field(
        None, ge=1, description="open loop: at most this many requests in flight; later ones wait (and the wait counts)"
    )
    turns: int = Field(1, ge=1, description="synthetic multi-turn: turns per session, each resending the history")
    tokenizer: str | None = Field(
        None, description="tokenizer directory for synthetic prompts (default: the repository's preprocessing one)"
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="a request without its final response after this long is an error"
    )
    max_schedule_lag_ms: float = Field(
        5.0,
        gt=0,
        description="the client kept the schedule when its own send lag p99 is within this; else INCONCLUSIVE",
    )

    @model_validator(mode="after")
    def _one_load(self) -> SLOSpec:
        if self.concurrency is not None and self.request_rate is not None:
            raise _Rule(
                "slo.request_rate", "set either 'concurrency' (closed loop) or 'request_rate' (open loop), not both"
            )
        openai = self.endpoint in ("chat", "completions")
        if self.transport == "openai" and not openai:
            if "endpoint" in self.model_fields_set:
                raise _Rule(
                    "slo.endpoint",
                    f"'{self.endpoint}' is a Triton interface; with transport openai use chat or completions",
                )
            self.__dict__["endpoint"] = "chat"  # the default for OpenAI-compatible servers
        elif self.transport != "openai" and openai:
            raise _Rule(
                "slo.endpoint",
                f"'{self.endpoint}' needs transport openai; Triton's interfaces are ensemble and tensorrt_llm",
            )
        return self


K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # an RFC 1123 label (namespaces, Secrets, PVCs)
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")


def _k8s_name(v: str | None) -> str | None:
    if v is not None and (len(v) > 63 or not K8S_NAME.fullmatch(v)):
        raise ValueError(f"'{v}' is not a Kubernetes name; use lower-case letters, digits and '-' (at most 63)")
    return v


def _quantity(v: str | None) -> str | None:
    if v is not None and not K8S_QUANTITY.fullmatch(v):
        raise ValueError(f"'{v}' is not a Kubernetes quantity; write e.g. '8', '500m', '64Gi'")
    return v


class DeployResources(Section):
    """What one pod asks for.  GPUs are not set here: a pod requests the GPUs its ranks use."""

    gpus_per_node: int = Field(
        8, ge=1, le=64, description="GPUs a node offers; a larger world size spans nodes (LeaderWorkerSet)"
    )
    gpu_resource: str = Field("nvidia.com/gpu", description="extended resource name of a GPU (NVIDIA device plugin)")
    cpu: str = Field("8", description="CPU request per pod (and limit on the cpu target)")
    memory: str = Field("64Gi", description="memory request and limit per pod")
    shm_size: str = Field("16Gi", description="size of /dev/shm (python backend tensors, NCCL)")

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantities(cls, v: str) -> str:
        return _quantity(v)


class DeployStorage(Section):
    """Where the pod finds the model repository and engines (built with the working directory = mount_path)."""

    kind: Literal["pvc", "object-storage"] = Field(
        "pvc", description="a PersistentVolumeClaim, or an init container that copies from s3:// or gs://"
    )
    claim_name: str | None = Field(None, description="pvc: the claim to mount (default <name>-models); it must exist")
    uri: str | None = Field(
        None, description="object-storage: s3://BUCKET/PREFIX or gs://BUCKET/PREFIX holding engines/ and triton_repo/"
    )
    credentials_secret: str | None = Field(
        None, description="object-storage: Secret whose keys become the copy's environment (e.g. AWS_ACCESS_KEY_ID)"
    )
    copy_image: str | None = Field(
        None, description="object-storage: image with the copy tool (default: aws-cli for s3, cloud-sdk for gs)"
    )
    cache_size: str = Field("200Gi", description="object-storage: size limit of the emptyDir the copy fills")
    mount_path: str = Field(
        "/models", description="where the volume is mounted; engines/ and triton_repo/ lie below it"
    )
    read_only: bool = Field(True, description="pvc: mount read-only")

    @field_validator("claim_name", "credentials_secret")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _k8s_name(v)

    @field_validator("cache_size")
    @classmethod
    def _size(cls, v: str) -> str:
        return _quantity(v)

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError(f"'{v}' must be an absolute directory other than '/', e.g. /models")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _source(self) -> DeployStorage:
        if self.kind == "object-storage":
            if not self.uri or not re.fullmatch(r"(s3|gs)://[a-z0-9][a-z0-9._-]{1,62}(/[^\s]*)?", self.uri):
                raise _Rule(
                    "deploy.storage.uri",
                    f"object-storage needs uri: s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (got {self.uri!r})",
                )
        elif self.uri or self.credentials_secret or self.copy_image:
            raise _Rule(
                "deploy.storage.uri", "'uri', 'credentials_secret' and 'copy_image' belong to kind: object-storage"
            )
        return self


class DeployAutoscaling(Section):
    """Horizontal autoscaling of replicas (Deployment pods or LeaderWorkerSet groups) on a Prometheus signal."""

    kind: Literal["none", "hpa", "keda"] = Field(
        "hpa", description="HPA autoscaling/v2 via prometheus-adapter, a KEDA ScaledObject, or none"
    )
    signal: Literal["waiting_requests", "queue_compute_ratio", "custom"] = Field(
        "waiting_requests",
        description="waiting_requests: nv_trt_llm_request_metrics{request_type='waiting'} per replica "
        "(see docs/deploy.md); "
        "queue_compute_ratio: Triton's queue/compute time (near zero for decoupled LLM models); custom: 'query'",
    )
    query: str | None = Field(
        None, description="custom: PromQL giving one series per pod with 'namespace' and 'pod' labels"
    )
    target: float | None = Field(
        None, gt=0, description="average value per replica to hold (default: 2 waiting requests, ratio 1.0)"
    )
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    scale_up_stabilization_s: int = Field(
        30,
        ge=0,
        le=3600,
        description="scale up only to the lowest recommendation of this window (a spike alone adds no replica)",
    )
    scale_down_stabilization_s: int = Field(
        300, ge=0, le=3600, description="scale down only to the highest recommendation of this window"
    )
    prometheus_url: str = Field(
        "http://prometheus-operated.monitoring.svc:9090", description="keda: Prometheus to query"
    )
    prometheus_labels: dict[str, str] = Field(
        default_factory=dict,
        description="labels the Prometheus Operator selects PodMonitors and rules by "
        "(e.g. release: kube-prometheus-stack)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> DeployAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise _Rule(
                "deploy.autoscaling.max_replicas", f"{self.max_replicas} is below min_replicas ({self.min_replicas})"
            )
        if (self.signal == "custom") != (self.query is not None):
            raise _Rule("deploy.autoscaling.query", "give 'query' exactly when signal is 'custom'")
        return self


class DeploySecrets(Section):
    """Names of existing Secrets; their values never enter the spec or the manifests."""

    hf_token: str | None = Field(None, description="Secret with key HF_TOKEN, given to the pods as an env reference")
    frontend_api_keys: str | None = Field(
        None,
        description="Secret holding the front door's keys under the variable serving.frontend.api_keys names; "
        "without it the front door stays on loopback inside the pod",
    )
    ssh: str = Field(
        "rtk-mpi-ssh", description="multi-node: Secret with id_rsa, id_rsa.pub and authorized_keys for mpirun's ssh"
    )
    image_pull: str | None = Field(None, description="imagePullSecret for the image (e.g. an NGC API key Secret)")

    @field_validator("hf_token", "frontend_api_keys", "ssh", "image_pull")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not K8S_NAME.fullmatch(v)):  # the value is not echoed: it may be a token
            raise ValueError(
                "is not the name of a Secret (lower-case letters, digits and '-'); "
                "give the Secret's name, "
                "never the secret itself"
            )
        return v


class DeploySpec(Section):
    """``rtk deploy k8s``: Kubernetes manifests for this spec (docs/deploy.md)."""

    namespace: str = Field("default", description="namespace every object is created in")
    image: str | None = Field(
        None,
        description="container image; default: the NGC Triton TensorRT-LLM image for GPU targets, "
        "rtk-cpu:<version> built from the written Dockerfile for cpu",
    )
    replicas: int = Field(
        1, ge=0, description="replicas (single node: pods; multi-node: leader+worker groups) without autoscaling"
    )
    resources: DeployResources = DeployResources()
    storage: DeployStorage = DeployStorage()
    autoscaling: DeployAutoscaling = DeployAutoscaling()
    secrets: DeploySecrets = DeploySecrets()
    startup_timeout_s: int = Field(
        1800, ge=60, le=7200, description="time the engine has to load and warm before the pod is restarted"
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector for every pod")
    service_type: Literal["ClusterIP", "LoadBalancer", "NodePort"] = "ClusterIP"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return _k8s_name(v)


class Spec(Section):
    name: str = Field(description="names the artifacts: engines/<name>/, triton_repo/<name>/")
    model: ModelSpec = ModelSpec()
    quantization: QuantizationSpec = QuantizationSpec()
    build: BuildSpec = BuildSpec()
    serving: ServingSpec = ServingSpec()
    slo: SLOSpec = SLOSpec()
    deploy: DeploySpec = DeploySpec()

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not SAFE_NAME.fullmatch(v):
            raise ValueError(
                f"'{v}' is not a safe directory name; use letters, digits, '.', '_' or '-' "
                "(at most 64, starting with a letter or digit)"
            )
        return v

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Spec:
        b, q, s = self.build, self.quantization, self.serving
        target = TARGETS[b.target]
        if q.format not in target.formats:
            ok = ", ".join(sorted(target.formats))
            raise _Rule(
                "quantization.format",
                f"'{q.format}' cannot run on build.target '{b.target}'; choose one of {ok} or another target",
            )
        if q.kv_cache not in target.kv_formats:
            ok = "', '".join(sorted(target.kv_formats))
            raise _Rule(
                "quantization.kv_cache",
                f"the {b.target} target supports KV-cache quantization '{ok}', not '{q.kv_cache}'",
            )
        if q.kv_cache == "int8":  # modelopt/torch/export/quant_utils.py postprocess_state_dict asserts it
            raise _Rule(
                "quantization.kv_cache",
                "'int8' cannot be exported: ModelOpt's unified HF checkpoint carries FP8 (or NVFP4) KV-cache "
                "scales only; "
                "use 'fp8' or 'none'",
            )
        if b.max_input_len >= b.max_seq_len:
            raise _Rule(
                "build.max_input_len",
                f"{b.max_input_len} must be below build.max_seq_len ({b.max_seq_len}) to leave room for output tokens",
            )
        if not b.enable_chunked_context and b.max_num_tokens < b.max_input_len:
            raise _Rule(
                "build.max_num_tokens",
                f"{b.max_num_tokens} is below build.max_input_len ({b.max_input_len}); without chunked context a "
                "whole prompt must fit one step. "
                "Raise max_num_tokens or set build.enable_chunked_context: true",
            )
        if b.max_num_tokens_without_decode is not None and b.max_num_tokens_without_decode < b.max_num_tokens:
            raise _Rule(
                "build.max_num_tokens_without_decode",
                f"{b.max_num_tokens_without_decode} is below build.max_num_tokens ({b.max_num_tokens}); a step "
                "without decodes may take more tokens, not fewer. Raise it or leave it unset",
            )
        for name in ("step_budget_ms", "step_budget_ratio", "prompt_backlog_steps"):
            if getattr(b, name) is not None and b.target != "cpu":
                raise _Rule(
                    f"build.{name}",
                    f"is rtk's cpu engine's; the {b.target} target's scheduler (TensorRT-LLM's) budgets steps in "
                    f"tokens only: drop {name} and size build.max_num_tokens",
                )
        if b.compute_dtype != "auto" and b.target != "cpu":
            raise _Rule(
                "build.compute_dtype",
                f"is rtk's cpu engine's; on the {b.target} target the engine's dtype is the checkpoint's (model.dtype) "
                "and its quantization: drop compute_dtype",
            )
        if b.decode_batching not in ("auto", "attention") and b.target != "cpu":
            raise _Rule(
                "build.decode_batching",
                f"is rtk's cpu engine's; on the {b.target} target TensorRT-LLM's in-flight batching decides: "
                "drop decode_batching",
            )
        if b.lm_head != "exported" and b.target != "cpu":
            raise _Rule(
                "build.lm_head",
                f"'{b.lm_head}' is rtk's cpu engine's; on the {b.target} target use quantization.quantize_lm_head "
                "(int8_sq, int4_awq) or leave lm_head unset",
            )
        if b.context_chunk_unit is not None:
            u, room = b.context_chunk_unit, b.max_num_tokens - b.max_batch_size + 1
            if b.target != "cpu":
                raise _Rule(
                    "build.context_chunk_unit",
                    f"is rtk's cpu engine's; the {b.target} target chunks context in whole KV blocks "
                    "(build.tokens_per_block): drop it",
                )
            if u & (u - 1) or u > b.tokens_per_block:
                raise _Rule(
                    "build.context_chunk_unit",
                    f"{u} must be a power of two up to build.tokens_per_block ({b.tokens_per_block})",
                )
            if u > room:
                raise _Rule(
                    "build.context_chunk_unit",
                    f"{u} does not fit a step beside a full batch's decodes (build.max_num_tokens - "
                    f"build.max_batch_size + 1 = {room}); lower it or raise build.max_num_tokens",
                )
        if b.prompt_backlog_steps is not None and b.step_budget_ms is None and b.step_budget_ratio is None:
            raise _Rule(
                "build.prompt_backlog_steps",
                "is a floor under a step's time budget and there is none: set build.step_budget_ratio or "
                "build.step_budget_ms, or drop prompt_backlog_steps",
            )
        for name in ("step_budget_ms", "step_budget_ratio"):
            if getattr(b, name) is not None and not b.enable_chunked_context:
                raise _Rule(
                    f"build.{name}",
                    f"cuts prompt chunks, so it needs build.enable_chunked_context: true; set that or drop {name}",
                )
        if b.max_num_tokens < b.max_batch_size:
            raise _Rule(
                "build.max_num_tokens",
                f"{b.max_num_tokens} is below build.max_batch_size ({b.max_batch_size}); "
                "a full batch could not decode one token each",
            )
        if (
            b.target == "trt-engine"
            and (b.enable_kv_cache_reuse or b.enable_chunked_context)
            and not b.use_paged_context_fmha
        ):
            raise _Rule(
                "build.use_paged_context_fmha",
                "KV-cache reuse and chunked context need paged context FMHA; set it true or disable both",
            )
        for name, why in target.unenforceable.items():
            if getattr(s, name) is not None:
                raise _Rule(f"serving.{name}", f"the {b.target} target cannot enforce it: {why}")
        if s.max_queue_size is None and target.default_max_queue_size is not None:
            s.max_queue_size = target.default_max_queue_size
        if s.server_niceness is None:
            s.server_niceness = target.default_server_niceness
        if target.max_world_size is not None and b.world_size > target.max_world_size:
            raise _Rule("build.tp_size", f"the {b.target} target runs on one process; set tp_size and pp_size to 1")
        if b.kv_cache_blocks is not None:
            need = -(-b.max_seq_len // b.tokens_per_block)
            if b.kv_cache_blocks < need:
                raise _Rule(
                    "build.kv_cache_blocks",
                    f"{b.kv_cache_blocks} blocks cannot hold even one sequence of max_seq_len {b.max_seq_len} "
                    f"({need} blocks of {b.tokens_per_block})",
                )
        if s.default_max_tokens > b.max_seq_len - 1:
            raise _Rule(
                "serving.default_max_tokens",
                f"{s.default_max_tokens} exceeds what build.max_seq_len ({b.max_seq_len}) allows",
            )
        ports = [s.http_port, s.grpc_port, s.metrics_port]
        if len(set(ports)) != 3:
            raise _Rule("serving.http_port", f"http, grpc and metrics ports must differ (got {ports})")
        f = s.frontend
        if f.enabled and f.port in ports:
            raise _Rule("serving.frontend.port", f"{f.port} is already one of Triton's ports {ports}; choose another")
        if f.enabled and f.host not in LOOPBACK_HOSTS and not f.api_keys:
            raise _Rule(
                "serving.frontend.api_keys",
                f"the front door binds to {f.host}, beyond loopback; set api_keys "
                "('env:VARIABLE' or 'file:PATH') or bind to 127.0.0.1",
            )
        kinds = [t.kind for t in s.guard.fallbacks]
        for kind in ("cache", "rule"):
            if kinds.count(kind) > 1:
                raise _Rule("serving.guard.fallbacks", f"'{kind}' is listed {kinds.count(kind)} times; list it once")
        if "rule" in kinds and kinds[-1] != "rule":
            raise _Rule("serving.guard.fallbacks", "a 'rule' always answers, so tiers after it never run; put it last")
        return self

    # -- derived values -----------------------------------------------------------------------
    def repository_dir(self) -> Path:
        return Path(self.serving.repository) if self.serving.repository else Path("triton_repo") / self.name


class _Rule(ValueError):
    """A cross-field rule violation; carries the field it is about."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# -- loading ------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'quantization.format=int4_awq'`` -> (['quantization', 'format'], 'int4_awq'); YAML-typed value."""
    if "=" not in text:
        raise SpecError(f"override '{text}' is not KEY=VALUE (e.g. quantization.format=int4_awq)")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise SpecError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise SpecError(f"cannot set '{'.'.join(path)}': '{part}' is not a section", field=".".join(path))
            node = nxt
        node[path[-1]] = value
    return data


def spec_from_dict(data: Any, *, file: str | None = None) -> Spec:
    if not isinstance(data, dict):
        raise SpecError("the spec must be a YAML mapping with at least a 'name'", file=file)
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, file) from None


def load_spec(path: str | Path, overrides: list[str] | None = None) -> Spec:
    """Read, override and validate a spec file. Raises SpecError with the field and the fix."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec file '{path}' does not exist; pass the path of a YAML spec (see examples/)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"not valid YAML{where}: {problem}. Fix the syntax and run again", file=str(path)) from None
    if isinstance(data, dict):
        data = apply_overrides(data, overrides or [])
    return spec_from_dict(data, file=str(path))


def _spec_error(exc: ValidationError, file: str | None) -> SpecError:
    lines = []
    first_field = None
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _Rule):
            loc, msg = ctx_err.field, str(ctx_err)
        elif err["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling (see examples/ for every field)"
        elif err["type"] == "missing":
            msg = "is required"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"].startswith("literal_error") or err["type"] == "enum":
                msg = f"got {err.get('input')!r}; {msg}"
        first_field = first_field or loc
        lines.append(f"'{loc}': {msg}" if loc else msg)
    text = "; ".join(lines)
    return (
        SpecError(text, file=file, field=None)
        if len(lines) > 1
        else SpecError(lines[0].split(": ", 1)[1] if first_field else lines[0], file=file, field=first_field or None)
    )


# -- rules that need the model's config ----------------------------------------------------------


def resolve_group_size(spec: Spec, hidden: int, intermediate: int) -> int | None:
    """The AWQ block size to use, or None for formats without one. Raises SpecError if it cannot divide."""
    q = spec.quantization
    if q.format not in ("int4_awq", "w4a8_awq"):
        return None
    if q.group_size is None:
        for g in (128, 64, 32):
            if hidden % g == 0 and intermediate % g == 0:
                return g
        raise SpecError(
            f"no block size in 128/64/32 divides hidden size {hidden} and intermediate size {intermediate}; "
            "choose another format",
            field="quantization.group_size",
        )
    if hidden % q.group_size or intermediate % q.group_size:
        fits = [g for g in (128, 64, 32) if hidden % g == 0 and intermediate % g == 0]
        hint = f"use {fits[0]}" if fits else "choose another format"
        raise SpecError(
            f"{q.group_size} does not divide the model's hidden size {hidden} and intermediate size {intermediate} "
            f"(export cannot pack partial blocks); {hint}",
            field="quantization.group_size",
        )
    return q.group_size


def check_against_model(spec: Spec, config: dict) -> None:
    """Model-dependent rules, checked from config.json before a stage does any work."""
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise SpecError(
            f"architecture {archs or '(none)'} is not supported; "
            f"rtk handles {', '.join(sorted(SUPPORTED_ARCHITECTURES))}",
            field="model.source",
        )
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    resolve_group_size(spec, hidden, inter)
    max_pos = int(config.get("max_position_embeddings") or 0)
    if max_pos and spec.build.max_seq_len > max_pos:
        raise SpecError(
            f"{spec.build.max_seq_len} exceeds the model's max_position_embeddings ({max_pos}); lower it",
            field="build.max_seq_len",
        )
