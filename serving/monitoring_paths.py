"""Where the monitoring role (roles/monitoring) puts Prometheus and Alertmanager on a host: the
containers' names (their units' after the runtime), configuration folders (the monitoring key
among their files) and data folders. Read by the role and by what removes them from a host that
is no longer in the group `monitoring` (serving/monitoring_leftovers.py)."""
from __future__ import annotations

from serving.serving_host import STATE_DIR

PROMETHEUS = "dgemma-prometheus"
ALERTMANAGER = "dgemma-alertmanager"
PROMETHEUS_DIR = "/etc/dgemma/prometheus"  # mounted read-only as /etc/prometheus
ALERTMANAGER_DIR = "/etc/dgemma/alertmanager"  # mounted read-only as /etc/alertmanager
PROMETHEUS_DATA = f"{STATE_DIR}/prometheus"
ALERTMANAGER_DATA = f"{STATE_DIR}/alertmanager"
