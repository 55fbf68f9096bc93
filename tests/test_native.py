"""The native CPU kernels (model/native.py): built by the install or the explicit build step, never on
load; loaded only when this installation built them (build record, owner, permissions), else the torch
code runs after one warning; and the key relocation kernel (model/kernels/rope_shift.c) writes
what `RopeRelocator.rotate` computes, into its slice of a reserved buffer and nowhere else.
The attention kernel: tests/test_attention.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import warnings

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import assemble
from rag_promptcache.model import native
from rag_promptcache.model.positions import relocator_for
from rag_promptcache.store import MemoryStore
from tests.tiny import build

needs_native = pytest.mark.skipif(native.library() is None, reason="no avx512_bf16 CPU or no C compiler here")
HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))


def test_kernels_are_built_where_they_can_run():
    """A machine with the CPU flags and a compiler must get the kernels (`make venv` builds them): a
    silent fallback would hide a broken build behind skipped tests."""
    if not native.cpu_supports() or not HAS_CC:
        pytest.skip("no avx512_bf16 CPU or no C compiler here")
    assert native.library() is not None
    assert native.library_path().exists()


@pytest.fixture
def nowhere(monkeypatch, tmp_path):
    """A package directory and a cache home with no library in them, on a CPU that could run one."""
    monkeypatch.setattr(native, "KERNELS_DIR", tmp_path / "package")
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(native, "cpu_supports", lambda: True)
    monkeypatch.setattr(native, "_loaded", {})
    return tmp_path


def test_a_failed_build_warns_once_and_leaves_the_torch_code(monkeypatch, nowhere):
    tmp_path = nowhere
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert "exited 1" in native.build(tmp_path / "k.so")
    assert native.main(["build"]) == 1  # the explicit step says it failed
    with pytest.warns(RuntimeWarning, match="so the torch code runs instead") as caught:
        assert native.library() is None
    assert len(caught) == 1 and native.BUILD_HINT in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next call neither builds again nor warns
        assert native.library() is None
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.json"))
    monkeypatch.setenv("CC", "no-such-compiler --flag")
    assert "no-such-compiler --flag failed to run" in native.build(tmp_path / "k.so")


def test_loading_never_compiles(monkeypatch, nowhere):
    monkeypatch.setattr(native, "build", lambda path: pytest.fail(f"library() built {path}"))
    with pytest.warns(RuntimeWarning, match="is not built"):
        assert native.library() is None


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    assert native.library() is None


@pytest.mark.skipif(not HAS_CC or not native.cpu_supports(), reason="no C compiler or no avx512_bf16")
def test_a_damaged_library_is_refused_and_built_again_by_the_build_step(monkeypatch, nowhere):
    path = nowhere / "package" / native.LIBRARY_NAME
    assert native.build(path) is None
    path.write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match="sha256 differs"):
        assert native.library() is None
    assert native.main(["build"]) == 0  # the package directory is writable: it builds there
    monkeypatch.setattr(native, "_loaded", {})
    lib = native.library()
    assert lib is not None and path.read_bytes()[:4] == b"\x7fELF"
    assert native.library_path() == path


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_build_writes_a_loadable_library(tmp_path):
    path = tmp_path / "kernels" / "k.so"
    assert native.build(path) is None
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    assert native.check(path) is None and native.record_path(path).exists()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One library built into a scratch directory; each test copies it before spoiling it."""
    if not HAS_CC:
        pytest.skip("no C compiler")
    path = tmp_path_factory.mktemp("built") / native.LIBRARY_NAME
    assert native.build(path) is None
    return path


def _copy(built, into):
    into.mkdir(mode=0o755)
    for src in (built, native.record_path(built)):
        shutil.copy2(src, into / src.name)
    return into / built.name


def test_a_library_without_its_record_is_refused(built, tmp_path):
    path = _copy(built, tmp_path / "k")
    native.record_path(path).unlink()  # a file someone put at the predictable name
    assert "has no build record" in native.check(path)


def test_a_library_built_from_other_sources_is_refused(built, tmp_path):
    path = _copy(built, tmp_path / "k")
    record = json.loads(native.record_path(path).read_text())
    native.record_path(path).write_text(json.dumps({**record, "sources": "0" * 64}))
    assert "other sources" in native.check(path)


