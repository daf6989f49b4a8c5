"""The README is a newcomer's page that tells the truth: its loop is the example's, its figures
are docs/benchmarks.md's, its commands exist and its links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from controlplane.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
#: The pages whose links are checked (docs/benchmarks.md and docs/security.md have their own
#: owners; their links into these pages are checked through the anchors below all the same).
LINKED = (
    "README.md",
    "docs/design.md",
    "docs/operations.md",
    "docs/settings.md",
    "docs/deploy/kubernetes.md",
)
#: A number as the pages write them (4,096; 0.087), not part of a word (p50, dp=64 are not).
NUMBER = re.compile(r"(?<![\w.=])\d[\d,]*(?:\.\d+)?(?![\w])")


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_the_readme_is_short():
    lines = README.count("\n")
    assert lines <= 300, f"README.md has {lines} lines; the newcomer's page keeps to 300"


def test_the_loop_shown_is_the_examples_own_code():
    section = _section(README, "Putting it in a training loop")
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    example = (ROOT / "examples" / "train.py").read_text(encoding="utf-8")
    assert code in example, "the README's loop differs from examples/train.py: copy it again"
    for call in ("Session(build", "session.steps(", "with session.step():", "session.finish()"):
        assert call in code


def test_every_headline_figure_is_stated_in_the_benchmarks_with_its_command():
    rows = [
        line
        for line in _section(README, "Headline figures").splitlines()
        if line.startswith("| ") and not line.startswith(("| what", "| ---"))
    ]
    assert len(rows) >= 5
    stated = set(NUMBER.findall(BENCHMARKS))
    for row in rows:
        _what, figure, command = (cell.strip() for cell in row.strip("|").split(" | "))
        command = command.strip("`")
        assert command.startswith("elasticctl "), row
        assert command in " ".join(BENCHMARKS.split()), (
            f"docs/benchmarks.md never names `{command}`"
        )
        numbers = NUMBER.findall(figure)
        assert numbers, row
        missing = [n for n in numbers if n not in stated]
        assert not missing, f"{missing} of '{figure}' are not in docs/benchmarks.md"


def test_every_command_is_named():
    group = typer.main.get_group(app)
    commands = []
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", None)
        if subcommands:
            commands += [f"elasticctl {name} {sub}" for sub in subcommands]
        else:
            commands.append(f"elasticctl {name}")
    missing = [c for c in commands if c not in README]
    assert not missing, f"README never names {missing}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        for title in re.findall(r"^#{1,6} (.+)$", text, re.M)
    }


def test_links_between_the_pages_lead_somewhere():
    broken = []
    for page in LINKED:
        path = ROOT / page
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif (
                anchor
                and linked.suffix == ".md"
                and anchor not in _anchors(linked.read_text(encoding="utf-8"))
            ):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken
