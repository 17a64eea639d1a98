"""Restore only when it pays (kvstore.engine.payoff): the choice, its counters, its rates."""

import time

import numpy as np
import pytest
from conftest import compute_cache, random_tokens, tiny_llama

import kvstore
from kvstore.engine import payoff
from kvstore.engine.payoff import EXPLORE_EVERY, Rates, RestorePolicy

C = 16


def rated(rates: Rates, bytes_per_s: float, *, fixed: float = 0.002) -> Rates:
    """``rates`` with a known byte rate and fixed restore time."""
    rates.restore, rates.restore_fixed = bytes_per_s, fixed
    return rates


def test_without_a_prefill_rate_every_prefix_is_restored():
    policy = RestorePolicy("auto")
    assert policy.decide([1000], [1 << 30]).restore
    policy.rates.note_restore(1 << 20, 1.0)  # a slow disk, but prefill unknown
    assert policy.decide([1000], [1 << 30]).restore


def test_the_faster_way_is_chosen_and_recomputing_is_explored_now_and_then():
    rates = rated(Rates(prefill=10_000.0), 1 << 30)  # tokens/s; 1 GiB/s
    policy = RestorePolicy("auto", rates=rates)
    cheap = policy.decide([20_000], [100 << 20])  # 2 s of prefill, ~0.1 s to read
    assert cheap.restore and cheap.recompute_s == pytest.approx(2.0)
    assert cheap.nodes is None
    dear = [policy.decide([100], [1 << 30]) for _ in range(2 * EXPLORE_EVERY)]
    assert [d.restore for d in dear].count(True) == 2  # one in EXPLORE_EVERY
    assert all(d.explored == d.restore for d in dear)


def test_small_prefills_do_not_move_the_rate():
    rates = Rates()
    assert not rates.note_prefill(payoff.MIN_PREFILL_TOKENS - 1, 0.001)
    assert rates.prefill is None
    assert rates.note_prefill(1000, 0.5) and rates.prefill == pytest.approx(2000)
    rates.note_prefill(1000, 1.0)  # a running mean: moves part of the way
    assert 1000 < rates.prefill < 2000


def test_prefill_samples_weigh_by_their_seconds():
    """A short batch step (a few tokens of prompt, mostly fixed cost) moves the
    rate by the little time it took; by one vote each, a server's many such steps
    pulled its rate far below what its long prefills ran at."""
    rates = Rates()
    for _ in range(10):
        rates.note_prefill(14_000, 1.0)
    rates.note_prefill(96, 0.05)  # 1,920 tokens/s
    assert rates.prefill > 13_000
    rates.note_prefill(96 * 20, 1.0)  # as slow, for a second: moves it as before
    assert rates.prefill < 0.8 * 14_000


def test_a_short_first_prefill_does_not_hold_the_rate_down():
    """A server's warm-up request (61 tokens in 0.18 s on an H100, 340 tokens/s)
    came first; clipped to 4x a sample, its long prefills at 15,000 tokens/s
    brought the rate to 2,300 after three."""
    rates = Rates()
    rates.note_prefill(61, 0.18)
    rates.note_prefill(16_384, 1.08)
    assert rates.prefill > 10_000


def test_a_restore_mostly_of_fixed_time_gives_no_byte_rate():
    """A server's warm-up request restores 61 tokens (8 MB in 15.7 ms on an H100):
    rated by bytes over seconds, that put a returning user's 0.85 GB at 1.6 s, above
    the 1.48 s its prefill takes, where the restore takes ~0.3 s. The shortest
    restore is the fixed time instead, and with no byte rate yet only it counts."""
    rates = Rates(prefill=4400.0)
    rates.note_restore(8_000_000, 0.0157)
    assert rates.restore is None and rates.restore_fixed == pytest.approx(0.0157)
    policy = RestorePolicy("auto", rates=rates)
    d = policy.decide([6510], [854_732_480])
    assert d.restore and d.restore_s == pytest.approx(0.0157)
    rates.note_restore(8_000_000, 0.02)  # under two fixed times: still no rate
    assert rates.restore is None
    rates.note_restore(854_732_480, 0.3157)  # 0.3 s past the fixed time
    assert rates.restore == pytest.approx(854_732_480 / 0.3)
    assert policy.decide([6510], [854_732_480]).restore_s == pytest.approx(0.3157)


