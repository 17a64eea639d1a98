"""Restores started when a request arrives (``kvstore.serve.prefetch``): taken by
the lookup of that very request only, and the lookup restores as before whenever
a prefetch cannot tell (none, failed, not started, another salt, RAM changed)."""

import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import compute_cache, next_logits, random_tokens
from serving import KEY, Request, provider

from kvstore.serve.pacing import SAME_BATCH_S, AdmittingBudget, Backlog
from kvstore.serve.prefetch import (
    Prefetched,
    Prefetcher,
    prefetch_response_generator_class,
)
from kvstore.server import PersistentPromptCache

pytestmark = pytest.mark.slow


@pytest.fixture
def stored(tmp_path, model, tokenizer):
    """A store holding a 600-token prompt (unsalted) and, under salt "a", another."""
    tokens = random_tokens(600, seed=31)
    salted = random_tokens(600, seed=32)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    pc.insert_cache(KEY, salted, compute_cache(model, salted), salt="a")
    pc.close()
    return tmp_path / "s", tokens, salted


def restarted(path, model, tokenizer, **kwargs):
    pc = PersistentPromptCache(path, provider(model, tokenizer), **kwargs)
    pc.open_store(KEY)
    pc.prefetcher = Prefetcher()
    assert pc.can_prefetch()
    return pc


def arrive(pc, tokens, salt=None):
    """A request arriving: its prefetch is submitted (as the HTTP handler does),
    and has run by the time this returns (one not started yet would be cancelled
    by the lookup: a test of its own)."""
    request = Request()
    pc.prefetcher.submit(request, lambda: pc.prefetch(KEY, tokens, salt))
    request.kvstore_prefetch.future.exception()  # waits
    return request


def look_up(pc, request, tokens, salt=None):
    pc.prefetcher.looking_up(request)  # the generation thread's _tokenize
    return pc.fetch_nearest_cache(KEY, tokens, salt=salt)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_restore_always_is_never_weighed_against_the_queue(
    stored, model, tokenizer, mode
):
    """With the rates known, an arriving request's extent prices the read in
    ``restore="auto"``; ``"always"`` gives no read estimate, so the queue
    (``Backlog``) restores it whatever it holds, as the option says."""
    path, tokens, _ = stored
    kwargs = {"store_kwargs": {"restore": mode}}
    pc = PersistentPromptCache(path, provider(model, tokenizer), **kwargs)
    store = pc.open_store(KEY)
    store.policy.rates.prefill = 1e9  # prefilling far faster than any read
    store.policy.rates.restore, store.policy.rates.restore_fixed = 1e6, 0.01
    ext = pc.extent(KEY, tokens + [1], None)
    assert ext.stored == len(tokens) and ext.prefill_s is not None
    assert (ext.read_s is None) == (mode == "always")
    if mode == "auto":
        assert not Backlog().restore_sooner(ext.read_s, ext.prefill_s)
    else:
        assert Backlog().restore_sooner(ext.read_s, ext.prefill_s)
    pc.close()


class Generator:
    """mlx-lm's ResponseGenerator, as far as the prefetching subclass uses it: a
    request's tokens are its ``tokens``, and ``generate`` does nothing."""

    model_provider = SimpleNamespace(model=object(), tokenizer=object(), model_key=KEY)

    def _tokenize(self, tokenizer, request, args):
        return list(request.tokens), [list(request.tokens)], [0], None, None

    def generate(self, request, args):
        pass


def same_as_cold(model, cache, query, rest):
    want = next_logits(model, compute_cache(model, []), query)
    assert mx.allclose(next_logits(model, cache, rest), want, atol=1e-4).item()


def test_prefetched_restore_is_taken_by_its_lookup(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    queries = [tokens + [i, 7] for i in range(4)]
    requests = [arrive(pc, q) for q in queries]  # four users arrive at once
    for request, q in zip(requests, queries):
        cache, rest = look_up(pc, request, q)
        assert len(rest) == 2 and cache[0].offset == 600
        same_as_cold(model, cache, q, rest)
    s = pc.stats()
    assert (s["disk_hits"], s["restores_prefetched"]) == (4, 4)
    assert pc.prefetcher._waiting == 0
    pc.close()


def test_requests_sharing_a_prefix_read_it_once(tmp_path, model, tokenizer):
    """Two users of one 300-token system prompt arrive together: the second's
    prefetch copies the first's restore of the system prompt (not yet taken by its
    lookup) and reads from the store only the nodes past it; both caches give the
    logits of computing their prompts from scratch. A third user under another salt
    shares nothing."""
    system = random_tokens(300, seed=33)
    a, b = system + random_tokens(200, seed=34), system + random_tokens(200, seed=35)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    for tokens, salt in ((a, None), (b, None), (b, "t")):
        pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt=salt)
    pc.close()
    pc = restarted(tmp_path / "s", model, tokenizer)
    store = pc.open_store(KEY)
    first = arrive(pc, a + [1])
    read = store.stats()["tokens_reused"]
    second = arrive(pc, b + [2])
    assert second.kvstore_prefetch.future.result().joined
    # The store gave only the tokens past the shared 300.
    assert store.stats()["tokens_reused"] - read == 500 - 300
    other = arrive(pc, b + [2], salt="t")
    assert not other.kvstore_prefetch.future.result().joined
    for request, query, salt in ((second, b + [2], None), (first, a + [1], None)):
        cache, rest = look_up(pc, request, query, salt=salt)
        assert len(rest) == 1 and cache[0].offset == 500
        same_as_cold(model, cache, query, rest)
    cache, rest = look_up(pc, other, b + [2], salt="t")
    same_as_cold(model, cache, b + [2], rest)
    s = pc.stats()
    assert (s["restores_prefetched"], s["restores_shared"]) == (3, 1)
    assert len(pc.shared) == 0  # every restore taken by its lookup
    pc.close()


