"""The documents against the code: the protocol version the spec states, the
signer of a coordinator record to a rank, links that resolve inside the
repository, and the README's module layout. A document that drifts from the
code misleads whoever implements or runs it, so each check names the fix."""

from __future__ import annotations

import json
import pathlib
import re

import msgpack
import pytest

from flodl_zmq.links import COORDINATOR_SENDER, RELAY_ROUTE, coordinator_sender, rank_of
from flodl_zmq.wire import PROTOCOL_VERSION
from flodl_zmq.wire.mac import label

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = (ROOT / "protocol" / "PROTOCOL.md").read_text()
PACKAGE = ROOT / "flodl_zmq"
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "examples" / "README.md",
                    *(ROOT / "docs").glob("*.md"), *(ROOT / "protocol").glob("*.md")])
# User documents that state the version this build speaks; docs/benchmarks.md is a dated log of measurements.
VERSIONED_DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "operations.md",
                       ROOT / "docs" / "architecture.md"]

# Every sentence form in PROTOCOL.md that states the current version (section: regex with the number as
# group 1). Each must be present, so rewording one breaks this test instead of slipping past it.
SPEC_VERSION_CLAIMS = {
    "title": r"\A# [^\n]*, version (\d+)\n",
    "3.2, the header's `v` row": r"^\| `v` \|[^\n]*`(\d+)` \|$",
    "7, check 7": r"`v` is the msgpack int (\d+)\b",
    "7, check 7's float example": r"a float such as (\d+)\.0\b",
    "4.2 and 3.5, the MAC labels": r'for V = "(\d+)"',
    "9.6, `join.hello`'s `protocol` field": r"^\| `protocol` \| Count \| the agent's protocol version \((\d+)\)",
    "12, the header's `v`": r"The header's `v` is (\d+)\b",
    "13, a restart": r"within version (\d+)\.",
    "13.1, a re-form": r"the version stays (\d+)\b",
}
# Versions named as history outside section 12 (section 12 is the history itself).
SPEC_HISTORY = ("Poly1305 of protocol version 1", "version 1's Poly1305")


def section(text: str, title: str) -> str:
    """The text under the heading that starts with `title` ("## 12."), up to the next one of its level or above."""
    level = len(title) - len(title.lstrip("#"))
    match = re.search(rf"^{re.escape(title)}[^\n]*\n(.*?)(?=^#{{1,{level}}} |\Z)", text, re.M | re.S)
    assert match, f"PROTOCOL.md has no heading {title!r}"
    return match.group(1)


def one_line(text: str) -> str:
    """`text` with every run of whitespace as one space, so a phrase wrapped over two lines still matches."""
    return " ".join(text.split())


def spec_version_problems(spec: str, version: int) -> list[str]:
    """Every place `spec` states a current protocol version other than `version`, or a claim form it lacks."""
    problems = []
    for where, pattern in SPEC_VERSION_CLAIMS.items():
        found = re.findall(pattern, spec, re.M)
        if not found:
            problems.append(f"{where}: no match for {pattern!r}; restore the sentence or update this test")
        problems += [f"{where} says {n}" for n in found if int(n) != version]
    prose = one_line(spec.replace(section(spec, "## 12."), ""))
    for history in SPEC_HISTORY:
        prose = prose.replace(history, "")
    for m in re.finditer(r"\bversion (\d+)\b", prose):
        if int(m.group(1)) != version:
            problems.append(f"outside section 12, {prose[m.start() - 40:m.end() + 20]!r}")
    return problems


def test_every_version_protocol_md_states_is_the_codes() -> None:
    problems = spec_version_problems(SPEC, PROTOCOL_VERSION)
    assert not problems, (
        f"protocol/PROTOCOL.md must state protocol version {PROTOCOL_VERSION} (codec.PROTOCOL_VERSION): "
        + "; ".join(problems))


@pytest.mark.parametrize("stale", ["`v` is the msgpack int 4", "| `v` | positive int | protocol version, `4` |",
                                   "the agent's protocol version (4)", "within version 4."])
def test_a_stale_version_reintroduced_in_the_spec_is_caught(stale: str) -> None:
    current = stale.replace("4", str(PROTOCOL_VERSION))
    assert current in SPEC, f"PROTOCOL.md no longer says {current!r}: update this test's sample"
    assert spec_version_problems(SPEC.replace(current, stale), PROTOCOL_VERSION)


def test_spec_mac_labels_name_the_codes_labels_and_their_lengths() -> None:
    # 3.5 and 4.2: NAME = "flodl-zmq/" || V || "/use" || 0x00   (N bytes for V = "v")
    row = r'^(\w+_LABEL)\s*= "flodl-zmq/" \|\| V \|\| "/([a-z-]+)" \|\| 0x00\s+\((\d+) bytes for V = "(\d+)"\)'
    rows = re.findall(row, SPEC, re.M)
    assert {use for _, use, _, _ in rows} == {"mac", "payload-key", "by-reference"}, (
        f"PROTOCOL.md 3.5 and 4.2 should define the mac, payload-key and by-reference labels, found {rows}")
    for name, use, size, version in rows:
        want = (PROTOCOL_VERSION, len(label(use)))
        assert (int(version), int(size)) == want, (
            f"PROTOCOL.md: {name} is {want[1]} bytes for V = \"{PROTOCOL_VERSION}\" (mac.label({use!r}))")


