"""Shared fixtures.

* ``tiny_llama_dir``: a small random Llama (2 layers, hidden 128) with the embedded model's real
  tokenizer, made by the test session itself in a few seconds — the model most tests use.
* ``smollm2_dir``: the real embedded SmolLM2-135M-Instruct, fetched once per session (≈30 s).
* ``smollm2_fp8_dir``: its FP8 quantized stage directory (``hf/``, ``trtllm/``, ``quality.json``),
  made once per session (≈60 s); used by the engine and serving tests.

Artifacts made by fixtures live under the session's temporary directory, never in the work tree.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.1,  # peaky logits, so greedy decoding is not a coin toss between near-ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


@functools.cache
def gemv_rounds_its_own_way() -> bool:
    """Whether rtk's bf16 GEMV rounds apart from oneDNN's one-row kernel here (oneDNN's AMX kernel, Intel
    Sapphire Rapids and later): the engine's bf16 decode rows are then not transformers' bits, but within the
    GEMV's tolerance (docs/engine-measurements.md, "Intel CPUs with AMX")."""
    import torch

    from toolkit.runtime import kernels
    from toolkit.runtime.checkpoint import Linear
    from toolkit.runtime.model import Projection, bf16_is_fast

    if not (bf16_is_fast() and kernels.available()):
        return False
    weight = torch.randn(576, 1536, generator=torch.Generator().manual_seed(0))
    return Projection([Linear(weight=weight)], torch.bfloat16, pack=True, gemv_kernel=True).own_rounding


def same_tokens_logit_gap(got, want) -> float:
    """Asserts that two steps' logits pick the same token at every position and returns their largest
    difference relative to ``want``'s largest logit: how far apart two roundings of one step are where they
    cannot be bit-equal (rtk's GEMV with its own rounding, integer kernels)."""
    import torch

    assert torch.equal(got.argmax(-1), want.argmax(-1))
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def greedy_ties_taken(model, prompt_ids: list[int], tokens: list[int], steps: int = 1) -> int:
    """Asserts that ``tokens`` are transformers' greedy continuation of ``prompt_ids`` up to a tie at bf16's
    resolution, and returns how many such ties went the other way.

    ``model`` is fed the prompt, then ``tokens`` one at a time with its KV cache (the arithmetic of its
    ``generate``), and each token must be its top logit or at most ``steps`` bf16 steps below it. bf16 logits of a 49k
    vocabulary tie exactly now and then, and which of two tied tokens ``argmax`` takes follows the host's
    matmul kernels: on one CI host transformers itself took another token at a tie where the engine took
    the one transformers takes here."""
    import torch

    ties = 0
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for i, tok in enumerate(tokens):
            logits = out.logits[0, -1].float()
            best = logits.max()
            step = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)  # bf16 has 8 significant bits
            assert logits[tok] >= best - steps * step, (
                f"token {i}: {tok} scores {logits[tok].item()}, transformers' best {logits.argmax().item()} "
                f"scores {best.item()}"
            )
            ties += int(logits[tok] < best or logits.argmax().item() != tok)
            # transformers 5 names the cache ``cache``; 4.x ``past_key_values``
            cache = {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}
            out = model(torch.tensor([[tok]]), use_cache=True, **cache)
    return ties


def make_tiny_llama(dest: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny Llama checkpoint (bf16 safetensors) with the given tokenizer files."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy2(f, dest / f.name)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), **{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``).

    Tests share 2 cores with other work; two OpenMP threads then stall on each other's barriers (2-3x
    slower here).  Numbers are compared within one thread count, so this changes nothing."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def with_kv_cache_scales(src: Path, dest: Path, kind: str, scales: tuple[float, float]) -> Path:
    """A copy of the 2-layer ``src`` checkpoint with a ``kind`` ("FP8" / "INT8") KV cache: per-layer k/v scales
    ``scales * (layer + 1)`` and the hf_quant_config.json ModelOpt writes for it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(scales[0] * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(scales[1] * (i + 1))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    quant = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": kind}}
    (dest / "hf_quant_config.json").write_text(json.dumps(quant))
    return dest


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """The embedded model's tokenizer and chat template, read from the GGUF (≈4 s)."""
    from toolkit.fetch import builtin_tokenizer

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    builtin_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer_dir)


def spec_for(name: str, source: str | Path, **sections):
    """A validated Spec for tests: ``spec_for('t', path, quantization={'format': 'fp8'})``."""
    from toolkit.spec import spec_from_dict

    data = {"name": name, "model": {"source": str(source)}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return spec_from_dict(data)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    from toolkit.fetch import fetch

    spec = spec_for("smollm2", "builtin:smollm2-135m-instruct")
    return fetch(spec, output=tmp_path_factory.mktemp("smollm2") / "checkpoint").path


@pytest.fixture(scope="session")
def smollm2_fp8_dir(tmp_path_factory, smollm2_dir) -> Path:
    from toolkit.quantize import quantize

    spec = spec_for(
        "smollm2-fp8",
        smollm2_dir,
        quantization={"format": "fp8", "calibration": {"num_samples": 16, "max_length": 128}, "eval_samples": 16},
    )
    return quantize(spec, checkpoint=smollm2_dir, output=tmp_path_factory.mktemp("smollm2-fp8") / "quantized").path


@pytest.fixture(autouse=True, scope="session")
def _quiet_hub():
    # Tests never reach the hub; make any accidental attempt fail fast instead of hanging.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    yield


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port for the session (skipped, saying why, where none is installed)."""
    import shutil
    import socket
    import subprocess
    import time

    from toolkit.triton.server import free_ports

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(
            "redis-server is not installed (Debian: apt-get install redis-server); Redis paths are untested here"
        )
    (port,) = free_ports(1)
    data_dir = tmp_path_factory.mktemp("redis")
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
