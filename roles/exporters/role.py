"""exporters: every host's own metrics, for the monitoring hosts to scrape through the
host's front door (or gateway), which passes them to the monitoring key alone
(serving/scrape_targets.py):

- the node exporter (the official image; on loopback, the host's / mounted read-only):
  memory, load, disks, and the textfiles below;
- on a GPU host, each GPU: NVIDIA's DCGM exporter where the DCGM host engine runs (DGX OS,
  data-centre installs), elsewhere (GeForce, GB10) a small collector of ours that reads
  nvidia-smi every ``gpu_metrics_interval_s`` and writes a textfile under DCGM's names, so
  that rules and dashboards read one set of names; it also writes the free space of the
  filesystem that holds the weights;
- what deploy knows (textfiles): which GPU serves which replica and which were left out,
  and why; each replica's model and diffusion settings; when the certificates expire.

Why the collector is a shell loop of ours and not a third-party nvidia-smi exporter: it
needs nothing on the host but nvidia-smi and awk, and writes DCGM's names, so one set of
rules and dashboards covers both kinds of host."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Command, Decision, File, Role
from converge.errors import StepFailed
from converge.facts.containers import Images
from converge.facts.host import Directory, FileState, OsRelease, UnitState
from converge.facts.nvidia import Dcgm

from serving import container_unit, scrape_targets
from serving.fleet import is_serving
from serving.handoffs import CERTIFICATES, CHOICE, GPU_METRICS, UNITS
from serving.exporter_containers import (COLLECTOR, COLLECTOR_UNIT, COLLECTOR_UNIT_PATH, DCGM_COUNTERS, TEXTFILES,
                                       collector_unit, dcgm_counters, dcgm_exporter, node_exporter)
from serving.host_programs import RESULT_LIBRARY, Program, Protocol, ended
from serving.prune import DEFAULT_KEEP, disk_textfile_step, prune_facts, selection
from serving.serving_host import STATE_DIR
from serving.systemd import SYSTEMD_FILE, folders_script, systemd_parameters

from . import textfiles

HERE = Path(__file__).parent
COLLECTOR_RUNNING = Protocol("the metrics collector running", result={
    "state": "ready (its textfile written since the start), failed (its unit; its last log lines before) or timeout",
    "seconds": "since the start"}, exits={"failed": 3, "timeout": 4})
COLLECTOR_RUNNING_PROGRAM = Program((SYSTEMD_FILE, RESULT_LIBRARY, HERE / "files" / "collector_running.sh"), COLLECTOR_RUNNING)


def facts(v):
    node, dcgm = node_exporter(v), dcgm_exporter(v)
    return {"os": OsRelease(), "dcgm": Dcgm(), "images": Images(v.get("container_runtime", "podman")),
            "textfiles_dir": Directory(TEXTFILES),
            "node_exporter_unit": UnitState(container_unit.unit_name(v, node)),
            "node_exporter_unit_file": FileState(container_unit.unit_path(v, node)),
            "dcgm_exporter_unit": UnitState(container_unit.unit_name(v, dcgm)),
            "dcgm_exporter_unit_file": FileState(container_unit.unit_path(v, dcgm)),
            "dcgm_counters": FileState(DCGM_COUNTERS),
            "collector": FileState(COLLECTOR), "collector_unit_file": FileState(COLLECTOR_UNIT_PATH),
            "collector_unit": UnitState(COLLECTOR_UNIT),
            "placement_textfile": FileState(f"{TEXTFILES}/placement.prom"),
            "certificates_textfile": FileState(f"{TEXTFILES}/certificates.prom"),
            # the fleet's disk (what prune weighs), on the hosts that serve
            **(prune_facts(v) if is_serving(v) else {})}


def plan(ctx):
    v, f = ctx.vars, ctx.facts
    nixos = (f.get("os") or {}).get("ID") == "nixos"
    # the node exporter's textfile collector reads it, files or none
    yield Command("metrics folder", script=folders_script(TEXTFILES), when=not f.get("textfiles_dir"),
                  describe=f"mkdir -p {TEXTFILES}")
    yield from _textfiles(ctx)
    serving = is_serving(v)
    dcgm = serving and scrape_targets.uses_dcgm(v, f.get("dcgm"))
    yield Decision("GPU metrics", produces=GPU_METRICS, value=None if not serving else "dcgm" if dcgm else "nvidia-smi")
    if serving:
        yield from _collector(ctx, nixos, dcgm)
    if dcgm:
        counters = File("DCGM exporter fields", path=DCGM_COUNTERS, content=dcgm_counters(), mode="0644",
                        current=f.get("dcgm_counters"))
        yield counters
        exporter = dcgm_exporter(v, bool((f.get("dcgm") or {}).get("hostengine")))
        if nixos:
            yield from container_unit.declared_by_nixos(ctx, exporter, "dcgm_exporter_unit")
        else:
            yield from container_unit.steps(ctx, exporter, "exporters", unit_fact="dcgm_exporter_unit",
                                            unit_file_fact="dcgm_exporter_unit_file",
                                            files_changed=counters.needed())
    if not v.get("node_exporter_managed", True):
        return
    if nixos:
        yield from container_unit.declared_by_nixos(ctx, node_exporter(v), "node_exporter_unit")
    else:
        yield from container_unit.steps(ctx, node_exporter(v), "exporters", unit_fact="node_exporter_unit",
                                        unit_file_fact="node_exporter_unit_file", files_changed=False)


def _textfiles(ctx):
    f = ctx.facts
    choice, declared = ctx.results.get(CHOICE), ctx.results.get(UNITS)
    if choice is not None and declared is not None:
        gpus = (f.get("nvidia") or {}).get("gpus") or []
        settings = {r.index: {k: r.settings.get(k, ctx.vars.get(k)) for k in textfiles.DIFFUSION_SETTINGS}
                    for r in choice.replicas}
        yield File("placement textfile", path=f"{TEXTFILES}/placement.prom", mode="0644",
                   content=textfiles.placement(gpus, declared.replicas, choice.placement.skipped, settings),
                   current=f.get("placement_textfile"))
    if is_serving(ctx.vars) and ctx.facts.get("prune_space") is not None:
        try:
            chosen = selection(ctx, DEFAULT_KEEP)
        except StepFailed:
            chosen = None  # prune says why when it runs; the textfile is not deploy's to fail for
        if chosen is not None:
            yield disk_textfile_step(ctx, chosen)
    if ctx.results.get(CERTIFICATES):
        yield File("certificates textfile", path=f"{TEXTFILES}/certificates.prom", mode="0644",
                   content=textfiles.certificates(ctx.results[CERTIFICATES]), current=f.get("certificates_textfile"))


def _collector(ctx, nixos: bool, dcgm: bool):
    v, f = ctx.vars, ctx.facts
    script = File("metrics collector", path=COLLECTOR, content=(HERE / "files" / "collector.sh").read_text(), mode="0755",
                  current=f.get("collector"))
    yield script
    unit_file = None
    if not nixos:
        declared = ctx.results.get(UNITS)
        replicas = [plan.replica for plan in declared.replicas] if declared else []
        unit_file = File("metrics collector unit", path=COLLECTOR_UNIT_PATH, content=collector_unit(v, dcgm, replicas),
                         mode="0644", current=f.get("collector_unit_file"))
        yield unit_file
    state = f.get("collector_unit") or {}
    if state.get("ActiveState") != "active":
        action, why = "start", f"was {state.get('ActiveState', 'absent')}"
    elif script.needed() or (unit_file is not None and unit_file.needed()):
        action, why = "restart", "its script or unit changed"
    else:
        action, why = "none", ""
    enabled = nixos or state.get("UnitFileState") == "enabled"
    timeout = 60
    yield Command("metrics collector running", when=action != "none" or not enabled,
                  script=COLLECTOR_RUNNING_PROGRAM.script({
                      **systemd_parameters(COLLECTOR_UNIT, action, daemon_reload=action != "none", enable=not nixos),
                      "TEXTFILE": f"{TEXTFILES}/replicas.prom", "TIMEOUT_S": timeout}),
                  describe=f"systemctl {action if action != 'none' else 'enable'} {COLLECTOR_UNIT} "
                           f"({why or 'not enabled at boot'})",
                  timeout=timeout + 60, interpret=_collector_running(why or "enabled at boot", timeout,
                                                                     waited=action != "none"))


def _collector_running(why: str, timeout: int, waited: bool = True):
    def interpret(result):
        if not waited and result.rc == 0:
            return f"{COLLECTOR_UNIT} enabled at boot ({why})"  # nothing started: nothing to wait for
        said, journal = ended(COLLECTOR_RUNNING, result, COLLECTOR_UNIT)
        if result.rc == 0 and said["state"] == "ready":
            return f"{COLLECTOR_UNIT} writes its textfiles in {TEXTFILES} ({why}, its first {said['seconds']} s after the start)"
        what = "its unit failed" if said["state"] == "failed" else f"no reading within {timeout} s"
        raise StepFailed(f"{COLLECTOR_UNIT} wrote no textfile in {TEXTFILES} ({what}). Last log lines:\n{journal}\n"
                         f"See: journalctl -u {COLLECTOR_UNIT}")
    return interpret


def summary(ctx) -> dict:
    """What verify checks (no secret in here)."""
    v = ctx.vars
    return {"exporters": {"node_exporter": container_unit.unit_name(v, node_exporter(v))
                          if v.get("node_exporter_managed", True) else None,
                          "node_exporter_port": int(v.get("node_exporter_port", scrape_targets.NODE_EXPORTER_PORT)),
                          "gpu_metrics": ctx.results.get(GPU_METRICS),
                          "collector": COLLECTOR_UNIT, "textfiles": TEXTFILES,
                          "dcgm_exporter": container_unit.unit_name(v, dcgm_exporter(v)),
                          "state_dir": STATE_DIR}}


ROLE = Role("exporters", facts, plan, summary=summary)
