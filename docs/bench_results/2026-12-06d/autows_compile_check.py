import sys, traceback, torch
sys.path.insert(0, "/work/main")
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction
class D:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")
    def get_device_interface(self): return torch.cuda
driver.set_active(D())
run = JITFunction.run
def co(self, *a, grid, warmup, **kw):
    k = run(self, *a, grid=grid, warmup=True, **kw)
    print("compiled", self.fn.__name__, "smem", k.metadata.shared, "warps", k.metadata.num_warps)
    return k
JITFunction.run = co
from nibble.kernels import fused_moe as fm
from nibble.kernels.moe import MoEWeights
from nibble.formats.nvfp4 import NVFP4Tensor
fm.pdl_supported = lambda d: True
fm.tma_supported = lambda d: True
def nvfp4(*shape):
    *lead, n, k = shape
    return NVFP4Tensor(torch.zeros(*lead, n, k // 2, dtype=torch.uint8), torch.zeros(*lead, n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(*lead, n))
h, inter, e, k = 3072, 1024, 256, 8
w4 = MoEWeights(nvfp4(e, 2 * inter, h), nvfp4(e, h, inter))
import json
big = {"path": "sorted", "xmode": "split", "block_t": 16, "gu_block_n": 64, "gu_block_k": 256, "gu_warps": 8, "gu_stages": 3, "dn_mode": "reduce", "dn_block_n": 128, "dn_block_k": 256, "dn_warps": 8, "dn_stages": 3, "chunk_pairs": 65536, "gu_tma": 2, "dec": 3}
small = {"path": "gemv", "xmode": "quad", "block_t": 2, "gu_block_n": 16, "gu_block_k": 256, "gu_warps": 2, "gu_stages": 4, "dn_mode": "fused", "dn_block_n": 32, "dn_block_k": 256, "dn_warps": 2, "dn_stages": 3, "chunk_pairs": 65536, "dec": 3}
for name, cfg, t in [("big", big, 256), ("small", small, 1)]:
    for ws in ({"gu_ws": True}, {"dn_ws": True}, {"gu_ws": True, "gu_tma": 2, "gu_warps": 4}, {"dn_ws": True, "dn_tma": 2, "dn_warps": 4}):
        print("==", name, ws)
        try:
            fm.fused_moe_launch(torch.randn(t, h, dtype=torch.bfloat16), torch.rand(t, k), torch.zeros(t, k, dtype=torch.int32), w4, path=cfg["path"], config={**cfg, **ws})
        except Exception as ex:
            print("FAIL", type(ex).__name__, str(ex)[-600:])