@pytest.mark.parametrize("spoil", ["library", "record", "directory"])
def test_a_library_others_could_have_written_is_refused(built, tmp_path, spoil):
    path = _copy(built, tmp_path / "k")
    target = {"library": path, "record": native.record_path(path), "directory": path.parent}[spoil]
    target.chmod(target.stat().st_mode | stat.S_IWOTH)
    assert "writable by group or others" in native.check(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_library_another_user_owns_is_refused(built, tmp_path):
    path = _copy(built, tmp_path / "k")
    os.chown(path, 65534, 65534)
    assert "belongs to uid 65534" in native.check(path)


@pytest.mark.parametrize("home", ["missing", "a file"])
def test_an_unusable_cache_home_falls_back_with_one_warning(tokenizer, monkeypatch, nowhere, home):
    where = nowhere / "x" / "y"
    if home == "a file":
        where = nowhere / "file"
        where.write_text("")  # <home>/kernels/... cannot exist below a file: stat raises NotADirectoryError
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(where))
    model = build("llama", vocab_size=len(tokenizer)).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="so the torch code runs instead") as caught:
        pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none")
        pc.add_schema('<schema name="s">You answer.<module name="d">A fact.</module></schema>')
        pc.encode("s")
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    # the explicit step creates a missing home and builds there; below a file it fails, and says so
    assert native.main(["build"]) == (0 if home == "missing" and HAS_CC else 1)


def _within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two bf16 tensors differ by at most one unit in the last place (bf16 keeps 8 significant bits)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2**-7).all())


@needs_native
@pytest.mark.parametrize("arch", ["llama", "phi_partial", "gpt_neox_pct25", "gemma3_text", "smollm3_nope"])
@pytest.mark.parametrize("shift", [300, -17])
def test_native_relocation_writes_what_rotate_computes(arch, shift, monkeypatch):
    model = build(arch)
    relocator = relocator_for(model)
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    keys = torch.randn(cfg.num_hidden_layers, 2, 37, head_dim).to(torch.bfloat16)
    buffer = torch.full((cfg.num_hidden_layers, 2, 100, head_dim), 7.0, dtype=torch.bfloat16)
    relocator.rotate_into(keys, shift, buffer[:, :, 20:57])
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    plain = torch.full_like(buffer, 7.0)
    relocator.rotate_into(keys, shift, plain[:, :, 20:57])
    assert (buffer[:, :, :20] == 7).all() and (buffer[:, :, 57:] == 7).all()  # its slice and nowhere else
    # the same fp32 arithmetic rounded once; torch may fuse a multiply-add where the kernel does not
    assert _within_one_ulp(buffer, plain)
    assert (buffer == plain).float().mean() > 0.99


@needs_native
def test_bf16_assembly_is_the_same_with_and_without_native_kernels(tokenizer, monkeypatch):
    model = build("llama", vocab_size=len(tokenizer)).to(torch.bfloat16)
    # the cached plan, whose assembly is compared, without the cost model's calibration "auto" runs first
    pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none", fallback="never")
    docs = "".join(f'<module name="d{i}">Document {i} says that the number {i} is the {i}th number.</module>'
                   for i in range(4))
    pc.add_schema(f'<schema name="s">You answer questions.{docs}</schema>')
    pc.encode("s")
    plan = pc.plan('<prompt schema="s"><d3/><d1/><d2/>Which number?</prompt>')

    def assembled():
        asm = assemble(plan.pieces, plan.kvs, pc.relocator, model.config, pc.geometry, model.device, model.dtype)
        return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in asm.cache.layers])

    fast = assembled()
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    assert _within_one_ulp(fast, assembled())


def test_check_says_which_copy_is_used_and_that_the_other_is_optional(nowhere, monkeypatch):
    package, home = nowhere / "package" / native.LIBRARY_NAME, nowhere / "home" / "kernels" / native.LIBRARY_NAME
    monkeypatch.setattr(native, "check", lambda p: None if p == package else f"{p} is not built")
    assert native.check_lines((package, home)) == [
        f"{package}: ok, this copy is used",
        f"{home} is not built (optional, not needed: the copy above is used)"]
    monkeypatch.setattr(native, "check", lambda p: None if p == home else f"{p} is not built")
    assert native.check_lines((package, home)) == [f"{package} is not built", f"{home}: ok, this copy is used"]
    monkeypatch.setattr(native, "check", lambda p: f"{p} is not built")
    lines = native.check_lines((package, home))
    assert lines[-1].startswith("no copy can be used: the torch code runs instead") and native.BUILD_HINT in lines[-1]
