"""Early warnings from the logits: attention-logit growth (H2), output-logit divergence (H3).

Both watch a value that moves *before* the loss does (Wortsman et al. 2023, arXiv:2309.14322;
docs/early-warning-logits.md) and judge it against its own history with a robust baseline
(:class:`~server.rules.windows.RobustWindow`: median / MAD, a flagged value kept out of it) and ask
for a sustained rise — ``consecutive`` samples in a row past the bar — so one spike says nothing.
"""
from __future__ import annotations

import numpy as np

from gradwatch.server.rules.batch import layer_array
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, name_of, streaks
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt
from gradwatch.server.rules.windows import RobustWindow


def _bar(factor: float, sigmas: float, floor: float):
    """The test of one arrival: past ``floor``, ``factor`` × its median and ``sigmas`` MADs above it."""
    return lambda x, med, mad: (x >= floor) & (x >= factor * med) & (x > med + sigmas * np.nan_to_num(mad))


def _doubling(first, step: int, x: float):
    """Steps per doubling of the logit from ``first`` ([step, value], the run's first flagged sample) to
    (``step``, ``x``); None when it did not grow or there is no span.

    >>> _doubling([100, 50.0], 120, 200.0)
    10.0
    """
    if first is None or step <= first[0] or not (x > first[1] > 0):
        return None
    return float((step - first[0]) * np.log(2.0) / np.log(x / first[1]))