def two_users_registered(tmp_path, model, tokenizer, seed):
    """A restarted cache over a store holding two users' prompts of one 300-token
    system prompt; both users' next requests registered as they arrive (in order).
    Returns the cache, the two requests' tokens and their registrations."""
    system = random_tokens(300, seed=seed)
    a = system + random_tokens(200, seed=seed + 1)
    b = system + random_tokens(200, seed=seed + 2)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    for tokens in (a, b):
        pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    pc.close()
    pc = restarted(tmp_path / "s", model, tokenizer)
    qa, qb = a + [1], b + [2]
    return pc, qa, qb, pc.register(KEY, qa, None, 0), pc.register(KEY, qb, None, 0)


def prefetched(pc, tokens, registration, *, joins=False):
    """A request whose prefetch (given its registration) has run."""
    request = Request()
    pc.prefetcher.submit(
        request,
        lambda: pc.prefetch(KEY, tokens, None, registration=registration),
        joins=joins,
    )
    request.kvstore_prefetch.future.exception()
    return request


def test_users_of_one_system_prompt_read_it_once_whichever_is_looked_up_first(
    tmp_path, model, tokenizer
):
    """Two users of one 300-token system prompt arrive together and are registered
    on arrival; the first's request is looked up (its restore taken) before the
    second's prefetch starts. The second still copies the first's system prompt,
    handed over as that restore ended, and reads only its own 200 tokens."""
    pc, qa, qb, reg_a, reg_b = two_users_registered(tmp_path, model, tokenizer, 33)
    store = pc.open_store(KEY)
    assert reg_b.other is reg_a.entry and reg_b.common == 300
    first = prefetched(pc, qa, reg_a)
    cache, rest = look_up(pc, first, qa)
    same_as_cold(model, cache, qa, rest)
    read = store.stats()["tokens_reused"]
    second = prefetched(pc, qb, reg_b, joins=True)
    assert second.kvstore_prefetch.future.result().joined
    assert store.stats()["tokens_reused"] - read == 200
    cache, rest = look_up(pc, second, qb)
    assert len(rest) == 1 and cache[0].offset == 500
    same_as_cold(model, cache, qb, rest)
    assert pc.stats()["restores_shared"] == 1
    pc.close()


def test_a_waiter_copies_the_restore_as_handed_not_what_its_owner_wrote_since(
    tmp_path, model, tokenizer
):
    """The owner's request is looked up and its generate loop writes into its cache
    objects (here: over the shared tokens themselves) before the waiter copies the
    shared prefix: the waiter copies the restore as it was handed over."""
    pc, qa, qb, reg_a, reg_b = two_users_registered(tmp_path, model, tokenizer, 36)
    first = prefetched(pc, qa, reg_a)
    cache, rest = look_up(pc, first, qa)
    for layer in cache:  # in place, as KVCache.update_and_fetch writes
        layer.keys[..., :10, :] = 0
        layer.values[..., :10, :] = 0
    mx.eval([layer.state for layer in cache])
    second = prefetched(pc, qb, reg_b, joins=True)
    assert second.kvstore_prefetch.future.result().joined
    cache, rest = look_up(pc, second, qb)
    same_as_cold(model, cache, qb, rest)
    pc.close()


def test_nothing_keeps_a_restore_once_its_requests_dropped_their_caches(
    tmp_path, model, tokenizer
):
    """Two users sharing a system prompt, restored (one handed the other's KV) and
    looked up: once their caches are dropped (a request ended), no memory of the
    restores is left: no registration, hand-off or prefetch result keeps it."""
    import gc

    pc, qa, qb, reg_a, reg_b = two_users_registered(tmp_path, model, tokenizer, 40)
    pc.open_store(KEY)
    gc.collect()
    before = mx.get_active_memory()
    first = prefetched(pc, qa, reg_a)
    second = prefetched(pc, qb, reg_b, joins=True)
    assert second.kvstore_prefetch.future.result().joined
    caches = [look_up(pc, first, qa)[0], look_up(pc, second, qb)[0]]
    mx.eval([layer.state for cache in caches for layer in cache])
    assert mx.get_active_memory() > before
    del caches, first, second
    gc.collect()
    assert mx.get_active_memory() == before
    pc.close()


