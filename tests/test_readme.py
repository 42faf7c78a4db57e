"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh process; the
links between those pages resolve, and they keep to the project's wording rules. README.md's
option blocks are the commands' own usage, as their parsers print it.

A block is run exactly as it is on the page: nothing is substituted. The only things the test
sets are outside the code: HOME and the working directory are temporary folders (so the demo
model and `~/.cache/kvstore` land there, not in the real home) and KVSTORE_DIR is unset. A block
that cannot run here (it needs an S3 bucket, a downloaded model) says so on the page itself, on
the line before it:

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
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Development-history wording and notes that live outside the repository have no place in the docs;
# nor, in the user's guides, the numbers of schema migrations.
BANNED = re.compile(r"\bissue \d+|\bmilestones?\b|\bthis session\b|\b\d+\.\d+ (did|had|was)\b|DESIGN\.md|STYLE\.md"
                    r"|\.\./shared", re.I)
MIGRATION = re.compile(r"`?\b\d{4}`? migration|\bmigrations?/?\s*`?\d{4}", re.I)
README_MAX_LINES = 300
# One block a command: `<!-- options:NAME -->`, a ```text fence with the command's usage, `<!-- /options -->`.
OPTION_BLOCK = re.compile(r"^<!-- options:(\S+) -->\n```text\n(.*?)^```\n<!-- /options -->$", re.M | re.S)
USAGE_WIDTH = 100
SERVE_TAIL = "[mlx_lm.server options]"


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, reason it is not run or None) of every ```python block."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").splitlines()
        skip = NOT_RUN.search(before[-1]) if before else None
        blocks.append((line, m.group(1), skip.group(1) if skip else None))
    return blocks


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


BLOCKS = [(_name(page), *block) for page in PAGES for block in python_blocks(page.read_text())]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S))
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_the_pages_have_python_examples_and_few_are_skipped():
    assert {page for page, *_ in BLOCKS} >= {"README.md", "docs/library.md"}, "the extraction is broken"
    assert sum(reason is None for *_, reason in BLOCKS) >= len(BLOCKS) / 2


def test_the_block_parser_sees_a_not_run_marker():
    text = "x\n<!-- not run: needs a model download -->\n```python\nraise SystemExit(1)\n```\n```python\npass\n```\n"
    assert python_blocks(text) == [(3, "raise SystemExit(1)\n", "needs a model download"), (6, "pass\n", None)]


@pytest.mark.parametrize("page, line, code, reason", BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_python_block_runs_as_written(tmp_path, page, line, code, reason):
    if reason is not None:
        pytest.skip(f"{page}:{line} is marked not run: {reason}")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_DIR"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = tmp_path / f"block_{line}.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{page}:{line} failed:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_resolve(page):
    """Every relative link names a file of the repository and, with #anchor, a heading in it."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            if dest == REPO / "docs" / "architecture.md":
                continue  # kept apart from these guides; its links are checked once it is in the tree
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{_name(page)}: links that lead nowhere: {broken}"


@pytest.mark.parametrize("page", [*PAGES, REPO / "tests" / "README.md", REPO / "bench" / "README.md"], ids=_name)
def test_no_development_history_or_outside_notes(page):
    text = page.read_text()
    found = [*BANNED.finditer(text), *(MIGRATION.finditer(text) if page in PAGES else ())]
    hits = [f"{_name(page)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in found]
    assert not hits, "\n".join(hits)


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) < README_MAX_LINES, "move the detail to docs/"


def option_blocks(text: str) -> dict[str, str]:
    """{command: the text of its options block} of a page."""
    return {m.group(1): m.group(2) for m in OPTION_BLOCK.finditer(text)}


def usage(parser) -> str:
    """A parser's usage as `--help` prints it, without "usage: ", wrapped at USAGE_WIDTH."""
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip("\n") + "\n"


def expected_option_blocks() -> dict[str, str]:
    """What README.md's option blocks hold: every `kvstore` command's usage, and serve's own options
    followed by mlx_lm.server's (which it passes on unchanged)."""
    from kvstore.cli.main import build_parser
    from kvstore.serve.options import build_parser as serve_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    blocks = {name: usage(p) for name, p in commands.items() if name != "serve"}
    serve = usage(serve_parser())
    blocks["serve"] = serve + " " * len("kvstore serve ") + SERVE_TAIL + "\n"
    return blocks


def test_the_readme_has_every_command_with_the_options_its_parser_has():
    expected, found = expected_option_blocks(), option_blocks(README.read_text())
    wrong = [name for name in expected if found.get(name) != expected[name]] + sorted(set(found) - set(expected))
    blocks = "\n\n".join(f"<!-- options:{n} -->\n```text\n{b}```\n<!-- /options -->" for n, b in expected.items())
    assert not wrong, f"README.md's option blocks of {wrong} differ from the parsers; they are:\n\n{blocks}"


def pack_option_blocks() -> dict[str, str]:
    """What docs/packs.md's option blocks hold: the usage of every `kvstore pack` subcommand."""
    from kvstore.cli.main import build_parser

    pack = build_parser()._subparsers._group_actions[0].choices["pack"]
    return {f"pack-{name}": usage(p) for name, p in pack._subparsers._group_actions[0].choices.items()}


def test_the_packs_page_has_every_pack_subcommand_with_its_options():
    expected, found = pack_option_blocks(), option_blocks((REPO / "docs" / "packs.md").read_text())
    wrong = [name for name in expected if found.get(name) != expected[name]] + sorted(set(found) - set(expected))
    blocks = "\n\n".join(f"<!-- options:{n} -->\n```text\n{b}```\n<!-- /options -->" for n, b in expected.items())
    assert not wrong, f"docs/packs.md's option blocks of {wrong} differ from the parsers; they are:\n\n{blocks}"
