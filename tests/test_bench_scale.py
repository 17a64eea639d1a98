"""tools/bench_scale.py's build traffic and writer rates (the tool itself measures
nothing here: no times are asserted)."""

import numpy as np
import pytest
from conftest import _load_tool

tool = _load_tool("bench_scale")


def test_traffic_is_warm_once_every_first_conversation_ended():
    conv = tool.Conversations(np.random.default_rng(0))
    assert not conv.warm and len(conv.first_cohort) == tool.ACTIVE
    ended = set()
    for saves in range(1, 100_000):
        before = [id(c) for c in conv.active]
        conv.step()
        ended |= {i for i, c in enumerate(conv.active) if id(c) != before[i]}
        if conv.warm:
            break
    assert conv.warm and ended == set(range(tool.ACTIVE))
    assert saves > tool.ACTIVE  # each slot saved at least once before it ended


def _sample(saves, rate, tokens):
    return {"saves": saves, "saves_per_s": rate, "tokens_per_save": tokens}


def test_writer_rates_first_last_and_once_warm():
    samples = [_sample(100 * (i + 1), 100.0 - i, 200 + 10 * i) for i in range(40)]
    record = {"saves_per_s": samples, "warm_saves": 2000}
    rates = tool.writer_rates(record)
    # 4 samples a tenth: medians of 100..97 and 64..61.
    assert rates["first_10pct"] == pytest.approx(98.5)
    assert rates["last_10pct"] == pytest.approx(62.5)
    assert rates["first_tokens_per_save"] == pytest.approx(215)
    # Warm after save 2,000: 20 samples left, the first 2 of them (saves 2,100, 2,200).
    assert rates["warm_first_10pct"] == pytest.approx(79.5)
    assert rates["warm_ratio"] == pytest.approx(79.5 / 62.5)
    assert rates["warm_first_tokens_per_save"] == pytest.approx(405)
    # A build whose traffic never warmed (or an older record): no warm figures.
    assert "warm_first_10pct" not in tool.writer_rates({"saves_per_s": samples})
    assert "warm_first_10pct" not in tool.writer_rates(
        {"saves_per_s": samples, "warm_saves": None}
    )


def test_durable_build_records_prompt_tokens_and_warm_point(tmp_path):
    # The 50 system prompts alone are ~750 nodes; then ~13 nodes a save.
    record = tool.build(str(tmp_path / "s"), 1500, durable=True)
    assert record["nodes"] >= 1500 and record["writes_dropped"] == 0
    assert record["warm_saves"] is None  # far too few saves to warm the traffic
    assert record["saves_per_s"]
    assert all(s["tokens_per_save"] > 0 for s in record["saves_per_s"])
