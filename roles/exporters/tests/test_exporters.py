"""Every host's metrics as deployed: the node exporter running on loopback only, the
collector writing fresh textfiles on a serving host, what deploy knows in its textfiles,
and none of it open without the monitoring key at the host's front door or gateway."""
import shlex

import pytest


@pytest.fixture
def exporters(expected):
    if not expected.get("exporters"):
        pytest.skip("no exporters planned for this host")
    return expected["exporters"]


def test_the_node_exporter_runs_on_loopback_alone(host, exporters, fix):
    if not exporters["node_exporter"]:
        pytest.skip("node_exporter_managed: false (the host runs its own)")
    unit = host.service(exporters["node_exporter"])
    assert unit.is_running and unit.is_enabled, f"{exporters['node_exporter']} is not running or not enabled; {fix}"
    port = exporters["node_exporter_port"]
    out = host.run(f"curl -sf -o /dev/null --max-time 5 http://127.0.0.1:{port}/metrics && echo answers; "
                   f"ss -Hltn 'sport = :{port}'").stdout
    assert out.startswith("answers"), f"the node exporter does not answer on 127.0.0.1:{port}; {fix}"
    listening = out.split()[1:]
    assert listening and all(addr.startswith("127.0.0.1:") for addr in listening if ":" in addr and "*" not in addr), \
        f"the node exporter listens beyond loopback ({listening}); {fix}"


def test_the_collector_writes_fresh_textfiles(host, exporters, fix):
    if not exporters["gpu_metrics"]:
        pytest.skip("not a serving host")
    unit = host.service(exporters["collector"])
    assert unit.is_running, f"{exporters['collector']} is not running; {fix} (or see: journalctl -u {exporters['collector']})"
    names = ["replicas.prom", "weights.prom"] + (["gpu.prom"] if exporters["gpu_metrics"] == "nvidia-smi" else [])
    folder = shlex.quote(exporters["textfiles"])
    out = host.run(f"cd {folder} && for f in {' '.join(names)}; do echo \"$f $(( $(date +%s) - $(stat -c %Y $f "
                   f"2>/dev/null || echo 0) ))\"; done; grep -h '^dgemma_gpu_collector_up' gpu.prom 2>/dev/null").stdout
    ages = dict(line.split() for line in out.splitlines() if line.endswith(tuple("0123456789")) and ".prom" in line)
    stale = {name: age for name, age in ages.items() if int(age) >= 120}
    assert sorted(ages) == sorted(names) and not stale, f"textfiles not fresh (age in s): {stale or ages}; {fix}"
    if exporters["gpu_metrics"] == "nvidia-smi":
        assert "dgemma_gpu_collector_up 1" in out, f"nvidia-smi did not answer the collector: {out[-300:]}"


def test_what_deploy_knows_is_in_the_textfiles(host, exporters, expected, fix):
    files = host.run(f"ls {shlex.quote(exporters['textfiles'])}").stdout.split()
    if exporters["gpu_metrics"]:
        assert "placement.prom" in files, f"no placement textfile; {fix}"
    if expected.get("frontdoor") or expected.get("gateway"):
        assert "certificates.prom" in files, f"no certificates textfile; {fix}"


def test_the_metrics_are_closed_without_the_monitoring_key(https_to, expected, fix):
    proxy = expected.get("frontdoor") or expected.get("gateway")
    if not proxy:
        pytest.skip("no front door or gateway here")
    paths = ("/metrics/node", "/metrics/haproxy", "/metrics/sd", "/metrics/replica/0")
    codes = dict(zip(paths, https_to(proxy).statuses([(p, "GET") for p in paths])))
    assert codes == {p: 404 for p in paths}, f"answers without the monitoring key: {codes}; {fix}"
