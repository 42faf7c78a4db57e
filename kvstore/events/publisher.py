"""The ZMQ side of KV events, as vLLM's publisher does it: a PUB socket and a replay ROUTER.

The PUB socket is an XPUB (subscribers still use plain SUB sockets): it sees each subscription
arrive, so the start batch (`AllBlocksCleared`) can wait for the first subscriber
(`wait_for_subscriber`). A PUB drops what it sends before a subscription has reached it (ZMQ's
"slow joiner"): a node that connects to a router which binds, as llm-d's does, would otherwise
lose the start batch on most starts, and the router would keep a dead process's blocks.

Every batch goes out as three frames, `(topic, sequence number as 8 bytes big-endian, payload)`;
numbers start at 0 and have no gaps. The last `buffer_steps` batches are kept: a subscriber
that missed some sends the first number it wants, as 8 bytes big-endian, to the replay socket
(a DEALER: the frames the ROUTER gets are `identity, "", start`) and gets, after the empty
delimiter, every kept batch from there as `(topic, number, payload)`, the frames the live socket
sent, then `(b"", -1, b"")`, as vLLM answers since its map-encoded events; with the legacy
encoding, as vLLM answered before: `(number, payload)`, then `(-1, b"")`. The replay socket
queues up to two messages per kept batch for one subscriber (a ROUTER drops past that).

Sockets are not thread-safe: after it is made, a `Publisher` is used by one thread only.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque

import zmq

from kvstore.errors import KVStoreError
from kvstore.events.config import EventsConfig, binds

log = logging.getLogger("kvstore")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How long closing waits for batches still in the PUB socket's queue to go out.
LINGER_MS = 1000
#: A ZMQ subscription message starts with this byte (an unsubscription with 0).
SUBSCRIBE = 1


class Publisher:
    """A PUB socket (bound or connected to `config.endpoint`) and, with `replay_endpoint`, a
    ROUTER bound there. Raises `KVStoreError` naming an address it cannot use."""

    def __init__(self, config: EventsConfig):
        self.topic = config.topic.encode()
        # What a replayed batch carries before its number (the topic; nothing with the legacy encoding).
        self._replay_head = () if config.encoding == "legacy" else (self.topic,)
        self.sent = 0  # the next sequence number
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self.subscriptions = 0  # subscription messages seen (a router that reconnects sends another)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, LINGER_MS)
            # Every subscription is passed up, not only a topic's first: a router that comes back
            # while the one it replaces is not yet gone, or beside another, is still seen.
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            _use(self._pub, config.endpoint, bind=binds(config.endpoint), what="KV events")
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))  # a whole replay
                _use(self._replay, config.replay_endpoint, bind=True, what="KV event replay")
        except BaseException:
            self.close()
            raise
        # Where they are (a port of 0 or `*` filled in): read now, as only one thread uses a socket.
        self.address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_address = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None

    def wait_for_subscriber(self, timeout: float, stop=lambda: False) -> bool:
        """Wait until a subscription has reached the socket, at most `timeout` seconds (or until
        `stop()` says so); whether one has."""
        deadline = time.monotonic() + timeout
        while not self.subscriptions and not stop():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.take_subscriptions(min(left, 0.05))
        return self.subscriptions > 0

    def take_subscriptions(self, wait_s: float = 0) -> int:
        """Read the subscription messages waiting (an XPUB queues them: they must be read);
        how many subscriptions they held."""
        got, wait_ms = 0, int(wait_s * 1000)
        while self._pub.poll(wait_ms):
            message = self._pub.recv()
            got += bool(message) and message[0] == SUBSCRIBE
            wait_ms = 0
        self.subscriptions += got
        return got

    def send(self, payload: bytes) -> int:
        """Publish one batch; its sequence number. Never blocks: past the high-water mark, the
        PUB socket drops (a subscriber then asks the replay socket)."""
        seq = self.sent
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.sent = seq + 1
        return seq

    def serve_replay(self, wait_ms: int = 0) -> int:
        """Answer the replay requests waiting (or arriving within `wait_ms`); how many."""
        if self._replay is None:
            return 0
        answered = 0
        while self._replay.poll(wait_ms if not answered else 0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kvstore: ignored a KV event replay request: %s", "its start sequence is %d bytes, "
                            "not 8 (big-endian)" % len(frames[2]) if len(frames) == 3 else
                            "%d frames, not an empty frame and an 8-byte start sequence" % (len(frames) - 1))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            head = self._replay_head
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", *head, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", *(b"" for _ in head), END_SEQ, b""))
            answered += 1
        return answered

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close()
        self._ctx.term()


def _use(sock: zmq.Socket, address: str, *, bind: bool, what: str) -> None:
    if "[" in address:  # an IPv6 address, e.g. tcp://[::1]:5557 (bound: on loopback only)
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(address) if bind else sock.connect(address)
    except zmq.ZMQError as e:
        raise KVStoreError(f"cannot {'listen on' if bind else 'connect to'} {address} for {what}: {e}") from None
    if not bind and address.startswith("tcp://"):  # ZMQ connects in the background, and says nothing
        host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
        try:
            socket.getaddrinfo(host, None)
        except OSError as e:
            log.warning("kvstore: %s: the host of %s does not resolve (%s): nothing is received there until it "
                        "does (ZMQ keeps trying)", what, address, e)
