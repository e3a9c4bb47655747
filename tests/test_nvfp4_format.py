"""nibble.formats.nvfp4 against NVIDIA ModelOpt's NVFP4QTensor: bit-identical packed codes, e4m3 block
scales and global scales; dequantization against ModelOpt's and against the exact product."""

from __future__ import annotations

import pytest
import torch

from nibble.formats import nvfp4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def Q():
    """ModelOpt's NVFP4QTensor (importing modelopt takes ~10 s, so once per module)."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    return qtensor.NVFP4QTensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_matches_modelopt(Q, w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> None:
    ref_q, ref_scale, ref_scale_2 = Q.quantize(w.clone(), 16, weights_scaling_factor_2=weight_scale_2)
    packed, block_scale, scale_2 = nvfp4.quantize(w, weight_scale_2)
    assert packed.dtype == torch.uint8 and block_scale.dtype == torch.float8_e4m3fn
    assert scale_2.dtype == torch.float32 and scale_2.shape == ()
    assert torch.equal(packed, ref_q._quantized_data), "packed FP4 codes differ from ModelOpt"
    assert torch.equal(_bits(block_scale), _bits(ref_scale)), "e4m3 block scales differ from ModelOpt"
    assert torch.equal(_bits(scale_2), _bits(ref_scale_2.reshape(()))), "weight_scale_2 differs from ModelOpt"


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Per-row magnitudes over three decades so that block scales cover much of the e4m3 range.
    rows = torch.logspace(-3, 0, shape[-2]).reshape(-1, 1)
    heavy = torch.randn(shape, generator=g) * torch.randn(shape, generator=g).abs()
    return (heavy * rows).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 16), (5, 32), (3, 48), (17, 4096), (2, 3, 5, 32), (4, 20), (3, 33)])
def test_quantize_bit_identical_to_modelopt(Q, shape, dtype):
    assert_matches_modelopt(Q, _random(shape, dtype, seed=sum(shape)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_when_k_not_multiple_of_16(Q, dtype):
    packed, block_scale, _ = nvfp4.quantize(_random((3, 33), dtype, 1))
    assert packed.shape == (3, 24) and block_scale.shape == (3, 3)
    assert_matches_modelopt(Q, _random((3, 33), dtype, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_get_scale_one(Q, dtype):
    w = _random((6, 64), dtype, 2)
    w[2, 16:32] = 0
    w[4] = 0
    assert_matches_modelopt(Q, w)
    _, block_scale, _ = nvfp4.quantize(w)
    assert block_scale[2, 1].float() == 1.0 and bool((block_scale[4].float() == 1.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier(Q, dtype):
    w = _random((8, 64), dtype, 3) * 1e-2
    w[5, 7] = 300.0
    assert_matches_modelopt(Q, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_scales_in_e4m3_subnormal_range_and_clamped(Q, dtype):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 64, generator=g)
    w[0] *= 1e3
    w[1] *= 1e-1  # block scales ~ 448e-4: e4m3 subnormals
    w[2] *= 3e-2
    w[3] *= 1e-4  # below 2^-9 * amax / 448: clamped to the smallest subnormal
    assert_matches_modelopt(Q, w.to(dtype))
    _, block_scale, _ = nvfp4.quantize(w.to(dtype))
    assert bool((block_scale[3].float() == 2.0**-9).all())


def test_tiny_magnitudes_fp32(Q):
    g = torch.Generator().manual_seed(5)
    for magnitude in (1e-20, 1e-37, 1e-41):  # the last gives a subnormal fp32 weight_scale_2
        assert_matches_modelopt(Q, torch.randn(8, 32, generator=g) * magnitude)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_on_rounding_ties(Q, dtype):
    # amax 2688 makes weight_scale_2 exactly 1; a block whose amax is 6 gets block scale 1, so the block's
    # values reach the E2M1 rounding unchanged: every midpoint between neighbouring codes, both signs.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    block = torch.cat([ties, -ties])
    w = torch.stack([block, block * 0.5, torch.full((16,), 2688.0)]).to(dtype)
    assert_matches_modelopt(Q, w)
    packed, _, scale_2 = nvfp4.quantize(w)
    assert float(scale_2) == 1.0
    codes = nvfp4.unpack_fp4(packed)[0]
    values = nvfp4.e2m1_table()[codes.long()]
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    assert torch.equal(values, torch.cat([expected, -expected]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_weight_scale_2(Q, dtype):
    """The export path: gate and up of one expert quantized with the larger of their global scales."""
    gate, up = _random((8, 32), dtype, 6), _random((8, 32), dtype, 7) * 3
    shared = nvfp4.compute_weight_scale_2(gate, up)
    assert torch.equal(_bits(shared), _bits(Q.get_weights_scaling_factor_2(torch.cat([gate, up])).reshape(())))
    assert_matches_modelopt(Q, gate, shared)
    assert_matches_modelopt(Q, up, shared)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_tensor_deviates_from_modelopt_nan(Q, dtype):
    w = torch.zeros(4, 32, dtype=dtype)
    _, ref_scale, _ = Q.quantize(w.clone(), 16)
    assert bool(ref_scale.float().isnan().all()), "ModelOpt behaviour changed: zero tensors no longer give NaN"
    packed, block_scale, scale_2 = nvfp4.quantize(w)
    assert not bool(packed.any()) and float(scale_2) == 0.0
    assert bool((block_scale.float() == 1.0).all())
    assert not bool(nvfp4.dequantize(packed, block_scale, scale_2).any())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_modelopt(Q, dtype):
    w = _random((2, 9, 64), dtype, 8)
    ref_q, ref_scale, ref_scale_2 = Q.quantize(w.clone(), 16)
    ref = ref_q.dequantize(torch.float32, scale=ref_scale, double_scale=ref_scale_2, block_sizes={-1: 16})
    packed, block_scale, scale_2 = nvfp4.quantize(w)
    ours = nvfp4.dequantize(packed, block_scale, scale_2)
    # ModelOpt rounds block_scale * weight_scale_2 before multiplying by the code; nibble multiplies the
    # exact code * block_scale product, so the two may differ by one fp32 ulp.
    torch.testing.assert_close(ours, ref, rtol=2.5e-7, atol=0)
    codes = nvfp4.e2m1_table(dtype=torch.float64)[nvfp4.unpack_fp4(packed).long()]
    exact = codes * block_scale.double().repeat_interleave(16, -1) * scale_2.double()
    assert torch.equal(ours, exact.float()), "dequantize is not the correctly rounded exact product"


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    packed = nvfp4.pack_fp4(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(packed[..., 0], codes[..., 0] | (codes[..., 1] << 4)), "low nibble must be the even element"
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(nvfp4.pack_fp4(nvfp4.unpack_fp4(every_byte)), every_byte)


def test_e2m1_codes_match_modelopt_cast(Q):
    grid = torch.arange(-8 * 256, 8 * 256 + 1, dtype=torch.float32) / 256  # every tie lies on this grid
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, -1e-45, 1e30, -1e30])
    x = torch.cat([grid, special])
    assert torch.equal(nvfp4.e2m1_codes(x), Q._cast_fp4(x.clone()))


def test_e2m1_codes_fixed_points_and_signed_zero():
    table = nvfp4.e2m1_table()
    codes = nvfp4.e2m1_codes(table)
    assert torch.equal(table[codes.long()], table)
    assert nvfp4.e2m1_codes(torch.tensor([-0.1, 0.1, -0.0, 7.0, -100.0])).tolist() == [8, 0, 0, 7, 15]


def test_quantize_to_compute_form_per_expert_global_scale(Q):
    w = _random((3, 8, 32), torch.bfloat16, 10)
    w[1] *= 50
    t = nvfp4.quantize_to_compute_form(w)
    assert t.shape == (3, 8, 32) and t.global_scale.shape == (3, 8)
    for e in range(3):
        ref_q, ref_scale, ref_scale_2 = Q.quantize(w[e].clone(), 16)
        assert torch.equal(t.packed[e], ref_q._quantized_data)
        assert torch.equal(_bits(t.block_scale[e]), _bits(ref_scale))
        assert bool((t.global_scale[e] == ref_scale_2).all())
    deq = t.dequantize()
    assert torch.equal(deq[1], nvfp4.dequantize(t.packed[1], t.block_scale[1], t.global_scale[1, 0]))


def test_from_checkpoint_expands_global_scale():
    w = _random((8, 32), torch.bfloat16, 11)
    packed, block_scale, scale_2 = nvfp4.quantize(w)
    t = nvfp4.from_checkpoint(packed, block_scale, scale_2)
    assert t.global_scale.shape == (8,) and bool((t.global_scale == scale_2).all())
    assert torch.equal(t.dequantize(), nvfp4.dequantize(packed, block_scale, scale_2))
    stacked = nvfp4.from_checkpoint(torch.stack([packed, packed]), torch.stack([block_scale, block_scale]),
                                    torch.stack([scale_2, scale_2 * 2]).reshape(2, 1))
    assert stacked.global_scale.shape == (2, 8) and float(stacked.global_scale[1, 3]) == float(scale_2) * 2


@pytest.mark.parametrize("case, message", [
    ("weight_dtype", "experts.0.gate_proj.weight: expected dtype uint8"),
    ("scale_dtype", "experts.0.gate_proj.weight_scale: expected dtype float8_e4m3fn"),
    ("scale_shape", "experts.0.gate_proj.weight_scale: expected shape (8, 2)"),
    ("scale_2_dtype", "experts.0.gate_proj.weight_scale_2: expected dtype float32"),
    ("scale_2_shape", "experts.0.gate_proj.weight_scale_2: expected one value"),
    ("scale_2_nan", "experts.0.gate_proj.weight_scale_2: expected finite non-negative"),
])
def test_from_checkpoint_errors(case, message):
    packed, block_scale, scale_2 = nvfp4.quantize(_random((8, 32), torch.float32, 12))
    if case == "weight_dtype":
        packed = packed.to(torch.int8)
    elif case == "scale_dtype":
        block_scale = block_scale.float()
    elif case == "scale_shape":
        block_scale = block_scale[:, :1]
    elif case == "scale_2_dtype":
        scale_2 = scale_2.to(torch.bfloat16)
    elif case == "scale_2_shape":
        scale_2 = scale_2.repeat(3)
    elif case == "scale_2_nan":
        scale_2 = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nvfp4.from_checkpoint(packed, block_scale, scale_2, name="experts.0.gate_proj")


def test_quantize_rejects_bad_input():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        nvfp4.quantize(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or NaN"):
        nvfp4.quantize(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        nvfp4.quantize(torch.ones(16))
    with pytest.raises(ValueError, match="K a multiple of 16"):
        nvfp4.quantize_to_compute_form(torch.ones(4, 20))


def test_stack_and_cat_rows():
    a = nvfp4.quantize_to_compute_form(_random((4, 32), torch.float32, 13))
    b = nvfp4.quantize_to_compute_form(_random((4, 32), torch.float32, 14) * 9)
    s = nvfp4.stack([a, b])
    assert s.shape == (2, 4, 32) and torch.equal(s.select(1).dequantize(), b.dequantize())
    c = nvfp4.cat_rows([a, b])
    assert c.shape == (8, 32) and torch.equal(c.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="different"):
        nvfp4.cat_rows([a, nvfp4.quantize_to_compute_form(torch.ones(4, 48))])
