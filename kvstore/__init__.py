"""kvstore: a persistent, on-disk prompt-cache store for MLX language models.

    import kvstore
    with kvstore.open() as store:
        mc = store.bind(model, "path/or/repo-id")
        cache, rest = mc.fetch(tokens)   # resume from the longest stored prefix
        ...                              # process `rest` with `cache`
        mc.insert(tokens, cache)         # store it for every later process
"""

from kvstore.errors import (
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
from kvstore.serve.promptcache import PersistentPromptCache
from kvstore.store import MEMORY, ModelCache, Store, default_path, open

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
    "PersistentPromptCache",
    "SchemaTooNewError",
    "Store",
    "StoreOpenError",
    "default_path",
    "open",
]