def test_a_prefetch_waiting_for_another_restore_does_not_hold_up_the_restores():
    """With one restoring thread busy, a request sharing the prefix of the restore
    in progress starts at once (it only waits for that restore, on a thread of its
    own) and gets its registration; the restore of a request that will never
    run (refused past ``max_waiting``) is abandoned at once."""
    gate, started = threading.Event(), []

    from kvstore.serve.shared import SharedRestores

    shared = SharedRestores(min_shared=4)

    def prepare(key, tokens, salt, weigh=True, registration=None):
        started.append((tokens[-1], registration.other is not None))
        if registration.other is None:
            assert gate.wait(10)
        shared.end(registration.entry, None)
        return "restored"

    def register(key, tokens, salt, held):
        return shared.begin(key, tokens, held)

    system = list(range(10, 30))
    prefetcher = Prefetcher(workers=1, max_waiting=2)
    generator = prefetch_response_generator_class(
        Generator,
        prefetcher,
        prepare,
        lambda k, t, s: (0, len(t) - 1),  # returning users: nothing in RAM
        register=register,
    )()
    requests = []
    for last in (1, 2, 3):
        request = Request()
        request.tokens = system + [last]
        requests.append(request)
    threads = [
        threading.Thread(target=generator.generate, args=(r, None))
        for r in requests[:2]
    ]
    for t in threads:
        t.start()
        time.sleep(0.1)
    assert started == [(1, False), (2, True)]  # the second did not queue
    # A third is refused (two wait already): its entry is abandoned, not left
    # for later arrivals to wait 30 s on.
    generator.generate(requests[2], None)
    assert not hasattr(requests[2], "kvstore_prefetch")
    third = [e for e in shared._entries if e.tokens[-1] == 3][0]
    assert third.done.is_set()
    gate.set()
    for t in threads:
        t.join(10)
    prefetcher.close()