@register
class AttentionLogitGrowth(BatchRule):
    id, name, severity, checklist = "H2", "attention_logit_growth", "warning", "5.2"
    family = "H"
    fires_when = ("an attention module's max attention logit stays >= {min_logit:g}, >= {factor:g}x its median and "
                  "{sigmas:g} MADs above it (its last {window} samples, one per {spacing} steps) for {consecutive} "
                  "samples in a row")
    diagnosis = ("Attention-logit growth: the queries and keys of this attention module grow until its softmax turns "
                 "one-hot (attention entropy collapse); the loss often diverges next, not always: a task that rewards "
                 "one-hot attention can train on through it (docs/early-warning.md). Check: (1) is qk-layernorm used? "
                 "(2) is the learning rate high for this model size? (3) is the warm-up short or absent?")
    actions = {
        "qk_layernorm": "Add qk-layernorm: a LayerNorm on each head's queries and keys before q·k (Dehghani et al. "
                        "2023; Wortsman et al. 2023).",
        "lower_lr": "Lower the learning rate (÷2-÷10); the growth rate follows it.",
        "longer_warmup": "Lengthen the learning-rate warm-up.",
    }
    # consecutive 3 / min_history 3 (issue 33; were 5 / 10): at a sample every 10 steps, ten samples of history and
    # five in a row put the first verdict at step 100 and a confirmation 40 steps after the growth was seen — after
    # the divergence on a fast-growing logit. The agent samples every step while the logit grows fast
    # (agent/collectors/early_logits.py, BOOST_*), so three in a row are then three steps. min_logit 50 and factor 4
    # stay: nn.TransformerEncoder's healthy run at lr 0.5 (tests/scenarios/early_heldout.py) climbs to ~50 with a
    # history median ~25, and a qk-layernorm run's logits level off at 20-35.
    # spacing: the baseline (median / MAD) keeps one sample per 10 steps, whatever the cadence. While the agent
    # samples every step (a fast growth), a baseline of every sample would follow the growth it should measure:
    # nn.TransformerEncoder's held-out run (12 -> 118 over steps 50-100, sampled every step) never reached 4x
    # its own trailing median.
    params = {"factor": Float(4.0), "sigmas": Float(6.0, zero_ok=True), "min_logit": Float(50.0, zero_ok=True),
              "consecutive": Int(3), "window": Int(200), "min_history": Int(3), "spacing": Int(10)}
    needs = ("layers.attn_logit_max",)
    REFRESH = 8
    # State per module j: "m<j>" its RobustWindow, "s<j>" the run of flagged samples at the batch's end, "f<j>"
    # [step, value] of that run's first sample (the growth rate's start), "p<j>" the step last pushed to the window.

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        carriers = batch.carriers("attn_logit_max")
        if not carriers:
            return out
        rows = [layer_array(batch.steps[i], "attn_logit_max") for i in carriers]
        width = max(len(r) for r in rows)
        X = np.full((len(rows), width), np.nan)
        for k, r in enumerate(rows):
            X[k, :len(r)] = r
        flags = _bar(cfg["factor"], cfg["sigmas"], cfg["min_logit"])
        judged_any = np.zeros(len(rows), dtype=bool)
        worst: dict[int, tuple] = {}                      # carrier -> (ratio, module, value, median, run)
        for j in np.flatnonzero(np.isfinite(X).any(axis=0)).tolist():
            col = X[:, j]
            at = np.flatnonzero(np.isfinite(col))
            win = RobustWindow(state, f"m{j}", int(cfg["window"]), refresh=self.REFRESH,
                               min_len=int(cfg["min_history"]), want_mad=True)
            # not monotone=True: its shortcut made the verdicts depend on where the batches were cut
            # (tests/rules/test_batch_cuts.py found it on a generated run)
            steps = batch.step[[carriers[int(c)] for c in at]]
            pushable = np.zeros(len(at), dtype=bool)
            last = state.get(f"p{j}")
            for k in range(len(at)):
                if last is None or steps[k] - last >= cfg["spacing"]:
                    pushable[k], last = True, int(steps[k])
            if last is not None:
                state[f"p{j}"] = int(last)
            s = win.screen(col[at], pushable, flags)
            win.save()
            run = streaks(s.flagged, int(state.get(f"s{j}", 0)))
            state[f"s{j}"] = int(run[-1]) if len(run) else int(state.get(f"s{j}", 0))
            judged_any[at[s.judged]] = True
            first = state.get(f"f{j}")
            for k in range(len(at)):
                if run[k] == 1 or (run[k] > 1 and first is None):
                    first = [int(steps[k]), float(col[at[k]])]
                elif run[k] == 0:
                    first = None
                if run[k] >= cfg["consecutive"]:
                    x, med = float(col[at[k]]), float(s.med[k])
                    ratio = x / med if med > 0 else np.inf
                    c = int(at[k])
                    if c not in worst or ratio > worst[c][0]:
                        worst[c] = (ratio, j, x, med, float(s.mad[k]), int(run[k]), _doubling(first, int(steps[k]), x))
            if first is None:
                state.pop(f"f{j}", None)
            else:
                state[f"f{j}"] = first
        for k, i in enumerate(carriers):
            if k in worst:
                ratio, j, x, med, mad, n, doubling = worst[k]
                module = name_of(batch.ctx.module_names, j)
                rate = f", doubling every {fmt(doubling)} steps" if doubling is not None else ""
                out.hits[i] = Hit({"module": module, "attn_logit_max": x, "median": med, "mad": mad,
                                   "ratio": ratio, "samples_in_a_row": n, "doubling_steps": doubling},
                                  f"Max attention logit of {module} is {fmt(x)}, {ratio:.1f}x its median {fmt(med)}, "
                                  f"for {n} samples in a row{rate}: add qk-layernorm, lower the LR or lengthen "
                                  f"the warm-up")
            elif judged_any[k]:
                out.clear[i] = True
        return out


