"""Fetch stage: local and builtin sources, manifests, cache, atomicity, and its error messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from conftest import spec_for

from toolkit.artifacts import is_complete, read_manifest, sha256_file
from toolkit.cli import cli
from toolkit.errors import SourceError
from toolkit.fetch import fetch


def test_local_source_manifest_and_compat_fixes(tmp_path, tiny_llama_dir):
    out = tmp_path / "ckpt"
    result = fetch(spec_for("t", tiny_llama_dir), output=out)
    assert not result.skipped
    m = read_manifest(out)
    assert m["complete"] and m["stage"] == "fetch" and m["source"]["kind"] == "local"
    assert m["files"]["model.safetensors"] == sha256_file(tiny_llama_dir / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0  # TensorRT-LLM's transformers 4.57 reads this key
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    # the user's own directory is untouched (files were replaced, not edited through hard links)
    src_tok = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    assert src_tok["tokenizer_class"] == "TokenizersBackend"


def test_second_run_is_skipped_from_the_manifest(tmp_path, tiny_llama_dir):
    out = tmp_path / "ckpt"
    fetch(spec_for("t", tiny_llama_dir), output=out)
    t = time.perf_counter()
    again = fetch(spec_for("t", tiny_llama_dir), output=out)
    assert again.skipped and time.perf_counter() - t < 5
    # a changed input invalidates the cache
    os.utime(tiny_llama_dir / "config.json", (1, 1))
    assert not fetch(spec_for("t", tiny_llama_dir), output=out).skipped


def test_interrupted_run_leaves_no_artifact_that_looks_complete(tmp_path, tiny_llama_dir, monkeypatch):
    out = tmp_path / "ckpt"

    def boom(directory):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-stage

    monkeypatch.setattr("toolkit.fetch.make_compatible", boom)
    with pytest.raises(KeyboardInterrupt):
        fetch(spec_for("t", tiny_llama_dir), output=out)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckpt.tmp-*"))


@pytest.mark.slow
def test_killed_process_is_not_mistaken_for_a_finished_one(tmp_path):
    """SIGKILL a real `rtk fetch` of the embedded model mid-conversion; the next run redoes it."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: killed\n")
    out = tmp_path / "engines" / "killed" / "checkpoint"
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit.cli", "fetch", str(spec)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not list(out.parent.glob(".checkpoint.tmp-*")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(out.parent.glob(".checkpoint.tmp-*")), "the stage should have been writing when killed"
    assert not out.exists()
    assert not is_complete(out, "any")
    # a half-written directory at the final path (e.g. copied by hand) is not taken as complete either
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"partial")
    assert read_manifest(out) is None and not is_complete(out, "any")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing", "is not a directory"),
        (lambda d: (d / "noconfig").mkdir() or d / "noconfig", "has no config.json"),
    ],
)
def test_bad_local_sources_exit_2_and_write_nothing(tmp_path, monkeypatch, make, message):
    src = make(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: bad\nmodel: {{source: '{src}'}}\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["fetch", str(spec)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "model.source" in result.output
    assert not (tmp_path / "engines").exists()


def test_unsupported_architecture_and_pickle_weights(tmp_path, tiny_llama_dir, monkeypatch):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64, "intermediate_size": 256})
    )
    (gpt2 / "model.safetensors").write_bytes(b"x")
    with pytest.raises(SourceError, match="GPT2LMHeadModel.*not supported"):
        fetch(spec_for("g", gpt2), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    (pickles / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(SourceError, match="safetensors"):
        fetch(spec_for("p", pickles), output=tmp_path / "out")


def test_unreachable_hub_says_how_to_use_a_local_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: hub\nmodel: {source: 'hf:HuggingFaceTB/SmolLM2-135M-Instruct@main'}\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["fetch", str(spec)])
    assert result.exit_code == 2, result.output
    assert "unreachable" in result.output and "local directory" in result.output
    assert "hf_secret_token_value" not in result.output  # tokens never reach logs
    assert not (tmp_path / "engines" / "hub" / "checkpoint").exists()


@pytest.mark.slow
def test_builtin_model_is_a_normal_bf16_checkpoint(smollm2_dir):
    from safetensors import safe_open

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 576
    assert cfg["rope_theta"] == 100000.0  # not the 10000 transformers 4.57 would assume
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert str(w.dtype) == "torch.bfloat16" and tuple(w.shape) == (576, 576)
    assert (smollm2_dir / "chat_template.jinja").is_file()
    assert read_manifest(smollm2_dir)["source"]["kind"] == "builtin"


@pytest.mark.slow
def test_builtin_model_answers_paris(smollm2_dir):
    """The conversion is a working model: transformers' greedy chat reply names Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
