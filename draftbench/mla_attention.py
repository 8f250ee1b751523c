"""MLA's absorbed attention (decode, verify, drafting) timed against the SDPA call it replaced, in
one process, at GLM-4.7-Flash's sizes (20 heads, latent 512 + 64, value 256):

    python -m draftbench.mla_attention                 # CUDA: graph-replayed us per call
    python -m draftbench.mla_attention --device cpu --tiny   # a smoke run (tests)

`draftinfer.models.mla.LatentAttention.attend_absorbed` scores the `T * nh` absorbed query rows
against the latent with two batched products and a softmax. Before (2026-11-29) it called
`F.scaled_dot_product_attention` with one 576-wide "KV head": no flash kernel takes that width and
PyTorch's memory-efficient kernel tiles the query rows, so at batch 1 one program read every key.
`sdpa_absorbed` below is that call, kept as the baseline. Rows: batch, query slots, keys read,
us per call (SDPA, the products eager, the products compiled), the largest output difference.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from draftinfer.models.mla import LatentAttention


def sdpa_absorbed(a: LatentAttention, q_nope, q_rot, lat, mask) -> torch.Tensor:
    """The absorbed attention through SDPA (the baseline; `attend_absorbed`'s signature)."""
    B, T, nh, _ = q_nope.shape
    L, R = lat.shape[1], a.kv_lora_rank
    w_uk, w_uv = a._kv_b()
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)
    q = torch.cat([q_lat, q_rot], dim=-1).reshape(B, 1, T * nh, R + a.dr)
    m = mask[:, :, :, None, :].expand(B, 1, T, nh, L).reshape(B, 1, T * nh, L)
    kv = lat[:, None]
    o_lat = F.scaled_dot_product_attention(q, kv, kv[..., :R], attn_mask=m, scale=a.scale)
    return torch.einsum("bthr,hvr->bthv", o_lat.view(B, T, nh, R), w_uv)


def graph_us(fn, n: int = 50) -> float:
    """us per call of `fn` replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small sizes, no timing (a smoke run)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("CUDA is not available (use --device cpu --tiny)")
    dtype = torch.bfloat16 if cuda else torch.float32
    nh, dn, dr, R, dv = (4, 16, 8, 32, 16) if a.tiny else (20, 192, 64, 512, 256)
    torch.manual_seed(0)
    attn = LatentAttention(
        64 if a.tiny else 2048,
        nh,
        q_lora_rank=None,
        kv_lora_rank=R,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=dv,
        softmax_scale=(dn + dr) ** -0.5,
    ).to(dev, dtype)
    compiled = torch.compile(attn.attend_absorbed, dynamic=False) if cuda else None
    rows = []
    with torch.no_grad():
        for B in (1, 8):
            for T in (1, 4):
                for L in (64,) if a.tiny else (1024, 2048):
                    q_nope = torch.randn(B, T, nh, dn, device=dev, dtype=dtype)
                    q_rot = torch.randn(B, T, nh, dr, device=dev, dtype=dtype)
                    lat = torch.randn(B, L, R + dr, device=dev, dtype=dtype)
                    mask = torch.ones(B, 1, T, L, dtype=torch.bool, device=dev)
                    mask[..., (L * 5) // 8 :] = False
                    args = (q_nope, q_rot, lat, mask)
                    ref = sdpa_absorbed(attn, *args).float()
                    diff = (ref - attn.attend_absorbed(*args).float()).abs().max().item()
                    row = {"B": B, "T": T, "L": L, "max_abs_diff": diff}
                    if cuda and not a.tiny:
                        row["sdpa_us"] = round(
                            graph_us(lambda args=args: sdpa_absorbed(attn, *args)), 1
                        )
                        row["products_us"] = round(
                            graph_us(lambda args=args: attn.attend_absorbed(*args)), 1
                        )
                        row["products_compiled_us"] = round(
                            graph_us(lambda args=args: compiled(*args)), 1
                        )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
