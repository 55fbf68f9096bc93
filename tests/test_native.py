"""The native CPU kernels (model/native.py): built where they can run, a failed build warns once and
leaves the torch code in charge, and the key relocation kernel (model/kernels/rope_shift.c) writes
what `RopeRelocator.rotate` computes, into its slice of a reserved buffer and nowhere else.
The attention kernel: tests/test_attention.py."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.assemble import assemble
from rag_promptcache.model import native
from rag_promptcache.model.positions import relocator_for
from rag_promptcache.store import MemoryStore
from tests.tiny import build

needs_native = pytest.mark.skipif(native.library() is None, reason="no avx512_bf16 CPU or no C compiler here")
HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))


def test_kernels_are_built_where_they_can_run():
    """A machine with the CPU flags and a compiler must get the kernels: a silent fallback would hide
    a broken build behind skipped tests."""
    if not native.cpu_supports() or not HAS_CC:
        pytest.skip("no avx512_bf16 CPU or no C compiler here")
    assert native.library() is not None
    assert native.library_path().exists()


def test_a_failed_build_warns_once_and_leaves_the_torch_code(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setattr(native, "cpu_supports", lambda: True)
    monkeypatch.setattr(native, "_loaded", {})
    assert "exited 1" in native.build(tmp_path / "k.so")
    with pytest.warns(RuntimeWarning, match="could not be built, so the torch code runs instead"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next call neither builds again nor warns
        assert native.library() is None
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))
    monkeypatch.setenv("CC", "no-such-compiler --flag")
    assert "no-such-compiler --flag failed to run" in native.build(tmp_path / "k.so")


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    assert native.library() is None


@pytest.mark.skipif(not HAS_CC or not native.cpu_supports(), reason="no C compiler or no avx512_bf16")
def test_a_damaged_library_is_built_again_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    path = native.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    lib = native.library()
    assert lib is not None and path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_build_writes_a_loadable_library(tmp_path):
    path = tmp_path / "kernels" / "k.so"
    assert native.build(path) is None
    assert path.exists() and not list(path.parent.glob("*.tmp"))


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
    pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none")
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
