"""A host that serves and is a gateway (or the monitoring host): which hosts serve, read from the
groups that list each host itself; the front door moved aside for the gateway, which takes the
address clients use; HAProxy's threads and memory bounded there, Prometheus's heap; the fleet,
the scrape targets and `invoke endpoints` naming each at its own port."""
import pytest

from day2.endpoints import endpoints
from roles.monitoring.role import prometheus_container
from serving.fleet import fleet_of, frontdoor_port, is_serving
from serving.haproxy.config import Server, render_config
from serving.haproxy.instance import FRONTDOOR, GATEWAY, run_command, set_apart


def hostvars(*direct, parents=(), **more):
    return {"group_names": sorted(set(direct) | set(parents)), "direct_group_names": list(direct),
            "ansible_host": "10.0.0.2", **more}


@pytest.mark.parametrize("v,serves", [
    (hostvars("rtx"), True),
    (hostvars(), True),  # ungrouped: every host serves unless a group says otherwise
    (hostvars("gateway"), False),
    (hostvars("monitoring"), False),
    (hostvars("gateway", "monitoring"), False),
    (hostvars("gateway", parents=("lab",)), False),  # a parent of `gateway` lists it only through it
    (hostvars("rtx", "gateway"), True),
    (hostvars("hgx", "gateway", "monitoring"), True),
    (hostvars("monitoring", "spark", parents=("lab",)), True),
    ({"group_names": ["rtx", "gateway"]}, True),  # a caller with no direct groups: group_names
])
def test_a_host_serves_when_a_group_other_than_gateway_and_monitoring_lists_it_itself(v, serves):
    assert is_serving(v) is serves


def test_the_front_door_moves_aside_on_a_gateway_and_where_the_inventory_says():
    assert frontdoor_port(hostvars("rtx")) == 8000
    assert frontdoor_port(hostvars("rtx", "gateway")) == 8001
    assert frontdoor_port(hostvars("rtx", "gateway", api_port=443)) == 444
    assert frontdoor_port(hostvars("rtx", "gateway", frontdoor_port=9443)) == 9443
    assert frontdoor_port(hostvars("rtx", frontdoor_port=0)) == 8000
    assert FRONTDOOR.port(hostvars("rtx", "gateway")) == 8001 and GATEWAY.port(hostvars("rtx", "gateway")) == 8000


def test_the_fleet_has_a_serving_gateway_among_its_front_doors_and_its_gateways():
    fleet = fleet_of({"spark01": {**hostvars("spark"), "ansible_host": "10.0.0.11"},
                      "rtx01": {**hostvars("rtx", "gateway"), "ansible_host": "10.0.0.12"},
                      "gw01": {**hostvars("gateway"), "ansible_host": "10.0.0.110"},
                      "hgx01": {**hostvars("hgx", "monitoring"), "ansible_host": "10.0.0.109"}})
    assert [(d.host, d.port) for d in fleet.serving] == [("spark01", 8000), ("rtx01", 8001), ("hgx01", 8000)]
    assert [(d.host, d.port) for d in fleet.gateways] == [("rtx01", 8000), ("gw01", 8000)]
    assert [d.host for d in fleet.monitors] == ["hgx01"]


