"""The front door's admin actions, for programs that run on the host as root
(files/admin.sh, a library the roll and the front door role's programs source): drain a replica, put it back, say it is up (its stats page with admin
actions, over a unix socket only root reaches), read a replica's state, and raise or
lower the host's "rolling" flag and its pools' flags.

The flag is a server of its own (backend ``rolling``, no checks, in maintenance until
raised). While it is up and no replica is in service, the front door answers /health
with 404, so the gateway keeps the host out of balancing (DRAIN, ``disable-on-404``)
for the whole roll, also once the replica has stopped, instead of seeing it DOWN."""
from __future__ import annotations

from pathlib import Path

from serving.haproxy.instance import (FRONTDOOR, GATEWAY_SAW_MARGIN_S, GATEWAY_SEES_FLAG_S, admin_socket,
                                    runtime_socket)
from serving.haproxy.stats import POOL_PREFIX

ADMIN_SOCKET = admin_socket(FRONTDOOR)  # the front door's stats page with admin actions (root only)
FRONTDOOR_CA = f"{FRONTDOOR.dir}/ca.crt"
ROLLING_BACKEND, ROLLING_SERVER = "rolling", "flag"
ADMIN_LIBRARY = Path(__file__).parent / "files" / "admin.sh"


def admin_parameters() -> dict:
    """What admin.sh needs to know of the front door: its admin socket and runtime API, the
    flags' names, how long the gateways may take to see a flag."""
    return {"ADMIN": ADMIN_SOCKET, "RUNTIME": runtime_socket(FRONTDOOR), "ROLLING_BACKEND": ROLLING_BACKEND,
            "ROLLING_SERVER": ROLLING_SERVER, "POOL_PREFIX": POOL_PREFIX,
            "GATEWAY_SEES_FLAG_S": f"{GATEWAY_SEES_FLAG_S:g}", "GATEWAY_SAW_MARGIN_S": f"{GATEWAY_SAW_MARGIN_S:g}"}
