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
    UnknownTenantError,
)

# The rest is imported on first use (PEP 562): `import kvstore` then costs no mlx, so maintenance
# (`kvstore stats`, `gc`, `verify`) starts fast.
_LAZY = {
    "MEMORY": "kvstore.store",
    "ModelCache": "kvstore.model.cache",
    "Store": "kvstore.store",
    "open": "kvstore.store",
    "default_path": "kvstore.storage.storedir",
    "PersistentPromptCache": "kvstore.serve.promptcache",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "UnknownTenantError",
    "default_path",
    "open",
]

