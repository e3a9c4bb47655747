"""What every kernel self-test (selftest.py, selftest_gdn.py) is built on: `SelfTestContext` (the model's
config and dtypes, the device, a seeded generator for fresh random inputs, the tolerance), `_call` with
`poison`, `rel_err` and `SelfTestFailure`.

Outputs that kernels allocate themselves are caught when left unwritten by poisoning the allocator: a
NaN-filled block of each expected output size is freed just before the call, so the caching allocator
hands that memory to the kernel's `torch.empty`.

Separate from the tests so that the tests of one part of the model can have a module of their own
(selftest_gdn.py) that imports it without an import cycle through the table of tests (`SELF_TESTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nibble.models.config import ModelConfig


class SelfTestFailure(RuntimeError):
    pass


def dense_split(c: ModelConfig, tp: int) -> int:
    """The tensor-parallel size one rank's attention, GDN and shared-expert shapes are taken at: tp where it
    divides their heads and the shared expert (and KV heads split tp ways or tp divides them, one per rank),
    else 1, the whole model's shapes (the loader refuses such a split with the reason)."""
    split = (c.linear_num_key_heads, c.linear_num_value_heads, c.num_attention_heads,
             c.shared_expert_intermediate_size)
    if any(n % tp for n in split) or (c.num_key_value_heads % tp and tp % c.num_key_value_heads):
        return 1
    return tp


@dataclass
class SelfTestContext:
    """What the self-tests run on: the model, device, dtypes, KV page size, the random source, and this
    process's place under tensor parallelism (tp_size ranks), whose projections the linear self-tests take
    (`selftest.dense_linear_shapes`), whose heads the attention, norm and GDN ones take (`attention_heads`,
    `linear_heads`) and whose share of the routed experts the MoE one takes (I / tp_size features of every
    expert, or with expert_parallel whole experts, num_experts / tp_size of them)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    block_size: int
    generator: torch.Generator
    tp_size: int = 1
    expert_parallel: bool = False

    @property
    def moe_share(self) -> tuple[int, int]:
        """(experts held, intermediate size of each) on one rank; the whole layer where the split would not
        divide it (or leave I off the 16-feature NVFP4 groups): the loader refuses those with the reason."""
        c = self.config
        e, inter, n = c.num_experts, c.moe_intermediate_size, self.tp_size
        if self.expert_parallel and n > 1 and e % n == 0:
            return e // n, inter
        if not self.expert_parallel and n > 1 and inter % (16 * n) == 0:
            return e, inter // n
        return e, inter

    @property
    def attention_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) of one rank's attention layer: each split tp ways, or one KV head where
        there are fewer KV heads than ranks (`layers.attention.kv_head_partition`); the whole layer's where
        `dense_split` takes the whole model."""
        c, n = self.config, dense_split(self.config, self.tp_size)
        return c.num_attention_heads // n, max(c.num_key_value_heads // n, 1)

    @property
    def linear_heads(self) -> tuple[int, int]:
        """(key heads, value heads) of one rank's Gated DeltaNet layer, each split tp ways (`dense_split`)."""
        c, n = self.config, dense_split(self.config, self.tp_size)
        return c.linear_num_key_heads // n, c.linear_num_value_heads // n

    @property
    def linear_conv_dim(self) -> int:
        """Channels of one rank's GDN conv1d: its q, k and v features."""
        hk, hv = self.linear_heads
        c = self.config
        return 2 * hk * c.linear_key_head_dim + hv * c.linear_value_head_dim

    @property
    def tol(self) -> float:
        return {torch.float32: 1e-4, torch.float16: 1e-2}.get(self.dtype, 2e-2)

    def randn(self, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(shape, generator=self.generator, device=self.device, dtype=torch.float32)
        return (x * scale).to(dtype or self.dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device, dtype=torch.float32)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator, device=self.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def poison(device: torch.device, *shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Fill then free blocks of the given sizes so the next allocations of those sizes start as NaN
    (or 0xFF bytes for integer types)."""
    blocks = []
    for shape, dtype in shapes_dtypes:
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0xFF)
        blocks.append(t)
    del blocks


def rel_err(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    if out.shape != ref.shape:
        raise SelfTestFailure(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        raise SelfTestFailure(f"{name}: dtype {out.dtype} != reference {ref.dtype}")
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        raise SelfTestFailure(f"{name}: {int((~torch.isfinite(o)).sum())} non-finite values")
    err = float((o - r).norm() / r.norm().clamp_min(1e-30))
    if not err <= tol:
        raise SelfTestFailure(f"{name}: relative error {err:.3g} > {tol:g}")
    return err


def _call(fn: Callable, device: torch.device, outs: list[tuple[tuple[int, ...], torch.dtype]], *args, **kwargs):
    poison(device, *outs)
    res = fn(*args, **kwargs)
    _sync(device)
    return res
