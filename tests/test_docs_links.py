"""Every relative link and image in the user docs (README, docs/, benchmarks/, examples/) names a file that
exists, and a heading there where it names one (GitHub's anchors): results and docs move, and a
front door with dead links is a defect a test can catch."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/**/*.md"), *ROOT.glob("examples/*.md")]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # images too
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated heading's gets -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6}\s+(.+)$", FENCE.sub("", path.read_text()), re.M):
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        found.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return found


def test_anchors_follow_githubs_rule():
    assert github_anchor("The sender's dispatch plan in two kernels (run 11)") == (
        "the-senders-dispatch-plan-in-two-kernels-run-11"
    )
    assert github_anchor("Against the issue's targets (#19)") == "against-the-issues-targets-19"
    assert github_anchor("`ubatch.comm` and DTensor") == "ubatchcomm-and-dtensor"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_a_file_and_a_heading_that_exist(doc):
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # a URL or mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"
