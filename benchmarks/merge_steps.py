"""At which step does the backward's last dS pass merge with the B pass? (The premise of gdn_bwd_dh's kMerge.)
--states: the same for the backward's states pass against the summaries' B half (state_role's kMerge).

Runs the dS chain of one segment twice on the CPU, from zero end gradients (the B pass) and from random ones (the
last pass), with the GPU chain's rounding: the products read the state rounded to bf16 (c_to_a), the fp32 state
takes gamma_C dS and then the products' sums. Their difference can only live in the fp32 state, where a 1-ulp
difference survives a step with probability ~gamma_C: the runs merge a few chunks after the end gradients' part has
decayed to the ulp. (With fp32 products instead, as the float32 reference computes them, a 1-ulp difference re-enters
every output through the products and the runs settle at ~10% of the entries differing for good, under the anchors'
gates: the merge relies on the kernels' bf16 operands.)

    PYTHONPATH=. python benchmarks/merge_steps.py [--tokens 4096] [--seeds 3] [--sweep] [--states]

--states: the forward state chain (S' = gamma_C S + X^T (V' - gamma_C K S)) from zero and from a random initial
state, the products reading S rounded to bf16 and X, K in bf16, as the wgmma chain does.

--sweep: the merge step against the decay rate (g = logsigmoid(randn) / d, d = 12 .. 40), with the summed log-decay
at the merge: the data behind gdn_bwd_dh's kMergeLogDecay (walks whose first half sums to at most -50 may merge).
"""
import argparse

import torch
import torch.nn.functional as F

from flashqla import reference as R

D = 128


def merge_step(g, seed, tokens):
    """(the first step from the segment's end after which both runs' fp32 states are bitwise equal, or None;
    the number of differing entries at each step)."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(1, tokens, 1, D), dim=-1)
    k = F.normalize(torch.randn(1, tokens, 1, D), dim=-1)
    beta = torch.rand(1, tokens, 1).sigmoid()
    do = torch.randn(1, tokens, 1, D)
    end = torch.randn(D, D) / 8
    P = R._prepare(q, k, do, g, beta, None, None, None, False, R.CHUNK)
    dOc, _, _, U1 = R._bwd_setup(P, do, None)
    T1 = P.scale * P.Qc.transpose(-1, -2) @ (P.gamma[..., None] * dOc)
    gb = (P.gamma * P.bc)[..., None]

    def walk(dS):
        states = []
        for c in range(P.NC - 1, -1, -1):
            if not bool(P.slot_valid[c].all()):
                continue
            states.append(dS)
            dVn = U1[c] + P.dte[c][..., None] * (P.Kc[c] @ dS.bfloat16().float())
            prod = P.Kc[c].transpose(-1, -2) @ (gb[c] * (P.M[c].transpose(-1, -2) @ dVn))
            dS = (P.gamma_C[c][..., None] * dS + T1[c]) - prod
        return states

    a, b = walk(torch.zeros(1, D, D)), walk(end[None])
    eq = [torch.equal(x, y) for x, y in zip(a, b)]
    first = next((i for i in range(len(eq)) if all(eq[i:])), None)
    return first, [int((x != y).sum()) for x, y in zip(a, b)]


def states_merge_step(g, seed, tokens):
    """The forward chain's merge (the states pass against the summaries' B half): the first step from the
    segment's start after which both runs' fp32 states are bitwise equal, or None; differing entries a step."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(1, tokens, 1, D), dim=-1)
    k = F.normalize(torch.randn(1, tokens, 1, D), dim=-1)
    v = torch.randn(1, tokens, 1, D)
    beta = torch.rand(1, tokens, 1).sigmoid()
    init = torch.randn(D, D) / 8
    P = R._prepare(q, k, v, g, beta, None, None, None, False, R.CHUNK)
    bf = lambda x: x.bfloat16().float()  # noqa: E731
    X = bf(P.bc[..., :, None] * (P.A.transpose(-1, -2) @ P.Kc))
    Kb, Vdec = bf(P.Kc), P.dte[..., None] * P.Vc

    def walk(S):
        states = []
        for c in range(P.NC):
            states.append(S)
            Y = Vdec[c] - P.gamma_C[c][..., None] * (Kb[c] @ bf(S))
            S = P.gamma_C[c][..., None] * S + X[c].transpose(-1, -2) @ Y
        return states

    a, b = walk(torch.zeros(1, D, D)), walk(init[None])
    eq = [torch.equal(x, y) for x, y in zip(a, b)]
    first = next((i for i in range(len(eq)) if all(eq[i:])), None)
    return first, [int((x != y).sum()) for x, y in zip(a, b)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--states", action="store_true", help="the states pass's merge (forward chain)")
    args = ap.parse_args()
    step = states_merge_step if args.states else merge_step
    T = args.tokens
    if args.sweep:
        for d in (12, 16, 20, 24, 32, 40):
            for seed in range(args.seeds):
                torch.manual_seed(100 + seed)
                g = F.logsigmoid(torch.randn(1, T, 1)) / d
                first, nd = step(g, seed, T)
                rate = float(g.sum()) / (T // R.CHUNK)
                at = f"{rate * first:6.1f}" if first is not None else "   -"
                print(f"g = logsigmoid(randn) / {d:2d} ({rate:5.2f} a chunk) seed {seed}: merge at step {first} "
                      f"(summed log-decay {at})")
        return
    gates = {"anchors: logsigmoid(randn) / 16": lambda: F.logsigmoid(torch.randn(1, T, 1)) / 16,
             "strong: -5 U(0, 1)": lambda: -5 * torch.rand(1, T, 1),
             "slow: logsigmoid(randn) / 64": lambda: F.logsigmoid(torch.randn(1, T, 1)) / 64,
             "none: g = 0": lambda: torch.zeros(1, T, 1)}
    for name, gen in gates.items():
        for seed in range(args.seeds):
            torch.manual_seed(100 + seed)
            first, nd = step(gen(), seed, T)
            print(f"{name:32s} seed {seed}: merge at step {first} of {len(nd)}; differing entries {nd[:14]}")


if __name__ == "__main__":
    main()
