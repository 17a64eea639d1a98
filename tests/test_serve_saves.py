"""Saves of ``kvstore serve`` off the generation thread (``kvstore.serve.saves``):
queued at once, merged into a later save that covers them, deferred while the
writer is full rather than dropped, lost only once their prefix left RAM."""

import threading
import time

import pytest
from conftest import assert_same_as_cold, compute_cache, next_logits, random_tokens
from serving import KEY, Request, provider

from kvstore import KVStore
from kvstore.serve.prefetch import Prefetcher
from kvstore.serve.saves import SaveJob, SaveQueue
from kvstore.server import PersistentPromptCache

pytestmark = pytest.mark.slow
C = 32


class Counts(dict):
    def __call__(self, **deltas):
        for k, v in deltas.items():
            self[k] = self.get(k, 0) + v


def job(store, tokens, cache, kind="assistant", salt=None):
    return SaveJob(store, KEY, list(tokens), len(tokens), cache, kind, salt)


def fill_writer(store, gate):
    """Hold the writer with a job carrying more bytes than it lets wait."""
    assert store.writer.submit(gate.wait, store.writer.max_pending_bytes + 1)


def test_queued_save_is_written(tmp_path, model):
    tokens = random_tokens(100, seed=41)
    counts = Counts()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: j.cache, count=counts)
        q.put(job(store, tokens, compute_cache(model, tokens)))
        q.flush()
        store.flush()
        assert store.lookup(tokens + [1]) == 100
        q.close()
    assert counts == {}


def test_save_covered_by_a_later_one_is_merged(tmp_path, model):
    tokens = random_tokens(130, seed=42)
    counts, gate = Counts(), threading.Event()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: j.cache, count=counts)
        fill_writer(store, gate)  # the queue waits: later saves stay queued
        blocker = random_tokens(40, seed=43)
        q.put(job(store, blocker, compute_cache(model, blocker)))
        q.put(job(store, tokens[:70], compute_cache(model, tokens[:70]), "system"))
        q.put(job(store, tokens[:90], compute_cache(model, tokens[:90]), "system"))
        q.put(job(store, tokens, compute_cache(model, tokens), "assistant"))
        # The 70-token save is covered by the 90-token one; the 90-token save is a
        # system prompt, not demoted into the assistant's save.
        assert counts["saves_merged"] == 1
        gate.set()
        q.flush()
        store.flush()
        assert store.lookup(tokens + [1]) == 130
        assert store.lookup(blocker + [1]) == 40
        assert store.stats()["writes_dropped"] == 0
        q.close()


def save_behind(store, model, tokens, gate) -> Counts:
    """Queue a save of ``tokens`` while ``gate`` holds the store's writer, open it
    0.3 s later: the queue's counts once the save is written."""
    counts = Counts()
    q = SaveQueue(in_ram=lambda j: j.cache, count=counts)
    q.put(job(store, tokens, compute_cache(model, tokens)))
    threading.Timer(0.3, gate.set).start()
    q.flush()
    store.flush()
    q.close()
    return counts


def test_save_waits_for_a_full_writer_instead_of_being_dropped(tmp_path, model):
    tokens = random_tokens(100, seed=44)
    gate = threading.Event()
    with KVStore(
        tmp_path / "s", model, chunk_tokens=C, max_pending_bytes=1 << 20
    ) as store:
        fill_writer(store, gate)
        assert save_behind(store, model, tokens, gate) == {"saves_deferred": 1}
        assert store.stats()["writes_dropped"] == 0
        assert store.lookup(tokens + [1]) == 100


def test_a_save_that_leaves_a_stored_node_midway_waits_for_room_for_it_whole(
    tmp_path, model
):
    """A prompt that matches a stored node only in part is saved from that node's
    start (a new sibling): the room a save needs counts those tokens, so it waits
    for a writer with room for them too, instead of being dropped there and tried
    again."""
    other = random_tokens(2 * C, seed=70)  # two whole nodes
    tokens = other[: C + 8] + random_tokens(60, seed=71)  # leaves node 2 after 8
    gate = threading.Event()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(other, compute_cache(model, other))
        store.flush()
        assert store.lookup(tokens) == C + 8
        tb = store.parts.shapes.token_bytes
        # Room for the 60 tokens past the matched prefix, not for the 68 past its
        # last whole node.
        store.writer.max_pending_bytes = (1 << 20) + 64 * tb
        assert store.writer.submit(gate.wait, 1 << 20)
        assert save_behind(store, model, tokens, gate) == {"saves_deferred": 1}
        assert store.stats()["writes_dropped"] == 0
        assert_same_as_cold(model, store, tokens + [1], len(tokens))


