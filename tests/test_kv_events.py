"""KV events (`kvstore.open(kv_events=...)`) as a router receives them: a ZMQ subscriber decodes
every batch with structs written from vLLM's schema (tests/vllm_events.py), never with kvstore's
own code, in both encodings. What it ends up believing must be what the store holds, in RAM and
on disk; the token ids of the blocks, chained, must be the prompts; sequence numbers have no gap
and replay gives exactly what was asked for."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from kvtest import prefill
from vllm_events import DECODERS, Consumer, chained_tokens, kind

import kvstore
from kvstore.errors import InvalidInputError
from kvstore.events import kvevents
from kvstore.events.blocks import block_ids
from kvstore.records import CHECKPOINT, prompt_records

C, B = 16, 4


@pytest.fixture
def consumer(request):
    c = Consumer(getattr(request, "param", "map"))
    yield c
    c.close()


def held_blocks(store, mc, prompts) -> dict[str, set[int]]:
    """medium -> the ids of the blocks the store holds for `prompts` (computed here from the
    records, as the docs define the ids: by the parent's key and the tokens)."""
    out = {"DISK": set(), "CPU_TIER1": set()}
    for tokens in prompts:
        for s in prompt_records(mc.ns, tokens, C):
            if s.kind == CHECKPOINT:
                continue
            ids = block_ids(s.parent, tokens[s.start : s.end], B)
            if store.index.present([s.hash]):
                out["DISK"].update(ids)
            if s.hash in store.memory:
                out["CPU_TIER1"].update(ids)
    return out


def believed(view) -> dict[str, set[int]]:
    return {m: set(view.get(m, {})) for m in ("DISK", "CPU_TIER1")}


def insert(mc, model, tokens) -> None:
    mc.insert(tokens, prefill(model, tokens))


def settle(store) -> int:
    """Wait until the store's publisher sent all it knows of; how many batches it sent."""
    store.flush()
    assert store.events.settle(30)
    return store.stats()["events"]["next_sequence"]


def observed(consumer, store) -> list:
    """Every batch the store published so far, as the consumer got them."""
    return consumer.batches(settle(store))


@pytest.mark.parametrize("consumer", ["map", "legacy"], indirect=True)
def test_a_router_sees_what_the_store_holds_stored_and_evicted(llama, tmp_path, consumer):
    path, model = llama
    prompts = [list(range(30, 30 + n)) + [7] * i for i, n in enumerate((40, 23, 57))]
    config = consumer.config(block_size=B, encoding=consumer.encoding)
    # A memory tier that holds about two chunks: later records push earlier ones out (its LRU).
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=config, memory_bytes=60_000) as store:
        mc = store.bind(model, str(path))
        for tokens in prompts:
            insert(mc, model, tokens)
        batches = observed(consumer, store)
        assert [n for n, _ in batches] == list(range(len(batches)))  # from 0, no gap
        assert kind(batches[0][1].events[0]) == "AllBlocksCleared"
        assert all(b.data_parallel_rank == 0 for _, b in batches)
        assert believed(consumer.view(batches)) == held_blocks(store, mc, prompts)
        removed = [e for _, b in batches for e in b.events if kind(e) == "BlockRemoved"]
        assert removed and all(e.medium == "CPU_TIER1" for e in removed)  # the LRU let some go
        assert all(e.block_size == B for _, b in batches for e in b.events if kind(e) == "BlockStored")

        store.gc(max_bytes=0)  # gc evicts every record: removed from disk (and RAM)
        batches = observed(consumer, store)
        assert believed(consumer.view(batches)) == {"DISK": set(), "CPU_TIER1": set()}
        assert any(kind(e) == "BlockRemoved" and e.medium == "DISK" for _, b in batches for e in b.events)


