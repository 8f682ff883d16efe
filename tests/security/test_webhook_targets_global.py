"""Issue 43, case 4: a project's webhook may only target a global address (``ipaddress``'s
``is_global``, after DNS resolution, checked again at delivery). Carrier-grade NAT (100.64.0.0/10, with
the cloud metadata address 100.100.100.200), 6to4 / NAT64 / IPv4-mapped / Teredo forms of internal
IPv4 addresses, benchmarking, documentation, reserved and multicast ranges are refused with a 422 and
nothing is stored; a global address is accepted; the operator's allow list admits an internal one.
An endpoint admitted under an allow list that is later withdrawn gets nothing delivered. Real servers,
both databases, auth on."""
from __future__ import annotations

from tests.conftest import create_token, wait_until

NOT_GLOBAL = ["http://100.100.100.200/latest/meta-data", "http://100.64.0.1/hook", "http://100.127.255.254/hook",
              "http://[2002:7f00:1::]/hook", "http://[2002:a00:1::]/hook", "http://[64:ff9b::7f00:1]/hook",
              "http://[::ffff:127.0.0.1]/hook", "http://[::ffff:10.0.0.1]/hook", "http://[::127.0.0.1]/hook",
              "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/hook", "http://198.18.0.1/hook",
              "http://192.0.0.1/hook", "http://192.0.2.1/hook", "http://240.0.0.1/hook", "http://224.0.0.1/hook",
              "http://255.255.255.255/hook", "http://[fc00::1]/hook", "http://[fe80::1]/hook",
              "http://[2001:db8::1]/hook", "http://[ff02::1]/hook", "http://0.0.0.0/hook"]
GLOBAL = ["http://8.8.8.8/hook", "http://[2606:4700::1111]/hook", "http://[2002:808:808::]/hook"]


def _hooks(srv, auth):
    st, body = srv.get("/api/v1/webhooks?project=alpha", headers=auth)
    assert st == 200, body
    return [e["url"] for e in body["endpoints"]]


def test_non_global_targets_are_refused_and_global_ones_accepted(server_factory, db_url, tmp_path):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    auth = {"Authorization": f"Bearer {create_token(db_url, 'alpha')}"}
    for url in NOT_GLOBAL:
        st, out = srv.post("/api/v1/webhooks", {"project": "alpha", "url": url}, headers=auth)
        assert st == 422, (url, out)
        assert "internal (non-global)" in out["detail"] and "GRADWATCH_WEBHOOK_ALLOW" in out["detail"], out
    assert _hooks(srv, auth) == []
    for url in GLOBAL:
        st, out = srv.post("/api/v1/webhooks", {"project": "alpha", "url": url}, headers=auth)
        assert st == 201, (url, out)
    assert sorted(_hooks(srv, auth)) == sorted(GLOBAL)


def test_the_operator_may_allow_a_shared_range(server_factory, db_url, tmp_path):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on", "GRADWATCH_WEBHOOK_ALLOW": "100.64.0.0/10"})
    auth = {"Authorization": f"Bearer {create_token(db_url, 'alpha')}"}
    st, out = srv.post("/api/v1/webhooks", {"project": "alpha", "url": "http://100.100.100.200/hook"}, headers=auth)
    assert st == 201, out
    st, out = srv.post("/api/v1/webhooks", {"project": "alpha", "url": "http://[2002:7f00:1::]/hook"}, headers=auth)
    assert st == 422, out


def test_nothing_is_delivered_once_the_allow_list_no_longer_admits_the_target(server_factory, db_url, tmp_path,
                                                                              webhook_receiver):
    env = {"GRADWATCH_AUTH": "on", "GRADWATCH_WEBHOOK_ALLOW": "127.0.0.1"}
    srv = server_factory(db_url, env=env)
    auth = {"Authorization": f"Bearer {create_token(db_url, 'alpha')}"}
    st, ep = srv.post("/api/v1/webhooks", {"project": "alpha", "url": f"{webhook_receiver.url}/x"}, headers=auth)
    assert st == 201, ep
    srv.stop()
    srv.env = {"GRADWATCH_AUTH": "on"}            # the operator withdrew the allowance
    srv.start()
    st, out = srv.post(f"/api/v1/webhooks/{ep['id']}/test", headers=auth)
    assert st in (200, 201, 202), out

    def refused():
        _, log = srv.get(f"/api/v1/webhooks/deliveries?endpoint_id={ep['id']}", headers=auth)
        rows = log.get("deliveries", [])
        return rows if any("internal" in (d.get("last_error") or "") for d in rows) else None

    rows = wait_until(refused, timeout=20, what="the test delivery refused at delivery time")
    assert all(d["status"] != "delivered" for d in rows), rows
    assert webhook_receiver.received == [], "nothing reached the withdrawn address"

