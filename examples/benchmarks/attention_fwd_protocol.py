"""A randomised interleaving model of the CUDA sparse-attention forward's synchronisation (the persistent kernel
in deepseek_v41/sparse_attention_cuda.py).

    python examples/benchmarks/attention_fwd_protocol.py [--schedules 3000]

The producer and the two math warpgroups are generators that follow the kernel's order of mbarrier waits and
arrivals, named-barrier arrivals and syncs, and shared-memory writes and reads (one step per warpgroup: its
128 threads act together).  A scheduler runs them in a random interleaving; a schedule fails when no actor can
move (deadlock), a warpgroup joins a named barrier twice in one generation, or a read finds another item's or
pair's data: Q, each kv half (each 64-column tile at its wgmma's issue, the half again where it is waited for),
the index row (read by the producer's gathers), the slot masks (read by the math), the output row, the exchanged
maxima, P and the row sums.
Items have 0-5 pairs (0: a query without keys).  The producer's own named barrier around its index-row load (its
four warps) is not modelled: the producer is one actor here.
"""

import argparse
import random

COMPLETIONS = [0]  # every arrival or barrier join: progress, for the deadlock test


class MBarrier:
    """An mbarrier: a phase completes after `count` arrivals; a wait on parity p passes once a phase of that
    parity has completed, i.e. while the current phase's parity differs from p (fresh: p = 1 passes)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        COMPLETIONS[0] += 1
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passed(self, parity):
        return (self.phase & 1) != parity


class NamedBarrier:
    """bar.arrive / bar.sync over both math warpgroups: a generation completes once each has joined."""

    def __init__(self):
        self.generation, self.joined = 0, set()

    def join(self, wg):
        COMPLETIONS[0] += 1
        assert wg not in self.joined, f"warpgroup {wg} joins a named barrier twice in one generation"
        self.joined.add(wg)
        generation = self.generation
        if len(self.joined) == 2:
            self.generation, self.joined = generation + 1, set()
        return generation


def schedule(pairs: list[int], seed: int) -> str | None:
    """Run one random interleaving for items with these pair counts; an error message, or None."""
    rnd = random.Random(seed)
    n = len(pairs)
    bar = {"q_ready": MBarrier(1), "q_free": MBarrier(2)}  # counts in warpgroups (128 threads each)
    for i in range(2):
        for h in range(2):
            bar["empty", i, h] = MBarrier(1)
            for tile in range(4):
                bar["ready", i, h, tile] = MBarrier(1)
        bar["idx_ready", i], bar["idx_free", i] = MBarrier(1), MBarrier(2)
    named = {name: NamedBarrier() for name in ("MAX_A", "MAX_B", "P0", "P1", "SUM")}
    smem = {"q": None, "k": {}, "idx": None, "masks": [None, None], "row": [None, None], "max_a": None, "max_b": None,
            "p": [None, None], "row_sum": {}}

    def wait(key, parity):
        while not bar[key].passed(parity):
            yield "blocked"
        yield "step"

    def bar_arrive(name, wg):
        named[name].join(wg)
        yield "step"

    def bar_sync(name, wg):
        generation = named[name].join(wg)
        while named[name].generation <= generation:
            yield "blocked"
        yield "step"

    def producer():
        filled = 0  # pairs gathered over all items

        def load_idx(it):
            yield from wait(("idx_free", it & 1), ((it >> 1) & 1) ^ 1)
            smem["idx"] = smem["masks"][it & 1] = smem["row"][it & 1] = it
            bar["idx_ready", it & 1].arrive()
            yield "step"

        yield from load_idx(0)
        for it in range(n):
            yield from wait("q_free", (it & 1) ^ 1)
            smem["q"] = it
            bar["q_ready"].arrive()
            for p in range(pairs[it]):
                for buf, half in ((0, 0), (1, 1), (0, 1), (1, 0)):  # the kernel's fill order
                    yield from wait(("empty", buf, half), (filled & 1) ^ 1)
                    for tile in range(4):  # each 64-column tile lands on its own barrier
                        assert smem["idx"] == it, ("index row", it, smem["idx"])
                        smem["k"][buf, half, tile] = (it, 2 * p + buf)
                        bar["ready", buf, half, tile].arrive()
                        yield "step"
                filled += 1
            if it + 1 < n:
                yield from load_idx(it + 1)

    def math(wg):
        it_phase = 0  # item << 1 | phase of the item's first pair

        def kv(it, p, buf, half, tiles=range(4)):  # a read of kv half (buf, half) for pair p of item it
            for tile in tiles:
                assert smem["k"].get((buf, half, tile)) == (it, 2 * p + buf), ("kv", wg, it, p, buf, half, tile)

        def qk(it, p, half):  # S of this warpgroup's block of pair p, one half: each tile once it has landed
            for tile in range(4):
                yield from wait(("ready", wg, half, tile), (it_phase + p) & 1)
                assert smem["q"] == it, ("Q", wg, it, smem["q"])
                kv(it, p, wg, half, [tile])

        for it in range(n):
            yield from wait(("idx_ready", it & 1), (it >> 1) & 1)
            yield from wait("q_ready", it & 1)
            n_pairs = pairs[it]
            if wg == 0:
                if n_pairs > 0:
                    yield from qk(it, 0, 0)
                    yield from qk(it, 0, 1)
                if n_pairs <= 1:
                    bar["q_free"].arrive()
                for p in range(n_pairs):
                    assert smem["masks"][it & 1] == it
                    smem["max_a"] = (it, p)
                    yield from bar_arrive("MAX_A", 0)
                    kv(it, p, 0, 0)  # own P V, issued
                    yield "step"
                    kv(it, p, 0, 0)  # and waited for
                    bar["empty", 0, 0].arrive()
                    yield from bar_sync("MAX_B", 0)
                    assert smem["max_b"] == (it, p)
                    smem["p"][0] = (it, p)
                    yield from bar_arrive("P0", 0)
                    yield from bar_sync("P1", 0)
                    assert smem["p"][1] == (it, p)
                    kv(it, p, 1, 0)  # the peer's P V, issued
                    if p + 1 < n_pairs:
                        yield from qk(it, p + 1, 0)
                    yield "step"
                    assert smem["p"][1] == (it, p)
                    kv(it, p, 1, 0)
                    bar["empty", 1, 0].arrive()
                    if p + 1 < n_pairs:
                        yield from qk(it, p + 1, 1)
                    if p + 2 == n_pairs:
                        bar["q_free"].arrive()
            else:
                if n_pairs == 0:
                    bar["q_free"].arrive()
                for p in range(n_pairs):
                    yield from qk(it, p, 1)
                    yield from qk(it, p, 0)
                    if p + 1 == n_pairs:
                        bar["q_free"].arrive()
                    assert smem["masks"][it & 1] == it
                    yield from bar_sync("MAX_A", 1)
                    assert smem["max_a"] == (it, p)
                    smem["max_b"] = (it, p)
                    yield from bar_arrive("MAX_B", 1)
                    kv(it, p, 1, 1)
                    smem["p"][1] = (it, p)
                    yield from bar_arrive("P1", 1)
                    yield from bar_sync("P0", 1)
                    assert smem["p"][0] == (it, p)
                    kv(it, p, 0, 1)
                    yield "step"
                    kv(it, p, 1, 1)
                    bar["empty", 1, 1].arrive()
                    assert smem["p"][0] == (it, p)
                    kv(it, p, 0, 1)
                    bar["empty", 0, 1].arrive()
            it_phase ^= n_pairs & 1
            smem["row_sum"][it & 1, wg] = it
            yield from bar_sync("SUM", wg)
            assert smem["row"][it & 1] == it
            bar["idx_free", it & 1].arrive()
            assert smem["row_sum"].get((it & 1, wg ^ 1)) == it, ("row sums", wg, it, smem["row_sum"])
            yield "step"
            it_phase += 2

    actors = {"producer": producer(), "warpgroup 0": math(0), "warpgroup 1": math(1)}
    while actors:
        names = list(actors)
        rnd.shuffle(names)
        before, moved = COMPLETIONS[0], False
        for name in names:  # one step of the first actor that can move
            try:
                moved = next(actors[name]) != "blocked"
            except StopIteration:
                del actors[name]
                moved = True
            except AssertionError as err:
                return f"{name}: {err}"
            if moved:
                break
        if not moved and COMPLETIONS[0] == before:
            return f"deadlock ({', '.join(actors)} blocked)"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", type=int, default=3000)
    args = ap.parse_args()
    rnd, failures = random.Random(0), 0
    for seed in range(args.schedules):
        pairs = [rnd.choice([0, 0, 1, 1, 2, 3, 5]) for _ in range(rnd.randint(1, 7))]
        error = schedule(pairs, seed)
        if error:
            failures += 1
            if failures <= 5:
                print(f"schedule {seed}, pairs {pairs}: {error}")
    print(f"{failures} of {args.schedules} schedules failed")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
