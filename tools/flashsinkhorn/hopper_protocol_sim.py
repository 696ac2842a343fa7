"""Model check of the Gluon sm_90 kernel's barrier protocol (no GPU), random interleavings.

    python3 tools/flashsinkhorn/hopper_protocol_sim.py [--seeds 300]

A Python transcription of the synchronization in ``flashsinkhorn/_softmin_hopper.py`` (and
``_symmetric_hopper.py``, whose one pass uses the same protocol: a stage's TMA bytes are two
y boxes instead of one y tile, each consumer reads its own box, both release the stage;
``_sample_hopper.py``, the same as the softmin pass; ``_plan_hopper.py`` with ``--plan``'s
modes: a second ring of V tiles, one per column tile, loaded by the producer after the
tile's score chunks and read by each consumer's P @ V wgmma after the tile's exps): the
ring's ready / empty mbarriers (parity waits, arrival counts, TMA transaction completion
later than the issue), the ping-pong turn barriers, async wgmma retired in order by
``warpgroup_mma_wait(n)``, for every mode the kernel launches: the main launch (a producer
warp, two consumers, PIPE with one chunk per tile, EARLY release with several, PINGPONG
with its TURN_AFTER) and the fallback launch (one warpgroup, inline refills).
Each step runs a random runnable agent or completes a random in-flight TMA / wgmma. It
checks: no deadlock, every consumer reads every chunk of every tile, a wgmma only reads a
stage that holds its chunk and that no TMA overwrites before the wgmma retired. Keep it in
step with the kernel when the protocol changes.
"""

from __future__ import annotations

import argparse
import itertools
import random


class Barrier:
    def __init__(self, count):
        self.count, self.arrived, self.tx, self.completed = count, 0, 0, 0

    def passes(self, parity):  # try_wait.parity: the phase of that parity has completed
        return (self.completed & 1) != parity

    def arrive(self, tx=0):
        self.arrived += 1
        self.tx += tx
        self._maybe_complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self):
        if self.arrived == self.count and self.tx == 0:
            self.completed += 1
            self.arrived = 0