@pytest.mark.parametrize("path", VERSIONED_DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_documents_state_only_the_codes_protocol_version(path: pathlib.Path) -> None:
    # "since protocol version N" is history; any other "protocol version N" is what this build speaks.
    text = one_line(path.read_text())
    stale = [m.group(0) for m in re.finditer(r"(?<!since )protocol version (\d+)", text, re.I)
             if int(m.group(1)) != PROTOCOL_VERSION]
    assert not stale, (
        f"{path.relative_to(ROOT)} says {stale}: this build speaks protocol version {PROTOCOL_VERSION}")


def test_operations_md_names_the_version_this_build_speaks() -> None:
    text = one_line((ROOT / "docs" / "operations.md").read_text())
    assert re.search(rf"This build speaks protocol version {PROTOCOL_VERSION}\b", text), (
        f"docs/operations.md (Security model) should say 'This build speaks protocol version {PROTOCOL_VERSION}'")


# ---------------------------------------------------------------- the coordinator's signer per route (10.7)

ENVELOPES = json.loads((ROOT / "protocol" / "vectors" / "records.json").read_text())["envelopes"]


def test_coordinator_vectors_are_signed_by_the_stream_of_the_rank_their_route_names() -> None:
    checked = 0
    for vector in ENVELOPES:
        envelope = [bytes.fromhex(f) for f in vector["envelope"]]
        sender = msgpack.unpackb(bytes.fromhex(vector["frames"][0]))["from"]
        from_coordinator = sender.split(":")[0] == COORDINATOR_SENDER or vector["kind"].startswith("control.")
        if not envelope or not from_coordinator:
            continue
        route = envelope[-1]  # the route frame: a rank's identity, or empty for the relay itself
        rank = rank_of(route)
        assert rank is not None or route == RELAY_ROUTE, (
            f"envelope vector {vector['name']}: a coordinator record on route {route!r}, "
            "neither a rank's nor the relay's")
        want = coordinator_sender(rank) if rank is not None else COORDINATOR_SENDER
        assert sender == vector["signer"] == want, (
            f"envelope vector {vector['name']} (route {route!r}) is signed {sender!r}, must be {want!r}: "
            "fix protocol/vectors/generate.py and regenerate")
        checked += 1
    assert checked, "records.json has no envelope vector of a coordinator record: regenerate protocol/vectors"


def test_spec_envelope_table_signs_a_rank_route_as_that_ranks_stream() -> None:
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section(SPEC, "### 3.1").splitlines()
            if line.startswith("| ") and "coordinator" in line]
    assert rows, "PROTOCOL.md 3.1's envelope table names no coordinator leg"
    for leg, _, check in rows:
        plain = check.count("`coordinator`")
        assert "`coordinator:<r>`" in check, (
            f"PROTOCOL.md 3.1, leg {leg!r}: say a record to rank r is signed `coordinator:<r>`")
        assert plain == check.count("`coordinator` on the empty route"), (
            f"PROTOCOL.md 3.1, leg {leg!r}: plain `coordinator` only signs records to the relay (the empty route)")
        assert not (plain and "→ rank" in leg), (
            f"PROTOCOL.md 3.1, leg {leg!r}: a rank never gets a record signed plain `coordinator`")


# ---------------------------------------------------------------- links

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PARENT_PATH = re.compile(r"`(\.\./[^`\s]+)`")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces as hyphens)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc: pathlib.Path) -> None:
    text = FENCE.sub("", doc.read_text())
    targets = LINK.findall(text) + PARENT_PATH.findall(text)
    broken = []
    for target in targets:
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.is_relative_to(ROOT) or not file.exists():
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)}: fix or remove the links {broken}"


# ---------------------------------------------------------------- README's layout


def layout_modules() -> set[str]:
    """The module and package names (`fold.py`, `wire/`) in the first column of README.md's Layout table."""
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", (ROOT / "README.md").read_text(), re.M | re.S)
    assert match, "README.md has no '## Layout' section"
    names = set()
    for line in match.group(1).splitlines():
        if line.startswith("| `flodl_zmq/"):
            cell = line.split("|")[1]
            names |= {name.removeprefix("flodl_zmq/") for name in re.findall(r"`([^`]+)`", cell)}
    return names


def package_modules() -> set[str]:
    """Every top-level module of flodl_zmq/ (but its __init__ and __main__), and each subpackage as `name/`."""
    modules = {p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    return modules | {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}


def test_readme_layout_names_every_module_of_the_package() -> None:
    named, present = layout_modules(), package_modules()
    assert named == present, (
        f"README.md's Layout table: add {sorted(present - named)}, remove {sorted(named - present)} "
        "(flodl_zmq/ holds these modules)")
