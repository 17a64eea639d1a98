"""``tools/soak.py`` in its short form: 35 s of every process the soak runs on one
budgeted store (server with salted clients, writers, readers one of them short of
descriptors, gc/verify/pull on timers, SIGKILLs, a small LMDB map), then its checks:
every acknowledged prompt restored bit-identically or evicted by the budget, verify
clean, no false corruption report, the store opens."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.stress

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "soak.py")


def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    argv = [
        sys.executable,
        TOOL,
        "--seconds",
        "35",
        "--dir",
        str(tmp_path / "soak"),
        "--json",
        str(out),
        "--clients",
        "2",
        "--kill-every",
        "4",
        "--prefill-every",
        "3",
        "--gc-every",
        "8",
        "--verify-every",
        "10",
        "--pull-every",
        "12",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    result = json.loads(out.read_text()) if out.exists() else None
    assert result is not None, run.stdout[-3000:] + run.stderr[-5000:]
    assert run.returncode == 0 and not result["failures"], (
        run.stdout + run.stderr[-14000:]
    )
    # The soak did what it says: these are figures, not thresholds of speed.
    assert sum(result["kills"].values()) >= 3, run.stdout
    assert result["map_resizes"] >= 1, run.stdout
    assert result["acknowledged"] > 0 and result["restored"] > 0, run.stdout
    assert result["restored"] + result["evicted"] == result["acknowledged"]
    assert result["false_corruption_reports"] == 0 and result["wrong"] == 0
    assert result["reads"]["fetches"] > 0 and result["reads"]["pressure_rounds"] > 0
    assert result["events"].get("pull runs", 0) >= 1
    assert result["audit"]["leaves"] > 0 and not result["audit"].get("leaves wrong")
    served = sum(v for k, v in result["events"].items() if k.endswith(": 200"))
    assert served > 0, run.stdout
