"""Linear layers with a quantization method per layer.

A `Linear` may stack several checkpoint projections along its output dim (`output_sizes`, e.g. q|k|v or
in_proj_qkv|z|b|a) so that one GEMM serves them; each stacked piece is a *shard* loaded from its own
checkpoint tensor. The method is decided per layer: BF16/FP32 weights through the `dense_linear` op
(a Triton GEMV at decode sizes where the tuning table says so, torch's cuBLAS otherwise);
NVFP4 weights (ModelOpt) through the `nvfp4_linear` kernel (W4A16), with the checkpoint's global scale of
each shard expanded to one fp32 value per output row.

Under tensor parallelism a Linear holds a `Partition` of the checkpoint weight: column-parallel layers
(`output_sizes` given as partitions) keep some output rows of each shard, row-parallel ones
(`RowParallelLinear`, `in_features` given as a partition) keep some input columns and produce a partial
sum that is all-reduced. For NVFP4, splitting K splits the packed bytes (K/2) and the block scales (K/16)
along with it; the per-row global scale belongs to the row and so is kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nibble.formats.nvfp4 import GROUP_SIZE, NVFP4Tensor
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.parallel import (
    SINGLE,
    ParallelContext,
    Partition,
    TensorSource,
    numel,
    read_full,
    read_partition,
)


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit the parameter it is meant for."""