@register
class OutputLogitDivergence(BatchRule):
    id, name, severity, checklist = "H3", "output_logit_divergence", "warning", "6.2"
    family = "H"
    fires_when = ("the output's mean log Z is >= {min_abs_log_z:g} in size, has moved >= {min_drift:g} and "
                  "{sigmas:g} MADs from its median (its last {window} samples) and stays there for {consecutive} "
                  "samples in a row")
    diagnosis = ("Output-logit divergence: the log-partition log Z of the output logits drifts away from 0 (softmax "
                 "cross-entropy is blind to a shift of every logit, the optimizer is not); once the logits are "
                 "large, bf16 rounds away their differences and the loss jumps. Check: (1) is a z-loss used? "
                 "(2) is there weight decay on the output layer? (3) is the learning rate high?")
    actions = {
        "z_loss": "Add a z-loss: loss + 1e-4 * logsumexp(logits, -1).pow(2).mean() holds log Z near 0 "
                  "(PaLM; Wortsman et al. 2023).",
        "weight_decay": "Add weight decay (e.g. AdamW weight_decay=0.1), on the output layer too.",
        "lower_lr": "Lower the learning rate if the drift goes on.",
    }
    params = {"min_abs_log_z": Float(20.0, zero_ok=True), "min_drift": Float(10.0, zero_ok=True),
              "sigmas": Float(6.0, zero_ok=True), "consecutive": Int(5), "window": Int(200),
              "min_history": Int(10)}
    needs = ("output_log_z",)
    REFRESH = 8

    def evaluate(self, batch, state, cfg):
        z = batch.values("output_log_z")
        at = np.flatnonzero(np.isfinite(z))
        out = Outcome.quiet(batch.n)
        if not len(at):
            return out
        xs = z[at]
        lo, drift, sigmas = cfg["min_abs_log_z"], cfg["min_drift"], cfg["sigmas"]

        def flags(x, med, mad):
            return (np.abs(x) >= lo) & (np.abs(x - med) >= drift) & (np.abs(x - med) > sigmas * np.nan_to_num(mad))
        win = RobustWindow(state, "z", int(cfg["window"]), refresh=self.REFRESH, min_len=int(cfg["min_history"]),
                           want_mad=True)
        s = win.screen(xs, np.ones(len(xs), dtype=bool), flags)
        win.save()
        run = streaks(s.flagged, int(state.get("s", 0)))
        state["s"] = int(run[-1])
        for k in range(len(xs)):
            i = int(at[k])
            if run[k] >= cfg["consecutive"]:
                x, med = float(xs[k]), float(s.med[k])
                out.hits[i] = Hit({"output_log_z": x, "median": med, "mad": float(s.mad[k]),
                                   "samples_in_a_row": int(run[k])},
                                  f"Output mean log Z is {fmt(x)}, {fmt(abs(x - med))} from its median {fmt(med)}, "
                                  f"for {int(run[k])} samples in a row")
            elif s.judged[k]:
                out.clear[i] = True
        return out


@register
class AttentionUnmeasured(BatchRule):
    id, name, severity, checklist = "H11", "attention_unmeasured", "info", "5.2"
    family = "H"
    fires_when = ("the model looks like a Transformer (an attention module by type, class or child name) and the first "
                  "sampled forward measured no attention logit")
    diagnosis = ("The model looks like a Transformer, but the agent saw no attention computed in its forward, so "
                 "attention-logit growth (H2) cannot warn on this run. The agent sees attention where PyTorch "
                 "computes it: F.scaled_dot_product_attention, a softmax over a 4-D [batch, heads, query, key] "
                 "tensor or over a 3-D [batch*heads, query, key] tensor of torch.bmm / baddbmm scores, "
                 "nn.MultiheadAttention; an external kernel (flash-attn, xformers), a 3-D softmax whose scores "
                 "no batched product made, or a hand-written exp/sum is not seen.")
    actions = {
        "name_modules": "Name the attention modules: agent.attach(..., attention_modules=\"blocks.*.attn:8\") (or "
                        "GRADWATCH_ATTENTION_MODULES); their logits are then read from their q/k projections "
                        "(docs/early-warning-logits.md).",
        "use_torch_attention": "Or compute attention with torch.nn.functional.scaled_dot_product_attention, which the "
                               "agent measures exactly.",
    }
    params = {"clear_steps": Int(1), "cooldown_steps": Int(0, zero_ok=True)}
    needs = ("attn_logit_max",)
    KIND = "attention_coverage"

    def applies(self, ctx) -> bool:
        return bool(ctx.events.get(self.KIND))

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        for step, data in sorted(batch.ctx.events.get(self.KIND, {}).items()):
            if not isinstance(data, dict):
                continue
            if data.get("measured") or not data.get("transformer"):
                out.before.append((step, False))
                continue
            like = [str(x) for x in data.get("attention_like") or []]
            out.before.append((step, Hit({"attention_like": like, "named": data.get("named") or []},
                                         f"No attention logit measured, though the model looks like a Transformer "
                                         f"({', '.join(like[:2])}{', …' if len(like) > 2 else ''}): name its "
                                         f"attention modules with attention_modules=")))
        return out
