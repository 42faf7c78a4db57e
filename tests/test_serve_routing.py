"""`kvstore serve` for routers, over real HTTP on 127.0.0.1 (tiny demo llama, subprocess servers
from test_server.py): KV events as a consumer written from vLLM's schema gets them, vLLM's render
endpoints against what the generation path really prefilled, the two gauges under load,
`--warm-top` and `POST /kvstore/prefetch` across a restart; and the most-hit ranking itself."""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import requests
from kvtest import prefill
from test_server import REQUEST_TIMEOUT, SYSTEM, Server, ask, chat_messages, scrape
from vllm_events import Consumer, chained_tokens

import kvstore
from kvstore.errors import InvalidInputError
from kvstore.serve.routing import most_hit
from kvstore.serve.server import _kv_events

B = 16  # tokens per announced block (the store's chunk is 256)


@pytest.fixture(scope="module")
def llama_dir(demo_model):
    return demo_model("llama")


def post(server: Server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT)


def disk_chains(consumer: Consumer, upto: int) -> list[list[int]]:
    """The token ids of every chain of blocks the consumer believes the node holds on disk."""
    blocks = consumer.view(consumer.batches(upto)).get("DISK", {})
    return [chained_tokens(blocks, h) for h in blocks]


def wait_for(predicate, timeout: float = 30.0, what: str = "it"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} never happened")


