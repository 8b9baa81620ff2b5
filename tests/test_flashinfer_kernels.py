"""The flashinfer kernel prebuild (epdserve/attention/flashinfer_kernels.py): which modules a model's runner loads,
which are built before the first forward and which in the background, and the build's threads, failures and
priority, against a stand-in for flashinfer's JIT API (CI has no flashinfer; the GPU tests in
tests/test_model_runtime.py run the real one and check that no module outside the prebuild is loaded)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import types

import pytest
import torch

from epdserve.attention.flashinfer_kernels import (KernelModule, foreground_and_background, kernel_modules,
                                                   start_kernel_build)
from epdserve.models.presets import PRESETS

BF16 = torch.bfloat16


def _text(preset: str) -> dict:
    return {"num_key_value_heads": 8, **PRESETS[preset]["text"]}


@pytest.mark.parametrize("preset, cuda_core_decode, head_dim", [
    ("qwen2.5-vl-3b", False, 128),   # 16 / 2 heads: tensor-core decode on the FA2 prefill module
    ("qwen2.5-vl-7b", False, 128),   # 28 / 4
    ("qwen3-vl-2b", True, 128),      # 16 / 8: below 4 query heads per KV head, the CUDA-core decode kernel
    ("qwen3.5-9b", False, 256),      # the gated-attention layers' head size
])
def test_modules_of_the_presets(preset, cuda_core_decode, head_dim):
    t = _text(preset)
    assert t["head_dim"] == head_dim
    mods = kernel_modules(t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"], BF16, fa3=True)
    kinds = [(m.kind, m.backend) for m in mods]
    assert kinds[:2] == [("prefill", "fa2"), ("prefill", "fa3")]
    assert (("decode", "") in kinds) == cuda_core_decode
    assert kinds[-2:] == [("norm", ""), ("activation", "")] and ("rope", "") not in kinds  # RoPE is Triton's
    assert all(m.head_dim == head_dim and m.dtype == BF16 for m in mods if m.kind in ("prefill", "decode"))
    # A GPU without FA3 (flashinfer's "auto" picks FA2 there): no FA3 module at all.
    assert all(m.backend != "fa3" for m in kernel_modules(head_dim, 16, 2, BF16, fa3=False))


def test_only_an_unbuilt_fa3_module_waits_for_the_background():
    mods = kernel_modules(128, 16, 2, BF16, fa3=True)
    fa3 = KernelModule("prefill", "fa3", 128, BF16)
    fg, bg = foreground_and_background(mods, built=set())
    assert bg == [fa3] and fa3 not in fg and len(fg) == len(mods) - 1
    fg, bg = foreground_and_background(mods, built={fa3})
    assert bg == [] and fg == mods


class FakeSpec:
    """A flashinfer ``JitSpec`` as far as the prebuild uses it."""

    def __init__(self, name: str, jit: "FakeFlashinfer"):
        self.name, self.jit = name, jit
        self.is_aot = name in jit.aot  # in flashinfer's prebuilt package (flashinfer-jit-cache)

    @property
    def is_compiled(self) -> bool:
        return self.name in self.jit.compiled or self.is_aot

    def build(self, verbose: bool) -> None:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.jit.builds.append((self.name, threading.current_thread().name, nice))
        if self.name in self.jit.fail:
            raise RuntimeError(f"Ninja build failed: nvcc died on {self.name}")
        self.jit.compiled.add(self.name)


class FakeFlashinfer:
    """Installs ``flashinfer``'s JIT entry points into ``sys.modules`` and records what the prebuild asks of them."""

    def __init__(self, monkeypatch, *, has_fa3: bool, compiled=(), fail=(), aot=()):
        self.has_fa3, self.compiled, self.fail, self.aot = has_fa3, set(compiled), set(fail), set(aot)
        self.builds: list[tuple[str, str, int]] = []  # (module, thread, nice)
        self.loaded: list[str] = []
        attention = types.SimpleNamespace(
            gen_batch_prefill_module=lambda backend, q, kv, o, idx, hd, hv, pe, swa, cap, f16: self.spec(
                f"prefill_{backend}_{hd}"),
            gen_batch_decode_module=lambda q, kv, o, idx, hd, hv, pe, swa, cap: self.spec(f"decode_{hd}"))
        mods = {
            "flashinfer": types.ModuleType("flashinfer"),
            "flashinfer.utils": types.SimpleNamespace(
                determine_attention_backend=lambda *a: "fa3" if self.has_fa3 else "fa2"),
            "flashinfer.jit": types.ModuleType("flashinfer.jit"),
            "flashinfer.jit.attention": types.ModuleType("flashinfer.jit.attention"),
            "flashinfer.jit.attention.modules": attention,
            "flashinfer.jit.norm": types.SimpleNamespace(gen_norm_module=lambda: self.spec("norm")),
            "flashinfer.jit.activation": types.SimpleNamespace(
                gen_act_and_mul_module=lambda act: self.spec(f"{act}_and_mul")),
            "flashinfer.prefill": types.SimpleNamespace(
                get_batch_prefill_module=lambda backend, *a: self.loaded.append(f"prefill_{backend}_{a[4]}")),
        }
        for name, mod in mods.items():
            monkeypatch.setitem(sys.modules, name, mod)

    def spec(self, name: str) -> FakeSpec:
        return FakeSpec(name, self)

    def built(self, thread_prefix: str) -> set[str]:
        return {name for name, thread, _ in self.builds if thread.startswith(thread_prefix)}


