"""monitoring: on the hosts of the inventory group `monitoring`, Prometheus and
Alertmanager (the official images), listening on loopback only.

Prometheus scrapes every serving host and gateway through its front door: https checked
against the fleet CA, with the monitoring key (its sha256 is all the front doors hold;
the key itself is here alone, 0400, readable by the containers' user). It keeps its
samples for ``prometheus_retention_time`` or until they take ``prometheus_retention_size``,
evaluates the fleet's rules (each alert names the command that fixes it), and hands the
alerts to Alertmanager, which sends them to ``alert_receivers``. A new configuration,
rule or target list is a reload (SIGHUP), never a restart.

A monitoring host is not on the serving path: a deploy that cannot reach it, or fails
there, reports so and fails none of the serving hosts (roles.advisory)."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Check, Command, Decision, File, Role
from converge.errors import SecretError, StepFailed
from converge.facts import Fact, call
from converge.facts.containers import Images
from converge.facts.host import Directory, FileState, OsRelease, UnitState
from converge.secrets import read_secret_file
from credentials import CredentialError, directory
from credentials.keys import service_key

from serving import container_unit
from serving.container_unit import Container
from serving.fleet import Fleet, is_monitoring, is_serving
from serving.haproxy import tls
from serving.handoffs import MONITORING
from serving.catalog import monitoring_image
from serving.monitoring_paths import (ALERTMANAGER, ALERTMANAGER_DATA, ALERTMANAGER_DIR, PROMETHEUS, PROMETHEUS_DATA,
                                      PROMETHEUS_DIR)
from serving.systemd import folders_script

from . import alertmanager, prometheus, rules

CONTAINER_UID = 65534  # the official images run as nobody


class Nobody(Fact):
    """The names of uid and gid 65534 on the host (nobody, nogroup or nobody): the owner of
    the files the containers' user reads."""

    library, command = Path(__file__).parent / "files" / "facts.sh", call("fact_names_of_id", CONTAINER_UID)

    def process(self, output, rc):
        lines = [line.strip() for line in output.splitlines()]
        return {"user": lines[0] if lines and lines[0] else str(CONTAINER_UID),
                "group": lines[1] if len(lines) > 1 and lines[1] else str(CONTAINER_UID)}


def reloaded_ready(port: int, program: str) -> dict:
    """Both reload on SIGHUP: ready once the program answers on ``port`` and its last (re)load,
    since this step began, succeeded (its own metrics say when: serving/container_unit/files/answering.sh)."""
    return {"ready_url": f"http://127.0.0.1:{port}/-/ready", "reloaded": program,
            "metrics_url": f"http://127.0.0.1:{port}/metrics"}


def prometheus_container(v: dict) -> Container:
    port = int(v.get("prometheus_port", 9090))
    return Container(
        PROMETHEUS, "Prometheus for the DiffusionGemma fleet", monitoring_image(v, "prometheus"),
        args=(f"--config.file={prometheus.CONTAINER_DIR}/prometheus.yml", "--storage.tsdb.path=/prometheus",
              f"--storage.tsdb.retention.time={v.get('prometheus_retention_time', '15d')}",
              f"--storage.tsdb.retention.size={v.get('prometheus_retention_size', '10GB')}",
              f"--web.listen-address=127.0.0.1:{port}"),
        options=("--network=host", "--user", f"{CONTAINER_UID}:{CONTAINER_UID}", *memory_bound(v)),
        volumes=(f"{PROMETHEUS_DIR}:{prometheus.CONTAINER_DIR}:ro", f"{PROMETHEUS_DATA}:/prometheus"),
        reload_signal="SIGHUP", **reloaded_ready(port, "prometheus"), stop_seconds=30)


def memory_bound(v: dict) -> tuple:
    """On a monitoring host that also serves, Prometheus keeps its heap near
    ``prometheus_memory_mib`` (Go's GOMEMLIMIT: it collects harder as it nears it), whatever the
    runtime's cgroup setup, so that vLLM keeps the rest of the host; its disk is bounded by
    ``prometheus_retention_size`` everywhere."""
    return ("-e", f"GOMEMLIMIT={int(v.get('prometheus_memory_mib', 2048))}MiB") if is_serving(v) else ()


