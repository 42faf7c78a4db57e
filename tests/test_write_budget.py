"""The write budget: `kvstore.open(max_write_rate="20GB/day")`, never exceeded in any rolling day."""

from __future__ import annotations

import json
import time

import pytest
from kvtest import prefill

import kvstore
from kvstore.cli.main import main
from kvstore.errors import InvalidInputError
from kvstore.settings import BY_NAME
from kvstore.storage.writesql import HOUR_S
from kvstore.write.budget import DAY_S

C = 16
START = 1_800_000_000.0  # a fixed unix time, so the test's day never spans a real one


class Clock:
    def __init__(self, t: float = START):
        self.t = t

    def __call__(self) -> float:
        return self.t


def parse_rate(value):
    return BY_NAME["max_write_rate"].parse(value)  # the one parser of rates


def test_rates_in_every_accepted_form():
    assert parse_rate("20GB/day") == 20 * 10**9
    assert parse_rate("500MB/h") == 500 * 10**6 * 24
    assert parse_rate("1GiB/week") == (1 << 30) // 7
    assert parse_rate("2GB") == 2 * 10**9  # a size alone is per day
    assert parse_rate("2GB/days") == parse_rate("2GB/d") and parse_rate("24MB/hours") == parse_rate("24MB/hour")
    assert parse_rate(12345) == 12345 and parse_rate("12345B") == 12345  # bytes a day: a number, or its unit
    assert parse_rate("off") is None and parse_rate("none") is None and parse_rate(None) is None
    for bad, reason in (("20GB/fortnight", "period"), ("fast", "not a rate"), (-1, "give 1 or more"),
                        ("20XB/day", "unit"), (True, "rate"), (0, "use off"), ("unlimited", "not a rate"),
                        ("12", r"'12' has no unit: a rate is a size per period, like 12GB/day or 12MB/h \(12B/day")):
        with pytest.raises(InvalidInputError, match=f"max_write_rate.*{reason}"):
            parse_rate(bad)


def prompt(i: int) -> list[int]:
    return [1 + (i * 7 + j) % 250 for j in range(64)]  # 4 chunks, different from the first token on


