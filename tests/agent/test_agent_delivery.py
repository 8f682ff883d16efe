"""Delivery to a real server: batching, the disk spool, outages, slow and failing servers, drops."""
from __future__ import annotations

import json
import math
import statistics
import time

import torch

from gradwatch import agent
from gradwatch.agent.sync import sync_spool
from agent_helpers import (StubbornServer, TinyNet, batches, checklist_step, find_run, spooled_steps,
                           stored_counts, stored_events, tiny_loop)
from tests.conftest import free_port, wait_until


def _train(monitor_args: dict, steps: int, model=None, opt=None, scaler=None, times=None):
    model = model or TinyNet()
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = scaler or torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, **monitor_args)
    for x, y in batches(steps):
        t0 = time.perf_counter()
        checklist_step(model, opt, scaler, x, y)
        if times is not None:
            times.append(time.perf_counter() - t0)
    return monitor, model, opt, scaler


def test_steps_meta_and_finished_status_reach_a_real_server(shared_server, tmp_path):
    srv = shared_server
    monitor, *_ = _train({"server": srv.url, "project": "deliv", "run": "basic",
                          "spool_dir": str(tmp_path / "spool")}, 25)
    monitor.close()
    assert stored_counts(srv, "deliv", "basic") == {i: 1 for i in range(25)}
    # close() waits exit_timeout for the final batch; on a loaded machine it may still be on its way
    run = wait_until(lambda: (r := find_run(srv, "deliv", "basic")) and r["status"] == "finished" and r, timeout=20,
                     what="the run's final batch")
    status, detail = srv.get(f"/api/v1/runs/{run['id']}")
    assert detail["param_names"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert spooled_steps(tmp_path / "spool") == []     # delivered batches leave no files behind


def test_server_down_mid_run_every_step_arrives_exactly_once(server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    args = {"server": srv.url, "project": "deliv", "run": "outage", "spool_dir": str(tmp_path / "spool"),
            "flush_interval": 0.05, "http_timeout": 1.0}
    model, opt, scaler = tiny_loop()
    monitor = agent.attach(model, scaler, **args)
    phases: dict[str, list[float]] = {"up": [], "down": [], "back": []}
    data = iter(batches(150))

    def run(phase: str, n: int) -> None:
        for _ in range(n):
            x, y = next(data)
            t0 = time.perf_counter()
            checklist_step(model, opt, scaler, x, y)
            phases[phase].append(time.perf_counter() - t0)

    run("up", 50)
    wait_until(lambda: len(stored_counts(srv, "deliv", "outage")) >= 25, what="first steps stored")
    srv.kill()                        # as a crash would
    run("down", 50)
    # batches made during the outage are on disk (the sender spools them at its next tick: waited for,
    # the limit is a hang bound)
    wait_until(lambda: spooled_steps(tmp_path / "spool"), what="the outage's batches in the spool")
    srv.start()
    run("back", 50)
    monitor.close(timeout=20)
    counts = stored_counts(srv, "deliv", "outage")
    assert counts == {i: 1 for i in range(150)}
    assert spooled_steps(tmp_path / "spool") == []
    assert monitor.dropped_steps == 0
    print("median step time (ms): " + ", ".join(
        f"{k}={1000 * statistics.median(v):.2f}" for k, v in phases.items()))


def test_outage_batches_are_replayed_in_order(tmp_path):
    """Order check at the transport: the spool is replayed oldest first, before any new batch."""
    from agent_helpers import RecordingTransport
    rec = RecordingTransport(status=0)                 # "connection refused"
    monitor, model, opt, scaler = _train({"transport": rec, "spool_dir": str(tmp_path / "spool"),
                                          "flush_interval": 0.02, "run": "order"}, 30)
    wait_until(lambda: len(spooled_steps(tmp_path / "spool")) >= 25, what="spooled")
    rec.status = 200
    for x, y in batches(30, seed=1):
        checklist_step(model, opt, scaler, x, y)
    monitor.close(timeout=10)
    sent = [s["step"] for s in rec.steps]
    assert sent == list(range(60))


def test_server_answering_500_does_not_block_training_and_the_spool_keeps_everything(tmp_path, shared_server):
    bad = StubbornServer(status=500)
    times: list[float] = []
    try:
        monitor, *_ = _train({"server": bad.url, "project": "deliv", "run": "five-hundred", "token": "tok-1",
                              "spool_dir": str(tmp_path / "spool"), "flush_interval": 0.05}, 60, times=times)
        monitor.close(timeout=3)
    finally:
        bad.stop()
    assert bad.requests, "the agent did try the server"
    assert bad.requests[0].get("Authorization") == "Bearer tok-1"
    assert sorted(spooled_steps(tmp_path / "spool")) == list(range(60))
    print(f"step time with a 500-answering server: median {1000 * statistics.median(times):.2f} ms, "
          f"max {1000 * max(times):.2f} ms")
    # The spool left behind is uploaded later by `gradwatch sync`.
    srv = shared_server
    result = sync_spool(tmp_path / "spool", srv.url, progress=False)
    assert result.ok and result.steps == 60
    assert stored_counts(srv, "deliv", "five-hundred") == {i: 1 for i in range(60)}


def test_hanging_server_does_not_block_training(tmp_path):
    hung = StubbornServer(hang=True)
    times: list[float] = []
    try:
        monitor, *_ = _train({"server": hung.url, "run": "hang", "spool_dir": str(tmp_path / "spool"),
                              "flush_interval": 0.05, "http_timeout": 2.0}, 80, times=times)
        t0 = time.perf_counter()
        monitor.close(timeout=1.0)
        close_s = time.perf_counter() - t0
        # close() returns at its timeout; the sender may still be inside a retry POST to the hung server
        # then (up to http_timeout, 2 s): the steps it holds are spooled when that POST gives up. On a
        # loaded machine the retry falls inside close's second (1 run in 6 with 5 other jobs on 2 cores)
        wait_until(lambda: sorted(spooled_steps(tmp_path / "spool")) == list(range(80)), timeout=10,
                   what="all 80 steps in the spool")
    finally:
        hung.stop()
    assert sorted(spooled_steps(tmp_path / "spool")) == list(range(80))
    print(f"step time with a hanging server: median {1000 * statistics.median(times):.2f} ms, "
          f"max {1000 * max(times):.2f} ms; close took {close_s:.2f} s")


def test_unwritable_spool_holds_batches_in_memory_until_the_server_returns(server_factory, sqlite_url, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool directory should be")
    port = free_port()
    # Nothing listens at first (refused at once): the spool cannot take the batches, so they wait in
    # memory (agent/sender.py HELD_MAX_BYTES) and go, in order, once the server answers. http_timeout is
    # a hang bound only.
    monitor, model, opt, scaler = _train({"server": f"http://127.0.0.1:{port}", "project": "deliv",
                                          "run": "nospool", "spool_dir": str(blocker / "spool"),
                                          "flush_interval": 0.05, "http_timeout": 30.0}, 40)
    assert monitor.dropped_steps == 0
    srv = server_factory(sqlite_url, port=port)
    for x, y in batches(10, seed=3):
        checklist_step(model, opt, scaler, x, y)
    monitor.close(timeout=30)
    assert stored_counts(srv, "deliv", "nospool") == {i: 1 for i in range(50)}
    assert stored_events(srv, "deliv", "nospool", kind="dropped") == []
    assert monitor.dropped_steps == 0


def test_unwritable_spool_drops_beyond_the_memory_bound_are_counted_and_reported_once(server_factory, sqlite_url,
                                                                                      tmp_path, monkeypatch):
    import gradwatch.agent.sender as sender_module
    # a bound of a few batches, so that a short outage outgrows it
    monkeypatch.setattr(sender_module, "HELD_MAX_BYTES", 6000)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool directory should be")
    port = free_port()
    monitor, model, opt, scaler = _train({"server": f"http://127.0.0.1:{port}", "project": "deliv",
                                          "run": "nospool-bound", "spool_dir": str(blocker / "spool"),
                                          "flush_interval": 0.02, "max_batch_steps": 5,
                                          "http_timeout": 30.0}, 60)   # a hang bound
    assert monitor.flush(timeout=5) is not None
    dropped = monitor.dropped_steps
    assert 0 < dropped < 60
    srv = server_factory(sqlite_url, port=port)
    for x, y in batches(5, seed=4):
        checklist_step(model, opt, scaler, x, y)
    monitor.close(timeout=30)
    counts = stored_counts(srv, "deliv", "nospool-bound")
    assert set(counts.values()) == {1}
    assert len(counts) + dropped == 65
    assert set(range(60, 65)) <= set(counts)
    events = stored_events(srv, "deliv", "nospool-bound", kind="dropped")
    assert sum(e["data"]["steps"] for e in events) == dropped    # each drop reported once


class ReplyDroppingProxy:
    """A real TCP proxy on loopback in front of a real server: it forwards each request and relays the
    answer, except that the first ``drop`` answers are thrown away and the connection closed, as when a
    post times out after the server has stored its batch."""

    def __init__(self, target_port: int, drop: int):
        import socket
        import threading
        self.target_port, self.drop, self.forwarded = target_port, drop, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket
        import threading
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        import http.client
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            length = int(headers.get("Content-Length", 0))
            while len(body) < length:
                body += conn.recv(65536)
            up = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=60)
            headers.pop("Connection", None)
            up.request(method, path, body=body, headers=headers)
            reply = up.getresponse()
            payload = reply.read()
            up.close()
            self.forwarded += 1
            if self.forwarded <= self.drop:
                return     # stored by the server; the agent never hears so
            out = [f"HTTP/1.1 {reply.status} {reply.reason}"]
            out += [f"{k}: {v}" for k, v in reply.getheaders() if k.lower() not in ("transfer-encoding", "connection")]
            out += ["Connection: close", "", ""]
            conn.sendall("\r\n".join(out).encode("latin-1") + payload)

    def close(self) -> None:
        self._closed = True
        self.sock.close()


def test_a_lost_reply_without_a_spool_is_sent_again_and_stored_once_nothing_counted_as_dropped(server_factory,
                                                                                                sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    proxy = ReplyDroppingProxy(int(srv.url.rsplit(":", 1)[1]), drop=3)
    try:
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("a file where the spool directory should be")
        monitor, *_ = _train({"server": f"http://127.0.0.1:{proxy.port}", "project": "deliv", "run": "lost-reply",
                              "spool_dir": str(blocker / "spool"), "flush_interval": 0.05,
                              "http_timeout": 30.0}, 40)   # a hang bound
        monitor.close(timeout=30)
    finally:
        proxy.close()
    assert proxy.forwarded > 3
    assert stored_counts(srv, "deliv", "lost-reply") == {i: 1 for i in range(40)}
    assert stored_events(srv, "deliv", "lost-reply", kind="dropped") == []
    assert monitor.dropped_steps == 0


def test_full_spool_drops_are_counted_and_reported_to_the_server(server_factory, sqlite_url, tmp_path):
    port = free_port()
    # Batches of at most 10 steps (~4 KB): without the cap, how many steps one batch holds
    # depends on how fast the loop runs against the 20 ms tick, and on a fast run every batch
    # outgrew the 10 KB spool, so none was kept (the test failed with kept == []).
    monitor, model, opt, scaler = _train({"server": f"http://127.0.0.1:{port}", "project": "deliv",
                                          "run": "tiny-spool", "spool_dir": str(tmp_path / "spool"),
                                          "spool_max_mb": 0.01, "flush_interval": 0.02, "max_batch_steps": 10,
                                          "http_timeout": 30.0}, 120)   # a hang bound, as above
    assert monitor.flush(timeout=5)
    kept = spooled_steps(tmp_path / "spool")
    dropped = monitor.dropped_steps
    assert kept and dropped and len(kept) + dropped == 120
    srv = server_factory(sqlite_url, port=port)
    wait_until(lambda: spooled_steps(tmp_path / "spool") == [], timeout=15, what="spool replayed")
    for x, y in batches(5, seed=4):
        checklist_step(model, opt, scaler, x, y)
    monitor.close(timeout=10)
    counts = stored_counts(srv, "deliv", "tiny-spool")
    assert set(counts) == set(kept) | set(range(120, 125))
    events = stored_events(srv, "deliv", "tiny-spool", kind="dropped")
    assert sum(e["data"]["steps"] for e in events) == dropped
    assert all(e["data"]["reason"] == "spool full" for e in events)


def test_a_nonfinite_loss_is_sent_at_once_not_at_the_next_flush_tick(shared_server, tmp_path):
    srv = shared_server
    model, opt, scaler = tiny_loop()
    monitor = agent.attach(model, scaler, server=srv.url, project="deliv", run="critical",
                           spool_dir=str(tmp_path / "spool"), flush_interval=60.0)
    data = batches(6)
    for i, (x, y) in enumerate(data):
        if i == 3:
            x = x.clone()
            x[0, 0] = float("nan")
        checklist_step(model, opt, scaler, x, y)
    t0 = time.perf_counter()
    counts = wait_until(lambda: stored_counts(srv, "deliv", "critical"), timeout=10, what="critical step")
    print(f"critical step visible after {time.perf_counter() - t0:.3f} s (flush interval 60 s)")
    assert 3 in counts
    monitor.close()


def test_offline_mode_writes_only_the_spool_and_sync_uploads_it_once(shared_server, tmp_path):
    spool = tmp_path / "offline-spool"
    monitor, *_ = _train({"mode": "offline", "server": "http://127.0.0.1:9", "project": "deliv",
                          "run": "offline", "spool_dir": str(spool), "flush_interval": 0.02}, 30)
    monitor.close()
    files = sorted(spool.rglob("*.json"))
    assert sorted(spooled_steps(spool)) == list(range(30))
    keep = files[0].read_bytes()
    srv = shared_server
    progress = tmp_path / "progress.txt"
    with open(progress, "w") as out:
        result = sync_spool(spool, srv.url, progress=True, out=out)
    assert result.ok and result.sent == len(files) and result.steps == 30
    assert "batches" in progress.read_text()
    assert stored_counts(srv, "deliv", "offline") == {i: 1 for i in range(30)}
    assert list(spool.rglob("*.json")) == []
    files[0].write_bytes(keep)                 # a batch sent twice is answered as a duplicate
    again = sync_spool(spool, srv.url, progress=False)
    assert again.duplicates == 1 and again.sent == 0
    assert stored_counts(srv, "deliv", "offline") == {i: 1 for i in range(30)}


def test_sync_stops_at_an_unreachable_server_and_keeps_the_files(tmp_path):
    spool = tmp_path / "s"
    monitor, *_ = _train({"mode": "offline", "run": "later", "spool_dir": str(spool)}, 5)
    monitor.close()
    before = sorted(p.name for p in spool.rglob("*.json"))
    result = sync_spool(spool, f"http://127.0.0.1:{free_port()}", progress=False, timeout=1)
    assert result.failed == len(before) and not result.ok
    assert sorted(p.name for p in spool.rglob("*.json")) == before


class BatchLog:
    """The real HTTP transport, noting the step numbers of every batch it posts (in order)."""

    def __init__(self, url: str):
        from gradwatch.agent.transport import HttpTransport
        self.http = HttpTransport(url)
        self.batches: list[list[int]] = []

    def post(self, body: bytes):
        self.batches.append([s["step"] for s in json.loads(body).get("steps", [])])
        return self.http.post(body)


def test_the_server_paces_the_ranks_of_a_large_run_and_a_nonfinite_step_still_goes_at_once(shared_server, tmp_path):
    """A run of many ranks: the ingest reply asks every rank but rank 0 to send at most every
    ``rank_pace`` seconds (server/ingest/pacing.py: 1024 ranks -> 8 s at least), and the agent does, every step still
    arriving; a non-finite step is sent at once whatever the pace. The rank is given by hand (no
    1024-process job here): the header is what the agent sends as its rank and world size.

    What the pace causes is asserted, not how many batches fit in so many seconds (docs/testing.md): the
    pace each rank took from the replies, rank 3 sending fewer batches than rank 0 over the same steps,
    and the non-finite step's batch ending at that step while the loop goes on (a batch sent at a tick
    of the pace would carry the steps made while it waited)."""
    from gradwatch.server.ingest.pacing import rank_pace

    least = rank_pace(1024, 3)   # the pace at the least hold; a measured hold only lengthens it
    assert least == 8.0 and rank_pace(1024, 0) == 0.0 and rank_pace(2, 1) < 0.5
    runs, logs = {}, {}
    for rank in (0, 3):
        model, opt, scaler = tiny_loop()
        logs[rank] = BatchLog(shared_server.url)
        monitor = agent.attach(model, scaler, server=shared_server.url, project="pace", run=f"r{rank}",
                               spool_dir=str(tmp_path / f"spool{rank}"), flush_interval=0.2, transport=logs[rank])
        monitor.sender.header.update(rank=rank, world_size=1024)
        data = batches(1200)
        i = 0
        # the measured stretch starts once a reply has told the agent its pace: an event, not a step count
        # (rank 3's first batch waits for its slot of the initial pace, and a loaded server answers late; the
        # CI of a busy machine had heard nothing by step 120). 1,000 steps only bound a hang.
        while monitor.sender._pace is None:
            assert i < 1000, "no ingest reply gave this rank its pace"
            checklist_step(model, opt, scaler, *data[i])
            time.sleep(0.05)
            i += 1
        sent_before, t0 = monitor.sender.delivered_batches, time.perf_counter()
        for x, y in data[i:i + 80]:
            checklist_step(model, opt, scaler, x, y)
            time.sleep(0.05)
        i += 80
        runs[rank] = (monitor.sender.delivered_batches - sent_before, time.perf_counter() - t0, monitor.sender._pace)
        if rank == 3:
            bad = i
            x, y = data[bad]
            x = x.clone()
            x[0, 0] = float("nan")
            checklist_step(model, opt, scaler, x, y)   # step `bad`: non-finite
            # the loop goes on until the step is stored (the wait's limit is a hang bound, the pace is 8 s)
            k = bad + 1
            while not stored_counts(shared_server, "pace", "r3", rank=3).get(bad):
                assert k < len(data), "the non-finite step was not stored"
                checklist_step(model, opt, scaler, *data[k])
                time.sleep(0.05)
                k += 1
            (carrier,) = [b for b in logs[3].batches if bad in b]
            assert carrier[-1] == bad, carrier     # shipped when taken, not with the steps after it
            print(f"\n[pace] the non-finite step stored {k - bad - 1} steps later (0.05 s each)")
        monitor.close()
    (fast, fast_s, pace0), (paced, paced_s, pace3) = runs[0], runs[3]
    assert pace0 == 0.0 and pace3 >= least, runs       # the paces the replies gave
    assert paced < fast, runs                           # rank 3 waited its pace between batches, rank 0 did not
    print(f"[pace] 80 steps once paced: rank 0 sent {fast} batches in {fast_s:.1f} s, rank 3 {paced} in {paced_s:.1f} s")
    stored = stored_counts(shared_server, "pace", "r3", rank=3)
    assert sorted(stored) == list(range(k)) and set(stored.values()) == {1}   # nothing lost


class PacingServer:
    """A transport that answers every batch with ``pace`` (as server/ingest/pacing.py would) and notes the wall
    time each batch was posted at."""

    def __init__(self, pace: float):
        self.pace = pace
        self.posted: list[float] = []
        self.steps = 0

    def post(self, body: bytes):
        import json

        from gradwatch.agent.transport import Delivery

        self.posted.append(time.time())
        self.steps += len(json.loads(body)["steps"])
        return Delivery(200, json.dumps({"accepted": 1, "pace": self.pace}))


def test_a_paced_rank_schedules_each_batch_in_its_own_slot_of_the_pace():
    """agent/pacing.py: rank r of W, paced at P seconds, sends at the wall-clock instants k P + P r / W, so
    the ranks of a run given one pace at once do not all send in the same instant. The sender's schedule
    on injected clocks (its ``clock`` and ``wall_clock``): two ranks of a 64-rank run, the first batch in
    its slot of the pace assumed before any reply (agent/pacing.py initial_pace: 2 s at 64 ranks), then,
    told a 1 s pace, every batch in its slot, one pace after the last, whatever the reply's round trip
    (shorter than half a pace) or the moment the reply came."""
    from gradwatch.agent.config import AgentConfig
    from gradwatch.agent.pacing import initial_pace
    from gradwatch.agent.sender import Sender

    world, pace = 64, 1.0
    cfg = AgentConfig.from_sources({"flush_interval": 0.2}, env={})
    for rank in (5, 40):
        slot = pace * rank / world                     # 5/64 s and 40/64 s past every whole second
        mono, wall = [50.0], [1_000.0]                 # the two clocks, 950 s apart
        sender = Sender(cfg, transport=None, spool=None, assembler=None,
                        header={"rank": rank, "world_size": world},
                        clock=lambda: mono[0], wall_clock=lambda: wall[0])

        def next_post_wall(now_wall: float) -> float:
            mono[0], wall[0] = now_wall - 950.0, now_wall
            return sender._next_tick(mono[0]) + 950.0  # the tick (sender clock) as a wall-clock instant

        first = initial_pace(rank, world)
        assert first == 2.0
        t = next_post_wall(1_000.0)
        assert t - 1_000.0 >= first / 2 and math.isclose((t - first * rank / world) % first, 0.0, abs_tol=1e-9)
        sender._read_reply(json.dumps({"accepted": 1, "pace": pace}))
        # replies that came 0 to 0.49 s after a post in the slot: the next post one pace later, in the slot
        for k, reply_after in enumerate((0.0, 0.03, 0.2, 0.49)):
            post = 1_010.0 + k + slot
            nxt = next_post_wall(post + reply_after)
            assert math.isclose(nxt, post + pace, abs_tol=1e-9), (rank, reply_after, nxt)
        # the pace told at an odd moment (1012.9): the next slot at least half a pace away
        nxt = next_post_wall(1_012.9)
        assert math.isclose((nxt - slot) % pace, 0.0, abs_tol=1e-9) or math.isclose((nxt - slot) % pace, pace)
        assert pace / 2 <= nxt - 1_012.9 <= 1.5 * pace, nxt


def test_paced_ranks_send_in_their_own_slots_of_the_pace_not_together(tmp_path):
    """The schedule above with real threads and the real wall clock: two ranks of a 64-rank run at a 1 s
    pace each post in their own slot, every batch delivered. What a loaded machine does to the instants
    (how late a woken thread posts) is printed, not asserted: the slots themselves are the test above."""
    world, pace = 64, 1.0
    servers = {}
    monitors = {}
    for rank in (5, 40):
        model, opt, scaler = tiny_loop()
        servers[rank] = PacingServer(pace)
        monitors[rank] = agent.attach(model, scaler, server="http://127.0.0.1:9", project="slots", run="r",
                                      spool_dir=str(tmp_path / f"spool{rank}"), flush_interval=0.2,
                                      transport=servers[rank])
        monitors[rank].sender.header.update(rank=rank, world_size=world)
        monitors[rank]._loop = (model, opt, scaler)
    data = batches(120)
    # until each rank has posted 5 batches (a slow start under load is no failure), 30 s at most
    t_end = time.time() + 30.0
    i = 0
    while time.time() < t_end and min(len(servers[r].posted) for r in (5, 40)) < 5:
        for rank in (5, 40):
            model, opt, scaler = monitors[rank]._loop
            checklist_step(model, opt, scaler, *data[i % len(data)])
        i += 1
        time.sleep(0.02)
    for rank in (5, 40):
        monitors[rank].close()
    for rank in (5, 40):
        posted = servers[rank].posted
        slot = pace * rank / world
        # after the first reply told the pace, every batch but the closing one is posted in the rank's slot
        paced = posted[1:-1]
        assert len(paced) >= 3, posted
        gaps = [b - a for a, b in zip(paced, paced[1:])]
        # never sooner than half a pace: the next slot is at least that far from the reply (agent/pacing.py)
        assert min(gaps) >= pace / 2, (rank, gaps)
        assert servers[rank].steps == i, (rank, servers[rank].steps, i)     # nothing lost
        print(f"\n[slots] rank {rank}: posted late by "
              f"{[round((t - slot) % pace, 3) for t in paced]} s after its slot; gaps {[round(g, 3) for g in gaps]}")
    # the two ranks post apart, 35/64 of the pace: their posts' phases (mod the pace) differ by about that
    phase = {r: statistics.median(t % pace for t in servers[r].posted[1:-1]) for r in (5, 40)}
    print(f"[slots] phases apart {(phase[40] - phase[5]) % pace:.3f} s (slots {35 / 64 * pace:.3f} s apart)")


def _journaled_steps(spool) -> set[int]:
    """Step numbers in the crash-tail journals under a spool directory, as a SIGKILL now would leave them."""
    out = set()
    for path in spool.rglob("tail-*.jsonl"):
        for line in path.read_text().split("\n")[:-1]:    # a line without its newline is unfinished
            if line.startswith("s"):
                out.add(json.loads(line[1:])["step"])
    return out


def test_steps_finished_while_a_post_hangs_are_journaled_before_it_returns(tmp_path):
    """A POST that does not return (a slow or hung server) must not hold back the crash tail: the steps
    sealed meanwhile reach the journal while the POST is still in flight, so a SIGKILL at that moment
    loses at most the open step. (At load ~15 a POST took hundreds of ms and a kill lost two steps.)"""
    hung = StubbornServer(hang=True, hang_s=3600)     # answers nothing until the test stops it
    spool = tmp_path / "spool"
    model, scaler = TinyNet(), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # http_timeout far beyond the wait below (a hang bound): the POST is in flight when the journal is read
    monitor = agent.attach(model, scaler, server=hung.url, run="tail-during-post", spool_dir=str(spool),
                           flush_interval=0.05, http_timeout=3600.0)
    try:
        data = list(batches(13))
        for x, y in data[:3]:
            checklist_step(model, opt, scaler, x, y)
        wait_until(lambda: len(hung.requests) >= 1, timeout=60, what="the first batch's POST in flight")
        for x, y in data[3:]:
            checklist_step(model, opt, scaler, x, y)
        # steps 0-11 finished and sealed (12 may still be open): each is in the spool (the batch being
        # POSTed was spooled first) or in the journal, before the hung POST returns
        wait_until(lambda: set(range(12)) <= set(spooled_steps(spool)) | _journaled_steps(spool), timeout=60,
                   what="steps 0-11 spooled or journaled while the POST hangs")
        assert len(hung.requests) == 1, "one POST, still unanswered"
        assert _journaled_steps(spool), "the steps after the POSTed batch are the journal's"
    finally:
        hung.stop()
        monitor.close(timeout=5.0)
