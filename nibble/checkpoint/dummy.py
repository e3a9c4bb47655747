"""Random weights of the right format for a model built from config.json alone (`--load-format dummy`),
for benchmarks of the real Qwen3.5 shapes without the real weights.

Values are drawn on the model's device, one parameter (or expert chunk) at a time, at scales that keep a
deep random model finite: dense weights ~ N(0, 0.02), NVFP4 weights with uniform random codes and scales
that give a similar spread, zero-centred norms at 0 (multiplier 1), GDN decay rates in Qwen's range.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nibble.layers.gdn import GatedDeltaNet
from nibble.layers.linear import Linear
from nibble.layers.moe import RoutedExperts
from nibble.layers.norm import RMSNorm

DENSE_STD = 0.02
# Uniform E2M1 codes have an rms of about 3.2; block scale * global scale = 0.02 / 3.2 gives dense-like weights.
FP4_ELEMENT_SCALE = DENSE_STD / 3.2
EXPERT_CHUNK = 32


def _fill_fp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
              gen: torch.Generator) -> None:
    packed.copy_(torch.randint(0, 256, packed.shape, dtype=torch.uint8, device=packed.device, generator=gen))
    scale = torch.empty(block_scale.shape, dtype=torch.float32, device=block_scale.device)
    scale.uniform_(1.0, 2.0, generator=gen)
    block_scale.copy_(scale.to(torch.float8_e4m3fn))
    global_scale.fill_(FP4_ELEMENT_SCALE / 1.5)


def _fill_normal(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        t.normal_(0.0, std, generator=gen)
    else:
        tmp = torch.empty(t.shape, dtype=torch.float32, device=t.device).normal_(0.0, std, generator=gen)
        t.copy_(tmp)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of a nibble model with random values of its format (in place). An MTP head
    (`model.mtp`) draws from its own stream, so that the rest of the model gets the same values with or
    without it (speculative decoding benchmarks compare the two)."""
    head = getattr(model, "mtp", None)
    in_head = {id(m) for m in head.modules()} if isinstance(head, nn.Module) else set()
    _fill_modules([m for m in model.modules() if id(m) not in in_head], seed)
    if isinstance(head, nn.Module):
        _fill_modules(list(head.modules()), seed + 1)


def _fill_modules(modules: list[nn.Module], seed: int) -> None:
    params = [p for m in modules for p in m.parameters(recurse=False)]
    if not params:
        return
    device = params[0].device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    handled: set[int] = set()
    for mod in modules:
        if isinstance(mod, Linear):
            if mod.quantized:
                _fill_fp4(mod.weight.data, mod.weight_scale.data, mod.global_scale.data, gen)
            else:
                _fill_normal(mod.weight.data, DENSE_STD, gen)
            handled.update(id(p) for p in mod.parameters())
        elif isinstance(mod, RoutedExperts):
            for start in range(0, mod.num_experts, EXPERT_CHUNK):
                sl = slice(start, min(start + EXPERT_CHUNK, mod.num_experts))
                if mod.quantized:
                    _fill_fp4(mod.w13.data[sl], mod.w13_scale.data[sl], mod.w13_global.data[sl], gen)
                    _fill_fp4(mod.w2.data[sl], mod.w2_scale.data[sl], mod.w2_global.data[sl], gen)
                else:
                    _fill_normal(mod.w13.data[sl], DENSE_STD, gen)
                    _fill_normal(mod.w2.data[sl], DENSE_STD, gen)
            handled.update(id(p) for p in mod.parameters())
        elif isinstance(mod, RMSNorm):
            mod.weight.data.zero_()
            handled.add(id(mod.weight))
        elif isinstance(mod, GatedDeltaNet):
            w = mod.conv_weight.data
            _fill_normal(w, 1.0 / math.sqrt(w.shape[1]), gen)
            a = torch.empty(mod.A_log.shape, dtype=torch.float32, device=device).uniform_(1.0, 16.0, generator=gen)
            mod.A_log.data.copy_(a.log())
            mod.dt_bias.data.fill_(1.0)
            mod.norm_weight.data.fill_(1.0)
            handled.update(id(p) for p in (mod.conv_weight, mod.A_log, mod.dt_bias, mod.norm_weight))
    for p in params:
        if id(p) not in handled:
            _fill_normal(p.data, DENSE_STD, gen)