def check_tensor(name: str, tensor: TensorSource, shape: Sequence[int], dtypes: Sequence[torch.dtype]) -> None:
    """Raise WeightLoadError naming the tensor and the expected vs found shape/dtype."""
    if tuple(tensor.shape) != tuple(shape):
        raise WeightLoadError(f"tensor '{name}': expected shape {tuple(shape)}, found {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        found = str(tensor.dtype).replace("torch.", "")
        raise WeightLoadError(f"tensor '{name}': expected dtype {want}, found {found}")


def global_scale_value(name: str, tensor: torch.Tensor) -> float:
    """The NVFP4 weight_scale_2 scalar; NaN, inf or negative values are refused at load time, where the
    file can be named, rather than poisoning every token routed through the layer."""
    value = float(tensor.float().reshape(()))
    if not (value >= 0.0 and value != float("inf")):
        raise WeightLoadError(f"tensor '{name}': weight_scale_2 is {value}; it must be finite and >= 0")
    return value


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Linear(nn.Module):
    """y = x W^T for x [T, in_features] -> [T, sum(output_sizes)], no bias (Qwen3.5 has none).

    quantized=False: `weight` [N, K] in the model dtype. quantized=True (NVFP4): `weight` uint8 [N, K/2],
    `weight_scale` float8_e4m3fn [N, K/16], `global_scale` fp32 [N]. N and K are this rank's sizes: an int
    is a whole checkpoint dimension, a `Partition` the part of it this rank holds.
    """

    def __init__(self, in_features: int | Partition, output_sizes: Sequence[int | Partition], *, quantized: bool,
                 kernels: KernelSet, dtype: torch.dtype, device: torch.device | str, pad_rows_to: int = 1) -> None:
        super().__init__()
        self.in_partition = _as_partition(in_features)
        self.out_partitions = tuple(_as_partition(o) for o in output_sizes)
        self.in_features = self.in_partition.size
        self.output_sizes = tuple(p.size for p in self.out_partitions)
        self.out_features = sum(self.output_sizes)
        self.quantized = quantized
        self.kernels = kernels
        n, k = self.out_features, self.in_features
        if quantized:
            if k % GROUP_SIZE:
                raise ValueError(f"NVFP4 linear needs in_features divisible by {GROUP_SIZE}, got {k}")
            self.in_partition.scaled(GROUP_SIZE, "NVFP4 linear")
            self.weight = nn.Parameter(torch.empty(n, k // 2, dtype=torch.uint8, device=device),
                                       requires_grad=False)
            self.weight_scale = nn.Parameter(
                torch.empty(n, k // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)
            self.global_scale = nn.Parameter(torch.empty(n, dtype=torch.float32, device=device),
                                             requires_grad=False)
        else:
            # zero rows up to a multiple of pad_rows_to keep the output rows 16-byte aligned for cuBLAS (an odd
            # width such as 2305 gets a slow unaligned GEMM); forward's output includes them, callers slice
            rows = -(-n // pad_rows_to) * pad_rows_to
            self.weight = nn.Parameter(torch.zeros(rows, k, dtype=dtype, device=device), requires_grad=False)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load(self, name: str, kind: str, tensor: TensorSource, shard: int = 0) -> None:
        """Copy this rank's part of one checkpoint tensor into shard `shard`.

        kind: 'weight' | 'weight_scale' | 'weight_scale_2' | 'input_scale' (the last is W4A4-only: accepted
        and dropped).
        """
        rows = self.shard_rows(shard)
        out_part, in_part = self.out_partitions[shard], self.in_partition
        n, k = out_part.full, in_part.full
        if kind == "input_scale":
            if not self.quantized:
                raise WeightLoadError(f"tensor '{name}': NVFP4 input_scale for a layer that is not quantized")
            return
        if kind == "weight":
            if self.quantized:
                if tensor.dtype != torch.uint8:
                    raise WeightLoadError(
                        f"tensor '{name}': the quantization config makes this layer NVFP4 (uint8 weight), "
                        f"found {tensor.dtype}")
                check_tensor(name, tensor, (n, k // 2), (torch.uint8,))
                cols = in_part.scaled(2, name)
            else:
                if tensor.dtype == torch.uint8:
                    raise WeightLoadError(
                        f"tensor '{name}': found an NVFP4 (uint8) weight, but the quantization config "
                        f"excludes this layer (or the checkpoint has no hf_quant_config.json)")
                check_tensor(name, tensor, (n, k), FLOAT_DTYPES)
                cols = in_part
            self.weight.data[rows].copy_(read_partition(tensor, (out_part, cols)))
        elif kind == "weight_scale":
            if not self.quantized:
                raise WeightLoadError(f"tensor '{name}': NVFP4 scale for a layer that is not quantized")
            check_tensor(name, tensor, (n, k // GROUP_SIZE), (torch.float8_e4m3fn,))
            self.weight_scale.data[rows].copy_(read_partition(tensor, (out_part, in_part.scaled(GROUP_SIZE, name))))
        elif kind == "weight_scale_2":
            if not self.quantized:
                raise WeightLoadError(f"tensor '{name}': NVFP4 scale for a layer that is not quantized")
            if numel(tensor) != 1:
                raise WeightLoadError(f"tensor '{name}': expected a scalar, found shape {tuple(tensor.shape)}")
            self.global_scale.data[rows].fill_(global_scale_value(name, read_full(tensor)))
        else:
            raise WeightLoadError(f"tensor '{name}': unknown linear tensor kind '{kind}'")

    def nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.weight, self.weight_scale, self.global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return self.kernels.nvfp4_linear(x, self.nvfp4())
        return self.kernels.dense_linear(x, self.weight)

    def param_kinds(self) -> tuple[str, ...]:
        return ("weight", "weight_scale", "weight_scale_2") if self.quantized else ("weight",)

    def extra_repr(self) -> str:
        q = "nvfp4" if self.quantized else str(self.weight.dtype).replace("torch.", "")
        return f"in={self.in_features}, out={self.output_sizes}, {q}"


class FusedProjections(nn.Module):
    """Several projections of the same input, computed with as few GEMMs as their quantization allows.

    specs: (checkpoint name, output size or this rank's `Partition` of it, quantized) per projection.
    Consecutive projections with the same method share one `Linear`; `forward` returns one output
    [T, local size] per spec (views where possible).
    `locate(name)` gives the Linear and shard a checkpoint tensor goes to.
    """

    def __init__(self, in_features: int, specs: Sequence[tuple[str, int | Partition, bool]], *, kernels: KernelSet,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        groups: list[list[tuple[str, int | Partition, bool]]] = []
        for spec in specs:
            if groups and groups[-1][-1][2] == spec[2]:
                groups[-1].append(spec)
            else:
                groups.append([spec])
        self.linears = nn.ModuleList(
            Linear(in_features, [s[1] for s in g], quantized=g[0][2], kernels=kernels, dtype=dtype, device=device,
                   pad_rows_to=8)
            for g in groups)
        self._where: dict[str, tuple[int, int]] = {}
        for gi, g in enumerate(groups):
            for si, s in enumerate(g):
                self._where[s[0]] = (gi, si)
        self.names = tuple(s[0] for s in specs)

    def locate(self, name: str) -> tuple[Linear, int]:
        gi, si = self._where[name]
        return self.linears[gi], si  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for lin in self.linears:
            y = lin(x)
            if len(lin.output_sizes) == 1 and y.shape[-1] == lin.out_features:
                outs.append(y)
                continue
            start = 0
            for size in lin.output_sizes:
                outs.append(y[..., start:start + size])
                start += size
        return outs


class RowParallelLinear(Linear):
    """A Linear whose input dim is split across the ranks: x [T, K/tp] (this rank's columns of the
    previous column-parallel layer's output) -> [T, N], summed over the ranks when `reduce_results`.

    `reduce_results=False` leaves the partial sum to the caller, who folds more partial sums into one
    all-reduce (the MoE block adds its shared expert to the routed experts first).
    """

    def __init__(self, in_features: int, output_size: int, *, quantized: bool, kernels: KernelSet,
                 dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext = SINGLE,
                 reduce_results: bool = True) -> None:
        super().__init__(parallel.split(in_features, "row-parallel in_features"), [output_size],
                         quantized=quantized, kernels=kernels, dtype=dtype, device=device)
        self.parallel = parallel
        self.reduce_results = reduce_results and parallel.is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.parallel.all_reduce(y) if self.reduce_results else y


def _as_partition(size: int | Partition) -> Partition:
    return size if isinstance(size, Partition) else Partition.whole(size)
