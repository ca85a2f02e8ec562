"""RoPE scaling survives the pipeline: the TensorRT-LLM checkpoint carries what TensorRT-LLM's own
HF converter would write (expected values: tests/data/trtllm_1_2_1_rope_scaling.json, read from
upstream), the HF export stays readable by transformers 4.x, and the CPU engine's logits equal
transformers' at positions beyond the original context."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama, spec_for

from toolkit.errors import SourceError
from toolkit.fetch import fetch
from toolkit.quantize import _export_trtllm, load_model, quantize

DATA = json.loads((Path(__file__).parent / "data" / "trtllm_1_2_1_rope_scaling.json").read_text())
CASES = DATA["cases"]
ORIGINAL_CONTEXT = 64  # original_max_position_embeddings of every scaled case


def tiny_with_rope(dest: Path, tokenizer_dir: Path, case: str, spelling: str) -> Path:
    """A tiny Llama whose config.json holds the case's rope fields, written by transformers 5
    (``rope_parameters`` only) or in the 4.x spelling a hub checkpoint ships (``rope_scaling``)."""
    hf = copy.deepcopy(CASES[case]["hf"])  # transformers adds keys to the dict it is given
    make_tiny_llama(
        dest, tokenizer_dir, rope_theta=hf["rope_theta"], rope_scaling=copy.deepcopy(hf.get("rope_scaling"))
    )
    if spelling == "v4":
        cfg = json.loads((dest / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        cfg.update(hf)
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def v4_rope_scaling(config: dict) -> dict | None:
    """``config.rope_scaling`` as transformers 4.x holds it (sources.hf_config_v4 in the data file)."""
    rs = config.get("rope_scaling")
    if rs is not None and "type" in rs:
        rs = {**rs, "rope_type": rs["type"]}
    return rs


@pytest.mark.parametrize("spelling", ["v5", "v4"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_trtllm_checkpoint_has_the_converters_rotary_fields(tmp_path, smollm2_tokenizer_dir, case, spelling):
    src = tiny_with_rope(tmp_path / "src", smollm2_tokenizer_dir, case, spelling)
    spec = spec_for("rope", src)
    ckpt = fetch(spec, output=tmp_path / "checkpoint").path
    # what a transformers 4.x reader (TensorRT-LLM's converter) sees in the fetched checkpoint
    assert v4_rope_scaling(json.loads((ckpt / "config.json").read_text())) == CASES[case]["trtllm"]["rotary_scaling"]
    source_config = json.loads((ckpt / "config.json").read_text())
    _export_trtllm(load_model(ckpt, spec), tmp_path / "trtllm", source_config)
    written = json.loads((tmp_path / "trtllm" / "config.json").read_text())
    expected = CASES[case]["trtllm"]
    assert written["rotary_base"] == expected["rotary_base"]
    assert written.get("rotary_scaling") == expected["rotary_scaling"]


def test_quantize_writes_llama31_scaling_into_both_exports(tmp_path, smollm2_tokenizer_dir):
    """The flagship path (examples/llama-3.1-8b-trt-engine.yaml is FP8): the whole stage, hf/ and trtllm/."""
    src = tiny_with_rope(tmp_path / "src", smollm2_tokenizer_dir, "llama3", "v5")
    spec = spec_for(
        "rope-fp8",
        src,
        quantization={
            "format": "fp8",
            "eval_samples": 1,
            "calibration": {"num_samples": 2, "max_length": 32, "batch_size": 2},
        },
    )
    out = quantize(spec, checkpoint=src, output=tmp_path / "quantized").path
    expected = CASES["llama3"]["trtllm"]
    trt = json.loads((out / "trtllm" / "config.json").read_text())
    assert (trt["rotary_base"], trt["rotary_scaling"]) == (expected["rotary_base"], expected["rotary_scaling"])
    hf = json.loads((out / "hf" / "config.json").read_text())
    assert hf["rope_theta"] == expected["rotary_base"] and v4_rope_scaling(hf) == expected["rotary_scaling"]


# -- the CPU engine against transformers beyond the original context ---------------------------------


def _engine_and_reference(path: Path):
    from transformers import AutoModelForCausalLM

    from toolkit.runtime.engine import Engine, EngineConfig

    eng = Engine(
        path,
        EngineConfig(
            max_batch_size=1,
            max_num_tokens=256,
            max_input_len=256,
            max_seq_len=320,
            tokens_per_block=16,
            dtype="float32",
        ),
    )
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return eng, ref


@pytest.mark.parametrize("case", ["llama3", "yarn", "linear"])
def test_engine_logits_match_transformers_beyond_the_original_context(tmp_path, smollm2_tokenizer_dir, case):
    path = tiny_with_rope(tmp_path / case, smollm2_tokenizer_dir, case, "v5")
    eng, ref = _engine_and_reference(path)
    ids = torch.randint(3, 49152, (4 * ORIGINAL_CONTEXT,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        want = ref(input_ids=torch.tensor([ids])).logits[0]
        unscaled = unscaled_reference(path)(input_ids=torch.tensor([ids])).logits[0]
    got = eng.prompt_logits(ids)
    beyond = slice(ORIGINAL_CONTEXT, None)
    err = (got[beyond] - want[beyond]).abs().max().item()
    # the scaling really matters at these positions: ignoring it moves the logits far more than the tolerance
    assert (unscaled[beyond] - want[beyond]).abs().max().item() > 100 * max(err, 1e-4)
    assert err < 1e-3, f"{case}: engine vs transformers max |Δlogit| {err:.2e} beyond position {ORIGINAL_CONTEXT}"


def unscaled_reference(path: Path):
    """transformers' model with the same weights and rope base but no rope scaling (the negative control)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", ["dynamic", "longrope"])
def test_engine_refuses_rope_types_it_does_not_implement(tmp_path, smollm2_tokenizer_dir, case):
    """Dynamic NTK and LongRoPE change every position's frequencies with the sequence length; the engine
    says so instead of serving wrong numbers."""
    from toolkit.runtime.engine import Engine, EngineConfig

    path = tiny_with_rope(tmp_path / case, smollm2_tokenizer_dir, case, "v5")
    with pytest.raises(SourceError, match=f"rope scaling type '{case}'"):
        Engine(
            path,
            EngineConfig(
                max_batch_size=1,
                max_num_tokens=64,
                max_input_len=64,
                max_seq_len=128,
                tokens_per_block=16,
                dtype="float32",
            ),
        )
