"""Objects follow the layer table, as imports do (tests/test_layout.py): walked from a live store,
no object of a layer holds a reference to an object, bound method or function of a layer above
it (the composition root, `kvstore/store.py`, holds everything; nothing holds it)."""

from __future__ import annotations

import gc
import types

import numpy as np
import pytest
from test_layout import _layer

import kvstore

C = 16
# Not followed: what holds no kvstore object, or reaches everything (a function's globals).
_LEAVES = (type, types.ModuleType, types.FrameType, types.CodeType, np.ndarray, str, bytes, bytearray,
           int, float, complex, bool, type(None), memoryview)


def _kv_module(obj) -> str | None:
    """The kvstore module `obj` belongs to: its class's (a function's own), else None."""
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        mod = getattr(obj, "__module__", None) or ""
    else:
        mod = type(obj).__module__ or ""
    return mod if mod.startswith("kvstore.") else None


def _outside(obj) -> bool:
    return isinstance(obj, _LEAVES) or (type(obj).__module__ or "").startswith("mlx")


def _references(owner) -> list[tuple[object, str]]:
    """The kvstore objects and functions `owner` reaches through anything that is not kvstore's
    (its attributes, containers, threads, bound methods, closures), with the path to each."""
    found, seen = [], {id(owner)}
    todo = [(r, type(owner).__name__) for r in gc.get_referents(owner) if not isinstance(r, type)]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen or _outside(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.MethodType) or (isinstance(obj, types.BuiltinMethodType)
                                                  and not isinstance(obj.__self__, types.ModuleType)):
            todo.append((obj.__self__, f"{path}.{obj.__name__}()"))
            continue
        if _kv_module(obj) is not None:
            found.append((obj, path))
            if isinstance(obj, types.FunctionType):
                todo += [(c.cell_contents, path + "<closure>") for c in obj.__closure__ or ()]
            continue
        if isinstance(obj, types.FunctionType):  # not kvstore's: what it closes over may be
            todo += [(c.cell_contents, path + "<closure>") for c in obj.__closure__ or ()]
            continue
        label = type(obj).__name__
        todo += [(r, f"{path}>{label}") for r in gc.get_referents(obj) if not isinstance(r, type)]
    return found


def upward_references(*roots) -> tuple[list[str], int]:
    """Every reference from an object to one of a higher layer, reachable from `roots`; and how
    many kvstore objects were walked."""
    problems, walked, todo = [], set(), list(roots)
    while todo:
        owner = todo.pop()
        if id(owner) in walked:
            continue
        walked.add(id(owner))
        mine = _layer(_kv_module(owner))
        for obj, path in _references(owner):
            theirs = _layer(_kv_module(obj))
            if theirs > mine:
                problems.append(f"{_kv_module(owner)}.{type(owner).__name__} -> {path} -> "
                                f"{_kv_module(obj)}.{getattr(obj, '__qualname__', type(obj).__name__)}")
            if not isinstance(obj, types.FunctionType):
                todo.append(obj)
    return problems, len(walked)


def _live(store, model, path):
    """A bound model with a fetch and an insert behind it, and one insert still queued."""
    mc = store.bind(model, path)
    toks = list(range(1, 3 * C + 5))
    cache, rest = mc.fetch(toks)
    model(kvstore_array(rest), cache=cache)
    mc.insert(toks, cache)
    store.flush()
    mc.fetch(toks + [7, 8])
    store.writer.pause()
    more = toks + list(range(200, 200 + C))
    cache, rest = mc.fetch(more)
    model(kvstore_array(rest), cache=cache)
    mc.insert(more, cache)
    return mc


def kvstore_array(rest):
    import mlx.core as mx

    return mx.array(rest)[None]


@pytest.mark.parametrize("where", ["disk", "ram", "events"])
def test_no_object_holds_a_reference_to_a_layer_above_it(tmp_path, llama, where):
    path, model = llama
    events = {"enable_kv_cache_events": True, "endpoint": f"inproc://objects-{id(tmp_path)}", "block_size": 4}
    store = kvstore.open(tmp_path / "s" if where != "ram" else kvstore.MEMORY, chunk_size=C,
                         max_bytes=1 << 30 if where != "ram" else None,
                         kv_events=events if where == "events" else None)
    try:
        mc = _live(store, model, path)
        problems, walked = upward_references(store, mc)
        assert walked > 20  # the walk reached the parts
        assert not problems, "\n".join(problems)
    finally:
        store.writer.resume()
        store.close()


def test_no_object_of_a_remote_store_holds_a_reference_up(tmp_path, llama, s3):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, remote=s3.url(), max_bytes=1 << 30) as store:
        try:
            mc = _live(store, model, path)
            problems, walked = upward_references(store, mc)
            assert walked > 20
            assert not problems, "\n".join(problems)
        finally:
            store.writer.resume()
