"""The index's bookkeeping, checked by `verify` and rewritten by its repair: the `totals` and
`tenant_totals` tables (counted again from the records), the `models` rows (every field of the type it must have), and
the rows every reader checks and reads past (`storage.writesql`, `storage.evictsql`): the write
log, the seen marks, the records' roles, the kept settings, the model files and digest memo, and
the `children` edges (written again from the records' parent, first token and tenant).

Nothing here deletes a record or a file. A damaged total is counted again. A damaged field of a
models row is taken again from the header of one of its blobs (fingerprint, model id, chunk
size), or set to now (when it was made), to 0 (its last use: its records' access times say it)
or to "{}" (a layout, which the next bind writes again). A row that names no namespace, or whose
fields no blob can give back, is deleted: its records are then orphans, which the next `verify`
reports. A damaged write-log value becomes 0 (nothing is counted as written that was not), and
an hour in the budget's window whose bytes were damaged stays closed (`closed_hour`: full until
it leaves the window, as the budget read it); a damaged role becomes the weakest, 0, as gc read it; a damaged kept setting is
forgotten, so its default applies, unless it is a limit (`max_write_rate`): that one is kept at
what it read as (0: no automatic writes) until a value is kept again; a damaged seen mark, model file or memoised digest is
deleted (the key is seen afresh, the next bind records its files, the file is hashed again), and
so is a damaged entry of the deletion or insertion log (its readers skip it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Collection, Iterable

from kvstore import keys, settings
from kvstore.storage import blobfile, blobtree
from kvstore.storage.evictsql import MAX_ROLE
from kvstore.storage.index import MODEL_FIELDS, TOTALS, Index
from kvstore.storage.pins import read_pins_file, write_pins_file
from kvstore.storage.storedir import PINS_NAME, SETTINGS_NAME, read_settings_copy
from kvstore.storage.writesql import MAX_HOUR_BYTES, MAX_LOG_SEQ, count_ok, kept_problem


def _hash(text: str) -> bytes:
    value = bytes.fromhex(text)
    if len(value) != keys.HASH_BYTES:
        raise ValueError(text)
    return value


#: Fields of a models row that only a blob's header can give back, and how the header says them.
_FROM_HEADER = {"fingerprint": _hash, "model_id": str, "chunk_size": int}
#: What each field of a models row must be.
_WANT = {"ns": "a 16-byte hash", "fingerprint": "a 16-byte hash", "model_id": "text", "layout": "text",
         "chunk_size": "a positive whole number", "created": "a time", "last_used": "a time"}


def table_problems(index: Index, skip: Collection[object] = (),
                   moved: Iterable[tuple[object, str | None, object]] = ()) -> list[tuple[str, str, str]]:
    """(kind, where, what is wrong) for the totals, the models rows, `row_problems` and
    `edge_problems` (but the edges of `skip`, the records verify mends or deletes). `moved`:
    (tenant, tenant its blob states, size) of each row verify retags: its tenant's totals are
    counted as repair leaves them (the records, not the totals, were wrong)."""
    out = []
    raw = index.stored_totals()
    counted = index.counted_totals()
    for ns in sorted(set(raw) | set(counted), key=repr):
        have = tuple(raw.get(ns, (0, 0, 0, 0)))
        want = counted.get(ns, (0, 0, 0, 0))
        if have != want:
            said = ", ".join(f"{name} {v!r:.40}" for name, v in zip(TOTALS, have))
            real = ", ".join(f"{name} {v}" for name, v in zip(TOTALS, want))
            out.append(("bad_totals", f"namespace {ns.hex() if isinstance(ns, bytes) else '?'}",
                        f"the totals table says {said}; the records hold {real}"))
    stored = {tag: v for tag, v in index.stored_tenant_totals().items() if v != (0, 0)}
    counted = index.counted_tenant_totals()
    for old, new, size in moved:
        size = size if type(size) is int else 0  # (as `counted_tenant_totals` counts it)
        for tag, sign in ((old, -1), (new, 1)):
            n, b = counted.get(tag, (0, 0))
            counted[tag] = (n + sign, b + sign * size)
    counted = {tag: v for tag, v in counted.items() if tag is not None and v != (0, 0)}
    for tag in sorted(set(stored) | set(counted), key=repr):
        if stored.get(tag) != counted.get(tag, (0, 0)):
            have = stored.get(tag, (0, 0))
            want = counted.get(tag, (0, 0))
            out.append(("bad_totals", f"tenant {str(tag)[:40]}", f"the tenant_totals table says records "
                        f"{have[0]!r:.40}, bytes {have[1]!r:.40}; its records are {want[0]}, {want[1]} bytes"))
    for row in index.model_rows():
        fields = dict(zip(MODEL_FIELDS, row))
        ns = fields["ns"].hex() if isinstance(fields["ns"], bytes) else "?"
        out += [("bad_model_row", f"namespace {ns}", f"its {name} is {fields[name]!r:.60}, not {_WANT[name]}")
                for name in _wrong(fields)]
    return out + row_problems(index) + copy_problems(index, skip) + edge_problems(index, skip)


def edge_problems(index: Index, skip: Collection[object] = ()) -> list[tuple[str, str, str]]:
    """(kind, where, what is wrong) of the `children` edges: an edge that is no record's (of the
    wrong type, or not what its record's parent, first token and tenant say), and a record with
    no edge. A lookup reads a record only through its edge: without it the record is never found."""
    out = []
    want = {h: (parent, first, tag) for h, parent, first, tag in index.edgeless() if h not in skip}
    told = set()
    for parent, first, h, tag, stored in index.damaged_edges():
        if h in skip:
            continue
        where = f"children edge ({_hex(parent)}, {first!r:.30}, {_hex(h)}, {tag!r:.30})"
        if h in want:
            p, f, t = want[h]
            told.add(h)
            out.append(("bad_edge", where, f"not the edge of record {h.hex()}, whose parent, first token and tenant "
                        f"are ({p.hex()}, {f}, {t!r}): no lookup finds the record; repair writes its edge"))
        else:
            what = "an edge of a record whose own edge is there" if stored else "an edge to no record"
            out.append(("bad_edge", where, f"{what}: readers ignore it; repair deletes it"))
    out += [("bad_edge", f"records {h.hex()}", f"no edge in children from its parent {p.hex()} (first token {f}, "
             f"tenant {t!r}): no lookup finds it; repair writes it") for h, (p, f, t) in want.items() if h not in told]
    return out


def row_problems(index: Index) -> list[tuple[str, str, str]]:
    """(kind, where, what is wrong) of the rows the store's readers check and read past."""
    out = []
    for hour, column, value in index.damaged_log():
        at = time.strftime("%Y-%m-%d %H:00 UTC", time.gmtime(hour * 3600)) if 0 <= hour < 1 << 32 else "?"
        out.append(("bad_write_log", f"write_log hour {hour} ({at})", _log_damage(column, value)))
    for h, role in index.damaged_roles():
        out.append(("bad_role", f"records {_hex(h)}", f"its role is {role!r:.40}, not 0 to {MAX_ROLE}: gc evicts it "
                    "as the weakest (0); repair sets it to 0"))
    copy = read_settings_copy(index.path.parent)
    for name, value, why in index.damaged_settings():
        s = settings.BY_NAME[name]
        if copy and name in copy and kept_problem(name, copy[name]) is None:  # (read from it meanwhile)
            reads = f"it is read from {SETTINGS_NAME} ({s.show(s.decode(copy[name]))}); repair keeps that"
        elif s.damaged is not None:  # a limit: closed until a value is kept
            reads = (f"it reads as {settings.damaged_reads(s)} unless given; repair keeps it so until "
                     f"{settings.keep_one(s, index.path.parent)}")
        else:
            reads = f"it reads as its default ({s.show(s.default)}) unless given; repair forgets it"
        out.append(("bad_setting", f"meta setting.{name}", f"the kept value {settings.shown_kept(value)} {why}: {reads}"))
    for h, seen, reused in index.damaged_seen():
        out.append(("bad_seen_row", f"seen_prefixes {_hex(h)}", f"seen {seen!r:.30}, reused {reused!r:.30}: "
                    "not a 16-byte key, a time and 0 or 1, so it is not seen; repair deletes it"))
    for ns, files in index.model_files(damaged=True).items():
        out += [("bad_model_file", f"model_files {_hex(ns)} {f[0]!r:.80}", "a stamp of the wrong type: the file is "
                 "not checked for staleness; repair deletes the row (the next bind records it again)") for f in files]
    for table, seq, h, ns in index.damaged_log_entries():
        what = "deletions" if table == "deletion_log" else "insertions"
        out.append(("bad_log_row", f"{table} entry {seq!r:.30} ({_hex(h)}, {_hex(ns)})", f"not numbered 1 to "
                    f"{MAX_LOG_SEQ} or not naming a 16-byte record and namespace: the readers of {what} (KV events, "
                    "the RAM tier's forgetting of deleted records) skip it (a number past any other also "
                    "disorders the entries logged after it); repair deletes it"))
    out += [("bad_digest", f"file_digests {path!r:.80}", "a digest that is not a 16-byte hash: it is not used; "
             "repair deletes it (the file is hashed again)") for path in index.damaged_digests()]
    return out


