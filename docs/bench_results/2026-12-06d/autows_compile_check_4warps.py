exec(open("/tmp/ws_compile.py").read().split("for name, cfg, t in")[0])
small = {"path": "gemv", "xmode": "quad", "block_t": 2, "gu_block_n": 16, "gu_block_k": 256, "gu_warps": 4, "gu_stages": 4, "dn_mode": "fused", "dn_block_n": 32, "dn_block_k": 256, "dn_warps": 4, "dn_stages": 3, "chunk_pairs": 65536, "dec": 3}
big = {"path": "sorted", "xmode": "split", "block_t": 16, "gu_block_n": 64, "gu_block_k": 256, "gu_warps": 4, "gu_stages": 3, "dn_mode": "reduce", "dn_block_n": 128, "dn_block_k": 256, "dn_warps": 4, "dn_stages": 3, "chunk_pairs": 65536, "dec": 3}
for name, cfg, t in [("small4w", small, 1), ("big4w-ptr", big, 256)]:
    for ws in ({"gu_ws": True}, {"dn_ws": True}):
        print("==", name, ws)
        try:
            fm.fused_moe_launch(torch.randn(t, h, dtype=torch.bfloat16), torch.rand(t, k), torch.zeros(t, k, dtype=torch.int32), w4, path=cfg["path"], config={**cfg, **ws})
        except Exception as ex:
            print("FAIL", type(ex).__name__, str(ex)[-200:])
