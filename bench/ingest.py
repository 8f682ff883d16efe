"""Ingest benchmark: N concurrent agents against a real ``gradwatch serve`` on loopback.

    .venv/bin/python bench/ingest.py                                    # SQLite (temp file), closed loop
    .venv/bin/python bench/ingest.py --db postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python bench/ingest.py --rate 1000000 --agents 8 --layer-stats all   # open loop at 1M values/s
    .venv/bin/python bench/ingest.py --in-process                        # where a batch's time goes
    .venv/bin/python bench/ingest.py --ranks 256 --sharded --seconds 30   # one 256-rank FSDP run, 2 steps/s/rank
    .venv/bin/python bench/ingest.py --ranks 256 --db postgresql://postgres@127.0.0.1:5432/test --replicas 2

Each agent is a thread with its own keep-alive connection, its own run, and
real wire-format payloads (the agent's fields, 150-layer statistics as the
agent encodes them, NaNs now and then), built and serialised before the clock
starts so the client side costs the server's CPU as little as possible.
``--layer-stats default`` mirrors the agent's defaults (per-parameter grad
norms every step, the other eight statistics every 100 steps); ``all`` sends
all nine every step.

Two ways to load the server:
- closed loop (default): each agent posts its next batch as soon as the last
  one is answered: the most the process can take. Latency here is mostly
  queueing (agents x batch size / throughput), so it says little about p99.
- open loop (``--rate V``): like real agents, each posts one batch per flush
  interval (``--interval``, the agent's 0.5 s default), phases staggered,
  whatever the server does; the batch size follows from the offered rate.
  Latency counts from the scheduled send time. This is the mode the target is
  read in: the server must keep up with V values/s and answer batches in
  p99 < 200 ms.

Both first send a few batches to an uncounted run (a running server is warm).
Reports values/s accepted (acknowledged) and verified as stored (counted in
the database afterwards), and p50 / p99 batch latency, with and without each
run's first batch (which creates the run).
Target: >= 1,000,000 values/s per server process with p99 < 200 ms.

``--ranks N``: one run of N ranks instead of N runs (each rank a thread, default telemetry, 150 layers,
``--steps-per-s`` steps/s each; rank 0 sends every ``--interval``, the agent's cadence, the others at the
pace the server's replies ask, which follows its measured lock hold: server/ingest/pacing.py). ``--sharded`` makes
it an FSDP run: each rank sends its shard's norms (``*_local``) and its layout, and the server combines
every step once its last rank arrives (server/storage/ranks.py), then runs the rules on the combined row as well
as the cross-rank ones (F1, F3, F5) on every batch. Reported besides: how many steps got their combined
row (must be every step every rank sent). Target (issue 17): 256 ranks keep up, p99 < 200 ms.
``--timeline CSV`` writes every batch (when it was due, its latency, rank, steps, pace) to see when a tail came.
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import checkout  # noqa: E402  (bench/, this script's folder)
sys.path.insert(0, str(checkout.shim(ROOT)))   # gradwatch.* is this checkout's code

LAYERS = 150
# --ranks: the start of a run's stream, reported apart as well as with the rest: every rank's first batch
# (its meta, its layout) in the first 5 s (agent/pacing.py initial_pace), the first steps completed
STARTUP_S = 10.0
ASK_ALERTS = True     # batches ask for the run's alerts, as the agent's do (--no-alerts: as before the loop asked)
ALL_STATS = ("grad_norm", "weight_norm", "update_ratio", "act_mean", "act_std", "act_absmax", "act_nonfinite",
             "bn_mean_norm", "bn_var_norm")


def make_batch(agent: int, first: int, n: int, stats: str, encoding: str = "f32", *,
               world_size: int = 0, sharded: bool = False) -> dict:
    """Steps ``first .. first+n-1`` of agent ``agent``'s run, as the agent would send them.

    Values behave like a healthy run (each layer's statistic drifts slowly around its own level, the
    loss falls with noise), with a NaN in one layer's grad norm every 997 steps: random noise would
    keep several rules firing on every step, which no real run does. ``encoding`` is the agent's
    compact ``"f32:"`` layer arrays (docs/wire-format.md) or plain JSON lists. ``world_size``: ``agent``
    is a rank of the one run ``ranks`` (its steps at the same times as the other ranks'); ``sharded``:
    an FSDP rank holding piece ``agent`` of ``world_size`` of every parameter (its norms are ``*_local``).
    """
    import numpy as np

    from gradwatch.server.wire.numbers import pack_f32_b64

    rnd = np.random.default_rng(agent * 1_000_003 + first)
    # each statistic's usual range in a healthy run (update ratio ~1e-3, activations of unit scale, ...)
    levels = {"grad_norm": (0.01, 1.0), "weight_norm": (1.0, 50.0), "update_ratio": (3e-4, 3e-3),
              "act_mean": (-0.5, 0.5), "act_std": (0.5, 2.0), "act_absmax": (2.0, 20.0), "act_nonfinite": (0.0, 0.0),
              "bn_mean_norm": (0.1, 1.0), "bn_var_norm": (1.0, 10.0)}
    gen = np.random.default_rng(agent)
    base = np.stack([gen.uniform(*levels[st], size=LAYERS) for st in ALL_STATS])
    steps = []
    for i in range(first, first + n):
        wanted = ALL_STATS if stats == "all" or i % 100 == 0 else ALL_STATS[:1]
        layers = {}
        for k, st in enumerate(wanted):
            v = (base[k] * (1.0 + 0.02 * rnd.standard_normal(LAYERS))).astype("<f4")
            if st == "grad_norm" and i % 997 == 3:
                v[5] = np.nan
            if sharded:
                if st not in ("grad_norm", "weight_norm"):
                    continue      # what a sharded rank measures of its pieces: their norms
                st, v = st + "_local", (v / np.sqrt(world_size)).astype("<f4")
            if encoding == "f32":
                layers[st] = pack_f32_b64(v)
            else:
                layers[st] = [x if x == x else "NaN" for x in np.round(v.astype(float), 6).tolist()]
        loss = 4.0 * (1.0 + i / 2000) ** -0.3 * (1.0 + 0.02 * rnd.standard_normal())
        grad_norm = 0.8 + 0.1 * rnd.random()
        steps.append({
            "step": i, "time": 1.7e9 + i * 0.05, "loss": loss, "grad_norm": grad_norm,
            "clip_max_norm": 1.0, "clipped": False, "loss_scale": 65536.0, "overflow": False, "overflow_count": 0,
            "lr": 3e-4, "step_time": 0.05, "samples_per_s": 1000.0, "tokens_per_s": 512000.0, "mem_peak": 1.2e9,
            "ema_divergence": 1e-3, "input_nonfinite": 0 if i % 10 == 0 else None, "custom": {}, "layers": layers,
        })
        if sharded:
            steps[-1]["grad_norm"] = None
            steps[-1]["grad_norm_local"] = grad_norm / math.sqrt(world_size)
    body = {"batch_id": uuid.uuid4().hex, "project": "bench", "run": f"agent-{agent}", "rank": 0,
            "world_size": 1, "steps": steps}
    if world_size:
        body.update(run="ranks", rank=agent, world_size=world_size)
    if ASK_ALERTS:
        # as the agent asks (docs/alerts-in-the-loop.md): 0 in a process's first batch, then the last
        # reply's cursor; bodies are built before the clock starts, so this cursor (the build time) is
        # older than an agent's and each reply carries every alert of the run changed during the run
        body["alerts_after"] = 0.0 if first == 0 else time.time()
    if first == 0:
        body["meta"] = {"param_names": [f"blocks.{k // 6}.p{k % 6}.weight" for k in range(LAYERS)],
                        "module_names": [f"blocks.{k // 6}.m{k % 6}" for k in range(LAYERS)],
                        "bn_names": [f"bn{k}" for k in range(LAYERS)]}
        if sharded:
            body["meta"]["param_shards"] = [[agent, world_size]] * LAYERS
        if world_size:
            body["meta"].update(host=f"node{agent // 8}", local_rank=agent % 8, pid=1000 + agent)
    return body


def count_values(body: dict) -> int:
    from gradwatch.server.wire.numbers import unpack_f32_b64

    n = 0
    for s in body["steps"]:
        n += sum(1 for k, v in s.items() if k not in ("step", "time", "custom", "layers") and v is not None)
        n += sum(len(unpack_f32_b64(v, max_values=LAYERS)) // 4 if isinstance(v, str) else len(v)
                 for v in s["layers"].values())
    return n


def start_server(db: str, port: int, data_dir: str, root: Path = ROOT) -> subprocess.Popen:
    """``gradwatch serve`` from the checkout at ``root`` (``python -m`` imports from the working directory,
    so another checkout's server can be measured against this one)."""
    env = dict(os.environ, GRADWATCH_DATA_DIR=data_dir, **checkout.pythonpath(root))
    subprocess.run([sys.executable, "-m", checkout.server_module(root), "db", "upgrade", "--db", db], cwd=root, env=env, check=True,
                   capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", checkout.server_module(root), "serve", "--db", db, "--port", str(port),
                             "--log-level", "warning"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} (port {port} taken?)")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/api/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("server did not start")


def combined_steps(db: str, project: str = "bench") -> tuple[int, int]:
    """(steps with their combined row, distinct steps the ranks sent) of ``project``'s runs."""
    from sqlalchemy import func, select

    from gradwatch.server.storage.db import open_database
    from gradwatch.server.storage.models import Project, Run, Step
    from gradwatch.server.storage.ranks import COMBINED_RANK

    database = open_database(db)
    with database.sessionmaker() as s:
        runs = select(Run.id).join(Project, Project.id == Run.project_id).where(Project.name == project)
        combined = s.scalar(select(func.count()).where(Step.run_id.in_(runs), Step.rank == COMBINED_RANK))
        sent = s.scalar(select(func.count(func.distinct(Step.step))).where(Step.run_id.in_(runs), Step.rank >= 0))
    database.dispose()
    return int(combined), int(sent)


def stored_values(db: str, project: str = "bench", ranks_only: bool = False) -> int:
    """Count what the database holds for ``project``: non-null step scalars (+ NaN bits) and layer values
    (``ranks_only``: the ranks' own rows, not the server's combined ones)."""
    from sqlalchemy import func, select

    from gradwatch.server.storage.db import open_database
    from gradwatch.server.storage.models import STEP_COLUMNS, LayerStat, Project, Run, Step
    from gradwatch.server.wire.numbers import extra_measured, unpack_extra

    database = open_database(db)
    with database.sessionmaker() as s:
        runs = select(Run.id).join(Project, Project.id == Run.project_id).where(Project.name == project)
        mine = [Step.run_id.in_(runs)] + ([Step.rank >= 0] if ranks_only else [])
        scalars = 0
        for name in STEP_COLUMNS:
            scalars += s.scalar(select(func.count(getattr(Step, name))).where(*mine))
        scalars += s.scalar(select(func.count()).where(Step.nan_mask != 0, *mine))
        # the signals declared after the columns (e.g. a sharded rank's grad_norm_local), measured slots
        for blob in s.scalars(select(Step.extra).where(Step.extra.is_not(None), *mine)):
            scalars += int(extra_measured(unpack_extra(blob)).sum())
        layer_bytes = s.scalar(select(func.sum(func.length(LayerStat.values))).where(
            LayerStat.run_id.in_(runs), *([LayerStat.rank >= 0] if ranks_only else []))) or 0
    database.dispose()
    return scalars + int(layer_bytes) // 4


def in_process_split(db: str, batches: int, steps_per_batch: int, stats: str, encoding: str) -> None:
    """Where a batch's time goes, without HTTP: parse + validate, then the write path with and
    without the rule engine (``ingest_batch(evaluate_rules=False)``), on one core."""
    from gradwatch.server.api.ingest import decode_body
    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.ingest.write import ingest_batch
    from gradwatch.server.wire.schemas import IngestBatchIn
    from gradwatch.server.operations.settings import Settings

    raws = [json.dumps(make_batch(0, b * steps_per_batch, steps_per_batch, stats, encoding)).encode()
            for b in range(batches)]
    nvals = sum(count_values(json.loads(r)) for r in raws)
    for rules in (False, True):
        upgrade(db)
        database = open_database(db)
        settings = Settings(data_dir=tempfile.mkdtemp(), database_url=db)
        run = f"split-{uuid.uuid4().hex[:6]}"
        t_parse = t_write = 0.0
        for raw in raws:
            t = time.perf_counter()
            body = decode_body(raw, "", limit=1 << 30)
            body["run"], body["batch_id"] = run, uuid.uuid4().hex
            batch = IngestBatchIn.model_validate(body)
            t_parse += time.perf_counter() - t
            t = time.perf_counter()
            with database.write_sessionmaker() as session:
                ingest_batch(session, batch=batch, settings=settings, now=time.time(), evaluate_rules=rules)
                session.commit()
            t_write += time.perf_counter() - t
        database.dispose()
        total = t_parse + t_write
        print(f"rules {'on ' if rules else 'off'}  {nvals / total:>12,.0f} values/s  "
              f"{batches * steps_per_batch / total:>7,.0f} steps/s   parse+validate {t_parse / total:4.0%}  "
              f"write{' + rules' if rules else ''} {t_write / total:4.0%}")


class FreshDatabase:
    """The database of one benchmark run: ``db`` None gives a new SQLite file in ``tmp``; a PostgreSQL
    URL gives a new database next to the one named, dropped again by ``close()``."""

    def __init__(self, db: str | None, tmp: str, prefix: str):
        from gradwatch.server.operations.settings import normalize_db_url

        self._admin = self._name = None
        if db and not db.startswith("sqlite"):
            import psycopg

            admin_url = db.replace("postgresql+psycopg://", "postgresql://")
            self._admin = psycopg.connect(admin_url, autocommit=True)
            self._name = f"gw_{prefix}_{uuid.uuid4().hex[:8]}"
            self._admin.execute(f'CREATE DATABASE "{self._name}"')
            self.url = normalize_db_url(admin_url.rsplit("/", 1)[0] + "/" + self._name)
        else:
            self.url = db or f"sqlite:///{tmp}/{prefix}.db"

    def close(self) -> None:
        if self._admin is not None:
            self._admin.execute(f'DROP DATABASE IF EXISTS "{self._name}" WITH (FORCE)')
            self._admin.close()
            self._admin = None


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lock_hold(port: int) -> tuple[float, float]:
    """A server's (average, paced) hold of a run's lock, seconds, from its /metrics (server/ingest/pacing.py)."""
    import re

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    found = dict(re.findall(r'^gradwatch_ingest_lock_hold_seconds\{figure="(\w+)"\} (\S+)$', text, re.M))
    return float(found.get("average", "nan")), float(found.get("paced", "nan"))


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


class RankStream:
    """One rank's steps for ``--ranks``, each serialised before the clock starts; ``body(lo, hi)`` is the
    batch of steps lo..hi-1 put together at send time (its size follows the pace the server asks)."""

    def __init__(self, rank: int, n: int, stats: str, encoding: str, *, world_size: int, sharded: bool):
        self.rank, self.n = rank, n
        self.steps: list[str] = []
        self.counts: list[int] = []
        self.meta = None
        for i in range(n):
            one = make_batch(rank, i, 1, stats, encoding, world_size=world_size, sharded=sharded)
            if i == 0:
                self.meta = one.get("meta")
            self.steps.append(json.dumps(one["steps"][0]))
            self.counts.append(count_values(one))
        self.values = sum(self.counts)
        self.json_bytes = sum(len(x) for x in self.steps)
        self.world_size = world_size

    def body(self, lo: int, hi: int, cursor: float = 0.0) -> tuple[bytes, int]:
        head: dict = {"batch_id": uuid.uuid4().hex, "project": "bench", "run": "ranks", "rank": self.rank,
                      "world_size": self.world_size}
        if ASK_ALERTS:   # as the agent asks: 0 in its first batch, then the last reply's cursor
            head["alerts_after"] = cursor
        if lo == 0 and self.meta is not None:
            head["meta"] = self.meta
        text = json.dumps(head)[:-1] + ', "steps": [' + ", ".join(self.steps[lo:hi]) + "]}"
        return text.encode(), sum(self.counts[lo:hi])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="database URL (default: a fresh SQLite file); for PostgreSQL a fresh database "
                                 "is created next to the one named")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--batches", type=int, default=30, help="batches per agent")
    ap.add_argument("--steps-per-batch", type=int, default=100)
    ap.add_argument("--layer-stats", choices=["default", "all"], default="default")
    ap.add_argument("--encoding", choices=["f32", "list"], default="f32",
                    help="layer arrays as the agent sends them (f32: base64 float32) or as JSON lists")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="open loop: offer this many values/s in total, each agent sending one batch every "
                         "--interval s (steps per batch follow); default: closed loop, as fast as answered")
    ap.add_argument("--interval", type=float, default=0.5, help="open loop: seconds between an agent's batches "
                    "(the agent's flush_interval)")
    ap.add_argument("--seconds", type=float, default=20.0, help="open loop: how long to send")
    ap.add_argument("--server-root", help="run the server of another checkout (e.g. `git worktree add /tmp/base "
                                          "<commit>`), for before / after figures with the same client")
    ap.add_argument("--warmup", type=int, default=5, help="batches sent to an uncounted run first")
    ap.add_argument("--gzip", action="store_true", help="send Content-Encoding: gzip bodies")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--ranks", type=int, default=0,
                    help="one run of this many ranks (a thread each) instead of --agents runs; open loop at "
                         "--steps-per-s per rank")
    ap.add_argument("--steps-per-s", type=float, default=2.0, help="with --ranks: each rank's training speed")
    ap.add_argument("--sharded", action="store_true",
                    help="with --ranks: an FSDP run (shard norms and layouts; the server combines the ranks)")
    ap.add_argument("--replicas", type=int, default=1, help="this many servers on the one PostgreSQL database "
                    "(--db), the agents spread across them round-robin (a run's ranks on both)")
    ap.add_argument("--no-pace", action="store_true", help="with --ranks: every rank sends every --interval, "
                    "not at the pace the server asks of ranks > 0 (as agents did before it asked)")
    ap.add_argument("--timeline", metavar="CSV", help="with --ranks: write every batch as a line (seconds since the "
                    "start it was due, latency ms, rank, steps, the pace it was sent at), to see when the tail came")
    ap.add_argument("--no-alerts", action="store_true", help="batches do not ask for the run's alerts "
                    "(alerts_after), as agents did before alerts reached the loop")
    ap.add_argument("--in-process", action="store_true",
                    help="instead: time parse/validate/write in this process, rule engine off and on")
    args = ap.parse_args()
    global ASK_ALERTS
    ASK_ALERTS = not args.no_alerts

    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    if args.replicas > 1 and not (args.db and args.db.startswith("postgresql")):
        ap.error("--replicas N needs --db postgresql://...: replicas share one PostgreSQL database")
    def free_port() -> int:   # never a fixed default: another benchmark or test server may hold it
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    args.port = args.port or free_port()
    ports = [args.port] + [free_port() for _ in range(args.replicas - 1)]
    tmp = tempfile.mkdtemp(prefix="gw-bench-")
    fresh = FreshDatabase(args.db, tmp, "bench")
    db = fresh.url

    if args.in_process:
        in_process_split(db, args.batches, args.steps_per_batch, args.layer_stats, args.encoding)
        fresh.close()
        return 0
    if args.sharded and not args.ranks:
        ap.error("--sharded needs --ranks N")
    if args.ranks:
        args.agents = args.ranks
    shape = {"world_size": args.ranks, "sharded": args.sharded}
    values_per_step = count_values(make_batch(0, 1, 100, args.layer_stats, args.encoding, **shape)) / 100
    streams: list[RankStream] = []
    if args.ranks:
        # as the agents do: every rank but 0 sends at the pace the server's last reply asked of it (server/
        # pacing.py, rank_pace: it follows the server's measured lock hold, so it moves during the run), its
        # steps in fewer, larger batches; the bodies are put together at send time from steps serialised
        # before the clock starts
        steps_per_batch = max(1, round(args.steps_per_s * args.interval))
        batches = max(1, round(args.seconds / args.interval))
        args.rate = args.ranks * args.steps_per_s * values_per_step     # open loop, the offered rate
        n_steps = max(1, round(args.steps_per_s * args.seconds))
        streams = [RankStream(r, n_steps, args.layer_stats, args.encoding, **shape) for r in range(args.ranks)]
        print(f"built {args.ranks} ranks x {n_steps} steps ({args.layer_stats} layer stats, "
              f"{args.encoding} layer arrays)", flush=True)
    elif args.rate:
        # open loop, like real agents: each sends one batch per flush interval whatever the server does
        steps_per_batch = max(1, round(args.rate * args.interval / (args.agents * values_per_step)))
        batches = max(1, round(args.seconds / args.interval))
    else:
        steps_per_batch, batches = args.steps_per_batch, args.batches
    payloads: list[list[tuple[bytes, int, int]]] = []
    if not args.ranks:
        print(f"building {args.agents} x {batches} batches of {steps_per_batch} steps "
              f"({args.layer_stats} layer stats, {args.encoding} layer arrays) ...", flush=True)
    for a in range(0 if args.ranks else args.agents):
        mine = []
        for b in range(batches):
            body = make_batch(a, b * steps_per_batch, steps_per_batch, args.layer_stats, args.encoding, **shape)
            raw = json.dumps(body).encode()
            mine.append((gzip.compress(raw, 1) if args.gzip else raw, count_values(body), len(body["steps"])))
        payloads.append(mine)
    total_values = (sum(st.values for st in streams) if streams else
                    sum(v for mine in payloads for _, v, _ in mine))
    mb = (sum(st.json_bytes for st in streams) if streams else sum(len(p) for mine in payloads for p, _, _ in mine)) / 1e6
    headers = {"Content-Type": "application/json"}
    if args.gzip:
        headers["Content-Encoding"] = "gzip"

    root = Path(args.server_root).resolve() if args.server_root else ROOT
    procs = [start_server(db, port, tmp, root) for port in ports]
    latencies: list[float] = []
    first_latencies: list[float] = []
    accepted = [0]
    errors: list[str] = []
    lock = threading.Lock()
    done_at = [0.0]

    def warm_up():
        """A server in production has been up for a while: one run not counted here takes the
        process's one-off costs (imports on first use, SQLAlchemy compiling its statements)."""
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
        for b in range(args.warmup):
            body = make_batch(10_000, b * 100, 100, args.layer_stats, args.encoding)
            body["project"], body["run"] = "warm-up", "warm-up"
            conn.request("POST", "/api/v1/ingest", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            conn.getresponse().read()
        conn.close()

    def post(conn, index: int, raw: bytes):
        """POST one batch on agent ``index``'s keep-alive connection: (the connection, status, body)."""
        try:
            conn.request("POST", "/api/v1/ingest", body=raw, headers=headers)
            resp = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closes a keep-alive connection idle for its keep-alive timeout (uvicorn: 5 s), which
            # a rank paced at 5 s may just pass; the agent opens one per batch anyway. Sent again on a new
            # one (the batch id makes a repeat harmless)
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", ports[index % len(ports)], timeout=120)
            conn.request("POST", "/api/v1/ingest", body=raw, headers=headers)
            resp = conn.getresponse()
        return conn, resp.status, resp.read()

    def record(b: int, now: float, latency_s: float, status: int, data: bytes, nvalues: int) -> None:
        """One answered batch, under ``lock``: its latency (the first batch apart), the values accepted."""
        (first_latencies if b == 0 else latencies).append(latency_s * 1000)
        done_at[0] = max(done_at[0], now)
        if status == 200:
            accepted[0] += nvalues
        else:
            errors.append(f"{status} {data[:200]!r}")

    sent_batches = [0]
    # (due s since start, latency ms, rank, steps, the pace it was sent at)
    timeline: list[tuple[float, float, int, int, float]] = []
    asked_paces: list[float] = []

    def rank_agent(index, stream: RankStream, t_start):
        """Rank ``index``: its steps happen at --steps-per-s from t_start; it sends what has happened as the
        agent does (gradwatch.agent.pacing): every --interval, or when the last reply's pace is longer (or,
        before any reply, the pace a rank of this run assumes), in its own slot of the pace; the rest once
        the time is up. --no-pace: every --interval, phases staggered, whatever the replies ask."""
        from gradwatch.agent.pacing import initial_pace, seconds_to_slot

        conn = http.client.HTTPConnection("127.0.0.1", ports[index % len(ports)], timeout=120)
        nxt, b, cursor = 0, 0, 0.0
        pace = 0.0 if args.no_pace else initial_pace(index, args.ranks)

        def next_due(now: float) -> float:
            if pace <= args.interval:
                return now + args.interval
            # one clock for every rank of the bench: the slots are counted from t_start
            return now + seconds_to_slot(now - t_start, pace, rank=index, world_size=args.ranks)

        due = t_start + index / len(streams) * args.interval if pace <= args.interval else next_due(t_start)
        end = t_start + args.seconds
        while nxt < stream.n:
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            upto = stream.n if due >= end else min(stream.n, int((due - t_start) * args.steps_per_s) + 1)
            if upto <= nxt:
                due = next_due(due)
                continue
            raw, nvalues = stream.body(nxt, upto, cursor)
            raw = gzip.compress(raw, 1) if args.gzip else raw
            conn, status, data = post(conn, index, raw)
            now = time.perf_counter()
            with lock:
                record(b, now, now - due, status, data, nvalues)
                timeline.append((due - t_start, (now - due) * 1000, index, upto - nxt, pace))
                sent_batches[0] += 1
                if status == 200:
                    reply = json.loads(data)
                    asked = float(reply.get("pace", 0.0))
                    cursor = reply.get("alerts_cursor") or cursor
                    if index:
                        asked_paces.append(asked)
                    if not args.no_pace:
                        pace = asked
            nxt, b = upto, b + 1
            due = next_due(max(due, time.perf_counter())) if pace > args.interval else due + args.interval
        conn.close()

    def agent(index, mine, t_start):
        # with --replicas, the agents (a run's ranks) are spread across the servers, as behind a balancer
        conn = http.client.HTTPConnection("127.0.0.1", ports[index % len(ports)], timeout=120)
        for b, (raw, nvalues, _) in enumerate(mine):
            if args.rate:
                # staggered phases; latency counts from the scheduled send time, so a server that falls
                # behind shows it (no coordinated omission)
                due = t_start + (b + index / len(payloads)) * args.interval
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                t = due
            else:
                t = time.perf_counter()
            conn, status, data = post(conn, index, raw)
            now = time.perf_counter()
            with lock:
                record(b, now, now - t, status, data, nvalues)
        conn.close()

    # the client's own collector must not pause its 256 threads (a full collection over the bodies built
    # above took 100-300 ms, every rank's batch of that moment counted late): what exists now is frozen
    # out of its sight, and its pauses are timed and reported
    import gc

    gc.collect()
    gc.freeze()
    gc_pauses: list[float] = []
    gc_started = [0.0]

    def gc_timer(phase, info):
        if phase == "start":
            gc_started[0] = time.perf_counter()
        elif info["generation"] == 2:
            gc_pauses.append(time.perf_counter() - gc_started[0])

    gc.callbacks.append(gc_timer)
    try:
        warm_up()
        cpu0 = sum(process_cpu_seconds(p.pid) for p in procs)
        t0 = time.perf_counter()
        threads = ([threading.Thread(target=rank_agent, args=(i, st, t0)) for i, st in enumerate(streams)] or
                   [threading.Thread(target=agent, args=(i, mine, t0)) for i, mine in enumerate(payloads)])
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = done_at[0] - t0
        server_cpu = sum(process_cpu_seconds(p.pid) for p in procs) - cpu0
        holds = [lock_hold(port) for port in ports]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    stored = stored_values(db, ranks_only=bool(args.ranks))
    combined = combined_steps(db) if args.sharded else None
    every = sorted(latencies + first_latencies)
    print(f"database          {db.split(':', 1)[0]}")
    print(f"mode              {'open loop: each agent sends a batch every %.2f s' % args.interval if args.rate else 'closed loop: each agent sends its next batch as soon as the last is answered'}")
    if streams:
        print(f"ranks x steps     {args.ranks} x {streams[0].n}, {sent_batches[0]:,} batches sent, "
              f"{total_values / (args.ranks * streams[0].n):.0f} values/step, {mb:.1f} MB JSON")
    else:
        print(f"agents x batches  {args.agents} x {batches}, {steps_per_batch} steps/batch, "
              f"{total_values / (args.agents * batches * steps_per_batch):.0f} values/step, "
              f"{mb:.1f} MB {'gzip' if args.gzip else 'JSON'}")
    if args.rate:
        offered = total_values / (batches * args.interval)
        print(f"offered           {offered:,.0f} values/s")
    print(f"wall              {wall:.2f} s")
    print(f"accepted          {accepted[0]:,} values = {accepted[0] / wall:,.0f} values/s "
          f"({accepted[0] / wall * 60 / 100_000:,.0f}x W&B's 100k values/min/run guidance)")
    print(f"server {'process  ' if len(procs) == 1 else f'x{len(procs)} CPU  '}{server_cpu:.2f} CPU-s over {wall:.2f} s wall ({server_cpu / wall:.0%} of one core, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): "
          f"{accepted[0] / server_cpu:,.0f} values per server CPU-second")
    print(f"stored            {stored:,} values ({'all' if stored == total_values else 'MISMATCH vs ' + format(total_values, ',')})"
          + (" by the ranks" if args.ranks else ""))
    if args.ranks:
        print(f"ranks             one run, {args.ranks} ranks x {args.steps_per_s:g} steps/s"
              + (", sharded (FSDP): the server combines each step" if args.sharded else " (DDP-like: no layout)"))
        paces = sorted(asked_paces) or [0.0]
        print(f"pacing            {'off (--no-pace): every rank' if args.no_pace else 'rank 0'} every "
              f"{args.interval:g} s" + ("" if args.no_pace else ", ranks 1-%d at the pace the replies asked" % (args.ranks - 1))
              + f"; asked of ranks > 0: min {paces[0]:g} / median {statistics.median(paces):g} / max {paces[-1]:g} s; "
              f"{sent_batches[0] / wall:,.0f} batches/s sent")
    if args.ranks:
        print("lock hold ms      " + "; ".join(f"average {a * 1000:.1f}, paced {p * 1000:.1f}" for a, p in holds)
              + "   (each server's, at the end: server/ingest/pacing.py)")
    if combined is not None:
        print(f"combined rows     {combined[0]:,} of {combined[1]:,} steps "
              f"({'all' if combined[0] == combined[1] else 'MISSING ' + format(combined[1] - combined[0], ',')})")
    print(f"batch latency ms  p50 {statistics.median(every):.0f}  p99 {percentile(every, 0.99):.0f}  max {every[-1]:.0f}"
          f"   (all {len(every)} batches)")
    if latencies:
        steady = sorted(latencies)
        print(f"                  p50 {statistics.median(steady):.0f}  p99 {percentile(steady, 0.99):.0f}  "
              f"max {steady[-1]:.0f}   (without each run's first batch, which creates the run)")
    if timeline and args.seconds > STARTUP_S:
        later = sorted(ms for t, ms, *_ in timeline if t >= STARTUP_S)
        print(f"                  p50 {statistics.median(later):.0f}  p99 {percentile(later, 0.99):.0f}  "
              f"max {later[-1]:.0f}   (the {len(later)} batches due {STARTUP_S:g} s or more after the start: "
              f"every rank's first batches and the first steps' combination are behind)")
    print(f"first batches ms  {', '.join(f'{x:.0f}' for x in first_latencies)}")
    if args.timeline:
        with open(args.timeline, "w") as f:
            f.writelines(f"{t:.3f},{ms:.1f},{r},{n},{p}\n" for t, ms, r, n, p in sorted(timeline))
    gc.callbacks.remove(gc_timer)
    print(f"client gc         {len(gc_pauses)} full collections, longest {max(gc_pauses, default=0) * 1000:.0f} ms")
    if errors:
        print(f"errors            {len(errors)}: {errors[:3]}")
    fresh.close()
    return 1 if errors or stored != total_values or (combined is not None and combined[0] != combined[1]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