def test_restores_count_by_their_seconds():
    """A server's many small tails (a low rate) do not outvote the whole prompts it
    restores: the rate is bytes over seconds, where an equal vote per sample would
    stay near the tails' rate; one stalled read moves it little."""
    rates = Rates()
    rates.note_restore(1_000_000, 0.001)  # the fixed time: 1 ms
    for _ in range(10):
        rates.note_restore(26_000_000, 0.037)  # 0.72 GB/s past it
    rates.note_restore(850_000_000, 0.301)  # 2.8 GB/s
    equal_vote = 0.7 * 0.72e9 + 0.3 * 2.83e9
    assert rates.restore > 2.0e9 > equal_vote
    steady = rates.restore
    rates.note_restore(1_000_000, 30.0)  # a stall: weighs as 1 s, MAX_STEP away
    assert rates.restore > steady / payoff.MAX_STEP
    for _ in range(3):
        rates.note_restore(850_000_000, 0.3)
    assert rates.restore > steady / 1.5


def test_a_kept_restore_rate_gives_way_to_a_measured_restore():
    rates = rated(Rates(), 0.5e9)  # kept by an earlier process: no weight here
    rates.note_restore(900_000_000, 0.302)  # 3 GB/s, MAX_STEP bounds it at 2 GB/s
    assert rates.restore > 1.5e9


def test_nodes_in_memory_before_a_slow_disk_are_restored_alone():
    """Two nodes in the RAM tier (nothing to read), then nodes whose reading costs
    more than prefilling them: only the first two are restored. A layout that can
    restore only whole paths (checkpoints) gets all or nothing."""
    rates = rated(Rates(prefill=10_000.0), 100 << 20)  # 1 s per 100 MiB
    policy = RestorePolicy("auto", rates=rates)
    takes, costs = [256] * 6, [0, 0] + [50 << 20] * 4  # 0.5 s a node vs 25.6 ms
    d = policy.decide(takes, costs)
    assert d.restore and d.nodes == 2 and d.tokens == 512
    whole = policy.decide(takes, costs, cuttable=False)
    assert not whole.restore or whole.explored


@pytest.mark.parametrize("mode", ["always", "never"])
def test_forced_modes_ignore_the_rates(mode):
    rates = Rates(prefill=1e9)
    rates.note_restore(1, 1.0)
    policy = RestorePolicy(mode, rates=rates)
    assert policy.decide([10], [1 << 30]).restore == (mode == "always")


def test_counters_and_seconds_saved():
    policy = RestorePolicy("auto", rates=Rates(prefill=1000.0))
    policy.rates.note_restore(1 << 20, 0.001)
    d = policy.decide([2000], [1 << 20])
    policy.record(d, nbytes=1 << 20, seconds=0.5)
    policy.record(payoff.Decision(False, 10, 1.0, 0.01), nbytes=0, seconds=0.0)
    stats = policy.stats()
    assert stats["restores_chosen"] == 1 and stats["recomputes_chosen"] == 1
    assert stats["restore_seconds_saved"] == pytest.approx(2.0 - 0.5)
    # Two restores side by side, 0.5 s each: 0.5 s of the store's time, not 1 s.
    policy.record(d, nbytes=1 << 20, seconds=0.5, sharing=2.0)
    policy.record(d, nbytes=1 << 20, seconds=0.5, sharing=2.0)
    saved = policy.stats()["restore_seconds_saved"]
    assert saved == pytest.approx(2.0 - 0.5 + 2 * (2.0 - 0.25))


def _stored(path, model, tokens, **kwargs):
    with kvstore.KVStore(path, model, chunk_tokens=C, ram_bytes=0, **kwargs) as s:
        s.save(tokens, compute_cache(model, tokens))


def test_a_store_recomputes_what_is_faster_to_prefill(tmp_path, model):
    """Measured rates decide: a model that prefills a billion tokens a second gets
    its prefix recomputed (a miss, counted), a slow one gets it restored."""
    tokens = random_tokens(6 * C, 1)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(
        tmp_path, model, chunk_tokens=C, ram_bytes=0, restore="auto"
    ) as s:
        assert s.fetch(tokens + [1])[1] == len(tokens)  # no prefill rate yet
        # One small restore: its time is the fixed time, no byte rate yet.
        assert s.stats()["restore_fixed_s"] > 0
        s.note_prefill(10_000, 1e-5)
        cache, n = s.fetch(tokens + [1])
        assert n == 0 and cache[0].offset == 0
        stats = s.stats()
        assert stats["recomputes_chosen"] == 1 and stats["restores_chosen"] == 1
        assert stats["misses"] == 1 and stats["corrupt"] == 0
    with kvstore.KVStore(
        tmp_path, model, chunk_tokens=C, ram_bytes=0, restore="auto"
    ) as s:
        s.policy.rates.prefill = None
        s.note_prefill(100, 10.0)  # 10 tokens/s: every restore pays
        s.policy.rates.note_restore(1 << 20, 1.0)
        assert s.fetch(tokens + [1])[1] == len(tokens)


