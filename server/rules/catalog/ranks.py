"""Ranks of one distributed run compared with each other: one rank diverging (F1), a straggler (F3),
replicas disagreeing (F5). A rank gone silent (F4) is a timer rule: ``liveness.py``."""
from __future__ import annotations

import numpy as np

from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import CrossRankRule, streaks
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import enc, fmt, median_of_others


@register
class RankDivergence(CrossRankRule):
    id, name, severity = "F1", "rank_divergence", "critical"
    failure_noun = "the rank divergence"
    family = "F"
    rollback_advice = True   # a critical alert names the checkpoint to restart from
    fires_when = ("one rank's loss is non-finite while the others' is finite, or > {factor:g}x the median of the "
                  "others for {consecutive} steps (judged once every rank has sent the step)")
    diagnosis = "One rank differs from the others: a bad node or a bad data shard."
    actions = {"check_rank": "Check that rank's data shard (NaN or corrupt samples) and its node (hardware errors, a "
                             "different software version)."}
    params = {"factor": Float(3.0), "consecutive": Int(5), "clear_steps": Int(10)}
    needs = ("loss",)
    one_alert_across_ranks = True

    def evaluate(self, steps, mine, others, state_of, cfg):
        """``mine["loss"]``: this rank's losses at ``steps``; ``others[rank]["loss"]``: another rank's at the
        same steps (NaN where it sent none: ``others[rank]["loss.measured"]`` tells). Compares every rank
        with the median of the others at each step both sent; the verdicts go on the outlier rank."""
        ranks = sorted(others) + [None]
        L = np.column_stack([others[r]["loss"] for r in ranks[:-1]] + [mine["loss"]])
        present = np.column_stack([others[r]["loss.measured"] for r in ranks[:-1]] + [mine["loss.measured"]])
        rows = present.sum(axis=1) >= 2
        finite = np.isfinite(L) & present
        # every rank's "others": the other present ranks, their finite losses' median (one sort a step)
        n_rest_all = present.sum(axis=1)[:, None] - present
        n_finite_rest_all = finite.sum(axis=1)[:, None] - finite
        medians = median_of_others(L, finite)
        # every rank's verdict inputs at once (steps x ranks); the loop below only reads its column
        here_all = rows[:, None] & present
        nonfinite_all = here_all & ~np.isfinite(L) & (n_finite_rest_all > 0)
        comparable_all = here_all & np.isfinite(L) & (n_finite_rest_all == n_rest_all)
        with np.errstate(invalid="ignore"):
            above_all = comparable_all & (medians > 0) & (L > cfg["factor"] * medians)
        judged = (nonfinite_all | comparable_all).any(axis=0)
        out: list[tuple[int, int, object]] = []
        for c in np.flatnonzero(judged).tolist():
            r = ranks[c]
            rank = mine["rank"] if r is None else r
            med, x = medians[:, c], L[:, c]
            nonfinite, comparable, above = nonfinite_all[:, c], comparable_all[:, c], above_all[:, c]
            counted = np.flatnonzero(nonfinite | comparable)
            state = state_of(rank)
            run = streaks((nonfinite | above)[counted], int(state.get("streak", 0)))
            state["streak"] = int(run[-1])
            for k, i in enumerate(counted.tolist()):
                step, xi, m = int(steps[i]), float(x[i]), float(med[i])
                if nonfinite[i]:
                    out.append((rank, step, Hit({"rank": rank, "loss": enc(xi), "others_median": m},
                                                f"Rank {rank} has loss {fmt(xi)} at step {step} while the other "
                                                f"ranks' median is {fmt(m)}")))
                elif above[i]:
                    if run[k] >= cfg["consecutive"]:
                        out.append((rank, step, Hit({"rank": rank, "loss": xi, "others_median": m, "ratio": xi / m,
                                                     "steps": int(run[k])},
                                                    f"Rank {rank}'s loss {fmt(xi)} is {xi / m:.1f}x the other ranks' "
                                                    f"median {fmt(m)} for {int(run[k])} steps")))
                else:
                    out.append((rank, step, False))
        out.sort(key=lambda v: v[1])
        return out