CUDA = torch.device("cuda", 0)


def test_fresh_hopper_machine_starts_on_fa2_and_moves_to_fa3(monkeypatch):
    fi = FakeFlashinfer(monkeypatch, has_fa3=True)
    build = start_kernel_build(128, 16, 2, BF16, CUDA)
    assert build.prefill_backend == "fa2" and not build.fa3_ready.is_set()
    build.wait()
    # Every module its own build (its own ninja run), on the build's threads, at the process's priority.
    assert fi.built("flashinfer-build") == {"prefill_fa2_128", "norm", "silu_and_mul"}
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert {nice for *_, nice in fi.builds} == {base}
    assert "prefill_fa3_128" not in fi.compiled  # not until the runner says its graphs are captured
    build.start_background()
    assert build.fa3_ready.wait(10)
    assert fi.built("flashinfer-fa3") == {"prefill_fa3_128"} and fi.loaded == ["prefill_fa3_128"]
    assert fi.builds[-1][2] == min(base + 10, 19) and os.getpriority(os.PRIO_PROCESS, 0) == base


def test_warm_machine_uses_fa3_from_the_start_and_checks_every_module(monkeypatch):
    every = ["prefill_fa2_128", "prefill_fa3_128", "decode_128", "norm", "silu_and_mul"]
    fi = FakeFlashinfer(monkeypatch, has_fa3=True, compiled=every)
    build = start_kernel_build(128, 16, 8, BF16, CUDA)
    assert build.prefill_backend == "fa3" and build.fa3_ready is None
    build.wait()
    build.start_background()
    # Built ones are still handed to ninja (it finds them up to date, or rebuilds stale ones now, all at once).
    assert fi.built("flashinfer-build") == set(every)
    assert fi.loaded == [] and all(t.name != "flashinfer-fa3" for t in threading.enumerate())


def test_modules_of_flashinfers_prebuilt_package_are_not_compiled(monkeypatch):
    every = ["prefill_fa2_128", "prefill_fa3_128", "norm", "silu_and_mul"]
    fi = FakeFlashinfer(monkeypatch, has_fa3=True, aot=every[:2])
    build = start_kernel_build(128, 16, 2, BF16, CUDA)
    build.wait()
    assert build.prefill_backend == "fa3" and build.fa3_ready is None  # FA3 is there from the package
    assert fi.built("flashinfer-build") == set(every[2:])


def test_gpu_without_fa3_builds_fa2_only(monkeypatch):
    fi = FakeFlashinfer(monkeypatch, has_fa3=False)
    build = start_kernel_build(256, 16, 4, BF16, CUDA)
    build.wait()
    assert build.prefill_backend == "fa2" and build.fa3_ready is None
    assert fi.built("flashinfer-build") == {"prefill_fa2_256", "norm", "silu_and_mul"}


def test_a_failed_build_fails_the_start_with_ninjas_message(monkeypatch):
    FakeFlashinfer(monkeypatch, has_fa3=True, fail=["norm"])
    build = start_kernel_build(128, 16, 2, BF16, CUDA)
    with pytest.raises(RuntimeError, match="flashinfer kernel build failed: Ninja build failed: nvcc died on norm"):
        build.wait()


def test_a_failed_background_build_keeps_fa2(monkeypatch, caplog):
    FakeFlashinfer(monkeypatch, has_fa3=True, fail=["prefill_fa3_128"])
    build = start_kernel_build(128, 16, 2, BF16, CUDA)
    build.wait()
    with caplog.at_level(logging.WARNING, logger="epdserve.attention.flashinfer_kernels"):
        build.start_background()
        for t in [t for t in threading.enumerate() if t.name == "flashinfer-fa3"]:
            t.join(10)
    assert not build.fa3_ready.is_set()
    assert "prefill stays on FA2" in caplog.text and "nvcc died on prefill_fa3_128" in caplog.text