def test_prefetch_restores_only_past_the_ram_copy(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    pc.insert_cache(KEY, tokens[:270], compute_cache(model, tokens[:270]))
    query = tokens + [3]
    request = arrive(pc, query)
    pre = request.kvstore_prefetch.future.result()
    assert pre.held == 270 and (pre.tail.start, pre.tail.end) == (256, 600)
    cache, rest = look_up(pc, request, query)
    assert rest == [3] and cache[0].offset == 600
    same_as_cold(model, cache, query, rest)
    s = pc.stats()
    assert (s["restores_prefetched"], s["tokens_reused_ram"]) == (1, 256)

    # RAM lost its copy meanwhile: the tail alone is no use, the lookup restores.
    request = arrive(pc, query)
    pc.trim_to(n_sequences=0)
    cache, rest = look_up(pc, request, query)
    assert rest == [3] and cache[0].offset == 600
    same_as_cold(model, cache, query, rest)
    assert pc.stats()["restores_prefetched"] == 1
    pc.close()


def test_only_a_whole_restore_lets_the_joins_in_progress_finish_first(
    stored, model, tokenizer
):
    """A returning user's restore (RAM holds under half its prompt) waits for the
    joins already handed a prefix; a next turn's read past RAM, or finding that
    prefilling it is cheaper, does not wait for them."""
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    waits = []
    let_joins_finish = pc.shared.let_joins_finish
    pc.shared.let_joins_finish = lambda **kw: (waits.append(1), let_joins_finish())
    pc.insert_cache(KEY, tokens[:400], compute_cache(model, tokens[:400]))
    request = arrive(pc, tokens + [3])  # kept: its prefetch goes with it
    pre = request.kvstore_prefetch.future.result()
    assert pre.held == 400 and pre.tail is not None and waits == []
    pc.trim_to(n_sequences=0)
    request = arrive(pc, tokens + [3])
    pre = request.kvstore_prefetch.future.result()
    assert pre.held == 0 and pre.tail.end == 600 and waits == [1]
    pc.close()


def test_prefetch_never_crosses_salts(stored, model, tokenizer):
    path, tokens, salted = stored
    pc = restarted(path, model, tokenizer)
    # A prefetch made under salt "a" is not taken by a lookup under "b".
    request = arrive(pc, salted + [1], salt="a")
    assert request.kvstore_prefetch.future.result().tail is not None
    cache, rest = look_up(pc, request, salted + [1], salt="b")
    assert cache is None and len(rest) == 601
    # Nor by an unsalted one; under its own salt it is.
    request = arrive(pc, salted + [1], salt="a")
    assert look_up(pc, request, salted + [1])[0] is None
    request = arrive(pc, salted + [1], salt="a")
    cache, rest = look_up(pc, request, salted + [1], salt="a")
    assert rest == [1] and cache[0].offset == 600
    s = pc.stats()
    assert (s["misses"], s["disk_hits"], s["restores_prefetched"]) == (2, 1, 1)
    # A prefetch for other tokens is not taken either.
    request = arrive(pc, tokens + [1])
    cache, rest = look_up(pc, request, tokens + [2])
    assert rest == [2] and pc.stats()["restores_prefetched"] == 1
    pc.close()


def test_failed_or_unstarted_prefetch_restores_at_lookup(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    query = tokens + [5]

    def boom():
        raise RuntimeError("disk on fire")

    request = Request()
    pc.prefetcher.submit(request, boom)
    cache, rest = look_up(pc, request, query)
    assert rest == [5] and pc.stats()["restores_prefetched"] == 0

    # A prefetch still queued behind a slow one is cancelled; the lookup restores.
    gate = threading.Event()
    slow = [Request() for _ in range(2)]
    for r in slow:
        pc.prefetcher.submit(r, gate.wait)
    request = Request()
    pc.prefetcher.submit(request, lambda: pc.prefetch(KEY, query, None))
    cache, rest = look_up(pc, request, query)
    assert rest == [5] and request.kvstore_prefetch is None
    assert pc.stats()["restores_prefetched"] == 0
    gate.set()
    for r in slow:
        look_up(pc, r, [1, 2, 3])
    assert pc.prefetcher._waiting == 0
    pc.close()


def test_waiting_prefetches_are_bounded(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = PersistentPromptCache(path, provider(model, tokenizer))
    pc.prefetcher = Prefetcher(max_waiting=2)
    requests = [Request() for _ in range(3)]
    for r in requests:
        pc.prefetcher.submit(r, lambda: None)
    assert [hasattr(r, "kvstore_prefetch") for r in requests] == [True, True, False]
    # A request that goes without being looked up frees its place.
    del requests[0]
    deadline = time.monotonic() + 5
    while pc.prefetcher._waiting != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pc.prefetcher._waiting == 1
    pc.close()


def test_extent_reads_the_index_past_the_ram_copy(stored, model, tokenizer):
    path, tokens, salted = stored
    # restore="auto": "always" (the suite's default) is never weighed, no read priced.
    pc = restarted(path, model, tokenizer, store_kwargs={"restore": "auto"})
    assert pc.extent(KEY, tokens + [5], None) == (0, 600, None, None, None)
    assert pc.extent(KEY, random_tokens(50, seed=33), None)[:2] == (0, 0)
    assert pc.extent(KEY, salted + [5], None)[:2] == (0, 0)  # another salt
    assert pc.extent(KEY, salted + [5], "a")[:2] == (0, 600)
    # With rates measured: what restoring the stored part and prefilling it take.
    store = pc.open_store(KEY)
    store.note_prefill(1000, 2.0)
    store.policy.rates.restore, store.policy.rates.restore_fixed = 1e6, 0.01
    ext = pc.extent(KEY, tokens + [5], None)
    assert ext.prefill_s == pytest.approx(1.2) and ext.prefill_rate == 500
    per_token = store.stats()["bytes_on_disk"] / 1200  # both prompts
    assert ext.read_s == pytest.approx(0.01 + 600 * per_token / 1e6)
    # Once RAM holds the prompt the store adds nothing to it.
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    assert pc.extent(KEY, tokens + [5], None)[:2] == (600, 0)
    pc.close()


def test_backlog_prefills_a_returning_user_when_restores_queued_take_longer():
    """Eight returning users at once, each restored in 0.26 s or prefilled in
    0.46 s: every third is prefilled while the others' restores read, so the last
    is ready at 1.38 s, not 2.08 s; a clock left idle starts again from now."""
    now = [100.0]
    backlog = Backlog(clock=lambda: now[0])
    chosen = [backlog.restore_sooner(0.26, 0.46) for _ in range(8)]
    assert chosen == [True, False, True, True, False, True, True, False]
    assert backlog._reads_free == pytest.approx(101.30)
    assert backlog._prefill_free == pytest.approx(101.38)
    now[0] = 200.0
    assert backlog.restore_sooner(0.26, 0.46)  # idle since: from now
    backlog.prefill(5.0)  # a long prompt sent straight on
    assert backlog.restore_sooner(0.26, 0.46)
    assert backlog.restore_sooner(None, 0.01)  # no restore rate yet: restored
    assert backlog.restore_sooner(0.26, None)


def test_backlog_counts_a_whole_prompt_prefilled_beside_others_for_each_of_them():
    """mlx-lm pads the prompts it prefills together to the longest: a returning
    user prefilled whole beside three next turns sent on (and not yet done) ends
    after about four times its own prefill, and each of them waits for its length
    too, so it is restored (0.3 s) rather than prefilled (0.1 s alone). Alone, or
    beside prompts as long as its own, it is prefilled; the rest of a prompt held
    back for its restore is not beside anything; the count stops at the prompt
    batch; a prompt sent on counts for ``SAME_BATCH_S`` at least."""
    now = [100.0]
    backlog = Backlog(clock=lambda: now[0], prompt_batch=3)
    for _ in range(3):
        backlog.prefill(0.01)  # next turns sent straight on
    assert backlog.restore_sooner(0.3, 0.1)  # 0.1 x 3 (the batch) >= 0.3
    now[0] = 200.0  # those are done
    backlog.prefill(0.01, straight_on=False)  # held back: not beside it
    assert not backlog.restore_sooner(0.3, 0.1)
    now[0] = 300.0
    backlog = Backlog(clock=lambda: now[0], prompt_batch=8)
    backlog.prefill(0.01)
    # 0.1 x 2 < 0.3, but the other waits 2 x 0.09 longer: 0.38 >= 0.3
    assert backlog.restore_sooner(0.3, 0.1)
    now[0] = 400.0
    backlog = Backlog(clock=lambda: now[0], prompt_batch=8)
    backlog.prefill(0.1)  # another whole prompt: no padding of it
    assert not backlog.restore_sooner(0.25, 0.1)  # 0.1 x 2 < 0.25
    assert backlog.restore_sooner(0.25, 0.1)  # beside two: 0.1 x 3 >= 0.25
    # Next turns whose own prefill is a token count while their burst is prefilled.
    now[0] = 500.0
    backlog = Backlog(clock=lambda: now[0], prompt_batch=8)
    for _ in range(3):
        backlog.prefill(1e-5)
    assert backlog.restore_sooner(0.3, 0.1)  # 0.1 x 4
    now[0] += SAME_BATCH_S + 0.01  # that batch has started without it
    assert not backlog.restore_sooner(0.3, 0.1)


def test_backlog_restores_a_next_turn_whose_prefill_would_pad_the_others():
    """16 users on an H200, the turns after a restart: seven next turns of 211
    tokens past RAM sent on (15.6 ms each), then one that RAM holds only the system
    prompt of (779 tokens, 58 ms; its read 0.19 s). Prefilled, it pads seven
    prompts to its length (2.4 s of their time): restored. One like the others is
    left to the store's own weighing, and so is the long one once the reads sent
    on end later than its padding would."""
    now = [100.0]
    backlog = Backlog(clock=lambda: now[0])
    for _ in range(7):
        backlog.prefill(0.0156)
    assert not backlog.restore_tail(0.06, 0.0156)
    assert backlog.restore_tail(0.19, 0.058)
    assert backlog._reads_free == pytest.approx(100.19)
    backlog.read(3.0)
    assert not backlog.restore_tail(0.19, 0.058)
    assert not backlog.restore_tail(None, 0.058)  # no read rate yet
    now[0] = 200.0  # alone: nothing to pad
    assert not backlog.restore_tail(0.19, 0.058)


def test_a_next_turn_that_would_pad_the_prompts_beside_it_is_restored_unweighed():
    """Through the prefetching generator: next turns alike go to the store's own
    weighing (``weigh=True``) and go on; the one that would pad them is restored as
    decided (``weigh=False``), held until then like a returning user."""
    prepared = []

    def extent(key, tokens, salt):
        if tokens[0] == 1:  # like the others: 211 tokens past RAM
            return 2578, 2788, 0.06, 0.0156, 13500.0
        return 2009, 2788, 0.19, 0.058, 13500.0  # 779 tokens past RAM

    def prepare(key, tokens, salt, weigh=True):
        prepared.append((tokens[0], weigh))
        return None

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Generator, prefetcher, prepare, extent
    )()
    requests = []  # kept: a request that goes away takes its prefetch with it
    for first in [1] * 7 + [2]:
        requests.append(Request())
        requests[-1].tokens = [first] * 2790
        generator.generate(requests[-1], None)
        # Held until its restore ran (the lookup would wait for it), then released.
        assert prefetcher.released_waiting() == (first == 2)
    deadline = time.monotonic() + 10
    while len(prepared) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    prefetcher.close()
    assert sorted(prepared) == [(1, True)] * 7 + [(2, False)]


def test_a_returning_user_is_weighed_once_the_requests_arriving_with_it_are_counted():
    """A returning user whose prefill alone would end sooner than its restore waits
    (0.2 s at most) until a next turn still being looked at is counted as sent on:
    prefilled beside it, padded, it would end later, so it is restored."""
    prefilled, prepared = [], []

    def extent(key, tokens, salt):
        if tokens[0] == 1:  # the next turn: slow to look at
            time.sleep(0.12)
            return 80, 90, 0.1, 0.1, 90.0
        return 0, 90, 0.8, 0.5, 90.0  # returning: read 0.8 s, prefill 0.5 s

    def prepare(key, tokens, salt, weigh=True):
        prepared.append(tokens[0])
        return "restored"

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Generator, prefetcher, prepare, extent, lambda: prefilled.append(1)
    )()
    turn, returning = Request(), Request()
    turn.tokens, returning.tokens = [1] * 100, [2] * 100
    first = threading.Thread(target=generator.generate, args=(turn, None))
    first.start()
    time.sleep(0.05)  # the next turn is being looked at
    generator.generate(returning, None)
    first.join(10)
    assert prefilled == [] and sorted(prepared) == [1, 2]
    prefetcher.close()


def test_requests_waiting_for_arrivals_do_not_wait_for_each_other():
    """Two returning users arriving together, both about to be prefilled, each wait
    for the requests still being looked at, not for each other (nor out the 0.2 s
    bound); a third still being looked at keeps them waiting until it is done."""
    prefetcher = Prefetcher()
    done, other = [], threading.Event()
    together = threading.Barrier(2)

    def arriving(name):
        with prefetcher.probing():
            if name == "slow":
                other.wait(10)
                return
            together.wait(10)  # both are being looked at
            t = time.monotonic()
            prefetcher.await_classified(timeout=5.0)
            done.append((name, time.monotonic() - t))

    threads = [threading.Thread(target=arriving, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(n for n, _ in done) == ["a", "b"]
    assert all(waited < 1.0 for _, waited in done)
    done.clear()
    slow = threading.Thread(target=arriving, args=("slow",))
    slow.start()
    time.sleep(0.05)
    threads = [threading.Thread(target=arriving, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert done == []  # the third is still being looked at
    other.set()
    for t in threads + [slow]:
        t.join(10)
    assert sorted(n for n, _ in done) == ["a", "b"]
    prefetcher.close()


def test_the_time_budget_ends_once_a_restored_request_is_released():
    """mlx-lm's loop steps a decoding batch for up to its time budget before it
    takes waiting requests: the budget ends early (after at least one step, so a
    loop that cannot take the request still steps) once a request held for its
    restore is released, and runs to its time otherwise."""
    from mlx_lm.server import TimeBudget

    released = [False]
    budget = AdmittingBudget(TimeBudget(budget=30.0), lambda: released[0])
    steps = 0
    for _ in budget:
        steps += 1
        if steps == 3:
            released[0] = True
    assert steps == 3
    steps = sum(1 for _ in budget)  # released from the start: one step
    assert steps == 1
    released[0] = False
    t = time.monotonic()
    steps = sum(1 for _ in AdmittingBudget(TimeBudget(budget=0.05), lambda: False))
    assert steps > 1 and time.monotonic() - t >= 0.05


def test_a_request_held_for_its_restore_counts_as_released_until_looked_up():
    class Base(Generator):
        def __init__(self):
            from mlx_lm.server import TimeBudget

            self.requests = object()
            self._time_budget = TimeBudget()

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Base, prefetcher, lambda *a, **k: "restored", lambda k, t, s: (0, 90)
    )()
    assert isinstance(generator._time_budget, AdmittingBudget)
    returning = Request()
    returning.tokens = [1] * 100
    generator.generate(returning, None)
    assert prefetcher.released_waiting()
    prefetcher.looking_up(returning)  # the generation thread takes it
    assert not prefetcher.released_waiting()
    prefetcher.close()


def test_request_reaches_the_generation_thread_once_its_restore_is_ready():
    """A returning user's request (RAM holds little of its prompt) waits on its HTTP
    thread for its restore, so the generation thread meanwhile serves others; a
    new user's request goes straight on, and so does a next turn (RAM holds most
    of it: its tail is read meanwhile); a failed restore lets its request go on."""
    gate, went = threading.Event(), []

    class Base:  # mlx-lm's ResponseGenerator, as far as the subclass uses it
        model_provider = SimpleNamespace(model=object(), tokenizer=object())
        model_provider.model_key = KEY

        def _tokenize(self, tokenizer, request, args):
            return list(request.tokens), [list(request.tokens)], [0], None, None

        def generate(self, request, args):
            went.append(request.name)

    def prepare(key, tokens, salt, weigh=True):
        if tokens[0] == 9:
            raise RuntimeError("disk on fire")
        assert gate.wait(10)
        # A returning user's restore was weighed on arrival: not weighed again.
        assert weigh == (tokens[0] != 1)
        return ("restored", tuple(tokens))

    extents = {1: (0, 90), 7: (0, 0), 9: (10, 90), 4: (60, 90)}  # (held, stored)
    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Base, prefetcher, prepare, lambda k, t, s: extents[t[0]]
    )()
    requests = {}
    for name, tokens in (
        ("returning", [1, 2, 3]),
        ("new", [7, 8]),
        ("broken", [9]),
        ("next turn", [4, 5]),
    ):
        requests[name] = Request()
        requests[name].name, requests[name].tokens = name, tokens
    returning = threading.Thread(
        target=generator.generate, args=(requests["returning"], None)
    )
    returning.start()
    for name in ("new", "broken", "next turn"):
        generator.generate(requests[name], None)
    time.sleep(0.1)
    # None of them waited for the restore in progress.
    assert went == ["new", "broken", "next turn"]
    assert requests["next turn"].kvstore_prefetch.future is not None  # reading
    gate.set()
    returning.join(10)
    assert went == ["new", "broken", "next turn", "returning"]
    # Their lookups take the finished restores.
    for name in ("returning", "next turn"):
        prefetcher.looking_up(requests[name])
        assert prefetcher.take() == ("restored", tuple(requests[name].tokens))
    prefetcher.looking_up(requests["broken"])
    assert prefetcher.take() is None
    assert not hasattr(requests["new"], "kvstore_prefetch")
    prefetcher.close()


def test_returning_user_behind_busy_reads_goes_on_to_be_prefilled():
    """When the restores queued before it would keep a returning user waiting
    longer than prefilling its stored prefix, it goes straight on and its lookup
    is told that the store adds nothing worth reading (no restore on the
    generation thread); without a prefill rate every returning user is held."""
    gate, went, prefilled = threading.Event(), [], []

    class Base:
        model_provider = SimpleNamespace(model=object(), tokenizer=object())
        model_provider.model_key = KEY

        def _tokenize(self, tokenizer, request, args):
            return list(request.tokens), [list(request.tokens)], [0], None, None

        def generate(self, request, args):
            went.append(request.tokens[0])

    def prepare(key, tokens, salt, weigh=True):
        assert gate.wait(10)
        return "restored"

    rate = [None]

    def extent(key, tokens, salt):  # 90 of 100 tokens stored, none in RAM
        return 0, 90, 1.0, 2.5 if rate[0] else None, rate[0]

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Base, prefetcher, prepare, extent, lambda: prefilled.append(1)
    )()
    requests, threads = [], []
    for i, r in enumerate((None, 90.0, 90.0)):
        rate[0] = r
        request = Request()
        request.tokens = [i] + [7] * 99
        requests.append(request)
        threads.append(
            threading.Thread(target=generator.generate, args=(request, None))
        )
        threads[-1].start()
        time.sleep(0.1)
    # The first two wait for their restores (one without a prefill rate, one
    # whose read ends at 2 s, before 2.6 s of prefill); the third's would end at
    # 3 s, the prefill of its prefix and the two others' rest at 2.7 s.
    assert went == [2] and prefilled == [1]
    prefetcher.looking_up(requests[2])
    pre = prefetcher.take()
    assert isinstance(pre, Prefetched)
    assert (pre.tail, pre.held, pre.tokens) == (None, 0, requests[2].tokens)
    gate.set()
    for t in threads:
        t.join(10)
    assert sorted(went) == [0, 1, 2]
    prefetcher.close()


def test_requests_arriving_while_the_model_loads_wait_for_it_then_prefetch():
    """The model and its store load on the generation thread after the server
    starts listening: a request arriving meanwhile looks for its prefix once the
    load has ended (its prefetch is not lost to the race)."""
    idle, prepared, went = threading.Event(), [], []

    class Base:
        model_provider = SimpleNamespace(model=None, tokenizer=None, model_key=None)
        model_provider.kvstore_idle = idle  # cleared: a load in progress

        def _tokenize(self, tokenizer, request, args):
            return [1, 2, 3], [[1, 2, 3]], [0], None, None

        def generate(self, request, args):
            went.append(request)

    def load():
        time.sleep(0.2)
        provider = Base.model_provider
        provider.model, provider.tokenizer, provider.model_key = object(), object(), KEY
        idle.set()

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Base,
        prefetcher,
        lambda k, t, s, **kw: prepared.append((k, t)) or "restored",
        lambda k, t, s: (0, 90),
    )()
    loader = threading.Thread(target=load)
    loader.start()
    request = Request()
    generator.generate(request, None)
    loader.join()
    assert prepared == [(KEY, [1, 2, 3])] and went == [request]
    prefetcher.looking_up(request)
    assert prefetcher.take() == "restored"
    prefetcher.close()


def test_a_request_is_tokenized_once_and_its_lookup_waits_for_no_other():
    """The HTTP thread tokenizes an arriving request; the generation thread's
    lookup takes a copy of those tokens, also while another arrival holds the
    tokenizer's lock (a burst is tokenized one request at a time)."""
    calls = []

    class Base(Generator):
        def _tokenize(self, tokenizer, request, args):
            calls.append(args)
            return super()._tokenize(tokenizer, request, args)

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Base, prefetcher, lambda *a, **k: None, lambda k, t, s: (0, 0)
    )()
    tokenizer, args = Base.model_provider.tokenizer, object()
    request = Request()
    request.tokens = [5, 6, 7]
    generator.generate(request, args)  # tokenized on arrival
    assert calls == [args]
    got = []
    with prefetcher.tokenize_lock:  # another arrival being tokenized
        looking = threading.Thread(
            target=lambda: got.append(generator._tokenize(tokenizer, request, args))
        )
        looking.start()
        looking.join(5)
        assert got, "the lookup waited for another request's tokenization"
    assert calls == [args] and got[0][0] == [5, 6, 7]
    got[0][0].append(8)  # the caller's copy: what is kept stays as it was
    assert generator._tokenize(tokenizer, request, args)[0] == [5, 6, 7]
    other = object()  # other arguments: tokenized again
    assert generator._tokenize(tokenizer, request, other)[0] == [5, 6, 7]
    assert calls == [args, other]
    prefetcher.close()