@register
class Straggler(CrossRankRule):
    id, name, severity = "F3", "straggler", "warning"
    family = "F"
    fires_when = ("one rank's step time is > {factor:g}x the median of the other ranks' for {consecutive} "
                  "consecutive steps, or (DDP, FSDP: the collectives make every rank's step time the slowest "
                  "one's) its time before the forward exceeds the others' median by more than {factor:g} - 1 of "
                  "their step time, by at least {min_excess_s:g} s (judged once every rank has sent the step)")
    diagnosis = ("One rank is slower than the others and the whole job waits for it at every collective: a slow "
                 "node, thermal throttling, or that host's data loader.")
    actions = {"check_host": "Check that rank's host: GPU clocks and temperature (nvidia-smi -q -d "
                             "CLOCK,TEMPERATURE,PERFORMANCE), other processes on it, its data-loader workers and "
                             "disk / network I/O.",
               "replace_node": "If the host stays slow, drain it and resume from a checkpoint on another node."}
    params = {"factor": Float(1.2), "consecutive": Int(20), "clear_steps": Int(20),
              "min_excess_s": Float(0.005, zero_ok=True)}
    needs = ("step_time", "data_time")
    one_alert_across_ranks = True

    def evaluate(self, steps, mine, others, state_of, cfg):
        """Each step is judged once, when its last rank arrives (``mine["world_size"]`` ranks sent it): the
        streak a rank's state keeps then does not depend on the order the ranks' batches come in. A rank is
        slow at a step when its step time exceeds ``factor`` x the median of the other ranks', or when its
        data time (previous step's end -> first forward, agent/signals.py) exceeds theirs by more than
        ``factor - 1`` of their median step time and by ``min_excess_s``: under DDP the all-reduce makes the
        fast ranks wait, so their step times equal the slow one's, but each rank's time before its forward
        stays its own. It fires after ``consecutive`` slow steps in a row, on that rank."""
        ranks = sorted(list(others) + [mine["rank"]])
        vals = {r: (mine if r == mine["rank"] else others[r]) for r in ranks}
        T = np.column_stack([vals[r]["step_time"] for r in ranks])
        present = np.column_stack([vals[r]["step_time.measured"] for r in ranks])
        complete = present.all(axis=1) & (present.sum(axis=1) >= max(2, mine.get("world_size", 2)))
        complete &= np.isfinite(T).all(axis=1)
        rows = np.flatnonzero(complete)
        out: list[tuple[int, int, object]] = []
        if not len(rows):
            return out
        W = T[rows]
        D = np.column_stack([np.where(vals[r]["data_time.measured"], vals[r]["data_time"], np.nan)
                             for r in ranks])[rows]
        factor, need, min_excess = cfg["factor"], cfg["consecutive"], cfg["min_excess_s"]
        # the other ranks' medians, one sort a step; a data time missing on another rank makes the
        # others' median unknown (NaN), as np.median over them would
        step_meds = median_of_others(W, np.ones(W.shape, dtype=bool))
        data_nan = np.isnan(D)
        data_meds = median_of_others(D, ~data_nan)
        data_meds[(data_nan.sum(axis=1)[:, None] - data_nan) > 0] = np.nan
        # every rank sends its host once (agent meta); ingest keeps them per rank
        hosts = (mine.get("run_meta") or {}).get("rank_hosts") or {}
        with np.errstate(invalid="ignore"):
            excess_all = D - data_meds
            by_step_all = (step_meds > 0) & (W > factor * step_meds)
            by_data_all = (step_meds > 0) & (excess_all > (factor - 1) * step_meds) & (excess_all >= min_excess)
        slow_all = by_step_all | by_data_all
        for c, r in enumerate(ranks):
            med, x, d_med, excess = step_meds[:, c], W[:, c], data_meds[:, c], excess_all[:, c]
            by_data, slow = by_data_all[:, c], slow_all[:, c]
            state = state_of(r)
            run = streaks(slow, int(state.get("streak", 0)))
            state["streak"] = int(run[-1])
            host = hosts.get(str(r))
            for k, i in enumerate(rows.tolist()):
                step = int(steps[i])
                if not slow[k]:
                    out.append((r, step, False))
                elif run[k] >= need:
                    xi, m = float(x[k]), float(med[k])
                    where = f" on host {host}" if host else ""
                    evidence = {"rank": r, "host": host, "step_time": xi, "others_median": m, "ratio": xi / m,
                                "steps": int(run[k])}
                    if by_data[k]:
                        # the cause, where it shows: under DDP the step times are everyone's, the lateness is its own
                        e, di = float(excess[k]), float(D[k, c])
                        evidence.update({"data_time": di, "others_data_median": float(d_med[k]), "excess_s": e,
                                         "ratio": (m + e) / m, "step_time_ratio": xi / m})
                        text = (f"Rank {r}{where} is a straggler: it reaches its forward {fmt(e)} s after the other "
                                f"ranks' median ({fmt(di)} s of data time), {(m + e) / m:.2f}x their step time of "
                                f"{fmt(m)} s, for {int(run[k])} steps; the others wait for it at the collectives")
                    else:
                        text = (f"Rank {r}{where} is a straggler: step time {fmt(xi)} s is {xi / m:.2f}x the other "
                                f"ranks' median {fmt(m)} s for {int(run[k])} steps")
                    out.append((r, step, Hit(evidence, text)))
        out.sort(key=lambda v: v[1])
        return out