def test_deferred_save_whose_prefix_left_ram_keeps_its_kv_within_the_bound(
    tmp_path, model
):
    """RAM evicting a waiting save's entry leaves the job's own reference to the KV:
    it is kept, and saved once the writer has room, while the KV kept so stays
    within the bound; past the bound the save is lost. Its bytes count until it is
    saved."""
    first, second = random_tokens(100, seed=45), random_tokens(100, seed=46)
    counts, gate, held = Counts(), threading.Event(), [True]
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        token_bytes = store.parts.shapes.token_bytes
        q = SaveQueue(
            in_ram=lambda j: j.cache if held[0] else None,
            count=counts,
            max_evicted_bytes=150 * token_bytes,  # one of the two saves, not both
        )
        fill_writer(store, gate)
        q.put(job(store, first, compute_cache(model, first)))
        q.put(job(store, second, compute_cache(model, second)))
        held[0] = False  # mlx-lm's LRU dropped both
        waited = threading.Thread(target=q.flush)
        waited.start()
        deadline = time.monotonic() + 10
        while counts.get("saves_lost", 0) + counts.get("saves_kept_evicted", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert q._evicted_bytes == 100 * token_bytes  # the first, waiting
        gate.set()
        waited.join()
        store.flush()
        assert q._evicted_bytes == 0
        assert counts == {"saves_deferred": 1, "saves_kept_evicted": 1}
        assert store.lookup(first + [1]) == 100
        # The second found the writer with room (the first's save was done).
        assert store.lookup(second + [1]) == 100

        held[0] = True
        fill_writer(store, gate := threading.Event())
        q2 = SaveQueue(
            in_ram=lambda j: j.cache if held[0] else None,
            count=counts,
            max_evicted_bytes=50 * token_bytes,  # less than the save's KV
        )
        third = random_tokens(100, seed=47)
        q2.put(job(store, third, compute_cache(model, third)))
        held[0] = False
        q2.flush()
        gate.set()
        store.flush()
        assert counts["saves_lost"] == 1 and counts["saves_deferred"] == 2
        assert store.lookup(third + [1]) == 0
        q.close()
        q2.close()


def test_deferred_save_replaced_in_ram_by_a_longer_prompt_is_saved_from_it(
    tmp_path, model, tokenizer
):
    """mlx-lm drops a trimmable cache's prefixes from its LRU when it stores a
    longer one (a system prompt's entry when the whole prompt's comes): a system
    prompt's save that waited for a full writer meanwhile is saved from the longer
    entry (the same KV), not lost."""
    tokens = random_tokens(130, seed=47)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    store = pc.open_store(KEY)
    gate = threading.Event()
    fill_writer(store, gate)
    system = compute_cache(model, tokens[:70])
    pc.insert_cache(KEY, tokens[:70], system, cache_type="system", salt="t")
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt="t")
    assert pc._save_in_ram(job(store, tokens[:70], None, salt="t")) is not None
    threading.Timer(0.3, gate.set).start()
    pc.flush()
    store.flush()
    s = pc.stats()
    assert s["saves_lost"] == 0 and s["saves_deferred"] >= 1
    assert store.lookup(tokens + [1], salt="t") == 130
    pc.close()


def test_prompt_cache_saves_on_its_own_thread(tmp_path, model, tokenizer, monkeypatch):
    tokens = random_tokens(300, seed=46)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    on = []
    store = pc.open_store(KEY)
    real = store.save_prefix
    monkeypatch.setattr(
        store,
        "save_prefix",
        lambda *a, **kw: on.append(threading.current_thread().name) or real(*a, **kw),
    )
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt="t")
    assert pc.stats()["saves"] == 1
    pc.flush()
    assert on == ["kvstore-saves"] and store.lookup(tokens + [1], salt="t") == 300

    # A failing save is counted on that thread, never raised anywhere.
    def boom(*a, **kw):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store, "save_prefix", boom)
    pc.insert_cache(KEY, tokens + [1], compute_cache(model, tokens + [1]))
    pc.flush()
    s = pc.stats()
    assert (s["saves_skipped"], s["store_errors"]) == (1, 1)
    pc.close()
    pc.close()


class Loop:
    """A generation loop that is busy until told otherwise (SaveQueue's busy)."""

    def __init__(self):
        self.working = True

    def busy(self) -> bool:
        return self.working


