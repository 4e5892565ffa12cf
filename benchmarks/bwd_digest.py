"""Bit-exact fingerprints of flashqla's forward and backward outputs on fixed inputs (GPU).

Kernel changes that should not change a single bit (a phase moved, a tile stored elsewhere) are checked by
running this under each build and comparing the printed digests: h200.sh's variants stage runs it as the
`digest` step, one line per output. Inputs: fixed seeds, packed sequences with partial chunks and an empty one,
GVA 2 and 4, with and without the in-kernel l2norm, bf16 and fp16. The forward-only cases are long enough to
take the forward's other paths (the split forward with the prep kernel, the chain with the prep beside it);
`--fwd` runs them alone (a prep change's A/B).

    python3 benchmarks/bwd_digest.py [--fwd]
"""
import hashlib
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/tests")
from util import make_inputs  # noqa: E402

import flashqla  # noqa: E402

CASES = [  # (name, seqlens, H_qk, H_v, dtype, l2norm)
    ("gva2_bf16", [700, 0, 130, 1300], 2, 4, torch.bfloat16, False),
    ("gva4_fp16_l2norm", [64, 191, 900], 2, 8, torch.float16, True),
    ("gva2_bf16_long", [4096], 2, 4, torch.bfloat16, False),
]
FWD_CASES = [  # (name, batch, seqlens per batch row, H_qk, H_v): bf16, in-kernel l2norm, forward only
    ("fwd_tp1_8192", 1, [8192], 16, 32),
    ("fwd_tp4_8192x4", 4, [8192], 4, 8),
    ("fwd_tp8_32768", 1, [32768], 2, 4),
    ("fwd_packed", 1, [100, 4096, 1, 4803], 4, 8),
]


def digest(t):
    """The first 16 hex digits of the sha256 of the tensor's bytes (any dtype: read as bytes)."""
    if t is None:
        return "-"
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def forward_digests():
    for name, B, seqlens, hq, hv in FWD_CASES:
        T = sum(seqlens)
        d = make_inputs(B, T, hq, hv, 128, 128, dtype=torch.float32, device="cuda", n_seqs=B * len(seqlens), seed=T + hv)
        q, k, v = (d[n].bfloat16() for n in ("q", "k", "v"))
        cu = None
        if len(seqlens) > 1:
            cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
        o, ht = flashqla.chunk_gdn(q, k, v, d["g"], d["beta"], initial_state=d["initial_state"],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        torch.cuda.synchronize()
        print(f"digest {name}: o={digest(o)} ht={digest(ht)}")


def main():
    if not torch.cuda.is_available():
        print("bwd_digest: no GPU")
        return 1
    forward_digests()
    if "--fwd" in sys.argv[1:]:
        return 0
    for name, seqlens, hq, hv, dtype, l2 in CASES:
        T = sum(seqlens)
        d = make_inputs(1, T, hq, hv, 128, 128, dtype=torch.float32, device="cuda", n_seqs=len(seqlens),
                        seed=sum(seqlens) + hv)
        q, k, v = (d[n].to(dtype) for n in ("q", "k", "v"))
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
        gen = torch.Generator(device="cpu").manual_seed(T)
        do = torch.randn(v.shape, generator=gen).to(device="cuda", dtype=dtype)
        dht = torch.randn(len(seqlens), hv, 128, 128, generator=gen).cuda() / 8
        o, ht = flashqla.chunk_gdn(q, k, v, d["g"], d["beta"], initial_state=d["initial_state"],
                                   output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
        grads = flashqla.chunk_gdn_bwd(q, k, v, d["g"], d["beta"], do, dht, initial_state=d["initial_state"],
                                       use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
        torch.cuda.synchronize()
        outs = dict(zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), (o, ht) + tuple(grads)))
        print(f"digest {name}: " + " ".join(f"{n}={digest(x)}" for n, x in outs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
