"""Shared pytest configuration and fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


def pytest_addoption(parser):
    # The fault suite (tests/test_faults*.py) runs many more random crash points with --soak.
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long fault-injection soak (see tests/README.md)")
    parser.addoption("--soak-runs", type=int, default=200, metavar="N",
                     help="random crash points in the soak (default 200)")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Callable[..., Path]:
    """`demo_model(arch="llama", size="tiny", dtype="float32")`: the folder of a demo model,
    built once per test session in a temporary directory (never in ~/.cache)."""
    from kvstore.demo import build_demo_model

    root = tmp_path_factory.mktemp("demo-models")
    built: dict[tuple[str, str, str], Path] = {}

    def get(arch: str = "llama", size: str = "tiny", dtype: str = "float32") -> Path:
        key = (arch, size, dtype)
        if key not in built:
            built[key] = build_demo_model(root / f"{arch}-{size}-{dtype}", arch, size=size, dtype=dtype)
        return built[key]

    return get


@pytest.fixture(scope="session")
def demo_model_path(demo_model) -> Path:
    """The tiny llama demo model (all `KVCache` layers), built once per session."""
    return demo_model("llama")


@pytest.fixture(scope="session")
def llama(demo_model):
    """(folder, loaded model) of the tiny llama demo model, shared by the whole session."""
    from mlx_lm import load

    path = demo_model("llama")
    model, _ = load(str(path))
    return path, model


# SeaweedFS for the remote-tier tests (tests/remote_fixture.py): `seaweed`, `s3`.
pytest_plugins = ("remote_fixture",)
