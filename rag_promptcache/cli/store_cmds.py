"""`rag-promptcache store info|verify|evict`: inspect and manage a corpus's module store on disk.

Formatting only: the work is `rag_promptcache.store.describe / verify / evict_to`. No model is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import App, app, fail, handle_errors

store_app = App(help="Inspect, verify or shrink a corpus's module store.", no_args_is_help=True)
app.add_typer(store_app, name="store")

CorpusOpt = Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)]


def _disk(corpus: Path):
    from rag_promptcache.rag import is_corpus
    from rag_promptcache.rag.layout import read_manifest
    from rag_promptcache.store import DiskStore

    if not is_corpus(corpus):
        raise fail(f"{corpus} is not a corpus (no manifest.json)")
    # the codec the corpus writes with (its manifest's), as `store info` says; a manifest this version
    # cannot read still leaves its store open to inspection, with the store's default codec
    try:
        codec = read_manifest(corpus).codec
    except ValueError:
        return DiskStore(corpus / "store")
    return DiskStore(corpus / "store", codec=codec)


@store_app.command("info")
@handle_errors
def store_info(corpus: CorpusOpt, as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Entries, bytes, bytes per token and codec of the store."""
    from rag_promptcache.cli.output import echo_facts, mib
    from rag_promptcache.store import describe

    facts = describe(_disk(corpus))
    echo_facts(facts, [
        ("store", f"{facts['root']} ({facts['kind']})"),
        ("entries", f"{facts['num_entries']} ({facts['num_tokens']} tokens)"),
        ("size", f"{mib(facts['num_bytes'])}, {facts['bytes_per_token']:.0f} bytes per token"),
        ("codec", f"{facts['codec']} (what new entries are written with; each entry records its own)"),
        ("hits", f"{facts['num_hits']} hits, {facts['num_misses']} misses (hit rate {facts['hit_rate']:.2f}), {facts['num_errors']} errors"),
        ("corrupt", _corrupt_line(facts["corrupt"])),
    ], as_json)


def _corrupt_line(found: list[dict[str, object]]) -> str:
    if not found:
        return "none found"
    last = found[-1]
    return f"{len(found)} entr{'y' if len(found) == 1 else 'ies'} found corrupt and removed (recomputed on use); last: {last['key']} ({last['why']})"


@store_app.command("verify")
@handle_errors
def store_verify(corpus: CorpusOpt) -> None:
    """Check every stored module's header and checksum; bad ones are removed (recomputed on use)."""
    from rag_promptcache.store import verify

    report = verify(_disk(corpus))
    typer.echo(f"checked {report.num_checked} entries, removed {len(report.bad_keys)} bad")
    for key in report.bad_keys:
        typer.echo(f"  removed now: {key}")
    for entry in report.found_earlier:
        typer.echo(f"  removed earlier, when read: {entry['key']} ({entry['why']})")


@store_app.command("evict")
@handle_errors
def store_evict(corpus: CorpusOpt, to: Annotated[str, typer.Option("--to", help="Target size: bytes, or with KB/MB/GB.")]) -> None:
    """Evict least-recently-used modules until the store fits; evicted modules are recomputed on use."""
    from rag_promptcache.store import evict_to

    evicted = evict_to(_disk(corpus), parse_size(to))
    typer.echo(f"evicted {len(evicted)} entries")


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    try:
        return int(float(number) * units[t[len(number):]])
    except (ValueError, KeyError) as e:
        raise ValueError(f"bad size {text!r}; use bytes or a number with KB, MB, GB, KiB, MiB, GiB") from e