@pytest.mark.parametrize("consumer", ["map", "legacy"], indirect=True)
def test_events_carry_the_fields_of_their_encoding(llama, tmp_path, consumer):
    """Maps carry what current vLLM sends: `extra_keys` with one entry per block (None for an
    untagged one), `group_idx` 0 and `kv_cache_spec_kind` "full_attention" on stored blocks,
    `group_idx` on removals. Legacy arrays stay as vLLM sent them before: 8 items for a stored
    event (no `extra_keys` when no block is tagged), 3 for a removal."""
    path, model = llama
    config = consumer.config(block_size=B, encoding=consumer.encoding)
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=config, memory_bytes=30_000) as store:
        mc = store.bind(model, str(path))
        for n in (30, 50, 70):
            insert(mc, model, list(range(n, n + 40)))
        batches = observed(consumer, store)
        events = [e for _, b in batches for e in b.events]
        with consumer._lock:
            raw = [msgspec.msgpack.decode(consumer.raw[n]) for n, _ in batches if n in consumer.raw]
    stored = [e for e in events if kind(e) == "BlockStored"]
    removed = [e for e in events if kind(e) == "BlockRemoved"]
    assert stored and removed
    if consumer.encoding == "map":
        assert all(e.extra_keys == [None] * len(e.block_hashes) for e in stored)
        assert {(e.group_idx, e.kv_cache_spec_kind) for e in stored} == {(0, "full_attention")}
        assert {e.group_idx for e in removed} == {0}
    else:
        lengths = {(e[0], len(e)) for _, evs, _ in raw for e in evs if e[0] != "AllBlocksCleared"}
        assert lengths == {("BlockStored", 8), ("BlockRemoved", 3)}


def test_chained_token_ids_rebuild_the_prompts(llama, tmp_path, consumer):
    path, model = llama
    system = list(range(100, 140))
    prompts = [system + [1, 2, 3, 4, 5, 6, 7, 8, 9], system + list(range(200, 226)), list(range(50, 83))]
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
        mc = store.bind(model, str(path))
        for tokens in prompts:
            insert(mc, model, tokens)
        disk = consumer.view(observed(consumer, store))["DISK"]
        for tokens in prompts:
            full = len(tokens) // B * B  # the tail's last partial block is not announced
            end = next(s for s in prompt_records(mc.ns, tokens, C) if s.start < full <= s.end)
            last = block_ids(end.parent, tokens[end.start : full], B)[-1]  # the block ending at `full`
            assert chained_tokens(disk, last) == tokens[:full]


def test_a_tail_and_the_chunk_that_covers_it_share_their_blocks(llama, tmp_path, consumer):
    """A 24-token prompt is a chunk and an 8-token tail; extended to 40 tokens, the tail's tokens
    are covered by a chunk and the writer drops the tail. Its two blocks stay announced, with
    the same ids: no BlockRemoved on disk, and the chunk announces only its two new blocks."""
    path, model = llama
    short = list(range(60, 84))
    longer = short + list(range(200, 216))
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
        mc = store.bind(model, str(path))
        insert(mc, model, short)
        n = settle(store)
        insert(mc, model, longer)
        batches = observed(consumer, store)
        assert store.stats()["writer"]["redundant_dropped"] == 1  # the tail is gone from the index
        later = [e for _, b in batches[n:] for e in b.events]
        assert not [e for e in later if kind(e) == "BlockRemoved" and e.medium == "DISK"]
        stored = [e for e in later if kind(e) == "BlockStored" and e.medium == "DISK"]
        assert [len(e.block_hashes) for e in stored] == [2, 2]  # the chunk's 2 new ones, the new tail's
        assert set(consumer.view(batches)["DISK"]) == held_blocks(store, mc, [longer])["DISK"]