def alertmanager_container(v: dict) -> Container:
    port = int(v.get("alertmanager_port", 9093))
    return Container(
        ALERTMANAGER, "Alertmanager for the DiffusionGemma fleet", monitoring_image(v, "alertmanager"),
        # no cluster: its gossip would listen on every address (one Alertmanager per monitoring host)
        args=(f"--config.file={alertmanager.CONTAINER_DIR}/alertmanager.yml", "--storage.path=/alertmanager",
              f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="),
        options=("--network=host", "--user", f"{CONTAINER_UID}:{CONTAINER_UID}"),
        volumes=(f"{ALERTMANAGER_DIR}:{alertmanager.CONTAINER_DIR}:ro", f"{ALERTMANAGER_DATA}:/alertmanager"),
        reload_signal="SIGHUP", **reloaded_ready(port, "alertmanager"))


def facts(v):
    p, a = prometheus_container(v), alertmanager_container(v)
    files = {"prometheus_yml": f"{PROMETHEUS_DIR}/prometheus.yml", "prometheus_rules": f"{PROMETHEUS_DIR}/{prometheus.RULES_FILE}",
             "prometheus_targets": f"{PROMETHEUS_DIR}/{prometheus.TARGETS_FILE}",
             "prometheus_ca": f"{PROMETHEUS_DIR}/{prometheus.CA_FILE}",
             "alertmanager_yml": f"{ALERTMANAGER_DIR}/alertmanager.yml"}
    out = {name: FileState(path) for name, path in files.items()}
    out["prometheus_key"] = FileState(f"{PROMETHEUS_DIR}/{prometheus.KEY_FILE}", secret=True)
    for i, _ in enumerate(v.get("prometheus_remote_write") or []):
        out[f"remote_write_{i}"] = FileState(remote_write_secret(i), secret=True)
    for receiver, kind, _ in alertmanager.secrets(v):
        out[f"receiver_{receiver}_{kind}"] = FileState(alertmanager.secret_path(receiver, kind, ALERTMANAGER_DIR),
                                                        secret=True)
    return {**out, "os": OsRelease(), "images": Images(v.get("container_runtime", "podman")), "nobody": Nobody(),
            "prometheus_data": Directory(PROMETHEUS_DATA), "alertmanager_data": Directory(ALERTMANAGER_DATA),
            "prometheus_unit": UnitState(container_unit.unit_name(v, p)),
            "prometheus_unit_file": FileState(container_unit.unit_path(v, p)),
            "alertmanager_unit": UnitState(container_unit.unit_name(v, a)),
            "alertmanager_unit_file": FileState(container_unit.unit_path(v, a))}


def remote_write_secret(index: int) -> str:
    return f"{PROMETHEUS_DIR}/secrets/remote-write-{index}"


def plan(ctx):
    v, f = ctx.vars, ctx.facts
    # a run without the fleet service (a lone host's plan) scrapes nothing but itself
    fleet = ctx.services.get("fleet") or Fleet((), ())
    if (f.get("os") or {}).get("ID") == "nixos":
        yield Check("monitoring host", ok=False,
                    message="a NixOS monitoring host is not supported: NixOS declares Prometheus itself "
                            "(services.prometheus); run `invoke render --format prometheus` for its scrape "
                            "configuration, rules and credentials, or choose another host for the group `monitoring`")
        return
    yield from tls.made_step(ctx, (tls.MONITORING_KEY,), certificate=False)
    try:
        key = service_key(directory(v), tls.MONITORING_KEY, make=not ctx.check)
        ca = tls.trusted_cas(ctx.name, v, tuple(dict.fromkeys(d.ca_file for d in fleet.serving if d.ca_file)),
                             make=not ctx.check)
        remote, remote_secrets = _remote_write(ctx)
        receiver_secrets = [(r, kind, read_secret_file(path, f"alert_receivers[{r}].{kind}", ctx.name))
                            for r, kind, path in alertmanager.secrets(v)]
    except (CredentialError, SecretError, StepFailed) as exc:
        yield Check("monitoring credentials", ok=False, message=str(exc))
        return
    owner = f.get("nobody") or {"user": str(CONTAINER_UID), "group": str(CONTAINER_UID)}
    missing = [d for d, fact in ((PROMETHEUS_DATA, "prometheus_data"), (ALERTMANAGER_DATA, "alertmanager_data"))
               if not f.get(fact)]
    yield Command("monitoring data folders", when=bool(missing),
                  script=folders_script(*missing, mode="0750", owner=str(CONTAINER_UID), group=str(CONTAINER_UID)),
                  describe=f"install -d -o {CONTAINER_UID} -g {CONTAINER_UID} {' '.join(missing)}")

    def secret(name, path, content, fact):
        # 0400, the containers' user's: the key and the receivers' secrets, never shown
        return File(name, path=path, content=content + "\n", mode="0400", owner=owner["user"], group=owner["group"],
                    secret=True, current=f.get(fact), keep_previous=False)

    prometheus_files = [
        File("prometheus configuration", path=f"{PROMETHEUS_DIR}/prometheus.yml", mode="0644",
             content=prometheus.render(ctx.name, v, fleet, remote), current=f.get("prometheus_yml")),
        File("alerting rules", path=f"{PROMETHEUS_DIR}/{prometheus.RULES_FILE}", mode="0644",
             content=rules.render(v), current=f.get("prometheus_rules")),
        File("fleet CA certificate", path=f"{PROMETHEUS_DIR}/{prometheus.CA_FILE}", mode="0644", content=ca,
             current=f.get("prometheus_ca")),
        secret("monitoring key", f"{PROMETHEUS_DIR}/{prometheus.KEY_FILE}", key, "prometheus_key"),
        *(secret(f"remote_write[{i}] secret", remote_write_secret(i), value, f"remote_write_{i}")
          for i, value in remote_secrets)]
    # the hosts it scrapes: read by Prometheus as it changes (file_sd), no reload needed
    targets = File("scrape targets", path=f"{PROMETHEUS_DIR}/{prometheus.TARGETS_FILE}", mode="0644",
                   content=prometheus.render_targets(fleet), current=f.get("prometheus_targets"))
    alertmanager_files = [
        File("alertmanager configuration", path=f"{ALERTMANAGER_DIR}/alertmanager.yml", mode="0644",
             content=alertmanager.render(v), current=f.get("alertmanager_yml")),
        *(secret(f"alert_receivers[{r}] {kind}", alertmanager.secret_path(r, kind, ALERTMANAGER_DIR), value,
                 f"receiver_{r}_{kind}") for r, kind, value in receiver_secrets)]
    yield from prometheus_files
    yield targets
    yield from alertmanager_files
    yield Decision("planned", produces=MONITORING, value=True)
    yield from container_unit.steps(ctx, alertmanager_container(v), "monitoring", unit_fact="alertmanager_unit",
                                    unit_file_fact="alertmanager_unit_file",
                                    files_changed=any(s.needed() for s in alertmanager_files), timeout=60)
    yield from container_unit.steps(ctx, prometheus_container(v), "monitoring", unit_fact="prometheus_unit",
                                    unit_file_fact="prometheus_unit_file",
                                    files_changed=any(s.needed() for s in prometheus_files), timeout=60)


def _remote_write(ctx) -> tuple[list[dict], list[tuple[int, str]]]:
    """prometheus_remote_write with where its secrets are in the container, and the secrets
    read on the control machine (SecretError names the file and the key)."""
    out, values = [], []
    for i, r in enumerate(ctx.vars.get("prometheus_remote_write") or []):
        entry = {"url": r["url"]}
        where = f"{prometheus.CONTAINER_DIR}/secrets/remote-write-{i}"
        if r.get("bearer_token_file"):
            values.append((i, read_secret_file(r["bearer_token_file"], f"prometheus_remote_write[{i}].bearer_token_file",
                                               ctx.name)))
            entry["bearer_token"] = where
        elif r.get("basic_auth"):
            values.append((i, read_secret_file(r["basic_auth"]["password_file"],
                                               f"prometheus_remote_write[{i}].basic_auth.password_file", ctx.name)))
            entry.update(username=r["basic_auth"]["username"], password=where)
        out.append(entry)
    return out, values


def summary(ctx) -> dict:
    """What verify checks (no secret in here)."""
    v = ctx.vars
    if not ctx.results.get(MONITORING):
        return {}
    return {"monitoring": {"prometheus": container_unit.unit_name(v, prometheus_container(v)),
                           "alertmanager": container_unit.unit_name(v, alertmanager_container(v)),
                           "prometheus_port": int(v.get("prometheus_port", 9090)),
                           "alertmanager_port": int(v.get("alertmanager_port", 9093)),
                           "dirs": [PROMETHEUS_DIR, ALERTMANAGER_DIR],
                           "secrets": [f"{PROMETHEUS_DIR}/{prometheus.KEY_FILE}"]}}


ROLE = Role("monitoring", facts, plan, summary=summary, hosts=is_monitoring)
