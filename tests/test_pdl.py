"""Programmatic dependent launch (PDL) of this project's Triton kernels: where it is on, and, on a Hopper GPU, that
a chain of them inside a CUDA graph (each kernel starting while the one before finishes) computes exactly what the
same kernels compute one at a time with the device idle between them (the chain starts with RoPE, which launches
plainly, or with the one-row layer front, after which the attention loads the older KV early). On any machine,
each kernel launched with PDL, compiled for Hopper (PTX), must wait (``griddepcontrol.wait``) before its first
global memory access, but for loads of what no kernel of the step writes, which some load early on purpose: weight
tiles, and the attention's page table and KV of earlier tokens.

A missing or misplaced ``griddepcontrol.wait`` shows here as a kernel reading its input before the kernel writing
it is done: stale q or KV in the attention, a stale activation in the MLP. Every replay gets fresh inputs, so a
stale read changes the result."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import triton

from epdserve.attention.base import KVWrite
from epdserve.attention.triton_decode import decode_attention, num_kv_splits
from epdserve.device import supports_pdl
from epdserve.models.decode_qkv import norm_qkv_rope
from epdserve.models.gate_up_silu import gate_up_silu
from epdserve.models.rope_inplace import rope_inplace


def test_pdl_is_off_on_the_cpu():
    assert supports_pdl(torch.device("cpu")) is False


def _hopper() -> bool:
    return torch.cuda.is_available() and supports_pdl(torch.device("cuda"))


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """flashinfer's RMSNorm (itself launched with PDL on Hopper) where installed, else torch's."""
    try:
        from flashinfer.norm import rmsnorm
    except ImportError:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)
    return rmsnorm(x, w, 1e-6)


class _Chain:
    """One decode layer's Triton kernels on static buffers: RoPE writing K and V into the cache, split-KV attention
    over it, RMSNorm, gate_up + SiLU. B requests of ``ctx`` cached tokens, 16 query / 2 KV heads of 128, page 16.
    ``front`` (B = 1): the one-row layer front instead of RoPE (add + RMSNorm, qkv, RoPE and the KV write in one
    kernel that launches the attention early), the attention loading the older KV before its wait."""

    def __init__(self, B: int = 4, ctx: int = 300, hq: int = 16, hkv: int = 2, d: int = 128, inter: int = 512,
                 front: bool = False, hidden: int = 512):
        dev, page = torch.device("cuda"), 16
        self.B, self.hq, self.hkv, self.d, self.front = B, hq, hkv, d, front
        self.x = torch.empty(B, hidden, dtype=torch.bfloat16, device=dev)
        self.w_qkv = (torch.randn((hq + 2 * hkv) * d, hidden, device=dev) * hidden ** -0.5).to(torch.bfloat16)
        self.gamma = torch.rand(hidden, device=dev).to(torch.bfloat16) + 0.5
        per = -(-(ctx + 1) // page)
        num_pages = B * per + 3
        self.kc = torch.empty(num_pages, page, hkv, d, dtype=torch.bfloat16, device=dev)
        self.vc = torch.empty_like(self.kc)
        self.indices = torch.randperm(num_pages, device=dev)[: B * per].to(torch.int32)
        self.indptr = torch.arange(0, B * per + 1, per, dtype=torch.int32, device=dev)
        self.lens = torch.full((B,), ctx + 1, dtype=torch.int32, device=dev)
        # the new token (index ctx) of each request: its page's slot
        pages = self.indices[self.indptr[:-1].long() + ctx // page].long()
        self.slots = pages * page + ctx % page
        self.qkv = torch.empty(B, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=dev)
        self.table = torch.empty(B, d, dtype=torch.float32, device=dev)
        self.norm_w = torch.rand(hq * d, device=dev).to(torch.bfloat16) + 0.5
        self.w = (torch.randn(2 * inter, hq * d, device=dev) * 0.02).to(torch.bfloat16)
        self.splits = num_kv_splits(B, hkv, torch.cuda.get_device_properties(dev).multi_processor_count)
        assert self.splits > 1  # the merge kernel runs too

    def refill(self, g: torch.Generator) -> None:
        """Fresh inputs in place: the qkv row, each token's angles, the whole KV cache."""
        self.qkv.copy_(torch.randn(self.qkv.shape, generator=g, device="cuda"))
        self.x.copy_(torch.randn(self.x.shape, generator=g, device="cuda"))
        angles = torch.rand(self.B, self.d // 2, generator=g, device="cuda") * 6.28
        self.table.copy_(torch.cat([angles.cos(), angles.sin()], dim=-1))
        self.kc.copy_(torch.randn(self.kc.shape, generator=g, device="cuda"))
        self.vc.copy_(torch.randn(self.vc.shape, generator=g, device="cuda"))

    def run(self, serial: bool) -> torch.Tensor:
        """The chain; with ``serial`` the host waits for the device after each kernel (nothing can overlap)."""
        wait = torch.cuda.synchronize if serial else (lambda: None)
        hq, hkv, d = self.hq, self.hkv, self.d
        kv = KVWrite(self.kc.view(-1, hkv, d), self.vc.view(-1, hkv, d), self.slots)
        if self.front:
            qkv = norm_qkv_rope(self.x, self.w_qkv, None, self.gamma, 1e-6, None, d, hq, hkv, self.table, kv)[0]
        else:
            qkv = self.qkv
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        if not self.front:
            rope_inplace(q, k, d, self.table, v=v, kv_write=kv)
        wait()
        o = decode_attention(q.view(self.B, hq, d), self.kc, self.vc, self.indptr, self.indices, self.lens,
                             d ** -0.5, self.splits, early=self.front)
        wait()
        x = _rmsnorm(o.view(self.B, hq * d), self.norm_w)
        wait()
        y = gate_up_silu(x, self.w)
        wait()
        return y


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA device of compute capability >= 9.0 (PDL)")
@pytest.mark.parametrize("front", [False, True])
def test_a_pdl_chain_in_a_cuda_graph_equals_the_kernels_run_one_at_a_time(front):
    torch.manual_seed(0)
    chain, g = _Chain(B=1 if front else 4, front=front), torch.Generator(device="cuda").manual_seed(1)
    chain.refill(g)
    chain.run(serial=False)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain.run(serial=False)
    for _ in range(20):
        chain.refill(g)
        saved = chain.qkv.clone(), chain.kc.clone(), chain.vc.clone()
        graph.replay()
        got, cache = out.clone(), (chain.kc.clone(), chain.vc.clone())
        chain.qkv.copy_(saved[0])
        chain.kc.copy_(saved[1])
        chain.vc.copy_(saved[2])
        want = chain.run(serial=True)
        assert torch.equal(chain.kc, cache[0]) and torch.equal(chain.vc, cache[1])
        assert torch.equal(got, want)


# ---- where the waits are: each kernel compiled for Hopper (sm_90) to PTX, on any machine ---------------------------

_MEMORY = re.compile(r"^(@!?%p\d+ )?(ld\.global|st\.global|cp\.async\.(ca|cg)|atom|red)\S*")


def _ptx(kernel, pointers: dict[str, str], constexprs: dict, **options) -> list[str]:
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 with PDL on: its PTX lines. Unnamed arguments are
    int32 and, like every pointer, divisible by 16 (how Triton specializes the usual aligned launch)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in params}
    scalars = {p for p, t in sig.items() if t in ("fp32",)}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in constexprs and p not in scalars}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return [line.strip() for line in triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            .asm["ptx"].splitlines()]


