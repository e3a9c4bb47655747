"""transformers' own Qwen3.5-MoE generating on the same shapes as a nibble run, for a side-by-side figure.

Random BF16 weights (transformers has no NVFP4 path for this model; the peer therefore reads ~4x the expert
bytes), built directly on the GPU from a real config.json. Measures greedy generation: batch-1 decode tok/s
after an input_len-token prompt, and batched output tok/s for each batch size.

    python benchmarks/transformers_peer.py --model benchmarks/models/Qwen3.5-35B-A3B --out $OUT/peer35.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _build(config_path: str):
    import transformers

    raw = json.load(open(f"{config_path}/config.json"))
    text = dict(raw.get("text_config", raw))
    for key in ("architectures", "quantization_config", "transformers_version", "model_type"):
        text.pop(key, None)
    config = transformers.Qwen3_5MoeTextConfig(**text)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.Qwen3_5MoeForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval(), config


@torch.inference_mode()
def _generate(model, vocab: int, batch: int, input_len: int, output_len: int) -> float:
    ids = torch.randint(0, vocab, (batch, input_len), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                         min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    assert out.shape[1] == input_len + output_len
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers

    model, config = _build(args.model)
    vocab = config.vocab_size
    _generate(model, vocab, 1, 32, 4)
    rows = []
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        # warm-up at this batch size: the first prefill of a new shape autotunes fla's kernels
        _generate(model, vocab, bs, args.input_len, 2)
        prefill = _generate(model, vocab, bs, args.input_len, 1)
        total = _generate(model, vocab, bs, args.input_len, args.output_len)
        decode = max(total - prefill, 1e-9)
        row = {"batch_size": bs, "input_len": args.input_len, "output_len": args.output_len,
               "prefill_s": prefill, "total_s": total, "decode_step_ms": decode / (args.output_len - 1) * 1e3,
               "decode_tok_s": bs * (args.output_len - 1) / decode, "output_tok_s": bs * args.output_len / total}
        rows.append(row)
        print(f"transformers {transformers.__version__} bs={bs}: prefill {prefill:.2f} s, decode step "
              f"{row['decode_step_ms']:.1f} ms, decode {row['decode_tok_s']:.1f} tok/s, "
              f"end-to-end {row['output_tok_s']:.1f} output tok/s")
    if args.out:
        json.dump({"model": args.model, "transformers": transformers.__version__, "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
