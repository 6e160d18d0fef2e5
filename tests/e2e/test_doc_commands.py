"""Every command line the README and docs/ show (``python -m kvtvm ...``,
``python examples/....py ...`` in their un-tagged code blocks) names options that command has:
each ``--option`` of the line appears in the command's ``--help`` (kvtvm's own commands, run
in-process) or among the ``add_argument`` names of the example script."""

import contextlib
import io
import itertools
import re
import shlex
from pathlib import Path

import pytest

from kvtvm.bench.__main__ import main as bench_main
from kvtvm.cli import main as cli_main

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _plain_blocks(text):
    """The contents of the code blocks with no language tag (shell lines here)."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = [] if line.strip() == "```" else False
            else:
                if current is not False:
                    blocks.append("\n".join(current))
                current = None
        elif current is not False and current is not None:
            current.append(line)
    return blocks


def _command_lines():
    for doc in DOCS:
        for block in _plain_blocks(doc.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("python "):
                    # {a,b,c}: one line per choice; [--opt x]: the option
                    choices = re.search(r"\{([\w,]+)\}", line)
                    names = choices.group(1).split(",") if choices else [None]
                    for name in names:
                        one = line if name is None else line.replace(choices.group(0), name)
                        yield doc.name, one.replace("[", "").replace("]", "")


def _help(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            (bench_main if argv[0] == "kvtvm.bench" else cli_main)([*argv[1:], "--help"])
        except SystemExit:
            pass
    return out.getvalue()


_HELPS: dict = {}


def _known_options(tokens):
    if tokens[1] == "-m":
        module, rest = tokens[2], tokens[3:]
        if module == "kvtvm" and rest[:1] == ["bench"]:
            module, rest = "kvtvm.bench", rest[1:]
        assert module in ("kvtvm", "kvtvm.bench"), module
        key = (module, *itertools.islice((r for r in rest if not r.startswith("-")), 1))
        if key not in _HELPS:
            _HELPS[key] = _help(list(key))
        return _HELPS[key]
    source = (ROOT / tokens[1]).read_text()
    return " ".join(re.findall(r"add_argument\(([^)]*)", source))


LINES = sorted(set(_command_lines()))


def test_the_docs_show_commands():
    assert len(LINES) >= 15
    assert any("generate" in line for _, line in LINES)


@pytest.mark.parametrize("doc,line", LINES, ids=[f"{d}: {ln[:60]}" for d, ln in LINES])
def test_documented_options_exist(doc, line):
    tokens = shlex.split(line)
    known = _known_options(tokens)
    assert "--" in known, f"{doc}: no options found for {line!r}"
    missing = [t.split("=")[0] for t in tokens
               if t.startswith("--") and f'{t.split("=")[0]}' not in known]
    assert not missing, f"{doc}: {line!r} names options the command lacks: {missing}"
