"""Real text this machine has, gathered into a folder for a large corpus: Python's reference (the pydoc
topics), text files under /usr/share/doc, and `apt-cache dumpavail`'s package records (one document
per package, as JSON lines), up to about a number of tokens.

The records are look-alike documents (same fields, similar descriptions), as a ticket archive or a
product catalogue is; their checksum and file fields are left out (hex no question asks about, at
several tokens a character). Sizes are guessed at `BYTES_PER_TOKEN` while gathering; the corpus's
own count after ingest is the one reported. Whatever source is missing here (no apt, no docs) is
skipped, and the pydoc topics are always present.

Not here: ingesting it (the sustained scenario does, through `Corpus.build`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

BYTES_PER_TOKEN = 2.5  # about, on this mix in SmolLM2's module tokens (labels and overlap included); only to decide how much to gather
DOC_SHARE = 0.25  # at most this much of the target from /usr/share/doc
DOC_SUFFIXES = (".md", ".txt", ".rst", ".html", ".htm")
DOC_MAX_BYTES = 200_000  # one file at most: a long changelog is not a manual
SKIPPED_FIELDS = ("MD5sum", "SHA256", "SHA1", "SHA512", "Description-md5", "Filename", "Size")


@dataclass(frozen=True, slots=True)
class Gathered:
    folder: Path
    num_bytes: dict[str, int]  # per source: python, doc, apt
    num_documents: dict[str, int]


def gather(folder: Path, tokens: int, doc_root: Path = Path("/usr/share/doc")) -> Gathered:
    """Write about `tokens` tokens of real text under `folder` (python/, doc/, apt/packages.jsonl)."""
    from rag_promptcache.rag.sample import topic_texts

    folder.mkdir(parents=True, exist_ok=True)
    target = int(tokens * BYTES_PER_TOKEN)
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    (folder / "python").mkdir(exist_ok=True)
    for name, text in topic_texts().items():
        if sizes.get("python", 0) >= target:
            break
        (folder / "python" / f"{name}.txt").write_text(text, encoding="utf-8")
        sizes["python"] = sizes.get("python", 0) + len(text.encode())
        counts["python"] = counts.get("python", 0) + 1
    left = target - sizes["python"]
    if left > 0 and doc_root.is_dir():
        sizes["doc"], counts["doc"] = _docs(doc_root, folder / "doc", int(min(left, target * DOC_SHARE)))
        left -= sizes["doc"]
    if left > 0 and shutil.which("apt-cache"):
        sizes["apt"], counts["apt"] = _records(folder / "apt" / "packages.jsonl", left)
    return Gathered(folder, sizes, counts)


def _docs(root: Path, out: Path, limit: int) -> tuple[int, int]:
    total = count = 0
    for path in sorted(root.rglob("*")):
        if total >= limit:
            break
        name = path.name.lower()
        if not path.is_file() or path.is_symlink() or name == "copyright":
            continue
        if not (path.suffix.lower() in DOC_SUFFIXES or name.startswith("readme")):
            continue
        size = path.stat().st_size
        if not 500 <= size <= DOC_MAX_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        dest = out / path.relative_to(root)
        dest = dest.with_suffix(dest.suffix if dest.suffix.lower() in DOC_SUFFIXES else ".txt")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text, encoding="utf-8")
        total, count = total + size, count + 1
    return total, count


def _records(out: Path, limit: int) -> tuple[int, int]:
    """Package records spread over the whole list (every n-th), until `limit` bytes."""
    text = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, check=True).stdout
    records = [r for r in text.split("\n\n") if r.startswith("Package:")]
    step = max(1, round(len(records) * 600 / max(limit, 1)))  # records average about 600 bytes kept
    out.parent.mkdir(parents=True, exist_ok=True)
    total = count = 0
    seen: set[str] = set()
    with out.open("w", encoding="utf-8") as f:
        for start in range(step):  # every n-th first; a second pass fills in where that falls short
            for record in records[start::step]:
                if total >= limit:
                    return total, count
                kept = "\n".join(line for line in record.splitlines() if line.split(":", 1)[0] not in SKIPPED_FIELDS)
                name = kept.split("\n", 1)[0].removeprefix("Package:").strip()
                if name in seen:
                    continue
                seen.add(name)
                f.write(json.dumps({"id": name, "text": kept}) + "\n")
                total, count = total + len(kept.encode()), count + 1
    return total, count