def test_ram_is_announced_when_it_starts_holding_a_prompt(llama, tmp_path, consumer):
    """A record is in RAM (queued for the writer, then in the memory tier) before it is on disk:
    its blocks are announced on CPU_TIER1 first, and once, not again when the writer hands its
    copy to the memory tier."""
    path, model = llama
    tokens = list(range(30, 70))
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
        mc = store.bind(model, str(path))
        insert(mc, model, tokens)
        stored = [e for _, b in observed(consumer, store) for e in b.events if kind(e) == "BlockStored"]
        assert [e.medium for e in stored][:1] == ["CPU_TIER1"]
        ram = [h for e in stored if e.medium == "CPU_TIER1" for h in e.block_hashes]
        assert sorted(ram) == sorted(held_blocks(store, mc, [tokens])["CPU_TIER1"])  # each once


def churn(batches) -> dict[str, list[int]]:
    """medium -> ids a `BlockRemoved` took away that a later `BlockStored` brought back."""
    removed: dict[str, set[int]] = {}
    out: dict[str, list[int]] = {}
    for _, b in batches:
        for e in b.events:
            if kind(e) == "BlockRemoved":
                removed.setdefault(e.medium, set()).update(e.block_hashes)
            elif kind(e) == "BlockStored":
                out.setdefault(e.medium, []).extend(h for h in e.block_hashes if h in removed.get(e.medium, ()))
    return {m: ids for m, ids in out.items() if ids}


@pytest.mark.parametrize("written", [True, False], ids=["written", "still-queued"])
def test_a_served_conversation_grows_without_churn(llama, tmp_path, consumer, written):
    """mlx_lm.server inserts a request's prompt and then the prompt with its answer: the adapter
    lets the shorter one go from RAM as the longer one (a trimmable cache) makes it redundant,
    and the writer drops its tail from disk. Its blocks are the longer one's first blocks: on
    neither medium is a block removed and stored again, and what the router ends up believing is
    what RAM and disk hold (the shorter one's tail written before the longer one is inserted, or
    still queued)."""
    path, model = llama
    short = list(range(60, 84))  # a chunk and an 8-token tail
    turns = [short, short + list(range(200, 216)), short + list(range(200, 230))]
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
        pc = kvstore.PersistentPromptCache(store, max_size=10)
        pc.register("m", mc := store.bind(model, str(path)))
        for tokens in turns:
            if not written:
                store.writer.pause()
            pc.insert_cache("m", tokens, prefill(model, tokens), cache_type="user")
            store.writer.resume()
            store.flush()
            assert len(pc) == 1  # the longer sequence holds RAM; the shorter one is let go
        batches = observed(consumer, store)
        assert churn(batches) == {}
        assert not [e for _, b in batches for e in b.events if kind(e) == "BlockRemoved"]
        assert believed(consumer.view(batches)) == held_blocks(store, mc, [turns[-1]])


def test_a_restart_clears_and_announces_the_whole_store(llama, tmp_path):
    path, model = llama
    prompts = [list(range(10 + i, 60 + i)) for i in range(0, 60, 12)]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:  # no events: a store from before
        mc = store.bind(model, str(path))
        for tokens in prompts:
            insert(mc, model, tokens)
    consumer = Consumer()
    try:
        with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
            mc = store.bind(model, str(path))
            batches = observed(consumer, store)
            assert kind(batches[0][1].events[0]) == "AllBlocksCleared"
            assert all(len(b.events) <= 512 for _, b in batches)
            assert believed(consumer.view(batches)) == {"DISK": held_blocks(store, mc, prompts)["DISK"],
                                                        "CPU_TIER1": set()}
            assert store.stats()["events"]["announced"]
    finally:
        consumer.close()


def test_a_router_that_binds_gets_the_start_batch_first_on_every_restart(llama, tmp_path, consumer):
    """The router binds and the node connects to it (llm-d's layout): on each of five starts,
    the first batch the live socket gets is number 0, `AllBlocksCleared` (a PUB socket drops
    what it sends before the subscription reaches it), then the store's announcement."""
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        insert(store.bind(model, str(path)), model, list(range(30, 70)))
    for _ in range(5):
        with consumer._lock:
            consumer.arrivals.clear()
        with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
            store.bind(model, str(path))
            settle(store)
            seq, batch = consumer.first_arrival()
            assert (seq, [kind(e) for e in batch.events]) == (0, ["AllBlocksCleared"])
            assert consumer.view(consumer.batches(settle(store)))["DISK"]


