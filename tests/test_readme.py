"""Every ```python block of README.md runs as written, each in a fresh process.

A block is run exactly as it is in the README: nothing is substituted. The only things the test
sets are outside the code: HOME and the working directory are temporary folders (so the demo
model and `~/.cache/kvstore` land there, not in the real home) and KVSTORE_DIR is unset. A block
that cannot run here says so in the README itself, on the line before it:

    <!-- not run: needs a model download -->
    ```python
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, reason it is not run or None) of every ```python block."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").splitlines()
        skip = NOT_RUN.search(before[-1]) if before else None
        blocks.append((line, m.group(1), skip.group(1) if skip else None))
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_examples_and_few_are_skipped():
    assert len(BLOCKS) >= 2, "no ```python block found: the extraction is broken"
    assert sum(reason is None for _, _, reason in BLOCKS) >= len(BLOCKS) / 2


def test_the_block_parser_sees_a_not_run_marker():
    text = "x\n<!-- not run: needs a model download -->\n```python\nraise SystemExit(1)\n```\n```python\npass\n```\n"
    assert python_blocks(text) == [(3, "raise SystemExit(1)\n", "needs a model download"), (6, "pass\n", None)]


@pytest.mark.parametrize("line, code, reason", BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_python_block_runs_as_written(tmp_path, line, code, reason):
    if reason is not None:
        pytest.skip(f"README.md:{line} is marked not run: {reason}")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_DIR"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = tmp_path / f"readme_{line}.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"README.md:{line} failed:\n{result.stderr[-4000:]}"
