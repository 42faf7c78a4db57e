"""kvstore: a persistent, on-disk prompt-cache store for MLX language models.

    import kvstore
    with kvstore.open() as store:
        mc = store.bind(model, "path/or/repo-id")
        cache, rest = mc.fetch(tokens)   # resume from the longest stored prefix
        ...                              # process `rest` with `cache`
        mc.insert(tokens, cache)         # store it for every later process
"""

from .errors import (
    BlobError,
    CorruptIndexError,
    IndexLostError,
    InvalidInputError,
    KVStoreError,
    ModelFilesError,
    NotAStoreError,
    SchemaTooNewError,
    StoreOpenError,
)
from .store import MEMORY, ModelCache, Store, default_path, open

__version__ = "0.1.0"

__all__ = [
    "MEMORY",
    "BlobError",
    "CorruptIndexError",
    "IndexLostError",
    "InvalidInputError",
    "KVStoreError",
    "ModelCache",
    "ModelFilesError",
    "NotAStoreError",
    "SchemaTooNewError",
    "Store",
    "StoreOpenError",
    "default_path",
    "open",
]


def __getattr__(name):
    # The server adapter imports mlx_lm.server; load it only when asked for.
    if name == "PersistentPromptCache":
        from .server import PersistentPromptCache

        return PersistentPromptCache
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