def test_a_router_that_connects_late_or_comes_back_gets_the_store_announced_again(llama, tmp_path, monkeypatch):
    """Dynamo's indexer and vLLM's router connect to the node's bound socket and never ask the
    replay socket: one that comes after the start batch went out (to nobody), comes back after a
    restart (before the node saw the old one go), or comes beside another gets AllBlocksCleared
    and the whole store; the router already there sees the same and its view stays whole."""
    monkeypatch.setattr(kvevents, "START_WAIT_S", 0.1)
    path, model = llama
    prompts = [list(range(30, 70)), list(range(100, 130))]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, str(path))
        for tokens in prompts:
            insert(mc, model, tokens)
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "block_size": B}
    ctx = zmq.Context()

    def router():
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(store.events.publisher.address)
        return sub

    def batches_until(sub, end):
        got = []
        while not got or got[-1][0] < end - 1:
            assert sub.poll(10_000), f"batches up to {end - 1} did not all come"
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), DECODERS["map"].decode(payload)))
        return got

    try:
        with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=config) as store:
            mc = store.bind(model, str(path))
            sent = settle(store)  # the start batch and the store, to nobody
            expected = held_blocks(store, mc, prompts)["DISK"]
            first = router()
            routers = [first]
            for times, came in enumerate(("late", "restarted", "beside"), start=1):
                if came == "restarted":  # a new socket before the old one is closed: the same topic
                    routers = [router()]
                    first.close(linger=0)
                    first = routers[0]
                elif came == "beside":
                    routers.append(router())
                deadline = time.monotonic() + 10
                while store.stats()["events"]["subscriber_announces"] < times:
                    assert time.monotonic() < deadline, f"the {came} router's subscription was not answered"
                    time.sleep(0.02)
                end = settle(store)
                for sub in routers:
                    got = batches_until(sub, end)
                    news = [(n, b) for n, b in got if n >= sent]
                    assert [n for n, _ in news] == list(range(sent, end)), came  # no gap
                    assert kind(news[0][1].events[0]) == "AllBlocksCleared", came
                    assert believed(Consumer.view(None, news))["DISK"] == expected, came
                sent = end
    finally:
        ctx.destroy(linger=0)  # (closes the sockets an assertion left open)


@pytest.mark.parametrize("memory_bytes", [0, None])
def test_removals_by_another_process_are_announced(llama, tmp_path, consumer, memory_bytes):
    """`kvstore gc` in a process of its own empties the store: its records leave the disk, and
    RAM too, where this process still holds copies it will not serve (its next fetch drops them)."""
    path, model = llama
    prompts = [list(range(30, 70)), list(range(130, 165))]
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B),
                      memory_bytes=memory_bytes) as store:
        mc = store.bind(model, str(path))
        for tokens in prompts:
            insert(mc, model, tokens)
        view = consumer.view(observed(consumer, store))
        assert view["DISK"] and bool(view.get("CPU_TIER1")) == bool(memory_bytes is None)
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "gc", "--store", str(tmp_path / "s"),
                               "--max-bytes", "0"], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 30  # the deletion log is read every half second, unasked
        while any(consumer.view(consumer.batches(store.events.publisher.sent)).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(consumer.view(consumer.batches(store.events.publisher.sent)).values())
        assert all(mc.fetch(tokens)[1] == tokens for tokens in prompts)  # (RAM served none of them)

def test_records_another_process_stores_are_announced(llama, tmp_path, consumer):
    """`kvstore warm` in a process of its own stores a prompt in the store a server publishes:
    the publisher reads the index's insertion log and announces its blocks on DISK within
    seconds, chained to the root (it never held them in its own RAM)."""
    path, model = llama
    tokens = [(7 * i) % 250 + 5 for i in range(300)]  # a 256-token chunk and a 44-token tail (no full block)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": tokens}) + "\n")
    with kvstore.open(tmp_path / "s", kv_events=consumer.config()) as store:
        mc = store.bind(model, str(path))
        settle(store)
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "warm", "--store", str(tmp_path / "s"),
                               "--model", str(path), "--prompts", str(prompts)], capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        spans = [s for s in prompt_records(mc.ns, tokens, 256) if s.kind != CHECKPOINT]
        want = {i for s in spans for i in block_ids(s.parent, tokens[s.start : s.end], 64)}
        assert len(want) == 4 and store.index.present([s.hash for s in spans])
        deadline = time.monotonic() + 30  # the log is read every half second, unasked
        while set(consumer.view(consumer.batches(store.events.publisher.sent)).get("DISK", {})) != want:
            assert time.monotonic() < deadline, "the records warm stored were never announced"
            time.sleep(0.1)
        disk = consumer.view(consumer.batches(store.events.publisher.sent))
        assert chained_tokens(disk["DISK"], block_ids(spans[0].parent, tokens[:256], 64)[-1]) == tokens[:256]
        assert "CPU_TIER1" not in disk or not disk["CPU_TIER1"]


