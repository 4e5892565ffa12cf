"""Bitwise fingerprints of the forward's outputs, for telling whether two builds compute the same bits.

Runs flashqla.chunk_gdn (bf16, an initial state, l2norm in the kernel) on fixed random inputs for a few shapes
that take different forward paths (the split forward with the prep kernel, the chain with the prep beside it,
a packed batch) and prints one line per case: its name, then the first 12 hex digits of the SHA-1 of o and of
the final state. Run it once per build (the same GPU) and compare the lines:

    python benchmarks/output_hashes.py
"""
import hashlib

import torch
import torch.nn.functional as F

import flashqla

CASES = [  # name, batch, tokens, q/k heads, value heads, cu_seqlens
    ("tp1_8192x1", 1, 8192, 16, 32, None),
    ("tp4_8192x4", 4, 8192, 4, 8, None),
    ("tp8_32768", 1, 32768, 2, 4, None),
    ("varlen", 1, 9000, 4, 8, [0, 100, 4196, 4197, 9000]),
]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]


def main() -> None:
    for name, B, T, H, HV, cu in CASES:
        gen = torch.Generator(device="cuda").manual_seed(1234)

        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        q, k = rand(B, T, H, 128).bfloat16(), rand(B, T, H, 128).bfloat16()
        v = rand(B, T, HV, 128).bfloat16()
        g, beta = F.logsigmoid(rand(B, T, HV)) * 0.5, torch.sigmoid(rand(B, T, HV))
        h0 = rand(B if cu is None else len(cu) - 1, HV, 128, 128) * 0.1
        cs = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
        o, s = flashqla.chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cs)
        torch.cuda.synchronize()
        print(name, digest(o), digest(s), flush=True)


if __name__ == "__main__":
    main()
