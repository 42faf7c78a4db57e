"""`kvstore stats`, `gc`, `verify` and `pins` (listing) import no mlx and no mlx-lm, with or without a remote.

Each command runs in a process of its own (`kvstore.cli.main.main`), which then lists the mlx
modules it imported: maintenance must start fast and work where no model could run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvtest import prefill

import kvstore

C = 16
REPO = Path(__file__).resolve().parents[1]
MARK = "mlx modules imported:"
SCRIPT = f"""
import sys
from kvstore.cli.main import main
code = main(sys.argv[1:])
print({MARK!r}, sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')), file=sys.stderr)
sys.exit(code)
"""

LOCAL = [["stats"], ["stats", "--json"], ["gc", "--max-bytes", "0", "--dry-run"], ["gc", "--stale"],
         ["gc", "--max-age", "30d"], ["verify"], ["verify", "--json"], ["verify", "--repair"],
         ["gc", "--max-bytes", "0"], ["pins"], ["pins", "--json"]]
REMOTE = [["stats"], ["stats", "--json"], ["gc", "--max-bytes", "0", "--dry-run"], ["verify", "--json"],
          ["verify", "--repair"], ["gc", "--max-age", "30d"]]


def mlx_imported(*args, env: dict | None = None) -> list[str]:
    """The mlx modules `kvstore ARGS...` imported (its exit code must be 0 or 1)."""
    result = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stdout + result.stderr
    line = next(l for l in result.stderr.splitlines() if l.startswith(MARK))
    return ast.literal_eval(line[len(MARK):].strip())


@pytest.fixture
def store(tmp_path, llama) -> Path:
    path, model = llama
    prompt = np.random.default_rng(7).integers(1, 250, 3 * C + 5).tolist()
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        s.bind(model, path).insert(prompt, prefill(model, prompt))
    return tmp_path / "s"


@pytest.mark.parametrize("command", LOCAL, ids=" ".join)
def test_maintenance_imports_no_mlx(store, command):
    assert mlx_imported(*command, "--store", store) == []


def test_rebuilding_a_lost_index_imports_no_mlx(store):
    for name in os.listdir(store):
        if name.startswith("index.sqlite"):
            os.unlink(store / name)
    assert mlx_imported("verify", "--repair", "--store", store) == []
    assert mlx_imported("verify", "--store", store) == []


@pytest.mark.parametrize("command", REMOTE, ids=" ".join)
def test_maintenance_of_the_bucket_imports_no_mlx(store, s3, command):
    url = s3.url()
    assert mlx_imported(*command, "--remote", url, "--store", store) == []
    assert mlx_imported(*command, "--store", store, env={"KVSTORE_REMOTE": url}) == []