@pytest.mark.parametrize("consumer", ["map", "legacy"], indirect=True)
def test_replay_returns_exactly_the_missed_batches_then_the_end_marker(llama, tmp_path, consumer):
    """In vLLM's layout of each encoding's time: the live frames `(topic, seq, payload)` after the
    delimiter (map), `(seq, payload)` (legacy); `Consumer.replay` refuses any other."""
    path, model = llama
    config = consumer.config(block_size=B, buffer_steps=3, topic="kv@node1@m",
                             encoding=consumer.encoding)
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=config, memory_bytes=0) as store:
        mc = store.bind(model, str(path))
        for i in range(6):  # one batch each
            insert(mc, model, list(range(100 + 20 * i, 120 + 20 * i)))
            settle(store)
        last = settle(store) - 1
        deadline = time.monotonic() + 10
        while not {last - 1, last} <= set(consumer.live) and time.monotonic() < deadline:
            time.sleep(0.02)  # the live socket gets them
        assert last >= 6
        got = consumer.replay(last - 1)
        assert [n for n, _ in got] == [last - 1, last]
        with consumer._lock:
            live = [consumer.live[n] for n in (last - 1, last)]
        assert [b for _, b in got] == live
        assert [n for n, _ in consumer.replay(0)] == [last - 2, last - 1, last]  # the last 3 kept
        assert consumer.replay(last + 1) == []
        assert consumer.topics == {b"kv@node1@m"}


def test_a_lost_change_makes_the_publisher_announce_again(llama, tmp_path, consumer):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0,
                      kv_events=consumer.config(block_size=B, max_queue_size=1)) as store:
        mc = store.bind(model, str(path))
        insert(mc, model, list(range(30, 70)))  # three records at once: more than may wait
        batches = observed(consumer, store)
        stats = store.stats()["events"]
        assert stats["dropped_changes"] > 0 and stats["resyncs"] == 1
        clears = [n for n, b in batches for e in b.events if kind(e) == "AllBlocksCleared"]
        assert len(clears) == 2
        assert set(consumer.view(batches)["DISK"]) == held_blocks(store, mc, [list(range(30, 70))])["DISK"]


def test_nothing_is_published_unless_asked(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "a", chunk_size=C) as store:
        assert store.events is None and store.stats()["events"] is None
    with kvstore.open(tmp_path / "b", chunk_size=C, kv_events={"endpoint": "tcp://127.0.0.1:1"}) as store:
        assert store.events is None  # enable_kv_cache_events is false, as vLLM's default