def test_the_budget_is_never_exceeded_over_a_simulated_day(tmp_path, llama):
    path, model = llama
    clock = Clock()
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:  # one prompt's size, to set the budget
        mc = store.bind(model, path)
        mc.insert(prompt(0), prefill(model, prompt(0)))
        store.flush()
        one = store.stats()["bytes"]
    limit = int(3.5 * one)
    hourly: list[int] = []
    with kvstore.open(tmp_path / "b", chunk_size=C, max_write_rate=limit) as store:
        store.gate.use_clock(clock)
        mc = store.bind(model, path)
        for i in range(1, 49):  # two days, one new prompt every hour
            mc.insert(prompt(i), prefill(model, prompt(i)))
            store.flush()
            hourly.append(store.stats()["writes"]["bytes_last_day"])
            clock.t += HOUR_S
        writes = store.stats()["writes"]
        log = store.index.write_hours(0)
        # What was kept out is in RAM still: the last prompt is restored from there.
        _, rest = mc.fetch(prompt(48))
        assert len(rest) == 1
    by_hour = {h: n for h, n, *_ in log}
    first = int(START // HOUR_S)
    for start in range(first - 24, first + 49):  # every 24-hour window of the two days
        assert sum(by_hour.get(h, 0) for h in range(start, start + 24)) <= limit
    assert max(hourly) <= limit
    assert writes["over_budget"] > 0 and writes["over_budget_bytes"] > 0
    assert writes["bytes_lifetime"] > limit  # the second day wrote again, as the first rolled off
    assert writes["budget_left"] == limit - writes["bytes_last_day"]


def test_two_stores_on_one_directory_share_the_budget(tmp_path, llama):
    """Two opens of one store (as two processes) take from one budget, kept in its index."""
    path, model = llama
    limit = 100_000
    with kvstore.open(tmp_path / "s", chunk_size=C, max_write_rate=limit) as a, \
            kvstore.open(tmp_path / "s", chunk_size=C) as b:
        assert b.gate.per_day == limit
        for i, store in enumerate([a, b] * 4):
            store.bind(model, path).insert(prompt(i), prefill(model, prompt(i)))
            store.flush()
        assert 0 < a.stats()["bytes"] <= limit
        assert a.stats()["writes"]["bytes_last_day"] == a.stats()["bytes"]
        assert a.stats()["writes"]["over_budget"] + b.stats()["writes"]["over_budget"] > 0


def test_stats_shows_a_week_of_writes(tmp_path, llama, capsys):
    path, model = llama
    clock = Clock(time.time() - 2 * DAY_S)  # the third day is today, as `kvstore stats` sees it
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        store.gate.use_clock(clock)
        mc = store.bind(model, path)
        for day in range(3):
            mc.prefill(prompt(day))  # warmed: written
            mc.insert(prompt(10 + day), prefill(model, prompt(10 + day)))  # seen once: kept out
            store.flush()
            clock.t += DAY_S
        clock.t -= DAY_S
        writes = store.stats()["writes"]
    days = writes["days"]
    assert len(days) == 7 and [d["records"] > 0 for d in days] == [False] * 4 + [True] * 3
    assert [d["not_admitted"] for d in days[-3:]] == [4, 4, 4]
    assert main(["stats", "--store", str(tmp_path / "s"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["writes"]["not_admitted"] == 12 and shown["writes"]["bytes_lifetime"] == writes["bytes_lifetime"]
    assert shown["scope"]["writes"].startswith("store")
    assert main(["stats", "--store", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "not admitted: 12" in text and days[-1]["day"] in text


def test_warm_takes_admit_and_max_write_rate_and_the_store_keeps_them(tmp_path, demo_model_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": prompt(1)}) + "\n")
    store = str(tmp_path / "s")
    assert main(["warm", "--store", store, "--model", str(demo_model_path), "--prompts", str(prompts),
                 "--admit", "pinned", "--max-write-rate", "1GB/day"]) == 0
    capsys.readouterr()
    assert main(["stats", "--store", store, "--json"]) == 0
    writes = json.loads(capsys.readouterr().out)["writes"]
    assert (writes["admit"], writes["max_write_rate"]) == ("pinned", 10**9)
    assert writes["bytes_lifetime"] > 0 and writes["not_admitted"] == 0  # warmed: always admitted
    with pytest.raises(SystemExit) as e:
        main(["warm", "--store", store, "--prompts", str(prompts), "--max-write-rate", "lots/day"])
    assert e.value.code == 2 and "lots" in capsys.readouterr().err


def test_remote_downloads_count_in_the_lifetime_bytes(tmp_path, s3, llama):
    """What the remote tier writes through to disk is in `bytes_lifetime`, as an SSD counts it."""
    path, model = llama
    url = s3.url()
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(prompt(3), prefill(model, prompt(3)))
        assert a.flush(timeout=60)
        written = a.stats()["writes"]["bytes_lifetime"]
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        _, rest = b.bind(model, path).fetch(prompt(3))
        assert len(rest) == 1
        assert b.flush(30)  # (downloads are stored locally in the background)
        writes = b.stats()["writes"]
        assert writes["records_lifetime"] == 0  # the writer wrote nothing
        # (objects go up without the uploader's model path, so B's blobs are a few bytes smaller)
        assert 0.9 * written < writes["downloaded_lifetime"] == writes["bytes_lifetime"] == b.stats()["bytes"] <= written
        assert writes["days"][-1]["downloaded"] == writes["downloaded_lifetime"]


def test_the_window_reaches_back_over_24_hours_not_to_the_last_whole_hour(tmp_path, llama):
    """Counted by the hour, what was written early in one hour must still count at the start of
    the hour 24 hours later (less than 24 hours after it): the window is 25 hourly buckets."""
    path, model = llama
    hour = int(START // HOUR_S)
    clock = Clock(hour * HOUR_S + 10)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        mc.insert(prompt(0), prefill(model, prompt(0)))
        store.flush()
        one = store.stats()["bytes"]
    with kvstore.open(tmp_path / "b", chunk_size=C, max_write_rate=one) as store:
        store.gate.use_clock(clock)
        mc = store.bind(model, path)
        written = []
        for i, at in enumerate((10, 24 * HOUR_S + 5, 25 * HOUR_S + 5)):  # 23:59:55 and 24:59:55 later
            clock.t = hour * HOUR_S + at
            mc.insert(prompt(i), prefill(model, prompt(i)))
            store.flush()
            written.append(store.stats()["bytes"])
    assert written == [one, one, 2 * one], written  # refused within 24 hours, written after


_TAKE = """
import json, os, sys, time
from pathlib import Path
from kvstore.storage.index import Index
from kvstore.write.budget import WriteBudget

store, limit, n, now = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
budget = WriteBudget(Index(store / "index.sqlite"), limit, clock=lambda: now)
(store / f"ready.{os.getpid()}").touch()
while not (store / "go").exists():  # the barrier: both start at once
    time.sleep(0.001)
print(json.dumps(sum(budget.take([n]) for _ in range(40))))
"""


def test_two_processes_never_both_take_the_last_of_the_budget(tmp_path):
    """Two processes take from one budget at once: what both took never exceeds it (the check
    and the take are one transaction)."""
    import subprocess
    import sys

    store = tmp_path / "s"
    kvstore.open(store).close()
    n, limit = 1000, 30_500  # room for 30 writes, and 80 asked for
    procs = [subprocess.Popen([sys.executable, "-c", _TAKE, str(store), str(limit), str(n), str(START)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 60
    while len(list(store.glob("ready.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (store / "go").touch()
    taken = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    with kvstore.open(store) as s:
        logged = sum(h[1] for h in s.index.write_hours(0))
    assert sum(taken) == 30 and logged == 30 * n, (taken, logged)


def test_stats_does_not_call_records_written_since_kept_in_ram_only(tmp_path, llama, capsys):
    """The not-admitted counts are of records kept out when inserted: one asked for again is on
    disk now, and `stats` must not say it is in RAM only."""
    path, model = llama
    p = prompt(3)
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        mc = store.bind(model, path)
        mc.insert(p, prefill(model, p))  # seen once: kept out
        store.flush()
        assert store.stats()["chunks"] == 0
        for _ in range(2):
            mc.fetch(p)  # seen again: written from RAM
        store.flush()
        on_disk = store.stats()["chunks"]
    assert on_disk > 0
    assert main(["stats", "--store", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "kept in RAM only" not in text
    line = next(s for s in text.splitlines() if "not admitted: " in s)
    assert line.startswith("kept out of the disk when inserted, in all: not admitted: ")
    assert "written since if asked for again" in line
