"""Shared-memory wavefronts of the wgmma prep's fp32 accesses to L / A (la) and the merge scratch, by a bank model.

Model: 32 banks of 4 bytes; a warp's access of 4-, 8- or 16-byte elements is split into phases of 128 bytes (all
32 lanes, 16 lanes, 8 lanes); within a phase, distinct 4-byte words in one bank serialise (one wavefront each),
the same word is broadcast. Counts one CTA-chunk (four warps) of the prep's patterns, per layout:
  padded   rows of 68 floats (la) and 36 (scratch), L stored a float at a time: main's layout;
  swizzled rows of 64 / 32 floats, 4-float groups XOR-permuted by the row's low three bits (session 44's branch
           prep-swz: conflict-free, but ~3 address instructions a load);
  rows8    rows of 72 / 40 floats (8 banks apart);
  flip     rows8 with column bit 2 flipped in rows whose bit 2 is set (warp::F32Rows8 of the prep-r8 patch, in git
           history at 3c9c552: measured slower than padded in session 46, bitwise equal; the model's wavefronts did
           not bound the prep).
The last three store L as float2 pairs.
    python benchmarks/smem_bank_model.py
"""


def wavefronts(addrs, width):
    per = 128 // width
    total = 0
    for p in range(0, 32, per):
        banks = {}
        for a in addrs[p:p + per]:
            if a is None:
                continue
            for w in range(width // 4):
                word = a // 4 + w
                banks.setdefault(word % 32, set()).add(word)
        total += max((len(s) for s in banks.values()), default=0)
    return total


def lanes(f):
    return [f(lane >> 2, lane & 3) for lane in range(32)]


def swz(r):
    r &= 7
    return ((r & 2) << 3) | ((((r >> 2) ^ r) & 1) << 3) | ((r & 1) << 2)


def layout(kind, cols):
    if kind == "padded":
        ld = cols + 4
        return lambda r, c: 4 * (r * ld + c)
    if kind in ("rows8", "flip"):
        ld, flip = cols + 8, kind == "flip"
        return lambda r, c: 4 * (r * ld + (c ^ (r & 4) if flip else c))
    return lambda r, c: 4 * (r * cols + (c ^ swz(r)))


def tally(kind):
    la, sc = layout(kind, 64), layout(kind, 32)
    pair_width = 4 if kind == "padded" else 8  # the L stores: floats on main, float2 pairs in the others

    def mma(A, a0, B, b0):  # one 16 x 16 x 16 tf32 product: A and B fragments, two k-steps
        fa = sum(wavefronts(lanes(lambda g, t: A(a0[0] + g + dr, a0[1] + 8 * k + t + dc)), 4)
                 for dr in (0, 8) for dc in (0, 4) for k in (0, 1))
        fb = sum(wavefronts(lanes(lambda g, t: B(b0[0] + 8 * k + t + dk, b0[1] + 8 * nt + g)), 4)
                 for dk in (0, 4) for nt in (0, 1) for k in (0, 1))
        return fa + fb

    def store(C, c0):
        return sum(wavefronts(lanes(lambda g, t: C(c0[0] + g + dr, c0[1] + 8 * nt + 2 * t)), 8)
                   for dr in (0, 8) for nt in (0, 1))

    out = {}
    if pair_width == 8:
        per_nt = sum(wavefronts(lanes(lambda g, t: la(g + 8 * dr, 2 * t)), 8) for dr in (0, 1))
    else:
        per_nt = sum(wavefronts(lanes(lambda g, t: la(g + 8 * dr, 2 * t + dc)), 4) for dr in (0, 1) for dc in (0, 1))
    out["L store"] = sum((2 * w + 2) * per_nt for w in range(4))
    out["diagonal"] = 4 * (30 + 16 * wavefronts([la(3, lane) if lane < 16 else None for lane in range(32)], 4))
    merges = 0
    for o in (0, 32):  # 16 -> 32 on warps 1 and 3: L21 A11 -> scratch, A22 tmp -> la
        merges += mma(la, (o + 16, o), la, (o, o)) + store(sc, (o // 2, 0))
        merges += mma(la, (o + 16, o + 16), sc, (o // 2, 0)) + store(la, (o + 16, o))
    for w in range(4):  # 32 -> 64: T = L_bl A_tl -> scratch, A_bl = -A_br T -> la
        rb, cb = w >> 1, w & 1
        merges += sum(mma(la, (32 + 16 * rb, 16 * kb), la, (16 * kb, 16 * cb)) for kb in range(cb, 2))
        merges += store(sc, (16 * rb, 16 * cb))
        merges += sum(mma(la, (32 + 16 * rb, 32 + 16 * kb), sc, (16 * kb, 16 * cb)) for kb in range(rb + 1))
        merges += store(la, (32 + 16 * rb, 16 * cb))
    out["merges"] = merges
    per_nt = sum(wavefronts(lanes(lambda g, t: la(g + 8 * dr, 2 * t)), 8) for dr in (0, 1))
    out["M's reads of A"] = sum((2 * w + 2) * per_nt for w in range(4))
    per_ks = sum(wavefronts(lanes(lambda g, t: la(2 * t + dm, g + di)), 4) for dm in (0, 1, 8, 9) for di in (0, 8))
    out["X's operand"] = sum((4 - w) * per_ks for w in range(4))
    return out


if __name__ == "__main__":
    for kind in ("padded", "swizzled", "rows8", "flip"):
        t = tally(kind)
        print(f"{kind:9s} {sum(t.values()):5d} wavefronts a CTA-chunk: " + ", ".join(f"{k} {v}" for k, v in t.items()))
