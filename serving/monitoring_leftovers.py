"""What a serving host keeps of the monitoring it ran once it is no longer in the group
`monitoring`: Prometheus and Alertmanager, still scraping and alerting beside the fleet's new
monitoring host (each alert sent twice), and their configuration folders, which hold the
monitoring key and the alert receivers' secrets the host no longer needs. The front door's role
removes them (roles/frontdoor): both units, their files and the configuration folders. Their
samples and silences (the data folders) stay, for the user to copy or delete."""
from __future__ import annotations

from converge.facts.host import UnitState

from serving import container_unit, leftovers
from serving.fleet import is_monitoring
from serving.monitoring_paths import (ALERTMANAGER, ALERTMANAGER_DATA, ALERTMANAGER_DIR, PROMETHEUS, PROMETHEUS_DATA,
                                      PROMETHEUS_DIR)

# the facts: each unit, whether it is still there
FACTS = {"prometheus_left": PROMETHEUS, "alertmanager_left": ALERTMANAGER}


def facts(v: dict) -> dict:
    """On a host outside the group `monitoring`: whether Prometheus's and Alertmanager's units are there."""
    return {} if is_monitoring(v) else {fact: UnitState(container_unit.unit_name(v, name))
                                        for fact, name in FACTS.items()}


def script(v: dict) -> str:
    """files/leftovers_removed.sh with this host's units and folders (no shared address to give up)."""
    return leftovers.script(units=[container_unit.unit_name(v, name) for name in FACTS.values()],
                            files=[container_unit.unit_path(v, name) for name in FACTS.values()],
                            folders=(PROMETHEUS_DIR, ALERTMANAGER_DIR))


def removal(ctx):
    """Prometheus and Alertmanager left on a host that is no longer in the group `monitoring`,
    removed; nothing when there are none."""
    if is_monitoring(ctx.vars) or not leftovers.still_there(ctx.facts, FACTS):
        return
    units = " and ".join(container_unit.unit_name(ctx.vars, name) for name in FACTS.values())
    yield leftovers.removal(
        "monitoring removed", script(ctx.vars),
        describe=f"{ctx.name} is no longer in the group `monitoring`: stop and remove {units}, and {PROMETHEUS_DIR} "
                 f"and {ALERTMANAGER_DIR} (the monitoring key); keep their samples and silences ({PROMETHEUS_DATA}, "
                 f"{ALERTMANAGER_DATA})",
        done=f"{units} stopped and removed, with their configuration and the monitoring key; their samples and "
             f"silences kept in {PROMETHEUS_DATA} and {ALERTMANAGER_DATA} (rm -rf them once copied or not needed)")