@pytest.mark.parametrize("fields", [4, 5])
def test_tokenize_results_of_every_supported_mlx_lm_are_kept_and_prefetched(fields):
    """mlx-lm 0.32.0-0.32.1's ``_tokenize`` gives ``(prompt, segments, types,
    state)``, 0.32.2's adds the vision inputs: both are kept as they came, and the
    arriving request's prompt is prefetched (it was a 404 on 0.32.0)."""
    seen = []

    class Base(Generator):
        def _tokenize(self, tokenizer, request, args):
            return super()._tokenize(tokenizer, request, args)[:fields]

    prefetcher = Prefetcher()
    generator = prefetch_response_generator_class(
        Base,
        prefetcher,
        lambda *a, **k: None,
        lambda k, t, s: seen.append(list(t)) or (0, 0),
    )()
    tokenizer, args = Base.model_provider.tokenizer, object()
    request = Request()
    request.tokens = [5, 6, 7]
    generator.generate(request, args)
    assert seen == [[5, 6, 7]]
    out = generator._tokenize(tokenizer, request, args)
    assert len(out) == fields and out[0] == [5, 6, 7] and out[3] is None
    prefetcher.close()


def test_generation_thread_waits_for_requests_still_arriving():
    """With its queue empty, the generation thread waits while arriving requests
    are looked at (so that a burst joins one batch), never longer than a request
    takes to reach the queue, nor when none is arriving."""
    prefetcher = Prefetcher()
    tic = time.perf_counter()
    prefetcher.await_arrivals(lambda: False, timeout=5)
    assert time.perf_counter() - tic < 1  # none arriving: no wait

    def arrive_slowly():
        with prefetcher.probing():
            time.sleep(0.3)

    for queued, least, most in ((lambda: False, 0.25, 4), (lambda: True, 0, 0.2)):
        t = threading.Thread(target=arrive_slowly)
        t.start()
        time.sleep(0.02)
        tic = time.perf_counter()
        prefetcher.await_arrivals(queued, timeout=5)
        assert least <= time.perf_counter() - tic < most
        t.join()
    prefetcher.close()


