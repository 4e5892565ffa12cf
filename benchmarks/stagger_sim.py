"""Does staggering a chunk-parallel kernel's first wave help? A toy model of the backward's gradient kernel
(csrc/flashqla/gdn_bwd_grad.cuh) at hk16_hv32 32k_1seq: one CTA per SM, each value head a load phase (L bytes,
HBM-bound when many SMs load at once) then a compute phase (C cycles, no memory traffic). Loading SMs share the
HBM's bytes per cycle equally, each capped at its own rate. Prints the model's run time with the first wave's
CTAs started in three cohorts `stagger` cycles apart, relative to all starting together, for a few amounts of
run-to-run noise in the compute phase (noise desynchronises the SMs by itself; none keeps them in step).
    python benchmarks/stagger_sim.py
The unit costs come from the phase profiler (NOTES, session 16): ~160 KB and ~11.3k cycles of phases 1-2 and
~27k cycles of compute a head, ~13 bytes a cycle per SM with every SM loading (3.4 TB/s at 1.98 GHz)."""
import numpy as np


def simulate(stagger, noise, per_sm_rate=40.0, load_bytes=160e3, compute=27e3, sms=132, heads=124,
             hbm_rate=1700.0, dt=50.0, cohorts=3, seed=0):
    rng = np.random.default_rng(seed)
    left = np.full(sms, load_bytes)            # bytes (loading) or cycles (computing) left in the phase
    loading = np.ones(sms, dtype=bool)
    done = np.zeros(sms, dtype=int)
    delay = np.array([(i % cohorts) * stagger for i in range(sms)], dtype=float)
    t = 0.0
    while (done < heads).any():
        active = (done < heads) & (delay <= 0)
        delay -= dt
        ld = active & loading
        rate = min(per_sm_rate, hbm_rate / max(int(ld.sum()), 1))
        left[ld] -= rate * dt
        left[active & ~loading] -= dt
        for i in np.where(active & (left <= 0))[0]:
            if loading[i]:
                loading[i], left[i] = False, compute * (1 + noise * rng.standard_normal())
            else:
                loading[i], left[i] = True, load_bytes
                done[i] += 1
        t += dt
    return t


def main():
    for noise in (0.0, 0.002, 0.02):
        base = simulate(0, noise)
        rel = "  ".join(f"{s}: {simulate(s, noise) / base:.3f}" for s in (4000, 8000, 13000))
        print(f"noise {noise:5.3f}: in step {base / 124:7.0f} cycles a head; staggered (cycles: time / in step) {rel}")


if __name__ == "__main__":
    main()