def test_a_serving_gateways_haproxy_keeps_to_its_threads_and_memory_and_a_dedicated_one_does_not():
    serving = hostvars("rtx", "gateway", gateway_threads=3)
    dedicated = hostvars("gateway")
    servers = [Server("spark01", "10.0.0.11:8000")]
    config = render_config("rtx01", serving, servers, "g1", proxy=GATEWAY)
    assert "\n    nbthread 3\n" in config and "bind :8000 ssl" in config
    front = render_config("rtx01", serving, [Server("vllm0", "127.0.0.1:8100", replica=0)], "g1", proxy=FRONTDOOR)
    assert "bind :8001 ssl" in front and "nbthread" not in front  # the front door is vLLM's own door
    assert "nbthread" not in render_config("gw01", dedicated, servers, "g1", proxy=GATEWAY)
    assert run_command(serving, GATEWAY)[-5:] == ["haproxy", "-m", "1024", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
    assert "-m" not in run_command(dedicated, GATEWAY) and "-m" not in run_command(serving, FRONTDOOR)
    assert set_apart(hostvars("rtx", "gateway", gateway_memory_mib=512), GATEWAY) == {"threads": 2,
                                                                                        "memory_mib": 512}


def test_prometheus_on_a_serving_host_keeps_its_heap_near_its_bound():
    assert "GOMEMLIMIT=3072MiB" in prometheus_container(hostvars("hgx", "monitoring", prometheus_memory_mib=3072)).options
    assert not any("GOMEMLIMIT" in o for o in prometheus_container(hostvars("monitoring")).options)


def test_endpoints_name_a_serving_gateways_front_door_and_its_gateway_each_at_its_port(tmp_path):
    rtx01 = hostvars("rtx", "gateway", credentials_dir=str(tmp_path), gateway_address="10.0.0.200")
    doc = endpoints({"rtx01": rtx01}, {"rtx01": rtx01})
    assert doc["gateway"] == "https://10.0.0.200:8000/v1"
    assert doc["hosts"] == [{"host": "rtx01", "url": "https://10.0.0.2:8001/v1"}]


def test_a_host_out_of_the_group_gateway_has_its_gateway_removed_before_its_front_door_moves_back(tmp_path):
    import subprocess
    from converge.changes import HostContext
    from serving import gateway_leftovers
    left = {"gateway_left": {"LoadState": "loaded", "ActiveState": "active"}}
    assert gateway_leftovers.facts(hostvars("rtx", "gateway")) == {}  # a gateway keeps its own
    assert set(gateway_leftovers.facts(hostvars("rtx"))) == {"gateway_left"}
    assert list(gateway_leftovers.removal(HostContext("rtx01", hostvars("rtx"), {}))) == []
    assert list(gateway_leftovers.removal(HostContext(
        "rtx01", hostvars("rtx"), {"gateway_left": {"LoadState": "not-found"}}))) == []
    assert list(gateway_leftovers.removal(HostContext("rtx01", hostvars("rtx", "gateway"), left))) == []
    step, = gateway_leftovers.removal(HostContext("rtx01", hostvars("rtx"), left))
    assert step.name == "gateway removed" and "port 8000" in step.describe
    assert "FOLDERS='/etc/dgemma/gateway\n/run/dgemma-gateway'" in step.script
    # run on a host's files: ours goes, a keepalived configuration of someone else's stays
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/systemctl.log\n")
    (bin_dir / "systemctl").chmod(0o755)
    for theirs in (False, True):
        root = tmp_path / ("theirs" if theirs else "ours")
        conf = root / "keepalived.conf"
        root.mkdir()
        conf.write_text("vrrp_instance other {}\n" if theirs else "# Managed by dgemma-fleet (roles/shared_address)\n")
        text = step.script.replace(gateway_leftovers.SHARED_ADDRESS_CONF, str(conf)).replace(
            gateway_leftovers.SHARED_ADDRESS_CHECK, str(root / "check"))
        for path in ("/etc/", "/run/", "/usr/local/lib/"):
            text = text.replace(path, f"{root}{path}")
        proc = subprocess.run(["dash", "-c", text], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert conf.exists() is theirs
    calls = (tmp_path / "systemctl.log").read_text().splitlines()
    assert calls.count("disable --now keepalived.service") == 1 and calls.count("daemon-reload") == 2, calls


def test_a_serving_host_out_of_the_group_monitoring_has_prometheus_removed_and_its_samples_kept(tmp_path):
    import subprocess
    from converge.changes import HostContext
    from serving import monitoring_leftovers
    left = {"prometheus_left": {"LoadState": "loaded", "ActiveState": "active"},
            "alertmanager_left": {"LoadState": "loaded", "ActiveState": "active"}}
    assert monitoring_leftovers.facts(hostvars("hgx", "monitoring")) == {}  # the monitoring host keeps its own
    assert set(monitoring_leftovers.facts(hostvars("hgx"))) == {"prometheus_left", "alertmanager_left"}
    assert list(monitoring_leftovers.removal(HostContext("hgx01", hostvars("hgx"), {}))) == []
    gone = {fact: {"LoadState": "not-found"} for fact in left}
    assert list(monitoring_leftovers.removal(HostContext("hgx01", hostvars("hgx"), gone))) == []
    assert list(monitoring_leftovers.removal(HostContext("hgx01", hostvars("hgx", "monitoring"), left))) == []
    # Alertmanager alone left (a removal cut short after Prometheus's unit went): removed too
    step, = monitoring_leftovers.removal(HostContext("hgx01", hostvars("hgx"), {**gone, "alertmanager_left": {
        "LoadState": "loaded"}}))
    step, = monitoring_leftovers.removal(HostContext("hgx01", hostvars("hgx", container_runtime="docker"), left))
    assert step.name == "monitoring removed" and "docker-dgemma-prometheus.service" in step.describe
    # run on a host's files: the units and the configuration (the monitoring key) go, the samples stay
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/systemctl.log\n")
    (bin_dir / "systemctl").chmod(0o755)
    root = tmp_path / "host"
    for path in ("etc/dgemma/prometheus/monitoring.key", "etc/dgemma/alertmanager/alertmanager.yml",
                 "etc/systemd/system/docker-dgemma-prometheus.service", "var/lib/dgemma/prometheus/wal/0",
                 "var/lib/dgemma/alertmanager/silences", "etc/dgemma/frontdoor/haproxy.cfg"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x\n")
    text = step.script
    for path in ("/etc/", "/var/lib/"):
        text = text.replace(path, f"{root}{path}")
    proc = subprocess.run(["dash", "-c", text], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    kept = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert kept == ["etc/dgemma/frontdoor/haproxy.cfg", "var/lib/dgemma/alertmanager/silences",
                    "var/lib/dgemma/prometheus/wal/0"], kept
    calls = (tmp_path / "systemctl.log").read_text().splitlines()
    assert calls == ["disable --now docker-dgemma-prometheus.service", "disable --now docker-dgemma-alertmanager.service",
                     "daemon-reload", "reset-failed docker-dgemma-prometheus.service",
                     "reset-failed docker-dgemma-alertmanager.service"], calls
