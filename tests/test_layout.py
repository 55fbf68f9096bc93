"""The package's shape: imports point one way with no circles (module-level and lazy imports alike,
`TYPE_CHECKING` blocks aside), each package of the engine says what it is for, and no file grows far
past the length a reader takes in at once. Reads the source with `ast`; imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rag_promptcache"
MAX_LINES = 400  # the style guide's ~400; a file past it is split by job


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, at run time (anywhere in the file)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
            for child in node.body for n in ast.walk(child)}
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name != here:
                found.add(name)
    return found


def command_unit(module: str) -> str:
    """The command line is one unit: cli/ and each package's cli.py (its commands, which register
    on the one typer app and so import it while it imports them) count as `rag_promptcache.cli`."""
    parts = module.split(".")
    return "rag_promptcache.cli" if len(parts) > 1 and (parts[1] == "cli" or parts[-1] == "cli") else module


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    g: dict[str, set[str]] = {}
    for m, p in files.items():
        unit = command_unit(m)
        g.setdefault(unit, set()).update(command_unit(d) for d in imports(p, set(files)))
        g[unit].discard(unit)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    # a package's __init__ re-exporting its modules is not a circle: importing a module runs its
    # package's __init__ anyway, so edges into an __init__ from its own package's modules are dropped
    g = graph()
    for m, deps in g.items():
        g[m] = {d for d in deps if not (m.startswith(d + ".") and d in g)}
    assert cycles(g) == []


def test_imports_point_down_the_layers():
    """adapters, cli, server, bench → rag → engine → store / model / pml; nothing imports upwards."""
    order = {"pml": 0, "store": 0, "model": 0, "engine": 1, "rag": 2, "tune": 3, "server": 3, "bench": 3, "cli": 4}
    wrong = []
    for m, deps in graph().items():
        layer = m.split(".")[1] if m.count(".") else None
        for d in deps:
            target = d.split(".")[1] if d.count(".") else None
            if layer in order and target in order and order[target] > order[layer]:
                wrong.append(f"{m} -> {d}")
    assert wrong == []


def test_each_engine_package_says_what_it_is_for():
    for init in (PACKAGE / "engine").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)} has no docstring"


def test_no_file_is_far_past_the_length_a_reader_takes_in():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES + 25}
    assert long == {}


def test_every_module_imports():
    """A moved or renamed name breaks here, not in the one command that imports it."""
    import importlib
    import pkgutil

    import rag_promptcache

    broken = {}
    for info in pkgutil.walk_packages(rag_promptcache.__path__, "rag_promptcache."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            broken[info.name] = str(e)
    assert broken == {}


def test_the_engine_packages_import_one_way():
    """The engine's subpackages (prompt, planning, prefix, kv, compute, decoding, batching) form no
    circle among themselves either: one request's path reads down the tree (docs/ARCHITECTURE.md)."""
    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 else m

    g: dict[str, set[str]] = {}
    for m, deps in graph().items():
        if m.startswith("rag_promptcache.engine."):
            g.setdefault(package(m), set()).update(
                package(d) for d in deps if d.startswith("rag_promptcache.engine.") and package(d) != package(m))
    assert cycles(g) == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path, modules: set[str]) -> list[str]:
    """`from pkg.mod import _name` and `mod._name` in `path` where `mod` is another of the package's
    modules: a private name used across modules."""
    tree = ast.parse(path.read_text())
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    aliases: dict[str, str] = {}  # local name → the package module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif _private(a.name) and base in modules and base != here:
                    found.append(f"{here}: from {base} import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                and aliases.get(node.value.id, here) != here):
            found.append(f"{here}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return found


def test_no_module_uses_another_modules_private_names():
    """A name another module needs is public API, named and documented (STYLE.md)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    assert [u for p in files.values() for u in private_uses(p, set(files))] == []


def test_the_rag_modules_import_one_way():
    """rag/'s modules form no circle, counting imports inside functions (what a "lazy" import hides) and
    edges into rag/__init__ alike; only `TYPE_CHECKING` blocks are left out. The corpus, its answering and
    its lazy KV once imported each other round: `Corpus` owns its engine (rag/engine_slot.py) and the
    others receive what they need."""
    files = {module_name(p): p for p in (PACKAGE / "rag").rglob("*.py")}
    g = {m: {d for d in imports(p, set(files)) if d != m} for m, p in files.items()}
    assert cycles(g) == []


def corpus_privates() -> set[str]:
    """The private attributes and methods `Corpus` defines (rag/corpus.py)."""
    tree = ast.parse((PACKAGE / "rag" / "corpus.py").read_text())
    corpus = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Corpus")
    names = {n.name for n in corpus.body if isinstance(n, ast.FunctionDef)}
    names |= {n.attr for n in ast.walk(corpus) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id in ("self", "corpus") and isinstance(n.ctx, ast.Store)}
    return {n for n in names if _private(n)}


def _defines(node: ast.AST) -> set[str]:
    """What a class or module body defines for itself: its methods, and `self._x = ...` in them."""
    out = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef)}
    out |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return out


def test_no_module_reaches_a_private_attribute_of_the_corpus():
    """Outside rag/corpus.py nothing reads or calls what `Corpus` keeps private: not a function handed a
    corpus (`corpus._engine`), and not a class mixed into it (`self._lock` in a mixin that does not set it).
    A name a class or module defines for itself is its own (RetrievalLog's `_lock`). The harnesses and
    probes outside the package are held to it too."""
    private = corpus_privates()
    assert "_ingest_lock" in private  # what the check looks for is what corpus.py has
    found = []
    for p in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "research").glob("*.py")]:
        if p == PACKAGE / "rag" / "corpus.py":
            continue
        tree = ast.parse(p.read_text())
        own = _defines(tree)
        classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
        defined = {id(c): _defines(c) for c in classes}  # once a class: per node it was quadratic (100 s)
        in_class = {id(n): defined[id(c)] for c in classes for n in ast.walk(c)}
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr in private):
                continue
            is_self = isinstance(n.value, ast.Name) and n.value.id == "self"
            if n.attr not in (in_class.get(id(n), set()) if is_self else own):
                found.append(f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    assert found == []


RESEARCH = ROOT / "research"
BENCHMARKS = ROOT / "benchmarks"
OUTSIDE = ("research", "benchmarks")  # run from the repository, never installed


def test_no_package_module_imports_the_research_probes_or_the_benchmarks():
    """research/ and benchmarks/ sit outside the package (the wheel does not carry them): the product may not
    need them."""
    wrong = []
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{p.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in OUTSIDE]
    assert wrong == []


def test_the_package_list_holds_no_research_or_benchmark_module():
    """What setuptools packages (pyproject.toml's discovery, namespaces as it finds them) is rag_promptcache
    only; the probes and harnesses moved out of bench/ are not left behind there."""
    import tomllib

    from setuptools import find_namespace_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_namespace_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "rag_promptcache.bench" in packages
    assert [p for p in packages if p.split(".")[0] != "rag_promptcache"] == []
    package_stems = {p.stem for p in PACKAGE.rglob("*.py")}
    probes = {p.stem for p in RESEARCH.glob("*.py")} - {"__init__"}
    assert {"fidelity_probe", "selection_probe", "tune_probe", "tune_run", "link_ttft"} <= probes
    assert probes & package_stems == set()
    harnesses = {p.stem for p in BENCHMARKS.glob("*.py")} - {"__init__", "fidelity"}  # fidelity: the scenario's runner
    assert {"soak", "fuzz_hooks", "eviction_replay", "sustained_large", "retrieval", "shape", "replicas"} <= harnesses
    assert harnesses & {p.stem for p in (PACKAGE / "bench").rglob("*.py")} == set()
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert "prune research" in manifest and "prune benchmarks" in manifest  # nor does the sdist


def test_the_package_bench_holds_scenarios_not_runners():
    """`rag-promptcache bench` is the package's one way into bench/: a module there with a command line of its
    own is a harness only the project runs, and belongs in benchmarks/."""
    runners = [p.name for p in (PACKAGE / "bench").rglob("*.py") if '__name__ == "__main__"' in p.read_text()]
    assert runners == []


def test_every_research_probe_and_benchmark_imports_and_is_documented():
    """Runnable as `python -m research.NAME` / `python -m benchmarks.NAME` from the repository root: each
    imports (a moved name breaks here); a probe has its command-line entry point; each harness with one is
    named in benchmarks/README.md."""
    import importlib

    for p in sorted(RESEARCH.glob("*.py")):
        if p.stem == "__init__":
            continue
        importlib.import_module(f"research.{p.stem}")
        assert '__name__ == "__main__"' in p.read_text(), f"{p.name} has no entry point"
        assert len(p.read_text().splitlines()) <= MAX_LINES + 25
    readme = (BENCHMARKS / "README.md").read_text()
    for p in sorted(BENCHMARKS.glob("*.py")):
        if p.stem == "__init__":
            continue
        importlib.import_module(f"benchmarks.{p.stem}")
        assert len(p.read_text().splitlines()) <= MAX_LINES + 25, p.name
        if '__name__ == "__main__"' in p.read_text():
            assert f"python -m benchmarks.{p.stem}" in readme, f"benchmarks/README.md does not say how to run {p.name}"
