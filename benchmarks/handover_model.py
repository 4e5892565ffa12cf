"""A model of the merging dS chain's stage hand-over (csrc/flashqla/gdn_bwd_dh.cuh, dh_state_role's kMerge and
aux_role's kStop), run under random schedules to look for hangs before a device does.

Named barriers as the hardware counts them: bar.arrive adds its threads without waiting, bar.sync adds them and
waits, and a barrier completes (and starts over) once 256 threads have arrived: the state warps (128) and one
loader group (128). The state warps walk N chunks over G stages (sync full, compute, arrive empty unless it + G >= N)
and stop at step `merge_at`; loader group g fills its stage for steps g, g + G, ... (sync empty from step G on, then
read the stop flag). The exit that this model found to hang: arriving on the stage barriers straight away (a group
that has not yet waited at its barrier sees two arrivals of the state warps complete it without the group, then waits
for ever). The exit as built first takes the fills of the steps in flight, then sets the stop and arrives.

    python benchmarks/handover_model.py            # the exit as built: expect 0 hangs
    python benchmarks/handover_model.py --naive    # the first exit: hangs
"""
import argparse
import random

STATE = LOADER = 128
EXPECT = STATE + LOADER


class Barrier:
    def __init__(self):
        self.count = 0
        self.waiting = []

    def arrive(self, threads):
        self.count += threads
        if self.count >= EXPECT:  # complete: release the waiters, start over
            self.count = 0
            for flag in self.waiting:
                flag[0] = True
            self.waiting = []

    def sync(self, threads):
        flag = [False]
        self.waiting.append(flag)
        self.arrive(threads)
        return flag


def walk(n, merge_at, stages, seed, naive):
    """'ok', or what went wrong under this schedule."""
    rnd = random.Random(seed)
    full = [Barrier() for _ in range(stages)]
    empty = [Barrier() for _ in range(stages)]
    stop = [False]
    filled = set()

    def state():
        for it in range(n):
            if it == merge_at:
                if not naive:
                    for d in range(stages):
                        if it + d < n:
                            flag = full[(it + d) % stages].sync(STATE)
                            while not flag[0]:
                                yield "wait"
                stop[0] = True
                for d in range(stages):
                    if it + d + stages < n:
                        empty[(it + d) % stages].arrive(STATE)
                return
            flag = full[it % stages].sync(STATE)
            while not flag[0]:
                yield "wait"
            if it not in filled:
                raise AssertionError(f"step {it} read before its fill")
            yield "work"
            if it + stages < n:
                empty[it % stages].arrive(STATE)

    def loader(g):
        for it in range(g, n, stages):
            if it >= stages:
                flag = empty[g].sync(LOADER)
                while not flag[0]:
                    yield "wait"
                if stop[0]:
                    return
            for _ in range(rnd.randint(0, 3)):
                yield "work"
            filled.add(it)
            full[g].arrive(LOADER)
            for _ in range(rnd.randint(0, 3)):  # (the group's own pace to its next wait)
                yield "work"

    actors = [state()] + [loader(g) for g in range(stages)]
    live = list(range(len(actors)))
    waits = 0
    while live:
        i = rnd.choice(live)
        try:
            waits = waits + 1 if next(actors[i]) == "wait" else 0
        except StopIteration:
            live.remove(i)
            waits = 0
        if waits > 1000:
            return f"hang ({len(live)} of {len(actors)} actors left)"
    return "ok"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--naive", action="store_true", help="the first exit (arrive at once)")
    ap.add_argument("--chunks", type=int, default=9, help="walks of 0 .. chunks - 1 steps")
    ap.add_argument("--seeds", type=int, default=300)
    args = ap.parse_args()
    bad = 0
    for n in range(args.chunks):
        for merge_at in [None] + list(range(n)):
            for seed in range(args.seeds):
                r = walk(n, merge_at, 2, seed, args.naive)
                if r != "ok":
                    bad += 1
                    if bad <= 3:
                        print(f"chunks {n}, merge at step {merge_at}, seed {seed}: {r}")
    print(f"{bad} bad schedules")


if __name__ == "__main__":
    main()