@pytest.mark.parametrize("config, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont' (did you mean 'endpoint'?)"),
    ('{"enable_kv_cache_events": true, "block_size": 5}', "block_size 5 does not divide the store's chunk size 16"),
    ('{"enable_kv_cache_events": true, "buffer_steps": true}', "buffer_steps must be a whole number, got true"),
    ('{"enable_kv_cache_events": true, "encoding": "arrays"}', "encoding must be one of map, legacy"),
    ('{"enable_kv_cache_events": true, "endpoint": "127.0.0.1:5557"}', "endpoint must be a ZMQ address"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://[::1]:99999"}', "endpoint 'tcp://[::1]:99999' has a bad port"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1"}', "endpoint 'tcp://127.0.0.1' has no port"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:x"}', "replay_endpoint 'tcp://*:x' has a bad port"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}',
     "replay_endpoint is endpoint ('tcp://*:5557'): the events and their replay need an address each"),
    ("[1]", "must be a JSON object"),
    ("{", "not JSON"),
])
def test_a_bad_config_is_refused_naming_what_is_wrong(tmp_path, config, message):
    with pytest.raises(InvalidInputError, match="kv_events") as e:
        kvstore.open(tmp_path / "s", chunk_size=C, kv_events=config)
    assert message in str(e.value)
    assert not (tmp_path / "s").exists()  # refused before anything was made