def test_a_store_restores_its_ram_tier_and_recomputes_the_rest(tmp_path, model):
    """The first nodes in RAM, the rest slower to read than to prefill: a fetch
    returns the RAM part's tokens, and they equal the stored KV."""
    tokens = random_tokens(6 * C, 9)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(
        tmp_path, model, chunk_tokens=C, ram_bytes=64 << 20, restore="auto"
    ) as s:
        short = tokens[: 2 * C] + [1]
        assert s.fetch(short)[1] == 2 * C  # puts nothing in RAM by itself
        arr = np.array(tokens, np.int32)
        path = s.index.read(
            lambda txn: s.parts.reads.trie.walk(txn, arr, limit=len(arr))
        )
        for step in path[:2]:  # as a pinned prefix preloaded at open would be
            data = s.blobs.read_all(
                s.namespace,
                step.h,
                nbytes=step.rec.nbytes,
                checksum=step.rec.checksum,
                expected=s.parts.shapes.expected(step.rec.ntokens),
            )
            s.ram.put(
                step.h, kvstore.engine.ram.RamEntry(data[0], data[1], "user", False)
            )
        # 96 tokens: 9.6 ms to prefill; the RAM part costs the fixed 2 ms and the rest
        # 6.4 ms of prefill; a node file takes seconds to read.
        s.policy.rates.prefill = 1e4
        s.policy.rates.restore, s.policy.rates.restore_fixed = 1e3, 0.002
        cache, n = s.fetch(tokens + [1])
        assert n == 2 * C and cache[0].offset == 2 * C
        fresh = compute_cache(model, tokens[: 2 * C])
        for x, y in zip(cache, fresh):
            assert np.array_equal(
                np.array(x.keys[..., :n, :]), np.array(y.keys[..., :n, :])
            )


def test_never_restores_nothing_and_bad_modes_are_refused(tmp_path, model, monkeypatch):
    tokens = random_tokens(3 * C, 2)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, restore="never") as s:
        assert s.fetch(tokens + [1])[1] == 0
        assert s.stats()["recomputes_chosen"] == 1
    with pytest.raises(ValueError, match="restore must be one of"):
        kvstore.KVStore(tmp_path / "new", model, restore="sometimes")
    assert not (tmp_path / "new").exists()
    monkeypatch.setenv("KVSTORE_RESTORE", "maybe")
    with pytest.raises(ValueError, match=r"\$KVSTORE_RESTORE must be one of"):
        kvstore.KVStore(tmp_path, model)


def test_the_rates_are_kept_for_the_next_process_on_this_host(tmp_path, model):
    """A restarted process decides its first fetch by what the last one measured."""
    tokens = random_tokens(4 * C, 7)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, restore="auto") as s:
        s.note_prefill(5000, 2.0)
        assert s.fetch(tokens + [1])[1] == len(tokens)
        s.flush()
        s.parts.accesses.rates_kept = None  # as if PERSIST_EVERY_S had passed
        for _ in range(40):  # now faster than any read (one sample moves it 1.9x)
            s.note_prefill(1e9, 1.0)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, restore="auto") as s:
        stats = s.stats()
        assert stats["prefill_tokens_per_s"] > 1e8
        assert stats["restore_fixed_s"] > 0
        assert s.fetch(tokens + [1])[1] == 0  # the first fetch: recomputed
    with kvstore.KVStore(tmp_path, tiny_llama(1), chunk_tokens=C) as s:
        assert s.stats()["prefill_tokens_per_s"] is None  # another model's


def test_generate_loops_and_prefill_feed_the_rate(tmp_path, model, tokenizer):
    with kvstore.KVStore(tmp_path, model, tokenizer, chunk_tokens=C) as s:
        prompt = random_tokens(64, 3)
        list(kvstore.stream_generate(model, tokenizer, prompt, store=s, max_tokens=2))
        assert s.stats()["prefill_tokens_per_s"] > 0
    with kvstore.KVStore(tmp_path / "p", model, tokenizer, chunk_tokens=C) as s:
        s.prefill(random_tokens(80, 4))
        assert s.stats()["prefill_tokens_per_s"] > 0


