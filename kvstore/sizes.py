"""Human-friendly sizes, durations and counts for the command line and the log: `2GiB`, `1.5G`,
`30m`, `7d`, `1 request`; and `printable`, which makes foreign text safe to show there.

Sizes follow GNU coreutils: `KB`, `MB`, `GB`, `TB` are powers of 1000; `K`, `M`, `G`, `T` and
`KiB`, `MiB`, `GiB`, `TiB` are powers of 1024; a plain number (or `B`) is bytes, except in a
disk budget (`budget=True`), where every number but 0 needs its unit.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1}
for _i, _letter in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_letter] = 1024**_i
    _SIZE_UNITS[_letter + "ib"] = 1024**_i
    _SIZE_UNITS[_letter + "b"] = 1000**_i

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# ASCII: digits of other scripts (٣, １) are no number here, as the unit checks read only 0-9.
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)


def parse_size(text: str, *, budget: bool = False) -> int:
    """Bytes in `text`: `500MB`, `2GiB`, `1.5G`, `4096` ... Raises ValueError with the reason.
    `budget`: a disk budget, which evicts down to it, so a number needs its unit but 0
    (`--store-max-bytes 10` meant as 10GB would read as 10 bytes, and empty a store)."""
    match = _SIZE_RE.fullmatch(str(text))
    if not match and str(text).strip().startswith("-"):
        raise ValueError(f"{text!r} is negative: a size is 0 or more bytes, like 500MB or 2GiB")
    if not match:
        raise ValueError(f"{text!r} is not a size: use bytes or a number with a unit, like 500MB, 2GiB or 1.5G")
    number, unit = match.groups()
    if budget and not unit and float(number):
        raise ValueError(f"{text!r} has no unit: a disk budget is a size, like {number}GB or {number}GiB"
                         + (f" ({number}B for bytes)" if number.isdigit() else ""))
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"{text!r}: unknown size unit {unit!r}; use B, KB, MB, GB, TB (x1000) "
                         "or K, M, G, T, KiB, MiB, GiB, TiB (x1024)")
    if factor == 1 and "." in number and float(number) != int(float(number)):
        raise ValueError(f"{text!r} is not a whole number of bytes: give bytes, or a unit, like 1.5KB")
    return int(float(number) * factor) if "." in number else int(number) * factor


def parse_duration(text: str) -> float:
    """Seconds in `text`: `30m`, `12h`, `7d`, `1h30m`, `2w`. Every number needs its unit but 0
    (`--max-age 7` meant as days would read as seconds, and empty a store)."""
    s = str(text).strip()
    if s.startswith("-"):
        raise ValueError(f"{text!r} is negative: a duration is 0 or more, like 30m, 12h or 7d")
    parts = list(_DURATION_PART_RE.finditer(s))
    if not s or not parts or "".join(m.group(0) for m in parts) != s or parts[0].start() != 0:
        raise ValueError(f"{text!r} is not a duration: use a number with a unit, like 30m, 12h or 7d")
    total = 0.0
    for m in parts:
        number, unit = m.groups()
        unit = unit.lower()
        if not unit:
            if float(number) == 0 and len(parts) == 1:
                return 0.0
            raise ValueError(f"{text!r} has no unit: a duration is a number with s, m, h, d or w, like "
                             f"{number}s, {number}m, {number}h or {number}d")
        if unit not in _DURATION_UNITS:
            raise ValueError(f"{text!r}: unknown duration unit {unit!r}; use s, m, h, d or w")
        total += float(number) * _DURATION_UNITS[unit]
    return total


_RATE_RE = re.compile(r"\s*([^/]+?)\s*(?:/\s*([a-z]+)\s*)?", re.IGNORECASE)
_PERIODS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "hour": 3600,
            "d": 86400, "day": 86400, "w": 7 * 86400, "wk": 7 * 86400, "week": 7 * 86400}


def parse_rate(text: str) -> int:
    """Bytes per day in `text`: `20GB/day`, `500MB/h`, `1TB/week`; a size alone is per day."""
    match = _RATE_RE.fullmatch(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a rate; use a size per period, like 20GB/day or 500MB/h")
    amount, period = match.groups()
    if period is None and re.fullmatch(r"[0-9.]+", amount) and float(amount):  # (12 meant as 12 GB/day)
        raise ValueError(f"{text!r} has no unit: a rate is a size per period, like {amount}GB/day or {amount}MB/h "
                         f"({amount}B/day for bytes)")
    period = (period or "day").lower()
    seconds = _PERIODS.get(period, _PERIODS.get(period[:-1]) if period.endswith("s") else None)  # (days, hours)
    if seconds is None:
        raise ValueError(f"{text!r}: unknown period {period!r}; use s, min, h (hour), d (day) or w (week)")
    try:
        size = parse_size(amount)
    except ValueError as e:
        if "is not a size" not in str(e):  # (a unit it does not know is said as such)
            raise
        raise ValueError(f"{text!r} is not a rate; use a size per period, like 20GB/day or 500MB/h") from None
    per_day = int(size * 86400 // seconds)
    if per_day == 0 and size > 0:
        raise ValueError(f"{text!r} is less than one byte a day: the least rate is 1B/day")
    return per_day


def format_size(n: int | float) -> str:
    """`1536` -> `1.5 KiB`: binary units, one decimal."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_setting(n: int) -> str:
    """A size as a user gives one: `20 GB` for 20e9 (a whole number of a power of 1000 that is
    none of 1024), else binary units as `format_size` (`18.6 GiB` reads as another value)."""
    for k, unit in ((4, "TB"), (3, "GB"), (2, "MB"), (1, "KB")):
        if n and n % 1000**k == 0 and n % 1024**k:
            return f"{n // 1000**k} {unit}"
    return format_size(n)


def format_age(seconds: float) -> str:
    """`5400` -> `1.5h`: the largest unit that keeps the number at least 1."""
    if seconds < 60:
        return f"{max(0, int(seconds))}s"
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}".replace(".0", "")
    raise AssertionError("unreachable")


def plural(n: int, word: str, words: str | None = None) -> str:
    """`1 problem`, `2 problems` (`words`: the plural, when it is not `word` + s)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def printable(text: object) -> str:
    """`text` with every non-printable character escaped (`\\x1b`, `\\u202e`): control and
    format characters, such as the bidirectional overrides that make a name read backwards.
    For anything that came from a file, the bucket or a request before it is printed or logged."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escape(c) for c in s)


def _escape(c: str) -> str:
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
