"""Command-line parsing that `kvstore` and `kvstore serve` share.

A mistyped option is named with the option it resembles ("did you mean"), a prefix of an option
is not silently taken for it, and a negative number after an option is read as its value, so the
option's own check says what is wrong with it (argparse alone says "expected one argument").
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
from typing import Callable, Iterable, Sequence

from kvstore.settings import OFF_WORDS
from kvstore.sizes import parse_duration, parse_size

_NEGATIVE = re.compile(r"-\.?\d")  # -5, -5MB, -.5G: a value, never one of our options
_OPTION = re.compile(r"--?[A-Za-z]")


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` with no abbreviations whose negative values reach their option."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--store` must never be read as `--store-max-bytes`
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._seen = args
        return super().parse_known_args(join_negative_values(self, args), namespace)

    def error(self, message: str):
        # `warm --promts F` is a typo first, and only then a missing --prompts.
        if "required" in message and unknown_options(getattr(self, "_seen", ()), option_strings(self)):
            message = unrecognized(self._seen, option_strings(self))
        super().error(message)


def add_store_options(p: argparse.ArgumentParser, check_remote: Callable[[str], None]) -> None:
    """`--store`, `--remote` and `--remote-key-file`: declared once, for `kvstore` and `kvstore serve`.
    `check_remote` raises ValueError for a `--remote` URL that is not well formed (nothing is
    contacted), so a mistyped one is a bad command line, said before a model loads."""
    p.add_argument("--store", metavar="DIR", type=not_empty("give a folder, or leave --store out for the default"),
                   help="store directory (default: $KVSTORE_DIR, else ~/.cache/kvstore)")
    p.add_argument("--remote", metavar="URL", nargs="?", const="", type=_checked(check_remote),
                   help="share the store through an S3 bucket, s3://BUCKET/PREFIX (default, and for a bare "
                        "--remote: $KVSTORE_REMOTE); gc and verify act on the bucket when it is given")
    p.add_argument("--remote-key-file", metavar="PATH",
                   help="file holding the fleet secret the remote's objects are sealed with (default: "
                        "$KVSTORE_REMOTE_KEY); `kvstore remote-key` prints a new one")


def _checked(check: Callable[[str], None]):
    """An argparse type: the text, if `check` passes it (an empty one, a bare option's, unchecked)."""
    def value(text: str) -> str:
        if text:
            try:
                check(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return value


def remote_url(args: argparse.Namespace) -> str | None:
    """`--remote URL`, else `$KVSTORE_REMOTE` (also for a bare `--remote`), else None; ValueError
    for a bare `--remote` without `$KVSTORE_REMOTE`."""
    url = getattr(args, "remote", None) or os.environ.get("KVSTORE_REMOTE") or None
    if url is None and getattr(args, "remote", None) is not None:
        raise ValueError("--remote needs a URL (s3://BUCKET/PREFIX) or $KVSTORE_REMOTE")
    return url


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def join_negative_values(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`--max-bytes -5MB` as `--max-bytes=-5MB`, for the options of `parser` that take one value."""
    takes_value = {s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--":
            return out + args[i:]
        if args[i] in takes_value and i + 1 < len(args) and _NEGATIVE.match(args[i + 1]):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def unknown_options(args: Iterable[str], known: Iterable[str]) -> list[str]:
    """The option-like arguments (`--name` or `--name=value`) whose name is not in `known`."""
    names = set(known)
    return [a.split("=", 1)[0] for a in args if _OPTION.match(a) and a.split("=", 1)[0] not in names]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`name`, with the known option it resembles: `--max-tokns (did you mean --max-tokens?)`."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"{name} (did you mean {close[0]}?)" if close else name


def unrecognized(extras: Sequence[str], known: Iterable[str]) -> str:
    """The error message for arguments a parser left over."""
    known = list(known)
    options = unknown_options(extras, known)
    if options:
        word = "option" if len(options) == 1 else "options"
        return f"unknown {word} " + ", ".join(did_you_mean(o, known) for o in options)
    return "unexpected argument " + " ".join(extras)


def not_empty(hint: str):
    """An argparse type: a path (or name) that is not empty, else `an empty value: {hint}`.
    `--store "$DIR"` with DIR unset would otherwise mean the default store, and write to it; an
    empty file or model path would be read as the current folder."""
    def given(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty value: {hint}")
        return text
    return given


def disk_budget(text: str) -> int:
    """An argparse type: a disk budget, `500MB`, `2GiB`, `0` (`sizes.parse_size` with its unit
    needed; its message on a bad value)."""
    try:
        return parse_size(text, budget=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def at_least(least: int, what: str, most: int | None = None):
    """An argparse type: a whole number of `least` or more (and `most` or fewer; `what` it
    counts, for the message)."""
    def whole(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {what}") from None
        if n < least or (most is not None and n > most):
            raise argparse.ArgumentTypeError(f"must be at least {least}" + (f" and at most {most}" if most is not None
                                                                             else "") + f", got {n}")
        return n

    whole.__name__ = "count"
    return whole


def temperature(text: str) -> float:
    """An argparse type: a sampling temperature, a finite number of 0 or more."""
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(t) or t < 0:
        raise argparse.ArgumentTypeError(f"a temperature is a finite number of 0 or more (0: greedy), got {text}")
    return t


def duration(text: str) -> float:
    """An argparse type: `30m`, `7d` (`sizes.parse_duration`)."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def or_off(parse):
    """The argparse type `parse` that also takes the settings' word for no limit (`off`, or
    `none`): None. Give the option `default=argparse.SUPPRESS` to tell it from one not given."""
    def parse_or_off(text: str):
        return None if text.strip().lower() in OFF_WORDS else parse(text)

    parse_or_off.__name__ = parse.__name__
    return parse_or_off