def test_a_save_waits_for_the_generation_loop_to_rest(tmp_path, model):
    """While the loop works, a save waits (counted as held) and a later turn of the
    same conversation merges into it; once the loop rests, the merged save goes."""
    tokens = random_tokens(130, seed=48)
    counts, loop = Counts(), Loop()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: j.cache, count=counts, busy=loop.busy)
        q.put(job(store, tokens[:70], compute_cache(model, tokens[:70])))
        threading.Event().wait(0.4)
        store.flush()
        assert store.lookup(tokens + [1]) == 0 and q.queued == 1
        assert counts["saves_held"] == 1
        q.put(job(store, tokens, compute_cache(model, tokens)))
        assert counts["saves_merged"] == 1 and q.queued == 1
        loop.working = False
        deadline = threading.Event()
        for _ in range(100):
            if q.queued == 0:
                break
            deadline.wait(0.05)
        store.flush()
        assert q.queued == 0 and store.lookup(tokens + [1]) == 130
        q.close()


def left_ram(why: str):
    """``in_ram`` of a RAM cache that holds every job's own cache, or none of them
    (``evicted``), or a longer entry holding their tokens (``replaced``)."""
    if why == "evicted":
        return lambda j: None
    if why == "replaced":
        return lambda j: list(j.cache)  # another entry: its first tokens are these
    return lambda j: j.cache


@pytest.mark.parametrize("why", ["max_defer", "evicted", "flush", "close"])
def test_a_save_waits_for_rest_only_so_long(tmp_path, model, why):
    """A busy loop holds a save back no longer than max_defer_s, not at all once
    mlx-lm's RAM cache no longer holds the save's tokens (the save alone keeps
    that memory then), and never past a flush or a close."""
    tokens = random_tokens(100, seed=49)
    counts, loop = Counts(), Loop()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(
            in_ram=left_ram(why),
            count=counts,
            busy=loop.busy,
            max_defer_s=0.3 if why == "max_defer" else 3600,
        )
        q.put(job(store, tokens, compute_cache(model, tokens)))
        if why in ("flush", "close"):
            for _ in range(100):  # held first: the flush or close lets it go
                if counts.get("saves_held"):
                    break
                threading.Event().wait(0.02)
            assert q.queued == 1
        if why == "flush":
            q.flush()
        elif why == "close":
            q.close()
        else:
            for _ in range(100):
                if q.queued == 0:
                    break
                threading.Event().wait(0.05)
        store.flush()
        assert store.lookup(tokens + [1]) == 100
        at_once = why == "evicted"
        assert counts.get("saves_held", 0) == (0 if at_once else 1)
        q.close()


def test_a_full_ram_cache_holds_saves_back_until_it_evicts_theirs(
    tmp_path, model, tokenizer
):
    """With mlx-lm's LRU full (2 entries here) and the loop busy, the saves of the
    entries it holds wait for the loop to rest; the one whose entry the LRU evicts
    goes ahead (only that save still holds its KV)."""
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer), max_size=2)
    assert pc.use_threads(Prefetcher())
    pc.activity.touch()
    keep_busy = threading.Event()

    def working():
        while not keep_busy.wait(0.05):
            pc.activity.touch()

    threading.Thread(target=working, daemon=True).start()
    store = pc.open_store(KEY)
    prompts = [random_tokens(60, seed=90 + i) for i in range(3)]
    for tokens in prompts[:2]:
        pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt="t")
    threading.Event().wait(0.4)
    store.flush()
    assert pc.saves.queued == 2 and pc.stats()["saves_held"] >= 1
    assert store.lookup(prompts[0] + [1], salt="t") == 0
    pc.insert_cache(KEY, prompts[2], compute_cache(model, prompts[2]), salt="t")
    for _ in range(100):  # the first prompt's entry left: its save goes ahead
        store.flush()
        if store.lookup(prompts[0] + [1], salt="t") == 60:
            break
        threading.Event().wait(0.05)
    assert store.lookup(prompts[0] + [1], salt="t") == 60
    assert pc.saves.queued == 2  # the other two still wait
    assert store.lookup(prompts[1] + [1], salt="t") == 0
    keep_busy.set()
    pc.flush()
    store.flush()
    assert all(store.lookup(t + [1], salt="t") == 60 for t in prompts)
    pc.close()


