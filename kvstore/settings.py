"""Every setting of a store, as data: one row each, which `kvstore.open`, the `kvstore` commands,
`kvstore serve`, `stats` and `kvstore settings` are all built from.

A row says the setting's name (the keyword of `kvstore.open`), its kind (which fixes the one
parser its values go through), its default, whether the store keeps it (and what a change does
to the records stored), its command-line option, and its help, which always says what 0 means.
`off` is the one word for "no limit" (`none` is an alias). A 0 that would mean "never" is
refused with what to use instead.

`resolve` tells, for one open, each setting's value and where it came from: `given` (passed to
this open), `kept` (remembered by the store) or `default`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kvstore.errors import InvalidInputError
from kvstore.sizes import format_age, format_setting, parse_duration, parse_rate, parse_size

OFF_WORDS = ("off", "none")
AUTO = "auto"
#: The chunk size of every open that does not give one (the command line's): a setting counted
#: in chunks (`exact_prefill`) is checked against it where no open's own is known.
CHUNK_SIZE = 256
GIVEN, KEPT, DEFAULT = "given", "kept", "default"
WIDTH_CHANGED = ("records stored at another width stay, and are not restored at this one (`kvstore stats` lists "
                 "the bytes of each width; gc evicts them, least recently used first)")


@dataclass(frozen=True)
class Setting:
    """One setting: see the module docstring. `kind` is one of `size`, `rate`, `duration`,
    `choice`, `bits`, `count`, `flag`, `list`, `json` (a JSON object, given as text or a dict),
    `text` (checked by `check`, which raises ValueError saying what is wrong)."""

    name: str
    kind: str
    default: Any
    help: str
    kept: bool = False
    option: str | None = ""  # "" : "--" + name with dashes; None: library only
    choices: tuple = ()
    off: bool = False  # takes `off` (no limit): the value None
    auto: bool = False  # takes `auto`
    zero: str | None = ""  # what 0 means, in short ("": not a number kind); None: 0 is refused
    refuse_zero: str = ""  # why 0 is refused and what to use instead
    default_text: str = ""  # how a default of None reads ("a quarter of RAM"; else "off")
    serve_default: Any = None  # `kvstore serve`'s own default, where it differs
    serve_note: str = ""
    damaged: str | None = None  # what a kept value that does not parse reads as (None: the default)
    check: Callable[[str], Any] | None = None  # a `text` setting's validator
    chunks: bool = False  # a whole number of chunks of the open's chunk size (`check_chunks`)
    budget: bool = False  # a disk budget: a size given as text needs its unit but 0 (`sizes.parse_size`)
    changed: str = ""  # what a change of the kept value does to the records already stored

    @property
    def flag(self) -> str | None:
        if self.option is None:
            return None
        return self.option or "--" + self.name.replace("_", "-")

    def parse(self, value: Any, where: str | None = None) -> Any:
        """`value` (text from a command line or a file, or a Python value) as the store uses it;
        `InvalidInputError` naming `where` (else the setting) and what to give instead."""
        return _parse(self, value, where or self.name)

    def show(self, value: Any) -> str:
        """`value` in a user's words: `20.0 GiB/day`, `off`, `8 bits`."""
        if value is None:
            return self.default_text or "off"
        if self.kind == "size":
            return AUTO if value == AUTO else format_setting(value)
        if self.kind == "rate":
            return f"{format_setting(value)}/day"
        if self.kind == "duration":
            return f"{value:g} s" if value < 60 else format_age(value)
        if self.kind == "bits":
            return f"{value} bits"
        if self.kind == "list":
            return ",".join(value) or "none"
        if self.kind == "json":
            return json.dumps(value, separators=(",", ":"))
        return str(value)

    def encode(self, value: Any) -> str:
        """How a kept value is written in the store's index (`decode` reads it back)."""
        return "off" if value is None else str(value)

    def decode(self, text: str, chunk_size: int = CHUNK_SIZE) -> Any:
        """A kept value, checked like a given one (and against `chunk_size`, for a setting
        counted in chunks), except that a 0 kept before 0 was refused is kept as it is. Raises
        `InvalidInputError` for a damaged one, its message what is wrong, as a clause: `is not
        one of all, reused, pinned`."""
        if not isinstance(text, str) or text.startswith("\0"):  # (`Index.settings`: not text in the index)
            raise InvalidInputError("is not text")
        if self.kind in ("rate", "size") and text.strip().isdigit():  # (kept as bytes; 0: kept before it was refused)
            return int(text)
        try:
            value = self.parse(text)
        except InvalidInputError:
            raise InvalidInputError(f"is not {self.allowed(chunk_size)}") from None
        if self.chunks and value is not None and value % chunk_size:
            raise InvalidInputError(f"is {value} tokens, not a multiple of the chunk size ({chunk_size})")
        return value

    def allowed(self, chunk_size: int = CHUNK_SIZE) -> str:
        """What a value of this setting may be, in words: `one of all, reused, pinned`."""
        more = " of 1 or more" if self.zero is None else ""
        text = {
            "size": f"a size{more} such as 500MB or 2GiB", "rate": "a rate above 0 such as 20GB/day or 500MB/h",
            "duration": "a duration such as 10s or 2m", "count": f"a whole number{more or ' of 0 or more'}",
            "choice": f"one of {', '.join(map(str, self.choices))}", "flag": "true or false",
            "bits": f"{' or '.join(map(str, self.choices))} (bits), or 0 for off", "list": "a comma-separated list",
            "json": "a JSON object", "text": "text"}[self.kind]
        if self.chunks:
            text = f"a multiple of the chunk size ({chunk_size}), such as {chunk_size} or {8 * chunk_size}"
        extra = [word for word, yes in ((AUTO, self.auto), ("off", self.off)) if yes]
        return text + (f", or {' or '.join(extra)}" if extra else "")

    def help_text(self, serve: bool = False) -> str:
        default = self.serve_default if serve and self.serve_default is not None else self.default
        text = f"{self.help} (default: {self.show(default) if default is not None else self.default_text or 'off'}"
        if serve and self.serve_note:
            text += f"; {self.serve_note}"
        if self.kept:
            text += "; kept in the store: later runs without it use it"
        return text.replace("%", "%%") + ")"