def copy_problems(index: Index, skip: Collection[object] = ()) -> list[tuple[str, str, str]]:
    """(kind, where, what is wrong) of the copies beside the index that a rebuild of it reads the
    kept settings and the pins back from: one that cannot be read, or that says other than the
    index (a write of it failed: a full disk, a crash), would lose them, or bring back old ones.
    The pins of `skip` (rows verify mends or deletes) and damaged kept settings are not compared."""
    out = []
    folder = index.path.parent
    damaged = {name for name, _, _ in index.damaged_settings()}
    good = {name: value for name, value in index.settings().items() if name not in damaged}
    copy = read_settings_copy(folder)
    if copy is None:
        out.append(("stale_copy", SETTINGS_NAME, "missing or not a kvstore settings file: a rebuild "
                    "of the index would lose the kept settings (and keep the write budget closed); repair "
                    "writes it from the index"))
    else:
        differ = sorted(n for n in set(good) | set(copy) if n not in damaged and copy.get(n) != good.get(n))
        if differ:
            out.append(("stale_copy", SETTINGS_NAME, f"says other than the index for "
                        f"{', '.join(differ)[:200]}: a rebuild of the index would read those back wrong; repair "
                        "writes it from the index"))
    pinned = {h for h in index.pinned() if h not in skip}
    pins = read_pins_file(folder / PINS_NAME)
    if pins is None and pinned or pins is not None and pins.problem is not None:
        out.append(("stale_copy", PINS_NAME, f"{'missing' if pins is None else pins.problem}: a "
                    "rebuild of the index would lose pins; repair writes it from the index"))
    elif pins is not None and {h for h in pins.hashes if h not in skip} != pinned:
        lost, back = len(pinned - pins.hashes), len({h for h in pins.hashes if h not in skip} - pinned)
        out.append(("stale_copy", PINS_NAME, f"lacks {lost} of the index's pinned records and lists "
                    f"{back} it does not pin: a rebuild of the index would read those pins back wrong; repair "
                    "writes it from the index"))
    return out