# -- wrong arguments and outliers -------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, seconds, name",
    [
        (64, float("nan"), "seconds"),
        (64, float("inf"), "seconds"),
        (64, 0.0, "seconds"),
        (64, -1.0, "seconds"),
        (float("nan"), 1.0, "tokens"),
        (float("inf"), 1.0, "tokens"),
        (-5, 1.0, "tokens"),
        (True, 1.0, "tokens"),
        ("64", 1.0, "tokens"),
        (64, 5e-324, "seconds"),  # 64 / 5e-324 overflows to inf
    ],
)
def test_wrong_prefill_arguments_are_value_errors_naming_them(
    tmp_path, model, tokens, seconds, name
):
    """Taken as measurements, they make the rate inf or NaN, kept for every later
    process of the model."""
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, restore="auto") as s:
        s.note_prefill(1000, 1.0)
        with pytest.raises(ValueError, match=name):
            s.note_prefill(tokens, seconds)
        assert s.stats()["prefill_tokens_per_s"] == pytest.approx(1000)


@pytest.mark.parametrize("kept", ["Infinity", "NaN", "-Infinity", "-3", "0", "true"])
def test_a_kept_rate_that_is_not_finite_and_positive_is_ignored(tmp_path, model, kept):
    """A kept Infinity (one bogus measurement, or a hand edit) would keep restores
    off in every later process until someone deleted the key."""
    tokens = random_tokens(4 * C, 11)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, restore="auto") as s:
        key = payoff.rates_key(s.namespace)
        raw = f'{{"prefill": {kept}, "restore": {kept}, "at": 0}}'.encode()
        s.index.write(lambda txn: txn.put(key, raw, db=s.index.db["meta"]))
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, restore="auto") as s:
        stats = s.stats()
        assert stats["prefill_tokens_per_s"] is None
        assert stats["restore_bytes_per_s"] is None
        assert s.fetch(tokens + [1])[1] == len(tokens)  # no rate: restored


def test_one_outlier_cannot_switch_restores_off_for_long(tmp_path, model):
    """With a plain running mean, note_prefill(10**15, 1.0) makes the rate 3e14
    tokens/s and ~70 real prefills wash it out; every fetch meanwhile recomputes (bar
    the 1-in-16 exploration)."""
    tokens = random_tokens(6 * C, 12)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(
        tmp_path, model, chunk_tokens=C, ram_bytes=0, restore="auto"
    ) as s:
        for _ in range(5):
            s.note_prefill(1000, 1.0)  # 1,000 tokens/s: every restore pays
        s.policy.rates.restore = 1e9
        assert s.fetch(tokens + [1])[1] == len(tokens)
        s.note_prefill(10**15, 1.0)
        assert s.stats()["prefill_tokens_per_s"] < 2 * 1000  # moved 1.9x at most
        for _ in range(2):
            s.note_prefill(1000, 1.0)
        assert s.stats()["prefill_tokens_per_s"] < 1.5 * 1000
        restored = [s.fetch(tokens + [1])[1] for _ in range(8)]
        assert restored == [len(tokens)] * 8


def test_a_real_change_of_rate_is_followed_within_a_few_samples():
    rates = Rates()
    rates.note_prefill(1000, 1.0)
    for n in range(1, 20):
        rates.note_prefill(100_000, 1.0)  # the machine is 100x faster now
        if rates.prefill > 50_000:
            break
    assert n <= 8, n


def test_restores_beside_each_other_are_rated_by_their_time_alone(monkeypatch):
    """Two restores that read at once each take twice as long: each is rated by its
    seconds over the mean number of reads beside it (2 here), so the rate is what a
    restore alone gets, not half of it (an H100 server's two prefetch threads
    measured 0.6-0.9 GB/s where one restore alone reads 3.3)."""
    clock = [0.0]
    monkeypatch.setattr(payoff.time, "perf_counter", lambda: clock[0])
    reads = payoff.Overlaps()
    with reads.track() as alone:
        clock[0] += 1.0
    assert alone.sharing == 1.0
    a = reads.track()
    first = a.__enter__()
    clock[0] += 1.0  # alone for 1 s
    b = reads.track()
    second = b.__enter__()
    clock[0] += 2.0  # both for 2 s
    a.__exit__(None, None, None)
    clock[0] += 1.0  # the second alone again for 1 s
    b.__exit__(None, None, None)
    assert first.sharing == pytest.approx((1 * 1 + 2 * 2) / 3)
    assert second.sharing == pytest.approx((2 * 2 + 1 * 1) / 3)

    policy = RestorePolicy(rates=Rates(prefill=1000.0))
    decision = payoff.Decision(True, 100, None, None)
    policy.record(decision, nbytes=1_000_000, seconds=0.001)  # the fixed time
    policy.record(decision, nbytes=3_000_000_000, seconds=2.001, sharing=2.0)
    assert policy.rates.restore == pytest.approx(3e9, rel=0.01)