def test_another_flashinfer_api_falls_back_to_its_lazy_builds(monkeypatch, caplog):
    fi = FakeFlashinfer(monkeypatch, has_fa3=True)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.attention.modules", types.SimpleNamespace(
        gen_batch_prefill_module=lambda *a: (_ for _ in ()).throw(TypeError("unexpected argument"))))
    with caplog.at_level(logging.WARNING, logger="epdserve.attention.flashinfer_kernels"):
        assert start_kernel_build(128, 16, 2, BF16, CUDA) is None
    assert "modules build on first use" in caplog.text and fi.builds == []


# ---------------------------------------------------------------- GPU: the real flashinfer

def _gpu_runner(tmp_path, heads: int, kv_heads: int):
    from test_model_runtime import _write_lm_checkpoint
    from epdserve.engine.model_runner import ModelRunner

    _write_lm_checkpoint(tmp_path, heads, kv_heads)
    return ModelRunner(str(tmp_path), attention_backend="flashinfer", device=torch.device("cuda"),
                       dtype=BF16, num_pages=64, page_size=16)


def _prefill(runner, prompt: torch.Tensor):
    from test_model_runtime import Seq, make_batch

    seq = Seq(prompt, [], list(range(-(-len(prompt) // 16))), 16)
    return runner.forward(make_batch([seq.extend_part(len(prompt))]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)])
def test_the_runner_loads_no_flashinfer_module_outside_its_prebuild(tmp_path, monkeypatch, heads, kv_heads):
    # Every module a forward loads goes through JitSpec.build_and_load (flashinfer 0.6): record them from a clean
    # cache of flashinfer's module getters, then run the runner's prefill and decode (and fused ops).
    pytest.importorskip("flashinfer")
    import flashinfer.activation, flashinfer.decode, flashinfer.norm, flashinfer.prefill, flashinfer.rope
    from flashinfer.jit.core import JitSpec

    for getter in (flashinfer.prefill.get_batch_prefill_module, flashinfer.decode.get_batch_decode_module,
                   flashinfer.norm.get_norm_module, flashinfer.activation.get_act_and_mul_module,
                   flashinfer.rope.get_rope_module):
        getter.cache_clear()
    loaded, real = [], JitSpec.build_and_load
    monkeypatch.setattr(JitSpec, "build_and_load", lambda self: (loaded.append(self.name), real(self))[1])
    runner = _gpu_runner(tmp_path, heads, kv_heads)
    runner.warmup()
    _prefill(runner, torch.randint(10, 600, (40,)))
    prebuilt = {spec.name for spec in runner.backend.kernels.specs.values()}
    print(f"{heads}/{kv_heads} heads: loaded {sorted(set(loaded))}; prebuilt {sorted(prebuilt)}")
    assert loaded and set(loaded) <= prebuilt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eager_prefill_moves_from_fa2_to_fa3_with_the_same_logits(tmp_path):
    pytest.importorskip("flashinfer")
    from flashinfer.utils import determine_attention_backend
    from epdserve.attention.flashinfer import FlashInferBackend

    if determine_attention_backend(torch.device("cuda"), 0, False, False, BF16, BF16) != "fa3":
        pytest.skip("flashinfer has no FA3 kernel for this GPU")
    runner = _gpu_runner(tmp_path, 8, 1)
    ready = threading.Event()
    runner.backend = runner.model.attn = FlashInferBackend(
        runner.kv_pool, runner.heads.num_heads, types.SimpleNamespace(prefill_backend="fa2", fa3_ready=ready))
    prompt = torch.randint(10, 600, (300,), generator=torch.Generator().manual_seed(0))
    fa2 = _prefill(runner, prompt)
    assert runner.backend._prefill_backend == "fa2"
    ready.set()  # what KernelBuild does once its background build has loaded FA3
    fa3 = _prefill(runner, prompt)
    assert runner.backend._prefill_backend == "fa3" and runner.backend._fa3_ready is None
    worst = float((fa2 - fa3).abs().max())
    print(f"eager prefill of 300 tokens, FA2 then FA3: max |logit difference| {worst:.3g} (bf16; bound 2e-2)")
    torch.testing.assert_close(fa3, fa2, atol=2e-2, rtol=2e-2)