def _before_wait(lines: list[str]) -> list[str]:
    """The global memory instructions before the first ``griddepcontrol.wait`` (which must be there)."""
    at = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    assert any(line.startswith("griddepcontrol.launch_dependents") for line in lines[at:])
    return [line for line in lines[:at] if _MEMORY.match(line)]


def _kernels():
    from epdserve.attention import triton_decode
    from epdserve.models import decode_gemv, decode_qkv, parts_gemm
    from epdserve.models import gate_up_silu as gus
    from epdserve.models import moe_decode

    bf16 = "*bf16"
    split, merge = triton_decode._kernel()
    split_ptrs = {p: bf16 for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        p: "*i32" for p in ("kv_indptr", "kv_indices", "kv_lens")} | {
        "part_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    return {
        "split": (split, split_ptrs, dict(GROUP=8, HEAD_ROWS=16, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=32,
                                          BLOCK_N=32, DIRECT=False, PRECISION=None, EARLY=True),
                  dict(num_warps=4, num_stages=2)),
        "split_late": (split, split_ptrs, dict(GROUP=8, HEAD_ROWS=16, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=8,
                                               BLOCK_N=64, DIRECT=False, PRECISION=None, EARLY=False),
                       dict(num_warps=4, num_stages=3)),
        "merge": (merge, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": bf16},
                  dict(HEAD_DIM=128, NUM_SPLITS=32, SPLITS_POW2=32), dict(num_warps=4)),
        "gate_up_silu": (gus._kernel()[0], {"x": bf16, "w": bf16, "y": bf16, "r": bf16, "r_out": bf16, "gamma": bf16,
                                         "eps": "fp32"},
                         dict(BM=16, BN=32, BK=128, IEEE=False, NORM=False, RESID=False, NM=4, BKN=16),
                         dict(num_warps=4, num_stages=3)),
        "norm_gate_up_silu": (gus._kernel()[0], {"x": bf16, "w": bf16, "y": bf16, "r": bf16, "r_out": bf16,
                                              "gamma": bf16, "eps": "fp32"},
                              dict(BM=16, BN=32, BK=128, IEEE=False, NORM=True, RESID=True, NM=4, BKN=2048),
                              dict(num_warps=4, num_stages=3)),
        "norm_gate_up_silu_gemv": (gus._kernel()[1], {"x": bf16, "w": bf16, "y": bf16, "r": bf16, "r_out": bf16,
                                                         "gamma": bf16, "eps": "fp32"},
                                   dict(BN=gus.GEMV_BN, BK=2048, NORM=True, RESID=True),
                                   dict(num_warps=gus.GEMV_WARPS)),
        "norm_gemv": (decode_gemv._kernel()[0], {p: bf16 for p in ("x", "r", "r_out", "n_out", "gamma", "w", "bias",
                                                                   "y")} | {"eps": "fp32"},
                      dict(S=1, BM=4, BN=8, BK=2048, NORM=True, RESID=True, NORMED=True, BIAS=True), dict(num_warps=4)),
        "norm_parts": (decode_gemv._kernel()[2], {"x": "*fp32", "r": bf16, "gamma": bf16, "y": bf16, "r_out": bf16,
                                                 "eps": "fp32"},
                       dict(S=3, BK=2048, R_OUT=True), dict(num_warps=4)),
        # the split-K GEMM of 2-128 rows (o at 32 rows): 2 of 4 K tiles of 32 x 128 before the wait
        "gemm_parts": (parts_gemm._kernel(), {"x": bf16, "w": bf16, "parts": "*fp32"},
                       dict(BM=32, BN=32, BK=128, KS=512, PRE=2, IEEE=False), dict(num_warps=4, num_stages=3)),
        "down_parts": (decode_gemv._kernel()[1], {"x": bf16, "w": bf16, "parts": "*fp32"},
                       dict(BM=4, BN=8, BK=2048), dict(num_warps=4)),
        # (the previous block's down projection in 3 float32 split-K parts, as the 3B's at one row)
        "norm_qkv_rope": (decode_qkv._kernel(), {p: bf16 for p in ("r", "r_out", "gamma", "w", "bias", "y", "kc",
                                                                   "vc")} | {"x": "*fp32", "table": "*fp32",
                                                                             "slots": "*i64", "eps": "fp32"},
                          dict(S=3, HQ=16, HKV=2, D=128, HALF=64, P=4, BK=2048, RESID=True, BIAS=True, WRITE_KV=True),
                          dict(num_warps=4)),
        # the MoE experts at Qwen3-VL-30B-A3B's shapes (top 8 of width 768)
        "moe_routing": (moe_decode._kernel()[2], {"logits": bf16, "weights": bf16, "experts": "*i64"},
                        dict(TOPK=8, BE=128, KP=8), dict(num_warps=4)),
        "moe_gate_up": (moe_decode._kernel()[0], {"x": bf16, "w": bf16, "experts": "*i64", "act": bf16},
                        dict(TOPK=8) | {k: v for k, v in moe_decode.GATE_UP_LAUNCH.items() if k.isupper()},
                        {k: v for k, v in moe_decode.GATE_UP_LAUNCH.items() if not k.isupper()}),
        "moe_down": (moe_decode._kernel()[1], {"act": bf16, "w": bf16, "experts": "*i64", "weights": bf16,
                                               "out": bf16},
                     dict(TOPK=8) | {k: v for k, v in moe_decode.down_launch(8, 768).items() if k.isupper()},
                     {k: v for k, v in moe_decode.down_launch(8, 768).items() if not k.isupper()}),
    }