def test_a_decision_that_may_not_explore_never_restores_what_loses():
    policy = RestorePolicy(rates=rated(Rates(prefill=1_000_000.0), 1e6))
    lost = [policy.decide([100], [1 << 30], explore=False) for _ in range(40)]
    assert not any(d.restore or d.explored for d in lost)
    explored = [policy.decide([100], [1 << 30]) for _ in range(payoff.EXPLORE_EVERY)]
    assert sum(d.explored for d in explored) == 1


def _slow_reads(monkeypatch, seconds_per_node: float) -> None:
    """Reads that take ``seconds_per_node`` a node more (a disk of that speed)."""
    from kvstore.engine.restore import ReadPath

    real = ReadPath.read

    def read(self, path, query):
        out = real(self, path, query)
        time.sleep(seconds_per_node * len(path))
        return out

    monkeypatch.setattr(ReadPath, "read", read)


def test_a_restore_rate_is_measured_on_purpose_and_kept(tmp_path, model, monkeypatch):
    """``measure_restore_rate``: a stored prompt's first node alone (the fixed time),
    then its first nodes (the byte rate), counted as no fetch and touching no access
    time; the rate is kept for the next process."""
    tokens = random_tokens(8 * C, 12)
    _stored(tmp_path, model, tokens)
    _slow_reads(monkeypatch, 0.02)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        assert s.stats()["restore_bytes_per_s"] is None
        atimes = _atimes(s)
        assert s.measure_restore_rate()
        stats = s.stats()
        assert stats["restore_bytes_per_s"] > 0 and stats["restore_fixed_s"] >= 0.02
        assert (stats["hits"], stats["misses"], stats["restores_chosen"]) == (0, 0, 0)
        assert atimes == _atimes(s) and len(atimes) == 8
        rate = stats["restore_bytes_per_s"]
        s.flush()
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        assert s.stats()["restore_bytes_per_s"] == pytest.approx(rate)


def test_the_bytes_measured_stop_at_the_limit(tmp_path, model, monkeypatch):
    """Only the first nodes up to ``max_bytes`` are read (at least two)."""
    from kvstore.engine import calibrate

    tokens = random_tokens(8 * C, 13)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        node = s.parts.reads.find(np.array(tokens, np.int32), limit=C)[0].rec.nbytes
        path = calibrate.first_stored_path(s.parts.reads, max_bytes=3 * node)
        assert [st.rec.start for st in path] == [0, C, 2 * C]
        whole = calibrate.first_stored_path(s.parts.reads, max_bytes=1 << 40)
        assert sum(st.take for st in whole) == len(tokens)


def test_nothing_to_measure_and_a_broken_file_are_no_rate(tmp_path, model):
    """An empty store and one of a single node measure nothing; a broken file on
    the way is reported, is no rate, and the next fetch is a clean miss."""
    with kvstore.KVStore(tmp_path / "empty", model, chunk_tokens=C) as s:
        assert not s.measure_restore_rate()
    _stored(tmp_path / "one", model, random_tokens(C, 14))
    with kvstore.KVStore(tmp_path / "one", model, chunk_tokens=C, ram_bytes=0) as s:
        assert not s.measure_restore_rate()
    tokens = random_tokens(4 * C, 15)
    _stored(tmp_path / "bad", model, tokens)
    with kvstore.KVStore(tmp_path / "bad", model, chunk_tokens=C, ram_bytes=0) as s:
        first = s.parts.reads.find(np.array(tokens, np.int32), limit=C)[0]
        blob = s.blobs.path(s.namespace, first.h)
        raw = bytearray(open(blob, "rb").read())
        raw[-1] ^= 0xFF
        open(blob, "wb").write(bytes(raw))
        assert not s.measure_restore_rate()
        assert s.stats()["restore_bytes_per_s"] is None
        assert s.stats()["corrupt"] == 1
        assert s.fetch(tokens + [1])[1] == 0


def _atimes(store) -> dict:
    """Every node's access time, by hash."""
    ns, index = store.namespace, store.index
    return index.read(
        lambda txn: {
            h: index.atime(txn, ns, h) for _, h, _ in index.iter_nodes(txn, ns)
        }
    )
