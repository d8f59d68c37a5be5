"""benchmarks/gpu_check.py in its CPU smoke mode, as CI runs it (the GPU run: docs/gpu.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_gpu_check_smoke_mode_trains_both_sizes_on_flash_and_broadcasts(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--smoke", "--out", str(out)]
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=240).stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["smoke"] and report["dtype"] == "float32"
    assert [r["size"]["layers"] for r in report["sizes"]] == [2, 4]
    for size in report["sizes"]:
        assert size["sdpa_forced"] == "FLASH_ATTENTION" and size["flash_error"] is None
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in size["attention_ops"]
        assert size["tokens_per_s"] > 0 and size["peak_memory_mib"] > 0
        assert size["num_params"] > 0
    assert report["sizes"][1]["num_params"] > report["sizes"][0]["num_params"]
    broadcast = report["broadcast"]
    assert broadcast["status"] == "ran" and broadcast["bit_identical"]
    assert broadcast["closed_cleanly"] and broadcast["num_tensors"] == 5
    # The GPU machine has torch only: none of the services' other packages may load.
    for package in ("msgspec", "safetensors", "transformers", "vllm", "pydantic", "nats"):
        assert package not in report["third_party_modules"]
    assert "broadcast over gloo" in printed and "smoke-4-layers" in printed