@pytest.mark.stress  # threads racing a real store: the slow tier
def test_a_burst_of_returning_users_of_few_system_prompts_all_get_their_kv(
    tmp_path, model, tokenizer
):
    """Nine returning users of three 300-token system prompts arrive at once
    through the prefetching generator (registered on arrival, held for their
    restores, one restoring thread); their lookups come in another order. Every
    one gets the logits of computing its prompt from scratch, none waits on an
    entry that never ends, the system prompts are shared, and nothing is left
    registered."""
    systems = [random_tokens(300, seed=40 + i) for i in range(3)]
    prompts = [systems[i % 3] + random_tokens(40, seed=50 + i) + [7] for i in range(9)]
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    for tokens in prompts:
        pc.insert_cache(KEY, tokens[:-1], compute_cache(model, tokens[:-1]))
    pc.close()
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.open_store(KEY)
    pc.prefetcher = Prefetcher(workers=1)
    went = []

    class Recording(Generator):
        def generate(self, request, args):
            went.append(request)

    generator = prefetch_response_generator_class(
        Recording,
        pc.prefetcher,
        lambda *a, **k: pc.prefetch(*a, **k),
        pc.extent,
        register=pc.register,
    )()
    requests = []
    for tokens in prompts:
        request = Request()
        request.tokens = tokens
        requests.append(request)
    threads = [
        threading.Thread(target=generator.generate, args=(r, None)) for r in requests
    ]
    t = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert len(went) == 9 and time.monotonic() - t < 30  # none waited out WAIT_S
    for request in reversed(requests):
        cache, rest = look_up(pc, request, request.tokens)
        assert cache is not None and cache[0].offset == len(request.tokens) - 1
        same_as_cold(model, cache, request.tokens, rest)
    s = pc.stats()
    assert (s["restores_prefetched"], s["restores_shared"]) == (9, 6)
    assert len(pc.shared) == 0 and pc.prefetcher._waiting == 0
    pc.close()