def test_render_is_what_generation_prefilled_and_events_carry_it(llama_dir, tmp_path):
    consumer = Consumer()
    config = '{"enable_kv_cache_events": true, "endpoint": "%s", "replay_endpoint": "%s"}' % (
        consumer.endpoint, consumer.replay_endpoint)
    try:
        with Server(llama_dir, tmp_path / "store", tmp_path / "log", "--kv-events-config", config,
                    "--kv-events-block-size", str(B)) as server:
            messages = chat_messages()
            chat_ids = post(server, "/v1/chat/completions/render", {"messages": messages}).json()["token_ids"]
            rendered = post(server, "/v1/completions/render", {"prompt": SYSTEM})
            assert rendered.status_code == 200 and isinstance(rendered.json(), list)
            text_ids = rendered.json()[0]["token_ids"]
            _, chat_usage = ask(server, messages=messages)
            _, text_usage = ask(server, prompt=SYSTEM)
            assert chat_usage["prompt_tokens"] == len(chat_ids)
            assert text_usage["prompt_tokens"] == len(text_ids)

            def stored():  # the generation path stored prompt + answer: render's ids lead them
                n = requests.get(server.url + "/kvstore/stats", timeout=10).json()["events"]["next_sequence"]
                chains = disk_chains(consumer, n)
                return all(any(c[: len(ids) // B * B] == ids[: len(ids) // B * B] and len(c) >= len(ids) // B * B
                               for c in chains) for ids in (chat_ids, text_ids))
            wait_for(stored, what="the prompts' blocks in the events")
            assert consumer.topics == {f"kv@127.0.0.1:{server.port}@{llama_dir}".encode()}
            shown = requests.get(server.url + "/kvstore/stats", timeout=10).text  # no --stats-paths: no path
            assert str(llama_dir) not in shown and str(tmp_path) not in shown, shown
            assert f"kv@127.0.0.1:{server.port}@{llama_dir.name}" in shown

            bad = post(server, "/v1/chat/completions/render", {"messages": messages, "model": "another/model"})
            assert bad.status_code == 404 and "not loaded here" in bad.json()["error"]
            assert post(server, "/v1/completions/render", {"prompt": ""}).status_code == 400
    finally:
        consumer.close()


def test_the_gauges_move(llama_dir, tmp_path):
    """One request at a time (--decode-concurrency 1): the others wait, and the gauge says so."""
    with Server(llama_dir, tmp_path / "store", tmp_path / "log", "--decode-concurrency", "1",
                "--prompt-concurrency", "1") as server:
        gauge = ("vllm:num_requests_waiting", (("model_name", str(llama_dir)),))
        usage = ("vllm:kv_cache_usage_perc", (("model_name", str(llama_dir)),))
        assert scrape(server)[gauge] == 0 and scrape(server)[usage] == 0
        seen, done = [], []

        def one(i: int) -> None:
            ask(server, prompt=f"{i} tell me about prompt caches, " * 4, max_tokens=120)
            done.append(i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while len(done) < 4 and any(t.is_alive() for t in threads):
            seen.append(scrape(server)[gauge])
        for t in threads:
            t.join(timeout=REQUEST_TIMEOUT)
        assert max(seen) >= 1, seen
        assert scrape(server)[gauge] == 0

        def settled():  # the writer puts what it wrote into RAM for a while after the answers
            before = requests.get(server.url + "/kvstore/stats", timeout=10).json()["memory"]
            value = scrape(server)[usage]
            after = requests.get(server.url + "/kvstore/stats", timeout=10).json()["memory"]
            return (value, after) if before == after and after["bytes"] > 0 else None
        value, memory = wait_for(settled, what="a settled memory tier")
        assert value == pytest.approx(memory["bytes"] / memory["capacity"])


def test_warm_top_counts_a_shared_system_prompt_once():
    """The first chunk of a system prompt, restored by other prompts too, is hit more often than
    the system prompt's own end: it is within that prompt, not a prompt of its own."""
    from types import SimpleNamespace

    from kvstore.serve.routing import most_hit

    ns = b"n" * 16

    def row(name: str, parent: bytes, depth: int, hits: int):
        return SimpleNamespace(hash=name.encode().ljust(16, b"."), parent=parent, depth=depth, hits=hits, kind=0,
                               bad=0, tenant=None)

    first = row("sys1", ns, 1, 5)  # 5 hits: the system prompt's 3, and 2 other prompts' template
    system = row("sys2", first.hash, 2, 3)
    code = row("code1", ns, 1, 2)  # another prompt, hit twice
    lone = row("lone1", ns, 1, 1)
    index = SimpleNamespace(rows=lambda _ns: [first, system, code, lone])
    chains = most_hit(index, ns, 2)
    assert [[r.hash for r in c] for c in chains] == [[first.hash, system.hash], [code.hash]]
    assert len(most_hit(index, ns, 5)) == 3


def test_a_request_waits_until_the_generation_thread_takes_it_up():
    """vLLM's num_requests_waiting: a request whose prompt is being processed is running, not
    waiting; each request ends its wait once, whichever sign comes first."""
    from kvstore.serve.mlxserver import Waiting

    waiting, first, second = Waiting(), object(), object()
    waiting.add(first)
    waiting.add(second)
    assert waiting.count == 2
    waiting.start(first)  # taken up by the generation loop: its prefill runs now
    assert waiting.count == 1
    progress, tokens = waiting.watch(first, None, iter([1, 2]))
    progress(1, 2)
    assert list(tokens) == [1, 2] and waiting.count == 1  # started once only
    _, tokens = waiting.watch(second, None, iter([3]))
    assert list(tokens) == [3] and waiting.count == 0


def test_warm_top_and_prefetch_across_a_restart(llama_dir, tmp_path):
    store, log = tmp_path / "store", tmp_path / "log"
    other = [{"role": "user", "content": "An unrelated question about caches, asked once."}]
    with Server(llama_dir, store, log) as server:
        for _ in range(3):  # the system prompt and its question: hit again and again
            ask(server, messages=chat_messages())
        ask(server, messages=other)
        assert server.stop() == 0  # SIGTERM: the writes and the hits reach the index
    with Server(llama_dir, store, log, "--warm-top", "1") as server:
        assert "warmed 1 prompt of the 1 most hit into RAM" in server.log()
        first = scrape(server)
        assert first[("kvstore_warmed_prompts", ())] == 1
        assert requests.get(server.url + "/kvstore/stats", timeout=10).json()["memory"]["records"] > 0
        _, usage = ask(server, messages=chat_messages())  # served from RAM: the disk is not read
        after = scrape(server)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        tier = lambda s, t: s[("kvstore_reused_tokens_total", (("tier", t),))]  # noqa: E731
        assert tier(after, "memory") > tier(first, "memory") and tier(after, "disk") == tier(first, "disk")

        loaded = after[("kvstore_prefetch_tokens_total", ())]  # by --warm-top
        assert after[("kvstore_prefetches_total", ())] == 0  # (no POST /kvstore/prefetch yet)
        got = post(server, "/kvstore/prefetch", {"messages": other}).json()
        assert got["in_ram"] == got["tokens"] and got["loaded"] > 0, got
        assert scrape(server)[("kvstore_prefetch_tokens_total", ())] == loaded + got["loaded"]
        assert scrape(server)[("kvstore_prefetches_total", ())] == 1
        assert post(server, "/kvstore/prefetch", {"tokens": [1, -2]}).status_code == 400
        beyond = post(server, "/kvstore/prefetch", {"tokens": [1, 2, 99_999_999]})
        assert beyond.status_code == 400 and "tokens[2]: 99999999 is outside the model's vocabulary" in beyond.text
        typo = post(server, "/kvstore/prefetch", {"promt": "hello"})
        assert typo.status_code == 400 and "promt (did you mean prompt?)" in typo.text, typo.text
        both = post(server, "/kvstore/prefetch", {"prompt": "x", "tokens": [1]})  # which one was meant?
        assert both.status_code == 400 and "not prompt and tokens" in both.text, both.text
    with Server(llama_dir, store, log, "--memory-bytes", "64KB") as server:  # too small for the prompt
        got = post(server, "/kvstore/prefetch", {"messages": chat_messages()}).json()
        assert "larger than the memory tier" in got["refused"] and got["in_ram"] == 0


def test_most_hit_ranks_where_prompts_end_or_part(llama, tmp_path):
    """A shared system prompt hit by every turn ranks first, then the conversations by their hits
    (each of which holds the system prompt: it takes its place, so no prompt is loaded twice); a
    prompt never asked for again not at all."""
    path, model = llama
    system = list(range(100, 164))  # four 16-token chunks
    a, b, once = system + list(range(170, 200)), system + list(range(210, 235)), list(range(1, 51))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        mc = store.bind(model, str(path))
        for tokens in (a, b, once):
            mc.insert(tokens, prefill(model, tokens))
        store.flush()
        for tokens in (a, a, b):
            mc.fetch(tokens + [1])
        store.flush()
        top = most_hit(store.index, mc.ns, 1)
        chains = most_hit(store.index, mc.ns, 5)
    # The system prompt's last chunk (3 hits: its children have 2 and 1), then a's tail (2), whose
    # chain holds the system prompt and takes its place, then b's (1); `once` was never asked for
    # again (0 hits): not a prompt anyone uses.
    assert [(len(c), c[-1].hits) for c in top] == [(4, 3)]
    assert [(len(c), c[-1].hits) for c in chains] == [(6, 2), (6, 1)]
    assert [r.hits for r in chains[0][:4]] == [3, 3, 3, 3] and chains[0][:4] == top[0] == chains[1][:4]
    assert chains[0][-2].first_token == 170 and chains[1][-2].first_token == 210  # after the system prompt


def test_events_beyond_this_machine_are_warned_about(capsys):
    peek = argparse.Namespace(host=None, port="8123")
    served = {"kv_events_config": {"enable_kv_cache_events": True}, "kv_events_block_size": 64}
    config = _kv_events(served, peek, "m")
    assert config["topic"] == "kv@127.0.0.1:8123@m" and config["endpoint"] == "tcp://*:5557"
    assert "carry the token ids of every prompt" in capsys.readouterr().err
    served["kv_events_config"] = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:9", "topic": "t"}
    assert _kv_events(served, peek, "m")["topic"] == "t"
    assert capsys.readouterr().err == ""
    served["kv_events_config"] = {"enable_kv_cache_events": True, "endpont": "x"}
    with pytest.raises(InvalidInputError, match="--kv-events-config: unknown key 'endpont'"):
        _kv_events(served, peek, "m")


def test_a_config_that_publishes_nothing_is_warned_about(capsys):
    """vLLM's default is off: a config with an endpoint but no "enable_kv_cache_events": true would
    leave a router waiting for events that never come, with nothing said."""
    peek = argparse.Namespace(host=None, port="8123")
    served = {"kv_events_config": {"endpoint": "tcp://127.0.0.1:9"}, "kv_events_block_size": 64}
    assert _kv_events(served, peek, "m")["enable_kv_cache_events"] is False
    assert capsys.readouterr().err == ('kvstore serve: warning: --kv-events-config publishes nothing: it does not '
                                       'say "enable_kv_cache_events": true\n')
    served["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null", "endpoint": "tcp://127.0.0.1:9"}
    _kv_events(served, peek, "m")
    assert 'publishes nothing: "publisher" is "null"' in capsys.readouterr().err


def test_a_block_size_given_twice_and_different_is_refused_naming_both():
    peek = argparse.Namespace(host=None, port="8123")
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:9", "block_size": 32}
    served = {"kv_events_config": config, "kv_events_block_size": 16, "given": {"kv_events_block_size"}}
    with pytest.raises(InvalidInputError) as e:
        _kv_events(served, peek, "m")
    assert str(e.value) == ('--kv-events-block-size 16 and --kv-events-config\'s "block_size": 32 differ: '
                            "give the block size once")
    served["kv_events_block_size"] = 32  # the same twice, or the JSON's with the flag left at its default
    assert _kv_events(served, peek, "m")["block_size"] == 32
    served.update(kv_events_block_size=64, given=set())
    assert _kv_events(served, peek, "m")["block_size"] == 32


def test_prefetch_acts_within_the_callers_tenant(llama, tmp_path):
    """A prefetch for a tenant brings into RAM the shared prompt and that tenant's own records,
    never another tenant's: bob's prefetch of alice's exact prompt loads the shared part only."""
    from kvstore.serve.binding import Binding
    from kvstore.serve.promptcache import PersistentPromptCache

    path, model = llama
    system, question = list(range(100, 164)), list(range(200, 240))  # 4 chunks of 16, then 40 tokens
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        store.bind(model, str(path)).insert(system, prefill(model, system))
        alice = store.bind(model, str(path), tenant="alice")
        alice.insert(system + question, prefill(model, system + question))
    for who, expect in (("bob", len(system)), ("alice", len(system + question))):
        with kvstore.open(tmp_path / "s", chunk_size=16) as store:  # a fresh memory tier
            cache = PersistentPromptCache(store, tenants=True)
            got = cache.prefetch(None, system + question, binding=Binding(store.bind(model, str(path))),
                                 tenant_id=who)
            assert got["stored"] == expect and got["in_ram"] == expect, (who, got)
            hashes = store.bind(model, str(path), tenant="alice").record_hashes(system + question)
            in_ram = [h in store.memory for h in hashes]  # 4 shared chunks, then alice's 2 chunks and tail
            assert in_ram == [True] * 4 + [who == "alice"] * 3, (who, in_ram)


def test_the_context_checked_is_the_models_own_with_its_rope_scaling(tmp_path):
    """A request is refused as too long only against what the model's own config.json states,
    times its RoPE scaling factor (YaRN x4 serves 4 times the base context); a config that names
    no context length, or a repo not on this machine, is no limit."""
    import json
    import types

    from kvstore.serve import routing

    def generator(config: dict | None):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        if config is not None:
            (folder / "config.json").write_text(json.dumps(config))
        provider = types.SimpleNamespace(model=types.SimpleNamespace(), model_key=(str(folder), None, None))
        return types.SimpleNamespace(model_provider=provider)

    assert routing._context(generator({"max_position_embeddings": 512})) == 512
    assert routing._context(generator({"max_position_embeddings": 512,
                                       "rope_scaling": {"type": "yarn", "factor": 4.0}})) == 2048
    assert routing._context(generator({"text_config": {"max_position_embeddings": 1024}})) == 1024
    assert routing._context(generator({"hidden_size": 8})) is None
    assert routing._context(generator(None)) is None
    small = generator({"max_position_embeddings": 4})  # 4 tokens: 128 characters at most
    with pytest.raises(routing.RequestError, match="more than any tokenizer fits"):
        routing.check_fits(small, "/v1/completions", {"prompt": "x" * 1000}, "served")
    # Another model named: mlx_lm.server loads it and checks it; this one's context is not its.
    assert routing.check_fits(small, "/v1/completions", {"prompt": "x" * 1000, "model": "another"}, "served") is None