@pytest.mark.parametrize("name", ["split", "split_late", "merge", "gate_up_silu", "norm_gate_up_silu", "norm_gemv",
                                  "down_parts", "norm_parts", "norm_qkv_rope", "moe_routing", "moe_gate_up",
                                  "moe_down", "norm_gate_up_silu_gemv", "gemm_parts"])
def test_each_kernel_waits_for_the_previous_one_before_touching_its_outputs(name):
    kernel, pointers, constexprs, options = _kernels()[name]
    lines = _ptx(kernel, pointers, constexprs | {"PDL": True}, launch_pdl=True, **options)
    early = _before_wait(lines)
    loaded = sum(16 if ".v4.b32" in line else 0 for line in early)  # bytes per thread in 16-byte loads
    if name in ("gate_up_silu", "norm_gate_up_silu"):  # the first gate and up weight tiles only: 2 x 32 x 128
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)  # bf16 / 128 threads
        assert loaded == 2 * 32 * 128 * 2 // 128
    elif name in ("norm_gemv", "down_parts", "norm_qkv_rope"):  # loads only (weights, bias, norm weight, angles);
        # the whole 8 x 2048 weight slice among them
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)
        assert loaded >= 8 * 2048 * 2 // 128
    elif name == "gemm_parts":  # loads only, exactly the prefetched 32 x 256 weight tile (not x, not the loop's)
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)
        assert loaded == 32 * 2 * 128 * 2 // 128
    elif name == "norm_gate_up_silu_gemv":  # loads only: the whole 4 + 4 x 2048 weight slice and the norm weight
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)
        assert loaded >= 2 * 4 * 2048 * 2 // 128
    elif name == "split":  # loads only (the lengths, the page table and the split's first K and V block of 32
        # tokens, all but each request's newest token: its K and V come from the kernel just before)
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)
        assert loaded >= 2 * 32 * 128 * 2 // 128
    elif name == "norm_parts":  # the norm weight only (2048 bf16), not the parts or the residual
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)
        assert sum(16 if ".v4.b32" in line else 8 if ".v2.b32" in line else 4 for line in early) <= 2048 * 2 // 128
    elif name == "moe_down":  # loads only (the expert ids, routing weights, and the 8 experts' 2 x 768 rows)
        assert early and all(_MEMORY.match(line).group(2) == "ld.global" for line in early)
        assert loaded >= 8 * 2 * 768 * 2 // 128
    else:
        assert early == []
    off = _ptx(kernel, pointers, constexprs | {"PDL": False}, **options)
    assert not any("griddepcontrol" in line for line in off)
