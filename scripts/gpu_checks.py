"""Checks that need a real NVIDIA GPU but not TensorRT-LLM (driven by scripts/gpu_checks.sh).

    python scripts/gpu_checks.py host DOCTOR_JSON       # rtk's host probe vs nvidia-smi and torch.cuda
    python scripts/gpu_checks.py numerics [--device cuda] [--formats nvfp4,fp8,int4_awq] [--json OUT]
                                          [--skip-cuda-ext int,fp8]

``numerics`` is the check that matters: on a CPU host ModelOpt cannot run the NVFP4 fake-quant
forward (dynamic-block quantization asserts a CUDA tensor), so rtk can only *emulate* NVFP4 when it
reads an export (toolkit/runtime/checkpoint.py, toolkit/quality.py).  Here a tiny random Llama
(tests/conftest.py's TINY_CONFIG, fixed seed, random token ids: no model files) is quantized with
ModelOpt on the GPU, its fake-quant logits are taken on the GPU, the unified HF export is read back
with rtk's ``load_checkpoint`` + ``reference_model`` on the CPU, and the two are compared — logits,
every linear's dequantized weight, and every linear's quantized input.  FP8 and INT4-AWQ are the
controls (their fake-quant forward also runs on CPU, so this mode also runs there: ``--device cpu``).

Relative error is ``||a - b|| / ||b||`` over the whole tensor.  See docs/gpu-checks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB = 2048
SEED = 0
GROUP_SIZE = {"int4_awq": 64, "w4a8_awq": 64}  # TINY_CONFIG's hidden 128 / intermediate 384: g128 cannot export 384
FORMATS = ("nvfp4", "fp8", "int4_awq")
# Verdict: rtk's reading of the export must sit much closer to ModelOpt's fake-quant model than the
# quantization noise itself (fake-quant vs unquantized) — else rtk's quality numbers are not ModelOpt's.
MAX_SHARE_OF_QUANT_NOISE = 0.10
ABS_FLOOR = 2e-3  # below this, agreement is float rounding (bf16 norms/embeddings in the export)
DECODE_TOL = 1e-6  # rtk's and ModelOpt's decode of the same bytes differ only in float association order


def rel(a, b) -> float:
    import torch

    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


# -- host ---------------------------------------------------------------------------------------


def host(doctor_json: Path) -> int:
    """Compare ``rtk doctor --json``'s host section with nvidia-smi and torch.cuda; non-zero on mismatch."""
    probe = json.loads(doctor_json.read_text())["host"]
    smi = shutil.which("nvidia-smi")
    if not smi:
        print("nvidia-smi not on PATH: no GPU to compare with")
        return 1
    fields = "index,name,memory.total,compute_cap,driver_version"
    rows = (
        subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()
    )
    banner = subprocess.run([smi], capture_output=True, text=True).stdout
    m = re.search(r"CUDA Version:\s*([0-9.]+)", banner)
    smi_cuda = m.group(1) if m else None
    checks: list[tuple[str, object, object]] = []
    checks.append(("GPU count", len(rows), len(probe["gpus"])))
    for row, g in zip(rows, probe["gpus"], strict=True):
        index, name, mem_mib, cap, driver = [p.strip() for p in row.split(",")]
        i = g["index"]
        checks += [
            (f"gpu{i} name", name, g["name"]),
            (f"gpu{i} compute capability", cap, ".".join(map(str, g["compute_capability"]))),
            (f"gpu{i} memory MiB", int(float(mem_mib)), g["memory_total_bytes"] // 2**20),
        ]
    checks.append(("driver", driver, probe["driver_version"]))
    checks.append(("CUDA (driver's, nvidia-smi banner)", smi_cuda, probe["cuda_driver_version"]))
    try:
        import torch

        if torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(0)
            checks.append(
                (
                    "torch.cuda compute capability",
                    f"{cc[0]}.{cc[1]}",
                    ".".join(map(str, probe["gpus"][0]["compute_capability"])) if probe["gpus"] else None,
                )
            )
            checks.append(
                (
                    "torch.cuda device name",
                    torch.cuda.get_device_name(0),
                    probe["gpus"][0]["name"] if probe["gpus"] else None,
                )
            )
    except ImportError:
        pass
    bad = 0
    print(f"{'field':38} {'nvidia-smi / torch':28} {'rtk doctor':28}")
    for name, want, got in checks:
        ok = str(want) == str(got)
        bad += not ok
        print(f"{name:38} {str(want):28} {str(got):28} {'ok' if ok else 'MISMATCH'}")
    print(f"probe notes: {probe.get('notes')}; CUDA runtime (CUDA_VERSION): {probe.get('cuda_runtime_version')}")
    return 1 if bad else 0


# -- numerics -----------------------------------------------------------------------------------


def tiny_llama(device: str):
    """tests/conftest.py's tiny Llama (random, seed 0) with bf16-exact weights, in float32 on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY_CONFIG

    torch.manual_seed(SEED)
    # transformers' default initializer_range (0.02) instead of the tests' 0.1: with 0.1 the random
    # model amplifies a 1 % weight change into ~10 % of the logits, which hides what is compared.
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **{**TINY_CONFIG, "initializer_range": 0.02}))
    # bf16-exact weights, so the export's bf16 embeddings/norms equal the calibrated model's.  Only the
    # parameters: model.to(bf16) would also round the rotary inv_freq buffer, which no checkpoint holds.
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))
    model.eval()
    rp = getattr(model.config, "rope_parameters", None) or {}
    if getattr(model.config, "rope_theta", None) is None and "rope_theta" in rp:
        model.config.rope_theta = rp["rope_theta"]  # as toolkit.quantize.load_model
    return model.to(device)


def token_ids(n: int, length: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g)


def linear_modules(model):
    """(layer index, projection name, module) for every decoder projection."""
    from toolkit.runtime.checkpoint import PROJECTIONS

    for i, block in enumerate(model.model.layers):
        for p in PROJECTIONS:
            parent = block.self_attn if p in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
            yield i, p, getattr(parent, p)


def reference_logits(hf_dir: Path, ids):
    """rtk's reading of a checkpoint: load_checkpoint + reference_model, float32 on the CPU."""
    import torch

    from toolkit.quality import reference_model
    from toolkit.runtime.checkpoint import load_checkpoint

    ckpt = load_checkpoint(hf_dir)
    with torch.no_grad():
        return ckpt, reference_model(ckpt)(input_ids=ids).logits


def check_format(fmt: str, base, base_logits, calib, eval_ids, device: str, work: Path) -> dict:
    """Quantize ``base`` with ModelOpt on ``device``, export it, read it back with rtk; compare.

    Three models give three logits: ``fq`` (ModelOpt's fake-quant forward), ``rtk`` (the export read
    by rtk on the CPU) and ``hybrid``: ModelOpt's fake-quant model carrying the export's tensors as
    rtk decodes them (weights, norms, pre-quant scales) with its weight quantizers off, so only its
    *activation* quantizers remain ModelOpt's.  rtk-vs-hybrid isolates rtk's activation emulation and
    model assembly; hybrid-vs-fq is how far ModelOpt's export is from its own fake-quant model.
    """
    import modelopt.torch.quantization as mtq
    import torch

    from toolkit.hfcompat import make_compatible
    from toolkit.quantize import export_hf, modelopt_config

    row: dict = {"format": fmt, "group_size": GROUP_SIZE.get(fmt)}
    errors = row.setdefault("errors", [])
    t0 = time.perf_counter()
    model = copy.deepcopy(base)
    cfg = modelopt_config(fmt, "none", GROUP_SIZE.get(fmt))

    def forward_loop(m):
        with torch.no_grad():
            for b in calib.split(4):
                m(input_ids=b.to(device))

    mtq.quantize(model, cfg, forward_loop)
    row["calibrate_s"] = round(time.perf_counter() - t0, 2)

    fq_weights = {}
    for i, p, mod in linear_modules(model):
        try:
            with torch.no_grad():
                fq_weights[(i, p)] = mod.weight_quantizer(mod.weight).float().cpu()
        except Exception as exc:  # NVFP4 on CPU: dynamic-block quantization needs CUDA
            errors.append(f"weight_quantizer {i}.{p}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            break
    t0 = time.perf_counter()
    fq_logits = _logits(model, eval_ids, device, errors, "fake-quant forward")
    row["fake_quant_forward_s"] = round(time.perf_counter() - t0, 3)
    hybrid = copy.deepcopy(model)  # the export mutates `model`

    t0 = time.perf_counter()
    hf_dir = work / fmt
    export_hf(model, hf_dir, checkpoint=work)  # rtk's export step (ModelOpt export + bf16 cast of unquantized tensors)
    make_compatible(hf_dir)
    del model
    row["export_s"] = round(time.perf_counter() - t0, 2)
    row["quant_algo"] = json.loads((hf_dir / "hf_quant_config.json").read_text())["quantization"].get("quant_algo")
    t0 = time.perf_counter()
    ckpt, rtk_logits = reference_logits(hf_dir, eval_ids)
    row["rtk_reference_s"] = round(time.perf_counter() - t0, 2)

    # The hybrid: ModelOpt's activation quantizers, the export's tensors.
    inputs, hooks = {}, []
    with torch.no_grad():
        for i, p, mod in linear_modules(hybrid):
            lin = ckpt.layers[i][p]
            mod.weight.copy_(lin.weight.to(mod.weight.device))
            mod.weight_quantizer.disable()
            iq = mod.input_quantizer
            if lin.pre_quant_scale is None:
                iq._enable_pre_quant_scale = False  # AWQ: the export folded it into the preceding norm
            else:
                iq._enable_pre_quant_scale = True
                iq.pre_quant_scale = lin.pre_quant_scale.to(mod.weight.device)

            def hook(m, args, key=(i, p)):
                inputs[key] = (args[0].float().cpu(), m.input_quantizer(args[0]).float().cpu())

            hooks.append(mod.register_forward_pre_hook(hook))
        for i, block in enumerate(hybrid.model.layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(block, norm).weight.copy_(ckpt.layers[i][norm].to(device))
        hybrid.model.norm.weight.copy_(ckpt.final_norm.to(device))
        hybrid.model.embed_tokens.weight.copy_(ckpt.embed_tokens.to(device))
    hybrid_logits = _logits(hybrid, eval_ids, device, errors, "hybrid forward")
    for h in hooks:
        h.remove()
    del hybrid

    def maybe(a, b):
        return rel(a, b) if a is not None and b is not None else None

    row["fq_vs_base"] = maybe(fq_logits, base_logits)
    row["rtk_vs_fq"] = maybe(rtk_logits, fq_logits)
    row["rtk_vs_hybrid"] = maybe(rtk_logits, hybrid_logits)
    row["hybrid_vs_fq"] = maybe(hybrid_logits, fq_logits)
    row["rtk_vs_base"] = rel(rtk_logits, base_logits)
    if fq_logits is not None:
        row["top1_rtk_eq_fq"] = (rtk_logits.argmax(-1) == fq_logits.argmax(-1)).float().mean().item()
    # Weights: the export as rtk decodes it vs ModelOpt's fake-quantized weight (differences here are
    # ModelOpt's export rounding, e.g. FP8 W/s computed in bf16, or AWQ re-smoothing of q/k/v).
    w_err = {f"{i}.{p}": rel(ckpt.layers[i][p].weight, w) for (i, p), w in fq_weights.items()}
    if w_err:
        row["weight_rel_max"] = max(w_err.values())
        row["weight_rel_worst"] = max(w_err, key=w_err.get)
        # One FP8/FP4/INT4 code step is >= 6 % of an element: count elements off by more than 1 %.
        off = sum(
            int(((ckpt.layers[i][p].weight - w).abs() > 0.01 * w.abs()).sum()) for (i, p), w in fq_weights.items()
        )
        row["weight_elems_off_1pct"] = off / sum(w.numel() for w in fq_weights.values())
    if fmt == "nvfp4":
        row["decode_rel_max"] = _nvfp4_decode_check(hf_dir, ckpt)
    a_err = {f"{i}.{p}": rel(ckpt.layers[i][p].prepare_input(x), mo_x) for (i, p), (x, mo_x) in inputs.items()}
    if a_err:
        row["input_rel_max"] = max(a_err.values())
        row["input_rel_worst"] = max(a_err, key=a_err.get)
    if row["rtk_vs_hybrid"] is not None:
        limit = max(ABS_FLOOR, MAX_SHARE_OF_QUANT_NOISE * row["fq_vs_base"])
        row["limit"] = limit
        row["passed"] = row["rtk_vs_hybrid"] <= limit and (row.get("decode_rel_max") or 0.0) <= DECODE_TOL
    else:
        row["passed"] = None
    if not errors:
        del row["errors"]
    return row


def _logits(model, ids, device: str, errors: list, what: str):
    import torch

    try:
        with torch.no_grad():
            out = model(input_ids=ids.to(device)).logits.float().cpu()
    except Exception as exc:
        errors.append(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        return None
    return out


def _nvfp4_decode_check(hf_dir: Path, ckpt) -> float:
    """rtk's NVFP4 weight decode vs ModelOpt's own (NVFP4QTensor.dequantize) of the same bytes: max rel."""
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors import safe_open

    from toolkit.runtime.checkpoint import PROJECTIONS

    worst = 0.0
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        for i, p in ((i, p) for i in range(len(ckpt.layers)) for p in PROJECTIONS):
            pre = f"model.layers.{i}.{'self_attn' if p in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{p}"
            packed = f.get_tensor(pre + ".weight")
            shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
            mo = NVFP4QTensor(shape, torch.float32, packed).dequantize(
                dtype=torch.float32,
                scale=f.get_tensor(pre + ".weight_scale"),
                double_scale=f.get_tensor(pre + ".weight_scale_2").float(),
                block_sizes={-1: 16},
            )
            worst = max(worst, rel(ckpt.layers[i][p].weight, mo))
    return worst


def nvfp4_ties(device: str) -> dict:
    """E2M1 rounding of values exactly halfway between codes: rtk's emulation vs ModelOpt's.

    One 16-element block with amax 6 and global amax 6*448, so the fp8 block scale is exactly 1 and
    x/scale = x.  ModelOpt rounds halfway values to the even code (triton fp4_round_magnitude on the
    GPU; NVFP4QTensor._cast_fp4 in the export).
    """
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from toolkit.runtime.checkpoint import E2M1_LUT, fake_quant

    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor([6.0] + ties + [-t for t in ties] + [0.0])
    global_amax = torch.tensor(6.0 * 448.0)
    out = {"x": ties}
    out["rtk"] = fake_quant(x[None], "nvfp4", global_amax / (6.0 * 448.0))[0, 1:8].tolist()
    codes = NVFP4QTensor._cast_fp4(x.clone())
    out["modelopt_export_cast"] = E2M1_LUT[codes.long()][1:8].tolist()
    if device == "cuda":
        from modelopt.torch.kernels.quantization import gemm as kernels

        if kernels.IS_AVAILABLE and hasattr(kernels, "fp4_fake_quant_block"):
            out["modelopt_gpu_kernel"] = (
                kernels.fp4_fake_quant_block(x[None].cuda(), global_amax.cuda())[0, 1:8].cpu().tolist()
            )
    out["rtk_matches_modelopt"] = all(out["rtk"] == v for k, v in out.items() if k.startswith("modelopt"))
    return out


def numerics(device: str, formats: list[str], json_out: Path | None, skip_ext: list[str]) -> int:
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.getLogger("modelopt").setLevel(logging.ERROR)
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device")
        return 2
    if device == "cuda" and skip_ext:
        # ModelOpt JIT-builds modelopt_cuda_ext (int) and modelopt_cuda_ext_fp8 on first use of a CUDA
        # tensor (modelopt/torch/quantization/extensions.py); a build cut short leaves torch's lock
        # behind, so a skipped one is marked absent and ModelOpt uses its torch fallback on the GPU
        # (fp8_eager, the legacy int fake-quant) — still ModelOpt's own arithmetic, on CUDA tensors.
        from modelopt.torch.quantization import extensions

        getters = {"int": extensions.get_cuda_ext, "fp8": extensions.get_cuda_ext_fp8}
        for name in skip_ext:
            getters[name].extension = None
        print(f"ModelOpt CUDA extensions not used: {', '.join(skip_ext)} (torch fallback on the GPU instead)")
    import modelopt
    import transformers

    info = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "modelopt": modelopt.__version__,
    }
    if device == "cuda":
        from modelopt.torch.kernels.quantization import gemm as kernels

        info["modelopt_triton_kernels"] = kernels.IS_AVAILABLE
        info["modelopt_cuda_ext_skipped"] = skip_ext
    print("numerics:", json.dumps(info))
    torch.manual_seed(SEED)
    base = tiny_llama(device)
    calib, eval_ids = token_ids(16, 64, seed=1), token_ids(4, 96, seed=2)
    with torch.no_grad():
        base_logits = base(input_ids=eval_ids.to(device)).logits.float().cpu()

    rows = []
    with tempfile.TemporaryDirectory(prefix="rtk-gpu-checks-") as tmp:
        work = Path(tmp)
        # Control 0: the unquantized checkpoint through rtk's reader (bf16 safetensors, as fetch writes).
        plain = work / "none"
        copy.deepcopy(base).to(torch.bfloat16).save_pretrained(plain)
        _, plain_logits = reference_logits(plain, eval_ids)
        rows.append(
            {
                "format": "none",
                "rtk_vs_base": rel(plain_logits, base_logits),
                "passed": rel(plain_logits, base_logits) <= ABS_FLOOR,
            }
        )
        for fmt in formats:
            try:
                rows.append(check_format(fmt, base, base_logits, calib, eval_ids, device, work))
            except Exception as exc:
                import traceback

                traceback.print_exc()
                rows.append({"format": fmt, "passed": False, "errors": [f"{type(exc).__name__}: {exc}"]})
        ties = nvfp4_ties(device) if "nvfp4" in formats else None

    print_table(rows)
    if ties:
        print("\nNVFP4 rounding of halfway values (block scale exactly 1):")
        for k in ("x", "rtk", "modelopt_export_cast", "modelopt_gpu_kernel"):
            if k in ties:
                print(f"  {k:22} {ties[k]}")
        print(f"  rtk matches ModelOpt: {ties['rtk_matches_modelopt']}")
    if json_out:
        json_out.write_text(json.dumps({"info": info, "rows": rows, "nvfp4_ties": ties}, indent=2, default=str) + "\n")
    failed = [r["format"] for r in rows if r.get("passed") is False]
    print(
        f"\nverdict: {'FAIL: ' + ', '.join(failed) if failed else 'all compared formats agree'} "
        f"(pass: rtk-vs-hybrid <= max({ABS_FLOOR}, {MAX_SHARE_OF_QUANT_NOISE} x fq-vs-base) "
        f"and nvfp4 decode <= {DECODE_TOL})"
    )
    return 1 if failed else 0


def _fmt(v, spec=".2e") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, spec)
    return str(v)


def print_table(rows: list[dict]) -> None:
    cols = [
        ("format", "format", "s"),
        ("quant_algo", "algo", "s"),
        ("fq_vs_base", "fq-vs-base", ".2e"),
        ("rtk_vs_fq", "rtk-vs-fq", ".2e"),
        ("rtk_vs_hybrid", "rtk-vs-hybrid", ".2e"),
        ("hybrid_vs_fq", "hybrid-vs-fq", ".2e"),
        ("rtk_vs_base", "rtk-vs-base", ".2e"),
        ("top1_rtk_eq_fq", "top1 rtk=fq", ".4f"),
        ("weight_rel_max", "weight max", ".2e"),
        ("input_rel_max", "input max", ".2e"),
        ("decode_rel_max", "nvfp4 decode", ".1e"),
        ("passed", "pass", "s"),
    ]
    print("\n" + " ".join(f"{h:>12}" for _, h, _ in cols))
    for r in rows:
        print(" ".join(f"{_fmt(r.get(k), s):>12}" for k, _, s in cols))
    print(
        "fq = ModelOpt fake-quant forward; rtk = export read by load_checkpoint + reference_model (CPU, fp32); "
        "base = unquantized;\nhybrid = ModelOpt's model with the export's tensors and only its activation quantizers. "
        "weight max: worst linear,\nrtk-decoded export vs ModelOpt fake-quant weight; input max: worst linear, "
        "rtk's activation emulation vs ModelOpt's\n"
        "input quantizer on the same input; nvfp4 decode: rtk vs ModelOpt NVFP4QTensor.dequantize of the same bytes."
    )
    for r in rows:
        extra = {
            k: r[k]
            for k in (
                "weight_rel_worst",
                "weight_elems_off_1pct",
                "input_rel_worst",
                "calibrate_s",
                "fake_quant_forward_s",
                "export_s",
                "rtk_reference_s",
            )
            if r.get(k) is not None
        }
        if extra:
            print(f"  {r['format']}: {extra}")
        for e in r.get("errors", [])[:3]:
            print(f"  {r['format']} error: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("host", help="compare `rtk doctor --json` with nvidia-smi and torch.cuda")
    h.add_argument("doctor_json", type=Path)
    n = sub.add_parser("numerics", help="ModelOpt fake-quant on the GPU vs rtk's reading of the export")
    n.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    n.add_argument("--formats", default=",".join(FORMATS))
    n.add_argument("--json", type=Path, default=None)
    n.add_argument(
        "--skip-cuda-ext", default="", help="ModelOpt CUDA extensions not to build or use: comma list of int, fp8"
    )
    args = ap.parse_args()
    if args.cmd == "host":
        return host(args.doctor_json)
    return numerics(
        args.device,
        [f for f in args.formats.split(",") if f],
        args.json,
        [e for e in args.skip_cuda_ext.split(",") if e],
    )


if __name__ == "__main__":
    sys.exit(main())