def test_the_batch_path_tells_when_the_loop_works():
    """A BatchGenerator step that returned responses touches the activity; an
    empty step (nothing to do) does not. Each step counts, and says whether it
    processed prompt tokens (returned prompt responses)."""
    from kvstore.serve.timing import Activity, timed_batch_generator_class

    class Base:
        def __init__(self):
            self.out = ([], [])

        def next(self):
            return self.out

    activity = Activity()
    gen = timed_batch_generator_class(Base, lambda *a: None, activity)()
    assert activity.idle_for() == float("inf")
    gen.next()
    assert activity.idle_for() == float("inf")
    gen.out = ([], ["a token"])
    gen.next()
    assert activity.idle_for() < 1.0
    assert (activity.steps, activity.prefilling) == (2, False)
    gen.out = (["progress"], [])
    gen.next()
    assert (activity.steps, activity.prefilling) == (3, True)


def test_the_store_writer_steps_aside_while_the_loop_works(tmp_path, model, tokenizer):
    """kvstore serve's store: its writer asks the prompt cache's activity."""
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    store = pc.open_store(KEY)
    busy = store.writer.yield_to
    assert busy is not None and not busy()  # the loop never worked
    pc.activity.touch()
    assert busy()
    pc.close()


def test_saves_wait_for_requests_on_their_way_to_the_loop(tmp_path, model, tokenizer):
    """Between two rounds of a chat the loop rests while the next round's requests
    are looked at, restored and queued: saves wait for them as for a step, and go
    on once the last is looked up. The store's writer does not wait for them (a
    request's restore may need it: what a remote tier sends is written locally)."""

    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    writer_waits = pc.open_store(KEY).writer.yield_to
    busy = pc.saves._busy_loop
    assert not busy()
    with pc.prefetcher.probing():  # an arrival on its HTTP thread
        assert busy() and not writer_waits()
    assert not busy()
    request, gate = Request(), threading.Event()
    pc.prefetcher.submit(request, lambda: gate.wait(10))
    assert busy() and not writer_waits()  # its restore runs
    gate.set()
    request.kvstore_prefetch.future.result(10)
    assert busy()  # restored, not looked up yet
    pc.prefetcher.looking_up(request)
    assert pc.prefetcher.take() is True
    assert not busy()
    pc.close()


def test_the_loop_is_busy_until_it_rested_rest_s():
    from kvstore.serve.timing import REST_S, Activity

    activity = Activity()
    assert not activity.busy()  # it never worked
    activity.touch()
    assert activity.busy()
    threading.Event().wait(REST_S + 0.05)
    assert not activity.busy()


def test_a_step_longer_than_rest_s_keeps_the_loop_busy():
    """A batch step (one prefill of many long prompts) or a sequential request that
    runs past REST_S keeps the loop busy until it ends: a save let in meanwhile
    slowed the step by half on a GPU."""
    from kvstore.serve.timing import (
        REST_S,
        Activity,
        PrefillClock,
        timed_batch_generator_class,
        timed_response_generator_class,
    )

    activity = Activity()
    seen = []

    class Batch:
        def next(self):
            threading.Event().wait(REST_S + 0.1)
            seen.append(activity.busy())
            return ([], [])  # nothing came out of it: no touch

    gen = timed_batch_generator_class(Batch, lambda *a: None, activity)()
    gen.next()
    assert seen == [True]
    assert not activity.busy()  # it did no work, and no step runs now

    class Responses:
        def _serve_single(self, request, stream):
            threading.Event().wait(REST_S + 0.1)
            seen.append(activity.busy())

    cls = timed_response_generator_class(
        Responses, object, PrefillClock(), lambda *a: None, activity
    )
    cls()._serve_single(("not", "a request"), None)
    assert seen == [True, True]
    assert not activity.busy()


def test_a_save_replaced_in_ram_by_a_longer_entry_keeps_waiting_with_its_kv(
    tmp_path, model
):
    """mlx-lm drops a chat's last turn from its LRU when the next prompt's cache is
    stored: the turn's save, held while the loop works, keeps waiting (it went ahead
    mid-prefill before), now holding the longer entry's KV instead of its own, and
    is saved from it once the loop rests."""
    tokens = random_tokens(100, seed=51)
    longer = tokens + random_tokens(40, seed=52)
    longer_cache = compute_cache(model, longer)
    counts, loop = Counts(), Loop()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: longer_cache, count=counts, busy=loop.busy)
        held = job(store, tokens, compute_cache(model, tokens))
        q.put(held)
        for _ in range(100):
            if counts.get("saves_held"):
                break
            threading.Event().wait(0.02)
        threading.Event().wait(0.2)  # a few polls more: still waiting
        assert q.queued == 1 and counts.get("saves_held") == 1
        assert held.cache is longer_cache
        loop.working = False
        for _ in range(100):
            if q.queued == 0:
                break
            threading.Event().wait(0.05)
        store.flush()
        assert store.lookup(longer + [1]) == 100  # its own tokens, no more
        assert_same_as_cold(model, store, tokens + random_tokens(5, seed=53), 100)
        q.close()


