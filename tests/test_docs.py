"""The documentation holds together: the site builds with warnings as errors, and every
relative link in the Markdown (the README, docs/ and benchmarks/README.md) leads to a
file and a heading that exist, as GitHub renders them.

The site needs the ``docs`` extra (``pip install -e '.[docs]'``), which ``.ci/setup``
installs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Final

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: seconds ``mkdocs build`` may take (a few on an idle machine; griffe reads every module)
BUILD_TIMEOUT_S: Final = 240.0
#: the Markdown a reader meets on GitHub, and whose links must resolve there
MARKDOWN: Final = (
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted(ROOT.glob("docs/*.md")),
)
#: docs pages the README need not link: the site's home (the README's own sections) and
#: the page that includes benchmarks/README.md (the README links that file itself)
NOT_LINKED_FROM_README: Final = frozenset({"docs/index.md", "docs/benchmarks.md"})

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"\s*$', re.MULTILINE)


def _expand_snippets(text: str) -> str:
    """The text as the site renders it: pymdownx.snippets lines replaced by what they name."""

    def include(match: re.Match[str]) -> str:
        included = (ROOT / match.group(1)).read_text()
        section = match.group(2)
        if section is None:
            return included
        start, end = f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"
        return included.split(start, 1)[1].split(end, 1)[0]

    return _SNIPPET.sub(include, text)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where links are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the text lowercased, punctuation dropped,
    spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    text = _FENCE.sub("", _expand_snippets(path.read_text()))
    for heading in _HEADING.findall(text):
        slug = _github_slug(heading)
        n = 0
        while (f"{slug}-{n}" if n else slug) in anchors:
            n += 1
        anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def _relative_links(path: Path) -> list[str]:
    links = _LINK.findall(_prose(path.read_text()))
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    command += ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")]
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"`mkdocs build` took over {BUILD_TIMEOUT_S:.0f} s:\n{expired.output}")
    assert done.returncode == 0, (
        "`mkdocs build --strict` failed (the docs extra installs mkdocs: "
        f"pip install -e '.[docs]'):\n{done.stdout}{done.stderr}"
    )
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_every_relative_link_leads_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for path in MARKDOWN:
        for link in _relative_links(path):
            target, _, anchor = link.partition("#")
            file = (path.parent / target).resolve() if target else path
            where = f"{path.relative_to(ROOT)}: ({link})"
            if not file.is_relative_to(ROOT) or not file.exists():
                broken.append(f"{where}: no file {target}")
            elif anchor and anchor not in _anchors(file):
                broken.append(f"{where}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_leads_to_every_page_and_to_the_benchmarks() -> None:
    linked = {
        (ROOT / link.partition("#")[0]).resolve().relative_to(ROOT).as_posix()
        for link in _relative_links(ROOT / "README.md")
    }
    pages = {path.relative_to(ROOT).as_posix() for path in MARKDOWN[1:]}
    missing = sorted(pages - NOT_LINKED_FROM_README - linked)
    assert not missing, f"README.md links none of: {', '.join(missing)}"


#: How long the sharded-learner example (two spawned ranks and a worker) may take on a
#: loaded 2-core machine.
EXAMPLE_TIMEOUT_S: Final = 240.0


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 60)
def test_the_sharded_learner_example_runs_as_written() -> None:
    """docs/sharded.md shows docs/examples/sharded_fsdp2.py whole; run as the page says,
    its worker ends holding the learner's last version, equal to the gathered model."""
    example = "docs/examples/sharded_fsdp2.py"
    assert f'--8<-- "{example}"' in (ROOT / "docs" / "sharded.md").read_text()
    try:
        done = subprocess.run(
            [sys.executable, example],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=EXAMPLE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{example} took over {EXAMPLE_TIMEOUT_S:.0f} s:\n{expired.output}")
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last == "worker holds version 3; equal to the learner's gathered model: True", (
        done.stdout + done.stderr
    )