@register
class ReplicaDisagreement(CrossRankRule):
    id, name, severity = "F5", "replica_disagreement", "critical"
    failure_noun = "the replica disagreement"
    family = "F"
    rollback_advice = True   # a critical alert names the checkpoint to restart from
    fires_when = ("the ranks of a DDP run (the agent attached to the DistributedDataParallel model), whose "
                  "all-reduced gradients are identical on every rank, report different grad norms for the same "
                  "step: not equal bit for bit (rel_tol = {rel_tol:g}; above 0, a relative difference it allows); "
                  "judged once every rank has sent the step, the odd rank is the one outside the largest group "
                  "of equal values")
    diagnosis = ("Replicas disagree on gradients that the all-reduce made identical: silent data corruption, a "
                 "desynchronised rank, or a bad GPU / host on the odd rank.")
    actions = {"check_rank": "Check the odd rank's node: GPU memory errors (nvidia-smi -q -d ECC, dmesg / Xid), "
                             "a different driver or library version; drain it and resume from a checkpoint.",
               "find_desync": "Look for code that changes gradients on one rank only after backward (hooks, "
                              "rank-conditional logic, non-deterministic kernels outside the all-reduce)."}
    params = {"rel_tol": Float(0.0, zero_ok=True), "clear_steps": Int(10)}
    needs = ("grad_norm",)
    one_alert_across_ranks = True

    def applies(self, ctx) -> bool:
        # only runs whose agent saw replicated gradients (a DDP-wrapped model): other multi-rank jobs
        # (independent models, sharded parameters) have norms that differ by design
        return bool(ctx.run_meta.get("grad_replicas")) and "grad_norm" in ctx.present

    def evaluate(self, steps, mine, others, state_of, cfg):
        """A step is judged once every rank of the run has sent it (``mine["world_size"]``), so the odd rank
        is told from the whole picture, not from the first two ranks to arrive. The ranks are grouped by
        their grad norm (equal within ``rel_tol``); the largest group (on a tie, the one holding the
        lowest rank) is taken as the agreed value and every other rank is odd. Verdicts go on the odd
        ranks; a rank back in agreement clears."""
        ranks = sorted(list(others) + [mine["rank"]])
        vals = {r: (mine if r == mine["rank"] else others[r]) for r in ranks}
        tol = cfg["rel_tol"]
        out: list[tuple[int, int, object]] = []
        for i, step in enumerate(steps.tolist()):
            here = [(r, float(vals[r]["grad_norm"][i])) for r in ranks if vals[r]["grad_norm.measured"][i]]
            if len(here) < max(2, mine.get("world_size", 2)):
                continue
            groups: list[list[tuple[int, float]]] = []
            for r, x in here:
                for g in groups:
                    y = g[0][1]
                    if x == y or (x != x and y != y) or (tol > 0 and abs(x - y) <= tol * max(abs(x), abs(y))):
                        g.append((r, x))
                        break
                else:
                    groups.append([(r, x)])
            agreed = max(groups, key=lambda g: (len(g), -g[0][0]))
            value = agreed[0][1]
            majority = len(agreed) > len(here) / 2
            for r, x in here:
                if any(r == a for a, _ in agreed):
                    out.append((r, int(step), False))
                    continue
                diff = x - value if x == x and value == value else float("nan")
                note = "" if majority else f" (no majority among {len(here)} ranks: the odd one cannot be told apart)"
                out.append((r, int(step), Hit(
                    {"rank": r, "grad_norm": enc(x), "agreed_grad_norm": enc(value),
                     "agreeing_ranks": [a for a, _ in agreed], "difference": enc(diff), "majority": majority},
                    f"Rank {r}'s grad norm {x!r} differs from {value!r} of ranks "
                    f"{', '.join(str(a) for a, _ in agreed)} at step {step}{note}")))
        out.sort(key=lambda v: v[1])
        return out
