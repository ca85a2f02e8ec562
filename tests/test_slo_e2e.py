"""End to end on the real embedded model: build the cpu target, `rtk serve --detach`, gate with `rtk slo`.

Uses the session fixture ``smollm2_fp8_dir`` (the FP8 export of SmolLM2-135M-Instruct), so in a
full run the fetch and quantize stages are shared with the other tests; this test adds the CPU
build, the repository, a tritonserver start (python stubs importing torch) and two short loads.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner
from conftest import spec_for

from toolkit.cli import cli
from toolkit.triton.server import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_rtk_slo_gates_the_embedded_model_on_the_cpu_target(tmp_path, smollm2_fp8_dir):
    from toolkit.targets import build
    from toolkit.triton.emit import emit

    http, grpc, metrics, front_door = free_ports(4)  # none of them a running server's
    repo = tmp_path / "repo"
    spec = spec_for(
        "slo-e2e",
        smollm2_fp8_dir,
        quantization={"format": "fp8"},
        build={"target": "cpu", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 256},
        serving={
            "repository": str(repo),
            "http_port": http,
            "grpc_port": grpc,
            "metrics_port": metrics,
            "frontend": {"port": front_door},
        },
    )
    engine = build(spec, smollm2_fp8_dir, tmp_path / "engine")
    emit(spec, engine.path, repo, tokenizer_dir=smollm2_fp8_dir / "hf")
    spec_path = tmp_path / "spec.yaml"
    import yaml

    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))

    runner = CliRunner()
    started = runner.invoke(cli, ["serve", str(spec_path), "--detach", "--timeout", "300"])
    assert started.exit_code == 0, started.output
    try:
        common = [
            "slo",
            str(spec_path),
            "--concurrency",
            "2",
            "--num-requests",
            "12",
            "--warmup-requests",
            "2",
            "--input-tokens",
            "24",
            "--output-tokens",
            "6",
            "--max-schedule-lag-ms",
            "100",
        ]
        # Objectives a 135M model on 2 CPU cores meets.
        ok = runner.invoke(
            cli,
            [
                *common,
                "-o",
                str(tmp_path / "pass"),
                "--objective",
                "ttft:p50<=10000",
                "--objective",
                "itl:p90<=5000",
                "--objective",
                "attainment>=0.9",
            ],
        )
        assert ok.exit_code == 0, ok.output
        data = json.loads((tmp_path / "pass" / "report.json").read_text())
        assert data["summary"]["succeeded"] == 12 and data["workload"]["tokenizer"].endswith("tokenizer")
        recs = [r for r in data["records"] if r["phase"] == "measure"]
        assert all(r["output_tokens"] == 6 and r["text"] for r in recs)  # min_tokens made every request produce 6
        # The server's own timestamps came back through the ensemble and fit inside the client's view.
        assert all(r["server"]["first_token_time_ns"] >= r["server"]["arrival_time_ns"] for r in recs)
        d = data["summary"]["distributions"]
        assert 0 < d["server_ttft"]["p50"] <= d["ttft_sent"]["p50"]
        # Objectives it cannot meet: the failure exit code, and the reports say why.
        bad = runner.invoke(
            cli, [*common, "-o", str(tmp_path / "fail"), "--objective", "ttft:p50<=1", "--objective", "itl:p50<=0.5"]
        )
        assert bad.exit_code == 10, bad.output
        suite = ET.parse(tmp_path / "fail" / "junit.xml").getroot().find("testsuite")
        assert suite.get("failures") == "2"
        props = {
            p.get("name"): float(p.get("value")) for p in suite.find("properties") if p.get("name").endswith("_ms")
        }
        fail_data = json.loads((tmp_path / "fail" / "report.json").read_text())
        assert props["ttft_p50_ms"] == pytest.approx(fail_data["summary"]["distributions"]["ttft"]["p50"], abs=1e-3)
        assert props["ttft_p50_ms"] > 1
        for png in ("latency.png", "ttft_over_time.png"):
            assert (tmp_path / "fail" / png).stat().st_size > 10_000
    finally:
        stopped = runner.invoke(cli, ["serve", "--stop", str(spec_path)])
        assert stopped.exit_code == 0, stopped.output