def test_a_waiting_save_takes_kv_only_from_an_entry_the_loop_evaluated(
    tmp_path, model, tokenizer
):
    """The longer RAM entry that replaced a waiting save's own gives the save its KV
    only once the generation thread has evaluated it (queued that entry's own
    save): evaluated on the save thread, a lazy entry races the generation loop, and
    on CUDA the save failed ("There is no Stream(gpu, 0) in current thread").
    Until then the save waits with its own KV."""
    from kvstore.serve import saves
    from kvstore.serve.timing import Activity

    a = random_tokens(70, seed=80)
    longer = a + random_tokens(30, seed=81)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    pc.activity = act = Activity()
    store = pc.open_store(KEY)
    a_cache = compute_cache(model, a)
    pc.insert_cache(KEY, a, a_cache, salt="t")  # queued at once: no batch loop
    waiting = SaveJob(store, KEY, list(a), len(a), a_cache, "assistant", "t")
    assert pc._save_in_ram(waiting) is a_cache

    pc.step_held = saves.StepHeldSaves()  # the batch loop's: held for a step
    longer_cache = compute_cache(model, longer)
    pc.insert_cache(KEY, longer, longer_cache, salt="t")
    assert len(pc.step_held) == 1
    # a's entry is gone and longer's is held unevaluated: a keeps its own KV and
    # waits (going ahead, it would copy beside the loop's steps)
    assert pc._save_in_ram(waiting) is a_cache

    with act.step():  # a decoding step: the held save is copied out and queued
        pass
    act.prefilling = False
    act.touch()
    pc.loop_top(idle=False)
    assert len(pc.step_held) == 0
    assert pc._save_in_ram(waiting) is longer_cache
    pc.close()


def test_a_lookup_reuses_the_kv_a_waiting_save_holds_once_ram_evicted_it(
    tmp_path, model, tokenizer, monkeypatch
):
    """mlx-lm's LRU evicted a chat's entry while its save still waits (16 users fill
    its 10 entries while the writer waits for the loop to rest): the chat's next
    turn takes the KV the save holds, as a cold run computes it, instead of
    prefilling it all again; never another salt's."""
    import mlx.core as mx

    gate = threading.Event()
    real = SaveQueue._save
    monkeypatch.setattr(
        SaveQueue, "_save", lambda self, job: gate.wait(30) and real(self, job)
    )
    a, b = random_tokens(80, seed=90), random_tokens(60, seed=91)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer), max_size=1)
    assert pc.use_threads(Prefetcher())
    store = pc.open_store(KEY)
    pc.insert_cache(KEY, a, compute_cache(model, a), salt="t")  # its save waits
    pc.insert_cache(KEY, b, compute_cache(model, b), salt="t")  # a leaves the LRU
    nxt = a + random_tokens(20, seed=92)
    _, rest = pc.fetch_nearest_cache(KEY, nxt, salt="u")
    assert rest == nxt  # another tenant's waiting save is not looked at
    cache, rest = pc.fetch_nearest_cache(KEY, nxt, salt="t")
    assert rest == nxt[80:]
    warm = next_logits(model, cache, rest)
    cold = next_logits(model, compute_cache(model, []), nxt)
    assert mx.allclose(warm, cold, atol=1e-4, rtol=1e-4).item()
    gate.set()
    pc.flush()  # the save's KV is as it was: the copy was used, not the job's
    saved, n = store.fetch(nxt, salt="t")
    assert n == 80
    assert mx.allclose(next_logits(model, saved, rest), cold, atol=1e-4).item()
    pc.close()


