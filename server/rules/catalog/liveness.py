"""Whether a run still sends data: a run gone silent (F2), one rank gone silent while the others go on
(F4). Timer rules: the periodic scan evaluates them (``server.rules.engine.scan_timer_rules``, run by
the webhook worker), since a silent rank sends no batch that could be evaluated."""
from __future__ import annotations

from typing import Optional

from sqlalchemy import select

from gradwatch.server.storage.models import Alert, Project, Run
from gradwatch.server.storage.ranks import rank_hosts, rank_progress
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import TimerRule
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.operations.settings import DEFAULT_STALL_SECONDS


@register
class RunStalled(TimerRule):
    id, name, severity = "F2", "run_stalled", "warning"
    family = "F"
    fires_when = "no data from a running run for {timeout_s:g} s"
    diagnosis = "The run stopped sending data: the job hung or died."
    actions = {"check_job": "Check the job: is the process alive, stuck in a collective (NCCL timeout), out of "
                            "memory, or waiting on I/O?"}
    # GRADWATCH_STALL_SECONDS (Settings.stall_seconds) sets the default for every project
    params = {"timeout_s": Float(DEFAULT_STALL_SECONDS, setting="stall_seconds")}
    timeout_param = "timeout_s"

    def candidates(self, session, *, now: float, smallest_timeout: float):
        """Runs still marked running whose last data is older than the smallest timeout any project has."""
        q = (select(Run, Project.name).join(Project, Project.id == Run.project_id)
             .where(Run.status == "running", Run.last_seen < now - smallest_timeout))
        if session.bind.dialect.name == "postgresql":
            # two replicas checking at once: the second skips the runs the first is handling
            q = q.with_for_update(skip_locked=True, of=Run)
        return session.execute(q).all()

    def check(self, session, run: Run, cfg: dict, now: float) -> Optional[tuple[int, Hit]]:
        """(step, hit) when ``run`` has been silent for its project's timeout."""
        timeout = cfg["timeout_s"]
        if run.last_seen is None or now - run.last_seen < timeout:
            return None
        silent = now - run.last_seen
        step = int(run.last_step) if run.last_step is not None else 0
        return step, Hit({"last_seen": run.last_seen, "silent_s": round(silent, 1), "timeout_s": timeout,
                          "last_step": run.last_step},
                         f"No data from run {run.name!r} for {silent:.0f} s (last step {run.last_step})")

    def fired(self, run: Run) -> None:
        run.status = "stalled"

    def revive(self, session, run, rank, lifecycle, cfg, now) -> bool:
        """Any data from rank 0, or from any rank of a run marked stalled, ends the stall."""
        was_stalled = self.revived(run)
        return rank == 0 or was_stalled

    def revived(self, run: Run) -> bool:
        """Data arrived: whether the run had been marked stalled (it runs again)."""
        if run.status == "stalled":
            run.status = "running"
            return True
        return False


@register
class RankSilent(TimerRule):
    id, name, severity = "F4", "rank_silent", "critical"
    family = "F"
    fires_when = ("one rank of a running multi-rank run stopped sending while the others go on: the others' latest "
                  "step is >= {steps_behind} steps ahead of its latest, or >= {timeout_s:g} s later (the agents' "
                  "step times); resolves when the rank catches up")
    diagnosis = ("One rank stopped sending while the others go on: it hangs (a deadlock, a stuck data loader, a "
                 "failing GPU) and the job will die at the collective timeout.")
    actions = {"check_rank": "Look at that rank's process now, before the collective timeout kills the job: "
                             "py-spy dump --pid <pid> on its host, nvidia-smi, dmesg (Xid errors), its data loader.",
               "timeout": "If it is stuck in a collective, TORCH_NCCL_ASYNC_ERROR_HANDLING / a shorter timeout in "
                          "init_process_group makes the job fail fast instead of hanging."}
    params = {"steps_behind": Int(200), "timeout_s": Float(120.0)}
    timeout_param = "timeout_s"

    def candidates(self, session, *, now: float, smallest_timeout: float):
        """Running multi-rank runs that sent something within the last ten timeouts (the others go on: a
        run gone quiet as a whole is F2's)."""
        q = (select(Run, Project.name).join(Project, Project.id == Run.project_id)
             .where(Run.status == "running", Run.world_size > 1, Run.last_seen >= now - 10 * smallest_timeout))
        return session.execute(q).all()

    def check(self, session, run: Run, cfg: dict, now: float) -> Optional[tuple[int, Hit]]:
        progress = rank_progress(session, run)
        if not progress:
            return None
        ahead_step = max(s for s, _ in progress.values())
        ahead_time = max(t for _, t in progress.values())
        hosts = rank_hosts(run.config)
        silent = []
        for r in range(run.world_size or 1):
            # a rank that never sent a step is behind from the run's start
            step, t = progress.get(r, (-1, run.started_at))
            behind, quiet = ahead_step - step, ahead_time - t
            if behind >= cfg["steps_behind"] or quiet >= cfg["timeout_s"]:
                silent.append({"rank": r, "host": hosts.get(str(r)), "last_step": step if step >= 0 else None,
                               "steps_behind": behind, "silent_s": round(quiet, 1)})
        if not silent or len(silent) == (run.world_size or 1):
            return None          # nobody goes on (the whole run is quiet: F2's), or nobody is behind
        silent.sort(key=lambda x: (x["last_step"] if x["last_step"] is not None else -1, x["rank"]))
        first = silent[0]
        where = f" on host {first['host']}" if first["host"] else ""
        names = ", ".join(str(x["rank"]) for x in silent)
        message = (f"Rank{'s' if len(silent) > 1 else ''} {names} stopped sending while the others go on: rank "
                   f"{first['rank']}{where} is at step {first['last_step']}, {first['steps_behind']} steps and "
                   f"{first['silent_s']:.0f} s behind step {ahead_step}")
        step = first["last_step"] if first["last_step"] is not None else 0
        return step, Hit({"rank": first["rank"], "host": first["host"], "ranks": [x["rank"] for x in silent],
                          "silent_ranks": silent, "others_step": ahead_step, "steps_behind": cfg["steps_behind"],
                          "timeout_s": cfg["timeout_s"]}, message)

    def alert_rank(self, hit: Hit) -> int:
        return int(hit.evidence["rank"])

    def revive(self, session, run, rank, lifecycle, cfg, now) -> bool:
        """Data from a silent rank: resolved once no rank is behind any more (the rank caught up)."""
        if (run.world_size or 1) < 2:
            return False
        lc = lifecycle()
        if not lc.get("firing") or lc.get("alert_id") is None:
            return False
        alert = session.get(Alert, lc["alert_id"])
        if alert is None or rank not in ((alert.evidence or {}).get("ranks") or ()):
            return False
        return self.check(session, run, cfg, now) is None
