"""toolkit/artifacts.py's run_stage: the cache, the atomic write, and library output kept out of the console."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest

from toolkit import console
from toolkit.artifacts import read_manifest, run_stage


def noisy_write(out) -> None:
    print("Inserted 756 quantizers")  # what ModelOpt prints
    sys.stderr.write("Converting tensors: 100%|##########| 272/272\n")  # a tqdm bar
    warnings.warn("transformers 5.24.0 is not tested", UserWarning, stacklevel=1)
    logging.getLogger("modelopt.torch").warning("current rank: 0, tp rank: 0")
    logging.getLogger("toolkit.quantize").warning("rtk's own warning")
    console.info("rtk's own progress")
    (out.tmp / "weights.bin").write_bytes(b"w")


def run(tmp_path, **kw):
    return run_stage("demo", tmp_path / "out", section={"a": 1}, inputs={}, tools={}, write=noisy_write, **kw)


def test_library_output_goes_to_the_stage_log_and_rtks_own_stays_on_the_console(tmp_path, capsys):
    logging.getLogger().addHandler(handler := logging.StreamHandler(sys.stderr))  # the CLI's console handler
    try:
        result = run(tmp_path)
    finally:
        logging.getLogger().removeHandler(handler)
    shown = capsys.readouterr()
    log = (tmp_path / "out.log").read_text()
    for noise in ("Inserted 756 quantizers", "272/272", "5.24.0 is not tested", "current rank: 0"):
        assert noise in log and noise not in shown.out + shown.err
    assert "rtk's own progress" in shown.err and "rtk's own warning" in shown.err
    assert not result.skipped and read_manifest(result.path)["files"] == {
        "weights.bin": result.manifest["files"]["weights.bin"]
    }
    assert run(tmp_path).skipped  # same inputs: the cache answers


def test_rtk_verbose_shows_library_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(console, "_verbosity", 1)
    with pytest.warns(UserWarning, match="not tested"):
        run(tmp_path)
    shown = capsys.readouterr()
    assert "Inserted 756 quantizers" in shown.out and "272/272" in shown.err
    assert not (tmp_path / "out.log").exists()
