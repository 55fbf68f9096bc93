"""Real text this machine has, as passages to build training samples from.

Four families, each full of look-alike passages (the case that matters: the answer sits in one of
several similar chunks):
- `changelog`: Debian package changelog entries (/usr/share/doc/*/changelog.Debian.gz): the same
  layout entry after entry, each with a package, a version, a maintainer, a date and bug numbers;
- `package`: Debian's package records (`apt-cache dumpavail`, tens of thousands where the package
  lists were fetched, else the installed ones in /var/lib/dpkg/status): records of one layout full
  of versions, sizes, maintainers and dependencies, siblings of one source package nearly alike;
  written as the record or as a short report;
- `reference`: Python's language reference topics (`pydoc_data.topics`), cut into paragraphs;
- `docstring`: the standard library's function and class docstrings, read from the sources with
  `ast` (nothing is imported).

Never the fidelity benchmark's generators, templates or names: the evaluation stays unseen. A
`holdout` share of each family (by a hash of its source) is kept out of training for the
ordinary-text check. Not here: questions (`samples.py`).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FAMILIES: tuple[str, ...] = ("changelog", "reference", "docstring", "package")
PACKAGE_FIELDS: tuple[str, ...] = ("Package", "Version", "Installed-Size", "Maintainer", "Architecture", "Depends",
                                   "Section", "Size", "Description")
_HEADER = re.compile(r"^(?P<pkg>[a-z0-9][a-z0-9+.-]+) \((?P<version>[^)]+)\) (?P<dist>[^;]+);.*$")
_TRAILER = re.compile(r"^ -- (?P<name>[^<]+?)\s*<[^>]*>\s+(?P<date>\w{3}, +\d{1,2} \w{3} \d{4})")


@dataclass(frozen=True, slots=True)
class Passage:
    family: str
    source: str  # what look-alikes share: a package, a topic, a module
    label: str  # the module's source label, as a corpus shows it
    text: str
    facts: tuple[tuple[str, str], ...] = ()  # (kind, value): changelog entries' package, version, name, date, bug


def held_out(source: str, share: float = 0.1) -> bool:
    """Whether `source` is kept out of training (for the ordinary-text check), by a stable hash."""
    return int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def changelog_entries(root: Path = Path("/usr/share/doc"), max_per_package: int = 12) -> Iterator[Passage]:
    for path in sorted(root.glob("*/changelog.Debian.gz")):
        try:
            lines = gzip.decompress(path.read_bytes()).decode("utf-8", "replace").splitlines()
        except (OSError, EOFError):
            continue
        entry: list[str] = []
        count = 0
        for line in lines:
            entry.append(line)
            m = _TRAILER.match(line)
            if not m:
                continue
            head = _HEADER.match(entry[0].strip()) if entry and entry[0].strip() else None
            body = [x for x in entry if x.strip()]
            entry = []
            if head is None or len(body) < 3 or len("\n".join(body)) > 1500:
                continue
            pkg, version = head["pkg"], head["version"]
            facts = [("package", pkg), ("version", version), ("name", m["name"].strip()),
                     ("date", " ".join(m["date"].split()[1:4]))]
            facts += [("bug", b) for b in re.findall(r"#(\d{5,7})", "\n".join(body))[:1]]
            yield Passage("changelog", pkg, f"{pkg}/changelog.Debian", "\n".join(body), tuple(facts))
            count += 1
            if count >= max_per_package:
                break


def _records(text: str) -> Iterator[dict[str, str]]:
    """Debian control records (RFC 822 style): field → value, continuation lines kept with their field."""
    for block in text.split("\n\n"):
        record: dict[str, str] = {}
        name = ""
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and name:
                record[name] += "\n" + line.strip()
            elif ":" in line:
                name, _, value = line.partition(":")
                record[name] = value.strip()
        if "Package" in record and "Version" in record:
            yield record


def _dumpavail() -> str:
    import subprocess

    try:
        out = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, timeout=300, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if out.count("\nPackage:") < 1000:  # no package lists fetched: the installed packages
        status = Path("/var/lib/dpkg/status")
        out = status.read_text(encoding="utf-8", errors="replace") if status.is_file() else ""
    return out


def package_records(text: str | None = None, max_per_source: int = 8, every: int = 3) -> Iterator[Passage]:
    """Debian package records (`text`: control records; None: this machine's, `_dumpavail`). Siblings of
    one source package share a `source`; `every`: keep one source package in so many (a stable hash), so
    the family does not swamp the others."""
    per: dict[str, int] = {}
    for r in _records(_dumpavail() if text is None else text):
        source = r.get("Source", r["Package"]).split()[0]
        if int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % every or per.get(source, 0) >= max_per_source:
            continue
        per[source] = per.get(source, 0) + 1
        summary, _, long = r.get("Description", "").partition("\n")
        maintainer = re.sub(r"\s*<[^>]*>", "", r.get("Maintainer", "")).strip()
        depends = [d.strip().split()[0] for d in r.get("Depends", "").split(",") if d.strip()]
        facts = [("package", r["Package"]), ("version", r["Version"]), ("maintainer", maintainer),
                 ("installed", r.get("Installed-Size", "")), ("size", r.get("Size", "")),
                 ("section", r.get("Section", "")), ("depends", depends[0] if depends else ""),
                 ("summary", summary.strip()), ("source", source)]
        facts = [(k, v) for k, v in facts if v]
        long_lines = [x for x in long.splitlines() if x and x != "."][:4]
        if int(hashlib.sha256(r["Package"].encode()).hexdigest()[:2], 16) % 2:
            lines = [f"{f}: {r[f]}" if f != "Description" else f"Description: {summary}" for f in PACKAGE_FIELDS if f in r]
            text_ = "\n".join(lines + [" " + x for x in long_lines])
        else:
            text_ = (f"{r['Package']} {r['Version']} ({r.get('Section', 'misc')}, {r.get('Architecture', 'any')}) is "
                     f"maintained by {maintainer or 'nobody'}. It takes {r.get('Installed-Size', '?')} kB once "
                     f"installed and {r.get('Size', '?')} bytes to download. "
                     + (f"It depends on {', '.join(depends[:6])}. " if depends else "It depends on nothing. ")
                     + f"{summary.strip()[:1].upper()}{summary.strip()[1:]}. " + " ".join(long_lines))
        yield Passage("package", source, f"debian/{r['Package']}", text_.strip(), tuple(facts))


def _paragraphs(text: str, min_words: int = 25, max_words: int = 170) -> Iterator[str]:
    words: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split())
        if not flat:
            continue
        words.extend(flat.split())
        if len(words) >= min_words:
            for i in range(0, len(words), max_words):
                part = words[i:i + max_words]
                if len(part) >= min_words:
                    yield " ".join(part)
            words = []


def reference_topics() -> Iterator[Passage]:
    from pydoc_data.topics import topics

    for topic in sorted(topics):
        for i, para in enumerate(_paragraphs(topics[topic])):
            yield Passage("reference", topic, f"reference/{topic}.txt", para)


def stdlib_docstrings(max_modules: int = 400) -> Iterator[Passage]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if not p.name.startswith("_"))[:max_modules]
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = path.stem
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 20:
                    for para in _paragraphs(doc, min_words=20):
                        yield Passage("docstring", module, f"{module}.py", f"{module}.{node.name}: {para}")


def gather(families: tuple[str, ...] = FAMILIES) -> list[Passage]:
    """Every passage of the named families this machine has (a family it lacks yields none)."""
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown text families {sorted(unknown)}; valid: {', '.join(FAMILIES)}")
    makers = {"changelog": changelog_entries, "reference": reference_topics, "docstring": stdlib_docstrings,
              "package": package_records}
    out: list[Passage] = []
    for family in families:
        out.extend(makers[family]())
    return out


if __name__ == "__main__":  # a count per family, to see what a machine offers
    from collections import Counter

    print(Counter(p.family for p in gather()), file=sys.stderr)
