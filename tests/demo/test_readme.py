"""The README stays the short front door: its shell blocks are the demo's, each run by a test,
and every repository path it names exists. (The docs pages' blocks, the generated references and
the code fences of every Markdown file are checked in tests/docs.)"""

from __future__ import annotations

import re

from tests.demo.readme import README, REPO, block_after, marked_blocks, shell_blocks

DEMO_TEST = "tests/demo/test_demo.py::test_make_demo_then_demo_down"


def test_shell_blocks_parse() -> None:
    text = (
        "x\n```sh\nmake a   # note\n# only a comment\n\nfoo \\\n  --bar\n```\n```text\nnot a command\n```\n"
    )
    assert shell_blocks(text) == [["make a", "foo --bar"]]
    marked = "<!-- tested: a.py::t, ci -->\n```sh\nmake a\n```\n```sh\nunmarked\n```\n"
    assert [(b.tests, b.commands) for b in marked_blocks(marked)] == [(("a.py::t", "ci"), ["make a"])]


def test_readme_commands_are_the_demo() -> None:
    assert block_after("## Quick start") == ["make demo", "make test"]
    assert block_after("## A five-minute tour") == [
        'eval "$(.venv/bin/baton-dev cluster env --name demo)"',
        "kubectl get infd -n baton-demo",
        "make demo-down",
    ]
    text = README.read_text()
    assert [b.commands for b in marked_blocks(text)] == shell_blocks(text)
    assert {t for b in marked_blocks(text) for t in b.tests} == {DEMO_TEST, "ci"}


def test_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 160


def test_readme_names_only_existing_paths() -> None:
    text = README.read_text()
    paths = set(
        re.findall(
            r"`((?:engine|operator|charts|examples|images|devcluster|tests|bench|support|docs)/[^`* <]+)`",
            text,
        )
    )
    paths |= set(re.findall(r"\]\(((?:docs)/[^)#]+)", text))
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == []
