"""What `kv_events` (`kvstore serve --kv-events-config`) says: vLLM's `KVEventsConfig`, as JSON.

The keys are vLLM's, with vLLM's defaults: `enable_kv_cache_events` (false), `publisher`
("zmq" when enabled, else "null"), `endpoint` ("tcp://*:5557"; an address with `*`, `::`,
`ipc://` or `inproc://` is bound, any other is connected to, as vLLM does), `replay_endpoint`
(none), `buffer_steps` (10,000 batches kept for replay), `hwm` (the PUB socket's high-water
mark), `max_queue_size` (changes waiting to be published) and `topic`. kvstore adds two:
`block_size` (tokens per announced block, 64 by default; it must divide the store's chunk size)
and `encoding` ("map", vLLM's events as maps tagged by "type", or "legacy", the positional
arrays vLLM sent before mid-2026, and its replay answers without the topic frame).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping
from urllib.parse import urlsplit

from kvstore.errors import InvalidInputError

ENCODINGS = ("map", "legacy")
DEFAULT_BLOCK_SIZE = 64


@dataclass(frozen=True)
class EventsConfig:
    """One publisher's settings (see the module docstring)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    encoding: str = "map"

    @property
    def publishes(self) -> bool:
        """Whether anything is published (vLLM: enabled, and a publisher other than "null")."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def with_defaults(self, **defaults: Any) -> "EventsConfig":
        """This config, with these values where it has vLLM's default (an empty topic, say)."""
        empty = EventsConfig()
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) == getattr(empty, k)})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_TYPES = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": str,
          "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str, "block_size": int,
          "encoding": str}
_MINIMUM = {"buffer_steps": 1, "hwm": 0, "max_queue_size": 1, "block_size": 1}


def parse(value: str | Mapping[str, Any] | EventsConfig, where: str = "kv_events") -> EventsConfig:
    """`value` (JSON text, a dict, or a config) as an `EventsConfig`; `InvalidInputError` naming
    `where` and what is wrong (an unknown key, with the key it resembles)."""
    if isinstance(value, EventsConfig):
        return value
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidInputError(f"{where}: not JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"{where}: must be a JSON object like "
                                '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}, '
                                f"got {type(value).__name__}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key not in _TYPES:
            near = difflib.get_close_matches(str(key), list(_TYPES), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(_TYPES)}"
            raise InvalidInputError(f"{where}: unknown key {key!r}{hint}")
        if v is None and key in ("publisher", "replay_endpoint"):
            out[key] = None
            continue
        kind = _TYPES[key]
        if type(v) is not kind:  # bool is an int: true is not a number of steps
            what = {bool: "true or false", int: "a whole number", str: "a string"}[kind]
            raise InvalidInputError(f"{where}: {key} must be {what}, got {json.dumps(v)}")
        if key in _MINIMUM and v < _MINIMUM[key]:
            raise InvalidInputError(f"{where}: {key} must be at least {_MINIMUM[key]}, got {v}")
        out[key] = v
    config = EventsConfig(**out)
    if config.publisher is None:
        config = replace(config, publisher="zmq" if config.enable_kv_cache_events else "null")
    if config.publisher not in ("zmq", "null"):
        raise InvalidInputError(f"{where}: publisher must be \"zmq\" or \"null\", got {config.publisher!r}")
    if config.encoding not in ENCODINGS:
        raise InvalidInputError(f"{where}: encoding must be one of {', '.join(ENCODINGS)}, got {config.encoding!r}")
    for key in ("endpoint", "replay_endpoint"):
        address = getattr(config, key)
        if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidInputError(f"{where}: {key} must be a ZMQ address (tcp://HOST:PORT, ipc://PATH "
                                    f"or inproc://NAME), got {address!r}")
        problem = _tcp_port_problem(address, bound=key == "replay_endpoint" or binds(address)) \
            if address and address.startswith("tcp://") else None
        if problem:
            raise InvalidInputError(f"{where}: {key} {address!r} {problem}")
    if config.replay_endpoint is not None and config.replay_endpoint == config.endpoint \
            and not config.endpoint.endswith((":*", ":0")):
        raise InvalidInputError(f"{where}: replay_endpoint is endpoint ({config.endpoint!r}): the events and their "
                                "replay need an address each (e.g. tcp://*:5557 and tcp://*:5558)")
    return config


def _tcp_port_problem(address: str, *, bound: bool) -> str | None:
    """What is wrong with the port of a `tcp://HOST:PORT` address, or None. Said here, as a bad
    setting, rather than by ZMQ once the store is open (which also takes 99999 as a port)."""
    host, colon, port = address[len("tcp://"):].rpartition(":")
    if not colon or not host or host.endswith("[") or port.endswith("]"):  # (tcp://[::1] has no port)
        return "has no port: give tcp://HOST:PORT"
    if bound and port in ("*", "0"):  # any free port, which ZMQ picks
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return (f"has a bad port {port!r}: give a number from 1 to 65535"
                + (" (or * for any free port)" if bound else ""))
    return None


def check_block_size(config: EventsConfig, chunk_size: int, where: str = "kv_events: block_size") -> None:
    """A block is a whole part of a chunk: `block_size` (given as `where` says) must divide `chunk_size`."""
    if chunk_size % config.block_size:
        raise InvalidInputError(f"{where} {config.block_size} does not divide the store's "
                                f"chunk size {chunk_size}: use a divisor of it, e.g. "
                                f"{max(d for d in range(1, min(chunk_size, DEFAULT_BLOCK_SIZE) + 1) if chunk_size % d == 0)}")


def binds(address: str) -> bool:
    """Whether the publisher binds `address` (else it connects to it), as vLLM decides."""
    return "*" in address or "::" in address or address.startswith(("ipc://", "inproc://"))


def beyond_loopback(address: str | None) -> bool:
    """Whether events sent to or bound at `address` can leave this machine (a TCP address whose
    host is not a loopback address: `*`, 0.0.0.0, a host name, another machine's address)."""
    if not address or not address.startswith("tcp://"):
        return False
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True
