"""How far rounding alone moves a random-weight MoE target's logits, and whether a verify pass's
first row equals the one-token step bit for bit (eager, batch 1, 600-token prompt).

    python -m draftbench.moe_rounding --out docs/results/$(date +%F)_h200_moe_gpt_oss_20b_rounding_diag.json
    python -m draftbench.moe_rounding --tiny --device cpu --out /tmp/diag.json   # a smoke run

For each of four configurations (the experts kernel or the older gather/grouped paths, x the
split-KV kernel or SDPA attention) it runs the one-token forward over the prompt's first
generated token and a verify forward of that token plus three drafts at the same cache
position, and reports: both top tokens, the top-2 gap, the max |one-token - verify row 0|, the
max |logits - the first configuration's|, whether the one-token forward replays to the same
bits. Then one MoE layer's output through each expert path against the dense fp32 reference.
What it showed is in docs/results.md ("MoE targets", the lossless check).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    import draftinfer.models.moe as moe
    from draftbench.shapes import GPT_OSS_20B, TINY_GPT_OSS, hf_config, random_native_target
    from draftinfer.conventions.slots import Slots
    from draftinfer.models.transforms import use_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny gpt-oss shape")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("moe_rounding: CUDA is not available; nothing run (use --device cpu --tiny)")
        return 0
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf = hf_config(TINY_GPT_OSS if a.tiny else GPT_OSS_20B)
    target = random_native_target(hf, dev, dtype, 1, 1024)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, hf.vocab_size, (1, 600), generator=g).to(dev)
    rows = torch.zeros(1, dtype=torch.long, device=dev)
    kernel_supported = moe.kernel_supported

    def fwd(tokens, start):
        cache = start + torch.arange(tokens.shape[1], device=dev)[None]
        rope = target.rope_positions(cache, rows)
        return target(tokens, Slots(rows, cache, rope, 640)).logits[0].float()

    res = {}
    try:
        with torch.no_grad():
            use_attention(target, "sdpa")
            moe.kernel_supported = lambda *_: False
            for s in range(0, 600, 512):
                logits = fwd(ids[:, s : min(s + 512, 600)], s)
            tok0 = int(logits[-1].argmax())
            drafts = torch.tensor([[tok0, 11, 12, 13]], device=dev)
            base = None
            for path in ("old", "kernel"):
                moe.kernel_supported = kernel_supported if path == "kernel" else lambda *_: False
                for attn in ("sdpa", "split_kv"):
                    use_attention(target, attn)
                    one = fwd(drafts[:, :1], 600)[0]
                    row0 = fwd(drafts, 600)[0]
                    again = fwd(drafts[:, :1], 600)[0]
                    base = one if base is None else base
                    top = one.topk(2).values
                    r = {
                        "one_token_top": int(one.argmax()),
                        "verify_row0_top": int(row0.argmax()),
                        "gap": float(top[0] - top[1]),
                        "max_abs_one_token_vs_verify_row0": float((one - row0).abs().max()),
                        "max_abs_vs_first_config": float((one - base).abs().max()),
                        "replays_same_bits": bool(torch.equal(one, again)),
                        "logit_absmax": float(one.abs().max()),
                    }
                    res[f"{path}/{attn}"] = r
                    print(path, attn, json.dumps(r), flush=True)
            blk = target.model.layers[0].mlp
            x = torch.randn(4, hf.hidden_size, device=dev, dtype=dtype)
            w, e = getattr(blk, blk.router_name)(x)
            ex = blk.experts
            w1, w2 = ex.mats()
            f32 = [t.float() for t in (x, w, w1, ex.gate_up_proj_bias, w2, ex.down_proj_bias)]
            ref = moe.experts_reference(f32[0], f32[1], e, *f32[2:], ex.act)
            for path in ("kernel", "grouped", "gather"):
                ex.path = path
                err = float((ex(x, w, e).float() - ref).abs().max())
                res[f"layer0_{path}_max_abs_vs_fp32"] = err
                print("layer 0 experts", path, "max abs vs fp32", err, flush=True)
            ex.path = None
            res["layer0_ref_absmax"] = float(ref.abs().max())
    finally:
        moe.kernel_supported = kernel_supported
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