@pytest.mark.parametrize("args, message", [
    (["--kv-events-block-size", "16"], "--kv-events-block-size goes with --kv-events-config"),
    (["--kv-events-config", '{"enable_kv_cache_events": true}', "--kv-events-block-size", "48"],
     "--kv-events-block-size 48 does not divide the store's chunk size 256"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "block_size": 48}'],
     "--kv-events-config's block_size 48 does not divide the store's chunk size 256"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:notaport"}'],
     "endpoint 'tcp://*:notaport' has a bad port 'notaport'"),
])
def test_serve_refuses_kv_events_options_it_cannot_use_as_a_bad_command_line(tmp_path, capsys, args, message):
    from kvstore.serve.server import main

    assert main(["--store", str(tmp_path / "s"), *args]) == 2  # before a model loads
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_tenants_blocks_follow_the_shared_prompt_and_carry_its_tag_only(llama, tmp_path, consumer):
    """Two tenants send the same prompt after a shared system prompt: the router sees the shared
    blocks once, and each tenant's own blocks under their own ids (the same tokens, other ids),
    chained to the shared prompt's last block, the first of them tagged in `extra_keys` with the
    tenant's tag, never its id."""
    path, model = llama
    system, question = list(range(100, 132)), list(range(200, 221))  # 2 whole chunks, then 21 tokens
    with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=consumer.config(block_size=B)) as store:
        shared = store.bind(model, str(path))
        insert(shared, model, system)
        tenants = {name: store.bind(model, str(path), tenant=name) for name in ("alice-id", "bob-id")}
        for mc in tenants.values():
            insert(mc, model, system + question)
        batches = observed(consumer, store)
        disk = consumer.view(batches)["DISK"]
        stored = [e for _, b in batches for e in b.events if kind(e) == "BlockStored" and e.medium == "DISK"]
        last_shared = prompt_records(shared.ns, system, C)[-1]
        shared_last = block_ids(last_shared.parent, system[C:], B)[-1]
        firsts = []
        for name, mc in tenants.items():
            tag = mc.tenant.tag
            own = [s for s in prompt_records(mc.ns, system + question, C, tenant=mc.tenant, shared=2)
                   if s.tenant is not None and s.kind != CHECKPOINT]
            ids = [i for s in own for i in block_ids(s.parent, (system + question)[s.start : s.end], B, s.tenant)]
            full = len(system + question) // B * B
            assert set(ids[: (full - len(system)) // B]) <= set(disk)
            assert chained_tokens(disk, ids[(full - len(system)) // B - 1]) == (system + question)[:full]
            first = next(e for e in stored if e.block_hashes[0] == ids[0])
            assert first.parent_block_hash == shared_last
            assert first.extra_keys and list(first.extra_keys[0]) == [tag]
            assert all(name not in repr(e) for e in stored)
            firsts.append(set(ids))
        assert not firsts[0] & firsts[1]  # the same tokens, each tenant's own ids



def test_a_router_that_connects_late_keeps_seeing_what_ram_holds(llama, tmp_path, monkeypatch):
    """A router that subscribes to a node's bound socket after the node served prompts gets
    AllBlocksCleared and the store again: what the memory tier holds is announced on CPU_TIER1
    again too, since it is still there, and the router already subscribed keeps it as well."""
    monkeypatch.setattr(kvevents, "START_WAIT_S", 0.1)
    path, model = llama
    prompts = [list(range(30, 70)), list(range(100, 130))]
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "block_size": B}
    ctx = zmq.Context()
    try:
        with kvstore.open(tmp_path / "s", chunk_size=C, kv_events=config) as store:
            mc = store.bind(model, str(path))
            settle(store)  # the start batch, to nobody
            for tokens in prompts:
                insert(mc, model, tokens)
            routers: list = []
            for times in (1, 2):  # a router comes, then a second one beside it
                routers.append(sub := ctx.socket(zmq.SUB))
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(store.events.publisher.address)
                deadline = time.monotonic() + 10
                while store.stats()["events"]["subscriber_announces"] < times:
                    assert time.monotonic() < deadline, "the router's subscription was not answered"
                    time.sleep(0.02)
                end = settle(store)
                expected = held_blocks(store, mc, prompts)
                assert expected["CPU_TIER1"]
                for sub in routers:
                    assert believed(Consumer.view(None, received(sub, end))) == expected
    finally:
        ctx.destroy(linger=0)


def received(sub, end: int) -> list:
    """The batches `sub` gets up to number `end - 1`: the last of them, from AllBlocksCleared on."""
    got: list = []
    while not got or got[-1][0] < end - 1:
        assert sub.poll(10_000), f"batches up to {end - 1} did not all come"
        _, seq, payload = sub.recv_multipart()
        got.append((int.from_bytes(seq, "big"), DECODERS["map"].decode(payload)))
    assert any(kind(e) == "AllBlocksCleared" for _, b in got for e in b.events)
    return got


def test_a_router_host_that_does_not_resolve_is_said(tmp_path, caplog):
    """A connected endpoint (a router that binds, as llm-d's does) whose host name does not
    resolve: ZMQ would keep trying in silence while every event went nowhere."""
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://no-such-router.invalid:5557", "block_size": C}
    with caplog.at_level("WARNING", logger="kvstore"), kvstore.open(tmp_path / "s", chunk_size=C,
                                                                    kv_events=config) as store:
        assert store.events is not None
    said = [r.getMessage() for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(said) == 1 and "tcp://no-such-router.invalid:5557" in said[0], said


def test_a_replay_of_every_kept_batch_reaches_a_subscriber_that_reads_after_it_was_sent():
    """The replay socket queues the whole answer (its high-water mark fits every kept batch): with
    ZMQ's default of 1000 messages, 10,000 kept batches sent before the subscriber read any lost
    about 3,000 of them here, and the end marker still came."""
    from kvstore.events import config as events_config
    from kvstore.events import wire
    from kvstore.events.publisher import Publisher

    cfg = events_config.parse({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                               "replay_endpoint": "tcp://127.0.0.1:*", "buffer_steps": 10_000,
                               "topic": "kv@n@m"})
    publisher = Publisher(cfg)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for _ in range(10_000):
            publisher.send(wire.encode([wire.cleared()]))
        dealer.connect(publisher.replay_address)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert publisher.serve_replay(wait_ms=10_000) == 1  # every reply queued before any is read
        numbers = []
        while True:
            assert dealer.poll(10_000), f"the replay stopped after {len(numbers)} batches"
            empty, topic, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                break
            assert topic == b"kv@n@m"
            numbers.append(n)
        assert numbers == list(range(10_000))
    finally:
        dealer.close(linger=0)
        ctx.term()
        publisher.close()