class Sim:
    def __init__(self, num_k, stages, n_tiles, num_wg, pipe, pingpong, inline, rng, vstages=0):
        self.K, self.S, self.T, self.W = num_k, stages, n_tiles, num_wg
        self.pipe, self.pingpong, self.inline, self.rng = pipe, pingpong, inline, rng
        # the plan application's V ring (vstages > 0): stage "V" + index in the same lists
        self.VS = vstages
        self.vready = [Barrier(1) for _ in range(vstages)]
        self.vempty = [Barrier(num_wg) for _ in range(vstages)]
        self.vslot = [None] * vstages
        self.vreaders = [set() for _ in range(vstages)]
        self.vseen = [[] for _ in range(num_wg)]
        self.ready = [Barrier(1) for _ in range(stages)]
        self.empty = [Barrier(num_wg) for _ in range(stages)]
        self.turn = [Barrier(1), Barrier(1)]
        self.slot = [None] * stages  # chunk the stage holds (None: being written)
        self.readers = [set() for _ in range(stages)]  # in-flight wgmma reading the stage
        self.tma = []  # in-flight TMA: (stage, chunk)
        self.mma = [[] for _ in range(num_wg)]  # per consumer, in issue order: (stage, chunk)
        self.seen = [[] for _ in range(num_wg)]
        self.total = num_k * n_tiles

    # -- operations -----------------------------------------------------------------------
    def load(self, t):
        s = t % self.S
        assert not self.readers[s], f"TMA overwrites stage {s} under a wgmma (chunk {t})"
        self.ready[s].arrive(tx=1)  # expect + the TMA's bytes
        self.slot[s] = None
        self.tma.append((s, t))

    def load_v(self, j):
        s = j % self.VS
        assert not self.vreaders[s], f"TMA overwrites V stage {s} under a wgmma (tile {j})"
        self.vready[s].arrive(tx=1)
        self.vslot[s] = None
        self.tma.append((("V", s), j))

    def release_v(self, wg, j):
        if self.inline:
            if j + self.VS < self.T:
                self.load_v(j + self.VS)
        else:
            self.vempty[j % self.VS].arrive()

    def apply_v(self, wg, j):
        """The P @ V wgmma of tile j (after its exps): waits for the V tile, reads it."""
        s = j % self.VS
        ph = (j // self.VS) & 1
        yield lambda: self.vready[s].passes(ph)
        assert self.vslot[s] == j, f"P @ V of tile {j} reads V stage {s} = {self.vslot[s]}"
        self.vreaders[s].add((wg, j))
        self.mma[wg].append((("V", s), j))
        self.vseen[wg].append(j)

    def release(self, wg, t):
        if self.inline:
            if t + self.S < self.total:
                self.load(t + self.S)
        else:
            self.empty[t % self.S].arrive()

    # -- agents (generators yield a predicate: run on when it is true) -------------------
    def producer(self):
        for t in range(self.total):
            s = t % self.S
            ph = ((t // self.S) & 1) ^ 1
            yield lambda s=s, ph=ph: self.empty[s].passes(ph)
            self.load(t)
            if self.VS and t % self.K == self.K - 1:  # the tile's V after its chunks
                j = t // self.K
                vs, vph = j % self.VS, ((j // self.VS) & 1) ^ 1
                yield lambda vs=vs, vph=vph: self.vempty[vs].passes(vph)
                self.load_v(j)

    def issue_tile(self, wg, j, early):
        turn_after = max(1, min(self.K, self.S - 1))  # _turn_after
        if self.pingpong:
            ph = (j & 1) ^ (1 - wg)
            yield lambda: self.turn[wg].passes(ph)
        for k in range(self.K):
            t = j * self.K + k
            s = t % self.S
            ph = (t // self.S) & 1
            yield lambda s=s, ph=ph: self.ready[s].passes(ph)
            assert self.slot[s] == t, f"wgmma of chunk {t} reads stage {s} = {self.slot[s]}"
            self.readers[s].add((wg, t))
            self.mma[wg].append((s, t))
            self.seen[wg].append(t)
            if self.pingpong and k == turn_after - 1:
                self.turn[1 - wg].arrive()
            if early and k > 0:
                yield lambda: len(self.mma[wg]) <= 1  # warpgroup_mma_wait(1)
                self.release(wg, t - 1)

    def release_tile(self, wg, j, early):
        ks = [self.K - 1] if early else range(self.K)
        for k in ks:
            self.release(wg, j * self.K + k)

    def consumer(self, wg):
        early = not self.pipe
        if self.pipe:
            yield from self.issue_tile(wg, 0, False)
            yield lambda: not self.mma[wg]
            self.release_tile(wg, 0, False)
            for j in range(self.T - 1):
                yield from self.issue_tile(wg, j + 1, False)
                yield lambda: True  # the exps of tile j
                if self.VS:
                    yield from self.apply_v(wg, j)
                yield lambda: not self.mma[wg]  # warpgroup_mma_wait(0)
                self.release_tile(wg, j + 1, False)
                if self.VS:
                    self.release_v(wg, j)
            if self.VS:
                yield from self.apply_v(wg, self.T - 1)
                yield lambda: not self.mma[wg]
                self.release_v(wg, self.T - 1)
        else:
            for j in range(self.T):
                yield from self.issue_tile(wg, j, early)
                yield lambda: not self.mma[wg]
                self.release_tile(wg, j, early)
                yield lambda: True  # the exps
                if self.VS:
                    yield from self.apply_v(wg, j)
                    yield lambda: not self.mma[wg]
                    self.release_v(wg, j)

    def run(self):
        agents = [self.consumer(w) for w in range(self.W)]
        if self.inline:
            for t in range(min(self.S, self.total)):
                self.load(t)
            for j in range(min(self.VS, self.T)):
                self.load_v(j)
        else:
            agents.append(self.producer())
        waiting = {id(a): (lambda: True) for a in agents}
        live = list(agents)
        for _ in range(200000):
            events = [("agent", a) for a in live if waiting[id(a)]()]
            events += [("tma", i) for i in range(len(self.tma))]
            events += [("mma", w) for w in range(self.W) if self.mma[w]]
            if not events:
                if not live:
                    break
                raise RuntimeError("deadlock")
            kind, x = self.rng.choice(events)
            if kind == "tma":
                s, t = self.tma.pop(x)
                if isinstance(s, tuple):  # a V tile
                    self.vslot[s[1]] = t
                    self.vready[s[1]].complete_tx(1)
                else:
                    self.slot[s] = t
                    self.ready[s].complete_tx(1)
            elif kind == "mma":  # the oldest in-flight wgmma of consumer x retires
                s, t = self.mma[x].pop(0)
                if isinstance(s, tuple):
                    self.vreaders[s[1]].discard((x, t))
                else:
                    self.readers[s].discard((x, t))
            else:
                try:
                    waiting[id(x)] = next(x)
                except StopIteration:
                    live.remove(x)
        assert not live and not self.tma, "did not finish"
        for w in range(self.W):
            assert self.seen[w] == list(range(self.total)), (w, self.seen[w][:12])
            if self.VS:
                assert self.vseen[w] == list(range(self.T)), (w, self.vseen[w][:12])


def modes(plan=False):
    """(num_k, stages, num_wg, pipe, pingpong, inline, vstages) of every launch the kernel
    makes (``_check_config``, ``_spec``): the main launch with two consumers (pipe exactly
    with one chunk per tile, ping-pong optional with several) and the fallback launch;
    ``plan``: the plan application's, with 1 to 3 V stages."""
    for vstages in (1, 2, 3) if plan else (0,):
        for num_k, stages in itertools.product((1, 2, 3, 8, 16), (2, 3, 4, 6)):
            for pingpong in (False, True) if num_k > 1 else (False,):
                yield num_k, stages, 2, num_k == 1, pingpong, False, vstages
            yield num_k, stages, 1, False, False, True, vstages


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--tiles", type=int, default=5)
    ap.add_argument("--plan", action="store_true", help="the plan application's modes")
    args = ap.parse_args()
    n = 0
    bad = []
    for mode in modes(args.plan):
        for seed in range(args.seeds):
            try:
                Sim(*mode[:2], args.tiles, *mode[2:6], random.Random(seed), mode[6]).run()
            except (AssertionError, RuntimeError) as e:
                bad.append((mode, seed, f"{type(e).__name__}: {e}"))
                break
            n += 1
    names = "num_k stages num_wg pipe pingpong inline vstages".split()
    for mode, seed, err in bad:
        print("FAIL", dict(zip(names, mode)), "seed", seed, err)
    print(f"{'ok' if not bad else 'FAILED'}: {len(list(modes(args.plan)))} modes, {n} runs")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