def _log_damage(column: str, value: object) -> str:
    """What a damaged write-log value does, and what repair writes, by the column it is in."""
    if column == "hour":
        return "an hour before 1970 or more than a day ahead: the budget ignores it; repair deletes the row"
    said = f"its {column} is {value!r:.40}, not a whole number of 0 to {MAX_HOUR_BYTES}: "
    if column == "explicit" and count_ok(value):  # (`damaged_log`: more than the bytes it is a part of)
        said = f"its explicit bytes ({value}) are more than the hour's bytes written, of which they are a part: "
    if column == "closed":
        return (f"the hour the budget counts as full is {value!r:.40}, not an hour: it reads as this hour; "
                "repair keeps this hour")
    if column in ("bytes", "downloaded"):
        return said + ("the budget counts this hour as the whole budget until it leaves the window; repair sets "
                       "it to 0 (nothing is counted as written) and keeps the budget closed for as long")
    return said + "stats leaves it out of its counts (the budget does not read it); repair sets it to 0"


def _hex(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else repr(value)[:40]


def _wrong(fields: dict) -> list[str]:
    """The fields of a models row that do not have the type they must have."""
    return [name for name in MODEL_FIELDS if not _good(name, fields[name])]


def _good(name: str, value: object) -> bool:
    if name in ("ns", "fingerprint"):
        return isinstance(value, bytes) and len(value) == keys.HASH_BYTES
    if name in ("model_id", "layout"):
        return isinstance(value, str)
    if name == "chunk_size":
        return type(value) is int and value > 0
    return type(value) in (int, float)


def repair_tables(index: Index, root: Path, records_of: dict[bytes, list[bytes]],
                  problems: Iterable[tuple[str, str, str]]) -> None:
    """Rewrite what `table_problems` found: the totals counted again, each damaged models row
    mended from the header of one of its blobs (`records_of`: ns -> hashes of good records)."""
    kinds = {kind for kind, _, _ in problems}
    if "bad_write_log" in kinds:
        index.mend_log()
    if "bad_role" in kinds:
        index.reset_damaged_roles()
    copy = read_settings_copy(index.path.parent) if "bad_setting" in kinds else None
    for name, _, _ in index.damaged_settings() if "bad_setting" in kinds else ():
        right = copy.get(name) if copy and kept_problem(name, copy.get(name)) is None else None
        # from the copy beside the index when it holds it right; else a limit stays closed, others are forgotten
        index.set_setting(name, right if right is not None else settings.BY_NAME[name].damaged)
    if "bad_seen_row" in kinds:
        index.forget_damaged_seen()
    if "bad_log_row" in kinds:
        index.forget_damaged_log_entries()
    if kinds & {"bad_model_file", "bad_digest"}:
        index.forget_damaged_files()
    if "bad_model_row" in kinds:
        for row in index.model_rows():
            fields = dict(zip(MODEL_FIELDS, row))
            wrong = _wrong(fields)
            if wrong:
                index.rewrite_model(fields["ns"], _mended(root, fields["ns"], wrong, records_of))
    if "bad_totals" in kinds:
        index.rewrite_totals()
        index.rewrite_tenant_totals()
    if "stale_copy" in kinds:  # (after the settings and pins are mended above)
        index.keep_settings_copy()
        if index.pins_file is not None:
            index.keep_pins_file()
        else:
            write_pins_file(index.path.parent / PINS_NAME, index.pinned())
    index.mend_edges()  # from the records as repair left them (a mended tenant moves its edge too)


def _mended(root: Path, ns: object, wrong: list[str], records_of: dict[bytes, list[bytes]]) -> dict:
    """The values that replace the `wrong` fields of the models row `ns`; {} to delete it."""
    if "ns" in wrong:
        return {}
    # A last use of 0: stats then shows its records' last access instead.
    defaults = {"created": time.time(), "last_used": 0.0, "layout": "{}"}
    out: dict[str, object] = {name: defaults[name] for name in wrong if name in defaults}
    needed = [name for name in wrong if name in _FROM_HEADER]
    if needed:
        meta = _header_of(root, records_of.get(ns, []))
        try:
            out.update({name: _FROM_HEADER[name](meta[name]) for name in needed})
        except (KeyError, TypeError, ValueError):
            return {}
    return out if all(_good(name, value) for name, value in out.items()) else {}


def _header_of(root: Path, hashes: list[bytes]) -> dict:
    """The header metadata of the first of these blobs that has one."""
    for h in hashes[:8]:
        meta = blobfile.peek_metadata(blobtree.blob_path(root, h))
        if meta is not None:
            return meta
    return {}

