"""Every command the README shows exists and takes the options it is shown with (issue 30 item 6)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from common.cli.app import app

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The command lines inside the README's code blocks (comments and shell redirections cut off)."""
    lines, inside = [], False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        command = re.split(r"\s{2,}#|\s+[|>&]", line.strip())[0].strip()
        if inside and command.split(" ")[:1] in (["fedla"], ["python"], ["make"]):
            lines.append(command)
    return lines


def options_of(words: list[str]) -> set[str]:
    return {word.split("=")[0] for word in words if word.startswith("--")}


def unwrapped(text: str) -> str:
    return " ".join(text.replace("\u2502", " ").split())


COMMANDS = readme_commands()


def test_the_readme_shows_commands():
    assert any(c.startswith("make demo") for c in COMMANDS) and any(c.startswith("make test") for c in COMMANDS)
    assert sum(c.startswith("fedla ") for c in COMMANDS) >= 5


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("fedla ")])
def test_each_fedla_command_in_the_readme_parses(command):
    words = [re.sub(r"<[^>]+>", "x", w) for w in shlex.split(command)[1:]]
    path = []  # the subcommand words: the plain words before the first option
    for word in words:
        if word.startswith("-"):
            break
        path.append(word)
    runner = CliRunner()
    for depth in range(len(path), 0, -1):  # the longest prefix of plain words that is a command
        result = runner.invoke(app, [*path[:depth], "--help"])
        if result.exit_code == 0:
            break
    assert result.exit_code == 0, (command, result.output)
    shown = unwrapped(result.output)
    for option in options_of(words):
        assert option in shown, f"{command}: {option} is not an option of `fedla {' '.join(path[:depth])}`"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("python -m ")])
def test_each_python_module_in_the_readme_runs_its_help(command):
    words = shlex.split(command)
    result = subprocess.run(
        [sys.executable, "-m", words[2], "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, (command, result.stderr[-500:])
    for option in options_of(words[3:]):
        assert option in result.stdout, f"{command}: {option} is not an option of {words[2]}"


def test_each_make_target_in_the_readme_exists():
    targets = set(re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    for command in (c for c in COMMANDS if c.startswith("make ")):
        assert command.split()[1] in targets, command


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md", "docs/how-it-works.md"])
def test_links_lead_to_files_and_headings_that_exist(page):
    text = (REPO / page).read_text()
    headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, fragment = target.partition("#")
        if path:
            assert (REPO / page).parent.joinpath(path).exists(), f"{page}: no file {path}"
        elif fragment:
            assert fragment in headings, f"{page}: no heading #{fragment}"


def test_the_readme_is_a_front_page():
    """Two commands first, then a table of contents over every section; history lives in docs/benchmarks.md."""
    text = (REPO / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    contents = re.findall(r"^- \[[^]]+\]\(#([^)]+)\)$", text, flags=re.M)
    assert contents == [anchor(s) for s in sections]
    assert text.index("make demo") < text.index("make test") < text.index("- [")
    assert len(text.splitlines()) <= 200, "move history and long tables to docs/"


def layout_listing() -> set[str]:
    """The files docs/how-it-works.md's Layout block names, as repository paths."""
    text = (REPO / "docs" / "how-it-works.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed, top = set(), None
    for line in block.splitlines():
        if re.match(r"^(common|client|server)/ ", line):
            top = line.split("/")[0]
        elif top and re.match(r"^  \S+\.py ", line):
            listed.add(f"{top}/{line.split()[0]}")
    return listed


def test_the_layout_names_every_product_module_and_no_stale_one():
    listed = layout_listing()
    on_disk = {
        str(p.relative_to(REPO))
        for top in ("common", "client", "server")
        for p in (REPO / top).rglob("*.py")
        if p.name != "__init__.py" or p.parent.name == "daemon"  # daemon/__init__.py holds the daemon itself
    }
    assert sorted(on_disk - listed) == [] and sorted(listed - on_disk) == []