def _parse(s: Setting, value: Any, where: str) -> Any:
    if isinstance(value, str):
        word = value.strip().lower()
        if s.off and word in OFF_WORDS:
            return None
        if s.auto and word == AUTO:
            return AUTO
        if word in OFF_WORDS and s.zero and not s.off and s.kind != "bits":  # (memory_bytes: 0 is its "off")
            raise InvalidInputError(f"{where}: {value!r} is not taken: use 0 ({s.zero})")
    elif value is None and (s.off or s.kind in ("bits", "choice")):
        return None
    try:
        parsed = _KINDS[s.kind](s, value)
    except (ValueError, TypeError) as e:
        raise InvalidInputError(f"{where}: {e}") from None
    if parsed == 0 and s.kind in ("size", "rate", "duration", "count") and s.zero is None:
        raise InvalidInputError(f"{where}: {s.refuse_zero}")
    return parsed


def _number(value: Any, text_parser: Callable[[str], Any], what: str, example: str, least: int = 0) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"must be {what}, like {example}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number: give {what}, like {example}")
    if value.strip().startswith("-") if isinstance(value, str) else value < 0:
        raise ValueError(f"{value!r} is negative: give {least} or more, like {example}")
    return text_parser(value) if isinstance(value, str) else value


def _size(s: Setting, value: Any) -> int:
    n = _number(value, lambda text: parse_size(text, budget=s.budget), "a size",
                "500MB or 2GiB" + (" (or off)" if s.off else ""), int(s.zero is None))
    if isinstance(n, float):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return n


def _rate(s: Setting, value: Any) -> int:
    return int(_number(value, parse_rate, "a rate", "20GB/day or 500MB/h (or off)", int(s.zero is None)))


def _duration(s: Setting, value: Any) -> float:
    return float(_number(value, parse_duration, "a duration", "10s or 2m", int(s.zero is None)))


def gc_bounds(max_bytes: Any, max_age: Any) -> tuple[int | None, float | None]:
    """A gc's bounds: a size (text with its unit, or an int of bytes) and a duration (`7d`, or
    seconds), 0 or more, or None; `InvalidInputError` naming the one that is not."""
    out, bound = [], Setting("gc", "size", None, "", budget=True)  # (a disk budget that takes 0, and no off)
    for name, value, kind in (("max_bytes", max_bytes, _size), ("max_age", max_age, _duration)):
        try:
            out.append(None if value is None else kind(bound, value))
        except (ValueError, TypeError) as e:
            raise InvalidInputError(f"{name}: {e}") from None
    return out[0], out[1]


def _count(s: Setting, value: Any) -> int:
    want = "a multiple of the chunk size, like 256, or off" if s.chunks else f"{int(s.zero is None)} or more"
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            of = f" of tokens: give {want}" if s.chunks else ""
            raise ValueError(f"{value!r} is not a whole number{of}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be a whole number, got {value!r}")
    if value < 0:
        raise ValueError(f"{value} is negative: give {want}")
    return value


def _choice(s: Setting, value: Any) -> str:
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in s.choices:
        raise ValueError(f"must be one of {', '.join(s.choices)}, got {value!r}")
    return text


def _bits(s: Setting, value: Any) -> int | None:
    if isinstance(value, str):
        word = value.strip().lower()
        value = 0 if word in OFF_WORDS else int(word) if word.isdigit() else value
    if value == 0 and not isinstance(value, bool):
        return None
    if isinstance(value, bool) or value not in s.choices:
        raise ValueError(f"must be one of {', '.join(map(str, s.choices))}, or 0 (off), got {value!r}")
    return int(value)


def _flag(s: Setting, value: Any) -> bool:
    word = value if isinstance(value, bool) else str(value).strip().lower()
    if word in (True, False, "1", "true", "yes", "on", "0", "false", "no", "off"):
        return word in (True, "1", "true", "yes", "on")
    raise ValueError(f"must be true or false, got {value!r}")


def _text(s: Setting, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be text, got {value!r}")
    value = value.strip()
    if s.check is not None:
        s.check(value)
    return value


def _list(s: Setting, value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [part.strip() for part in str(value).split(",") if part.strip()]


def _json(s: Setting, value: Any) -> dict:
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"not JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a JSON object, got {type(value).__name__}")
    return dict(value)


_KINDS: dict[str, Callable[[Setting, Any], Any]] = {
    "size": _size, "rate": _rate, "duration": _duration, "count": _count, "choice": _choice,
    "bits": _bits, "flag": _flag, "list": _list, "json": _json, "text": _text}


# -- the store's settings -----------------------------------------------------------------------

STORE_SETTINGS: tuple[Setting, ...] = (
    Setting("max_bytes", "size", None, option="--store-max-bytes", off=True, auto=True, zero=None, budget=True,
            refuse_zero="0 would keep nothing on disk: use off for no limit, admit=pinned (--admit pinned) to write "
                        "only warmed and pinned prompts, or `kvstore gc --max-bytes 0` to empty the store once",
            help="bound the store on disk, e.g. 20GB: past it, gc evicts the least recently used "
                 "records; auto: a quarter of what the store holds plus its disk's free space, worked "
                 "out again every 30 s; off: no bound; 0 is refused (`kvstore gc --max-bytes 0` empties the store once)",
            serve_default=AUTO),
    Setting("tenant_max_bytes", "size", None, off=True, zero=None, budget=True,
            refuse_zero="0 would keep no tenant's records: use off for no quota",
            help="bound what each tenant's records take on disk, e.g. 2GiB: past it, gc evicts that "
                 "tenant's least recently used records (shared prompts do not count); off: no quota; "
                 "0 is refused"),
    Setting("memory_bytes", "size", 1 << 30, zero="no memory tier",
            help="bound the memory tier (decoded records in RAM, in front of the disk), e.g. 2GiB; "
                 "0: no memory tier (every fetch reads the disk)",
            serve_note="--prompt-cache-bytes when that is given"),
    Setting("buffer_cache_bytes", "size", None, zero="mlx's own limit", default_text="a quarter of RAM",
            help="freed restore memory mlx may keep for the next restore, for the whole process, "
                 "e.g. 4GiB; 0: mlx's own limit"),
    Setting("admit", "choice", "all", kept=True, choices=("all", "reused", "pinned"),
            help="which prompts automatic writes put on disk: all; reused (a prefix asked for a "
                 "second time; a first sight stays in RAM); pinned (only warmed and pinned "
                 "prompts, which are always written)"),
    Setting("max_write_rate", "rate", None, kept=True, off=True, zero=None, damaged="0",
            refuse_zero="0 would never write: use off for no limit, or admit=pinned (--admit pinned) to write only "
                        "warmed and pinned prompts",
            help="write at most this much to disk in any rolling day, e.g. 20GB/day or 500MB/h; "
                 "past it, automatic writes stay in RAM only (warmed and pinned prompts are always "
                 "written, and count); off: no limit; 0 is refused"),
    Setting("disk_kv_bits", "bits", None, kept=True, choices=(4, 8), zero="off", changed=WIDTH_CHANGED,
            help="store the K/V of bf16/f16 attention layers quantized to 8 (or 4) bits: lossy, "
                 "about half the disk of bf16 at 8 bits; other dtypes are stored as they are; 0: off"),
    Setting("exact_prefill", "count", None, kept=True, off=True, zero=None, chunks=True,
            refuse_zero="0 is no step: use off for token-exact reuse, or a multiple of the chunk size such as 256",
            help="exact mode: prefill prompts in steps of N tokens from token 0 (N a multiple of the chunk "
                 "size, e.g. 256 or 2048) and restore only at multiples of N (or at a stored prompt's own "
                 "end), so a restored run computes what a cold run does, bit for bit (docs/exact.md); "
                 "off: reuse every stored token; 0 is refused"),
    Setting("remote_prefetch", "choice", "timeout", choices=("timeout", "best_effort", "wait_complete"),
            help="how long a fetch waits for the remote tier: timeout (1 s + 0.1 s per 1,024 tokens "
                 "not held locally, at most 10 s; what arrived is restored, the rest prefilled); "
                 "best_effort (serve what is local now, download in the background for the next "
                 "fetch); wait_complete (wait for the whole path)"),
    Setting("remote_deadline", "duration", None, off=True, zero="fetches never read the bucket",
            help="the longest a fetch waits for the remote tier whatever --remote-prefetch says, "
                 "e.g. 2s; off: the policy alone decides; 0: fetches never read the bucket (uploads go on)"),
    Setting("remote_flush_timeout", "duration", 10.0, zero="do not wait for uploads",
            help="how long one command, or one close, waits in all for uploads to the remote "
                 "tier, e.g. 30s; uploads left undone are counted and said; 0: do not wait for uploads"),
    Setting("chunk_size", "count", CHUNK_SIZE, option=None, zero=None, refuse_zero="a chunk needs at least one token",
            help="tokens per chunk record (part of the namespace: another size stores apart); 0 is refused"),
    Setting("max_pending_bytes", "size", 2 << 30, option=None, zero="every insert is dropped",
            help="bound the background writer's queue; an insert that does not fit is dropped and counted; "
                 "0: every insert is dropped"),
    Setting("kv_events", "json", None, option=None, default_text="none: nothing is published",
            help="publish the store's records as vLLM's KV events for cache-aware routers: vLLM's "
                 "KVEventsConfig as JSON text or a dict, with kvstore's block_size and encoding "
                 "(docs/serve.md); kvstore serve builds it from --kv-events-config"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in STORE_SETTINGS}
KEPT_SETTINGS = tuple(s for s in STORE_SETTINGS if s.kept)


def resolve(given: Mapping[str, Any], kept: Mapping[str, str | None],
            warn: Callable[[str], None] = lambda message: None,
            chunk_size: int = CHUNK_SIZE, defaults: Mapping[str, Any] | None = None,
            store: object = None) -> dict[str, tuple[Any, str]]:
    """`{name: (value, source)}` for every store setting: given (not None in `given`: parsed,
    `InvalidInputError` when bad), else kept (checked against `chunk_size` too; a damaged one
    reads as its `damaged` value, else the default, with one `warn` naming the command that
    mends it in `store`), else the default (the table's, or one of `defaults`: serve's)."""
    where = store_option(store)
    if unknown := sorted(set(defaults := defaults or {}) - BY_NAME.keys(), key=str):
        raise InvalidInputError(f"defaults: {unknown[0]!r} is not a store setting (they are: {', '.join(BY_NAME)})")
    out: dict[str, tuple[Any, str]] = {}
    for s in STORE_SETTINGS:
        if given.get(s.name) is not None:
            out[s.name] = (s.parse(given[s.name]), GIVEN)
            continue
        text = kept.get(s.name) if s.kept else None
        if text is not None:
            try:
                out[s.name] = (s.decode(text, chunk_size), KEPT)
                continue
            except InvalidInputError as e:
                why = f"the store's kept {s.name} {shown_kept(text)} is damaged ({str(e).removeprefix('is ')})"
                if s.damaged is not None:  # a limit: a damaged one never turns it off
                    out[s.name] = (s.decode(s.damaged), KEPT)
                    warn(f"{why}: it reads as {damaged_reads(s)} until {keep_one(s, store)}, or it is given")
                    continue
                warn(f"{why}: using the default, {s.show(s.default)}, until `kvstore settings{where} "
                     f"{s.name}=...` keeps a value (`kvstore verify{where} --repair` forgets it)")
        out[s.name] = (s.parse(defaults[s.name]) if s.name in defaults else s.default, DEFAULT)
    return out


def shown_kept(text: object) -> str:
    """A kept value as a message shows it: quoted and cut short (not text: what it was)."""
    if isinstance(text, str) and text.startswith("\0"):
        return text[1:41]
    return f"{text!r:.40}"


def damaged_reads(s: Setting) -> str:
    """What a damaged kept value of the limit `s` reads as, in words: `0 B/day (no automatic writes)`."""
    means = "no automatic writes" if s.name == "max_write_rate" else "closed"
    return f"{s.show(s.decode(s.damaged))} ({means})"


def keep_one(s: Setting, store: object = None) -> str:
    """The command that keeps a value of `s` (in `store`, when given), and what it may be."""
    return f"`kvstore settings{store_option(store)} {s.name}=VALUE` keeps one ({s.allowed()})"


def now_kept(s: Setting, value: Any, was: str | None, store: object) -> str:
    """The line that says a given value of `s` is kept from now on (`was`: the kept text before)."""
    try:  # (said as `kvstore settings` says it: 5 MB/day, not the bytes it is kept as)
        before = s.decode(was) if was else s.default
        was = s.show(before) if was else "the default"
    except InvalidInputError:
        before, was = None, f"{shown_kept(was)}, damaged"
    return (f"{s.name} {s.show(value)} is kept in the store {store} (was {was}"
            f"): later runs that do not give {s.flag or s.name} use it; `kvstore settings{store_option(store)} "
            f"--reset {s.name}` forgets it" + (f"; {s.changed}" if s.changed and before != value else ""))


def store_option(store: object = None) -> str:  # ` --store PATH` in a command a message suggests
    return f" --store {shlex.quote(str(store))}" if store is not None else ""


def report(resolved: Mapping[str, tuple[Any, str]]) -> dict[str, dict]:
    """`stats()["settings"]`: `{name: {"value": ..., "source": ...}}`."""
    return {name: {"value": value, "source": source} for name, (value, source) in resolved.items()}


def not_default(settings: Mapping[str, Mapping[str, Any]]) -> str:
    """`admit=reused (kept), max_write_rate=1.0 MiB/day (given)`: the settings not at their defaults."""
    parts = []
    for name, entry in settings.items():
        s = BY_NAME.get(name)
        if s is not None and entry["source"] != DEFAULT and entry["value"] != s.default:
            parts.append(f"{name}={s.show(entry['value'])} ({entry['source']}){_zero_note(s, entry['value'])}")
    return ", ".join(parts)


def notes(resolved: Mapping[str, tuple[Any, str]], store: object = None) -> list[str]:
    """What a user must know of these settings' values, one line each (a kept 0 rate; `store`: its commands')."""
    (value, source), where = resolved["max_write_rate"], store_option(store)
    return [f"max_write_rate is 0 ({source}){_zero_note(BY_NAME['max_write_rate'], 0)}; "
            f"`kvstore settings{where} max_write_rate=20GB/day` (or another rate) sets a budget, "
            f"`kvstore settings{where} max_write_rate=off` lifts it"] if value == 0 else []


def _zero_note(s: Setting, value: Any) -> str:
    never = value == 0 and s.name == "max_write_rate"
    return ": automatic writes never reach the disk (warmed and pinned prompts still do)" if never else ""


# -- command-line options built from a table ---------------------------------------------------

def add_options(parser: argparse.ArgumentParser, table: tuple[Setting, ...] = STORE_SETTINGS, *,
                serve: bool = False) -> None:
    """An option for every setting of `table` that has one, its value parsed by the setting. An
    option not given is left out of the parsed arguments (`given` then leaves the setting to
    the store: its kept value, or the default)."""
    for s in table:
        if s.flag is None:
            continue
        common = {"dest": dest(s), "default": argparse.SUPPRESS, "help": s.help_text(serve)}
        if s.kind == "flag":
            parser.add_argument(s.flag, action="store_true", **common)
            continue
        metavar = {"size": "SIZE", "rate": "RATE", "duration": "TIME", "count": "N", "list": "LIST",
                   "json": "JSON", "bits": "BITS", "choice": "{" + ",".join(map(str, s.choices)) + "}",
                   "text": s.name.split("_")[-1].upper()}[s.kind]
        parser.add_argument(s.flag, metavar=metavar, type=argtype(s), **common)


def dest(s: Setting) -> str:
    """The attribute of the parsed arguments that holds the option of `s`."""
    return s.flag.lstrip("-").replace("-", "_") if s.flag else s.name


def argtype(s: Setting) -> Callable[[str], Any]:
    """The argparse type of the option of `s`: its one parser, its message argparse's."""
    def parse(text: str) -> Any:
        try:
            value = s.parse(text, s.flag)
            check_chunks(s, value, "given")  # (the chunk size of every command)
            return value
        except InvalidInputError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{s.flag}: ")) from None

    parse.__name__ = s.kind  # argparse names the type in its message
    return parse


def given(args: argparse.Namespace, table: tuple[Setting, ...] = STORE_SETTINGS) -> dict[str, Any]:
    """`{name: value}` of the settings of `table` given on the command line (`add_options`)."""
    out = {}
    for s in table:
        if hasattr(args, dest(s)):
            value = getattr(args, dest(s))
            out[s.name] = "off" if value is None and (s.off or s.kind == "bits") else value  # (None: not given)
    return out


def serve_defaults(table: tuple[Setting, ...] = STORE_SETTINGS) -> dict[str, Any]:
    """`kvstore serve`'s own defaults where they differ (`resolve`'s `defaults`: not as given)."""
    return {s.name: s.serve_default for s in table if s.serve_default is not None}


def table_text(table: tuple[Setting, ...] = STORE_SETTINGS) -> str:
    """The settings as a Markdown table (for the docs: name, option, default, kept, what it does)."""
    rows = ["| setting | option | default | kept | what it does |", "| --- | --- | --- | --- | --- |"]
    for s in table:
        default = s.show(s.default) if s.default is not None else s.default_text or "off"
        if s.serve_default is not None:
            default += f" (`kvstore serve`: {s.show(s.serve_default)})"
        elif s.serve_note:
            default += f" (`kvstore serve`: {s.serve_note})"
        rows.append(f"| `{s.name}` | {f'`{s.flag}`' if s.flag else 'library only'} | {default} | "
                    f"{'yes' if s.kept else 'no'} | {s.help} |")
    return "\n".join(rows)


def check_chunks(s: Setting, value: Any, source: str, chunk_size: int = CHUNK_SIZE) -> None:
    """A value of `s` counted in chunks must be a whole number of chunks of `chunk_size` tokens;
    `InvalidInputError` says which multiple to give."""
    if s.chunks and value is not None and value % chunk_size:
        raise InvalidInputError(
            f"{s.name} ({source}) is {value} tokens, not a multiple of the chunk size ({chunk_size}): "
            f"give a multiple such as {max(1, round(value / chunk_size)) * chunk_size}, or off")
