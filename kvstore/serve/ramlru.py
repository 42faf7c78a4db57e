"""What the prompt cache holds in RAM, by sequence, in the order mlx-lm's `LRUPromptCache` evicts.

`RamSequences` is the bookkeeping only (sequences and the hashes of their records); the records
themselves are in the store's memory tier and write queue. `SystemPrompts` remembers the recent
system prompts whose records the memory tier keeps fresh.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import InvalidInputError
from kvstore.upkeep.evict import ROLES

#: `insert_cache` types, in the order mlx-lm's LRUPromptCache evicts them (the store's order too).
CACHE_TYPES = ROLES


def check_bounds(max_size, max_bytes) -> None:
    """`LRUPromptCache`'s bounds: `max_size` sequences (a count), `max_bytes` bytes (or None)."""
    for name, value, none in (("max_size", max_size, False), ("max_bytes", max_bytes, True)):
        if (value is None and none) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            continue
        raise InvalidInputError(f"{name}: give a whole number, 0 or more{' (or None)' if none else ''}, "
                                f"as to mlx-lm's LRUPromptCache, not {value!r:.30}")


def can_trim(cache: list) -> bool:
    """Whether mlx-lm can trim `cache` (then it makes every held prefix of it redundant)."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    try:
        return bool(can_trim_prompt_cache(cache))
    except Exception:
        return False


class RamSequences:
    """The sequences held in RAM, each with the hashes of its records, one LRU per cache type.

    `pop` takes the oldest sequence of the first type (assistant, user, system) that holds at least
    as many as the next one: the order in which mlx-lm's `LRUPromptCache` evicts.
    """

    def __init__(self):
        self._lrus: dict[str, OrderedDict[tuple, list[bytes]]] = {t: OrderedDict() for t in CACHE_TYPES}

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lrus.values())

    def add(self, seq: tuple, hashes: list[bytes], cache_type: str) -> None:
        self.remove(seq)
        self._lrus[cache_type][seq] = hashes

    def remove(self, seq: tuple) -> list[bytes]:
        for lru in self._lrus.values():
            if seq in lru:
                return lru.pop(seq)
        return []

    def pop(self) -> tuple[tuple, list[bytes]]:
        lrus = [self._lrus[t] for t in CACHE_TYPES]
        for this, after in zip(lrus, lrus[1:]):
            if this and len(this) >= len(after):
                return this.popitem(last=False)
        return lrus[-1].popitem(last=False)

    def items(self) -> list[tuple[tuple, list[bytes]]]:
        return [item for lru in self._lrus.values() for item in lru.items()]

    def prefixes_of(self, seq: tuple) -> list[tuple]:
        """Held sequences of the same key and namespace whose tokens are a strict prefix of `seq`'s."""
        key, ns, tokens = seq
        return [s for s, _ in self.items()
                if s[0] == key and s[1] == ns and len(s[2]) < len(tokens) and tokens[: len(s[2])] == s[2]]

    def held_hashes(self) -> set[bytes]:
        return {h for _, hashes in self.items() for h in hashes}

    def by_type(self) -> dict[str, tuple[int, set[bytes]]]:
        return {t: (len(lru), {h for hashes in lru.values() for h in hashes}) for t, lru in self._lrus.items()}


class SystemPrompts:
    """Recent system prompts, whose records the memory tier keeps fresh.

    mlx_lm.server marks the cache at the end of a system prompt as "system". Those records are the
    ancestors of every turn that follows, so on disk they already outlive the turns (eviction takes
    leaves first). In RAM they are moved to the recent end of the memory tier's LRU after every other
    insert, so assistant and user records go first. Bounded: only the last `limit` system prompts.
    No pins: a pin is the operator's decision (`kvstore warm`), and unpinning here could undo it.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._prompts: OrderedDict[bytes, list[bytes]] = OrderedDict()

    def remember(self, hashes: list[bytes]) -> None:
        if not hashes:
            return
        self._prompts.pop(hashes[-1], None)
        self._prompts[hashes[-1]] = hashes
        while len(self._prompts) > self.limit:
            self._prompts.popitem(last=False)

    def hashes(self) -> list[bytes]:
        return [h for hashes in self._prompts.values() for h in reversed(hashes)]