def test_saves_of_a_batch_step_are_held_until_the_loop_decodes_or_rests(
    tmp_path, model, tokenizer
):
    """The caches a batch step stores are copied out for their saves, together, at
    the loop's top once a step has run since that processed no prompt (the first
    tokens are out), once the loop has rested, after MAX_STEPS_HELD steps, and at
    close, whatever is left. They are saved as a cold run computes them."""
    from kvstore.serve import saves
    from kvstore.serve.timing import REST_S, Activity

    a, b, c, d = (random_tokens(70 + 10 * i, seed=60 + i) for i in range(4))
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    pc.activity, pc.step_held = Activity(), saves.StepHeldSaves()
    act = pc.activity

    def step(prefilling: bool):
        with act.step():
            pass
        act.prefilling = prefilling
        act.touch()

    pc.open_store(KEY)
    step(prefilling=True)  # the step that ends a's prompt
    pc.insert_cache(KEY, a, compute_cache(model, a), salt="t")
    pc.loop_top(idle=False)
    step(prefilling=True)  # a's last prompt token: its first token
    pc.loop_top(idle=False)
    assert (pc.stats()["saves"], pc.stats()["saves_queued"], len(pc.step_held)) == (
        1,
        0,
        1,
    )
    step(prefilling=False)  # decoding
    pc.loop_top(idle=False)
    assert len(pc.step_held) == 0

    # A finished chat's cache, the loop idle: held until it has rested.
    pc.insert_cache(KEY, b, compute_cache(model, b), salt="t")
    pc.loop_top(idle=True)
    assert len(pc.step_held) == 1
    time.sleep(REST_S + 0.05)
    pc.loop_top(idle=True)
    assert len(pc.step_held) == 0

    # Prompts all the time: held MAX_STEPS_HELD steps at most.
    pc.insert_cache(KEY, c, compute_cache(model, c), salt="u")
    for _ in range(saves.MAX_STEPS_HELD - 1):
        step(prefilling=True)
        pc.loop_top(idle=False)
    assert len(pc.step_held) == 1
    step(prefilling=True)
    pc.loop_top(idle=False)
    assert len(pc.step_held) == 0

    pc.insert_cache(KEY, d, compute_cache(model, d), salt=None)
    pc.close()  # the loop has ended: d is saved with the rest
    with KVStore(tmp_path / "s", model, tokenizer) as s2:
        for tokens, salt in ((a, "t"), (b, "t"), (c, "u"), (d, None)):
            assert s2.lookup(tokens + [1], salt=salt) == len(tokens)
        assert_same_as_cold(model, s2, d + [1, 2], len(d))


def a_save_held_for_the_step(tmp_path, model, tokenizer, n, seed):
    """A threaded cache whose batch loop holds the caches a step stores, with one
    save of ``n`` random tokens (salt "t") held so. Returns the cache, its open
    store and the tokens."""
    from kvstore.serve.saves import StepHeldSaves

    tokens = random_tokens(n, seed=seed)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    pc.step_held = StepHeldSaves()
    store = pc.open_store(KEY)
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt="t")
    return pc, store, tokens


def test_a_flush_waits_for_the_loop_to_queue_its_held_saves(
    tmp_path, model, tokenizer, monkeypatch
):
    """Also while the loop copies them out (slowed here): a save the loop has taken
    but not queued yet is still waited for."""
    from kvstore.serve import prompt_cache

    real = prompt_cache.evaluate_all
    monkeypatch.setattr(
        prompt_cache, "evaluate_all", lambda *a: time.sleep(0.3) or real(*a)
    )
    pc, store, tokens = a_save_held_for_the_step(tmp_path, model, tokenizer, 90, 64)
    loop = threading.Timer(0.3, lambda: pc.loop_top(idle=True))  # never stepped
    loop.start()
    pc.flush()  # returns once the loop (here a timer) queued and saved it
    loop.join()
    assert store.lookup(tokens + [1], salt="t") == 90
    pc.close()


def test_close_closes_the_stores_when_the_held_saves_cannot_be_queued(
    tmp_path, model, tokenizer, monkeypatch
):
    """The held saves' copy-out failing at close is logged and counted, as at the
    top of the loop: the save thread still ends and the stores still close."""
    from kvstore.serve import prompt_cache

    def boom(*a):
        raise RuntimeError("copy-out failed")

    pc, store, tokens = a_save_held_for_the_step(tmp_path, model, tokenizer, 40, 66)
    assert len(pc.step_held) == 1
    monkeypatch.setattr(prompt_cache, "evaluate_all", boom)
    pc.close()
    assert pc.stats()["saves_skipped"] == 1 and pc.stats()["store_errors"] == 1
    assert not pc.saves._thread.is_alive()
    with pytest.raises(Exception):
        store.lookup(tokens + [1], salt="t")  # closed
