"""The README and the docs stay true: every Python and shell block either runs here, as written, in a
folder holding `docs/` and a corpus named `my-corpus`, or says why not (`<!-- not run: REASON -->` on
the line above it); every measured table is what scripts/bench_tables.py writes from the bench's
JSON. The site itself is built strictly by `make docs`, which `make test` runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>.+?) -->\s*$")
RUNNABLE = ("python", "bash", "sh", "shell", "console")


def blocks(page: Path) -> list[tuple[str, str, str | None, int]]:
    """(language, code, why it is not run or None, line) of each fenced block."""
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        tag = NOT_RUN.match(before.strip())
        out.append((m.group("lang"), m.group("code"), tag.group("reason") if tag else None,
                    text.count("\n", 0, m.start()) + 1))
    return out


def test_every_code_block_runs_or_says_why_not():
    untagged_shell, unknown = [], []
    for page in PAGES:
        for lang, _, reason, line in blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            if lang in ("bash", "sh", "shell", "console") and reason is None:
                untagged_shell.append(where)  # shell blocks install, serve or take minutes: each says why
            if lang not in (*RUNNABLE, "text", "json", "jsonl", "xml", "html", "toml", "yaml", "") :
                unknown.append(f"{where} ({lang})")
    assert not untagged_shell, f"shell blocks without <!-- not run: REASON -->: {untagged_shell}"
    assert not unknown, f"code blocks in a language this test does not know: {unknown}"
    assert sum(1 for p in PAGES for lang, _, reason, _ in blocks(p) if lang == "python" and reason is None) >= 5


def test_measured_tables_are_written_from_the_bench_json():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- bench-table ") == 1 and "**5.9x**" in readme  # the headline table is there, filled


def test_the_readme_is_short_and_links_only_to_what_exists():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", readme):
        assert (ROOT / target).exists(), target


# -- the runnable blocks, as written -----------------------------------------------------------------

@pytest.fixture(scope="module")
def my_corpus(tmp_path_factory, smollm):
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import Corpus

    root = tmp_path_factory.mktemp("docs-blocks")
    docs = root / "docs"
    docs.mkdir()
    (docs / "paris.txt").write_text("The Eiffel Tower is a wrought-iron tower in Paris, France. It opened in 1889.")
    (docs / "rome.txt").write_text("The Colosseum is an ancient amphitheatre in the centre of Rome, Italy.")
    engine = PromptCache(*smollm, name="smollm2-135m-instruct")
    Corpus.build([docs], root / "my-corpus", engine=engine)
    return root


@pytest.fixture(scope="module")
def each_model_loads_once():
    """The blocks open and build corpora as a user does, and each of those loads its model; here a model
    asked with the same arguments is loaded once for all the pages and shared, as the blocks only read it
    (loading itself is test_model_loading's)."""
    import functools

    import rag_promptcache.engine.engine as engine_module

    with pytest.MonkeyPatch.context() as mp:
        loaded = functools.cache(engine_module.load_model)
        mp.setattr(engine_module, "load_model", loaded)
        yield loaded


RUN_PAGES = [p for p in PAGES if any(lang == "python" and reason is None for lang, _, reason, _ in blocks(p))]


@pytest.mark.smollm
@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.name for p in RUN_PAGES])
def test_python_blocks_run_as_written(page, my_corpus, each_model_loads_once, tmp_path, monkeypatch, capsys):
    """A page's Python blocks run in order in one namespace (a later block may use an earlier one's
    names), in a copy of the folder, so that a block that builds or changes the corpus changes its own."""
    work = tmp_path / "work"
    shutil.copytree(my_corpus, work)
    monkeypatch.chdir(work)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for lang, code, reason, line in blocks(page):
        if lang == "python" and reason is None:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
    out = capsys.readouterr().out
    if "Eiffel" in page.read_text():
        assert "Paris" in out, out
