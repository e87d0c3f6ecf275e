"""The relay as a run's service: offered to each host's roles (``ctx.services["relay"]``)
when the run converges several hosts, from where that host stands."""
from __future__ import annotations

import threading

from converge.runner import RunService

from .server import Relay, RelayView


class RelayService(RunService):
    name = "relay"

    def __init__(self, workdir: str | None = None):
        self.workdir = workdir
        self.relay: Relay | None = None
        self.several = False
        self._lock = threading.Lock()

    def start(self, hosts):
        self.several = len(hosts) > 1  # one host alone fetches once anyway

    def for_host(self, transport, hostvars):
        if not self.several or not hostvars.get("artifact_relay", True):
            return None
        address = transport.local_address()
        if not address:
            return None
        with self._lock:  # serves only once a role asks for a URL (Relay.port)
            self.relay = self.relay or Relay(self.workdir)
        return RelayView(self.relay, address)

    def close(self) -> dict:
        if self.relay is None:
            return {}
        self.relay.close()  # gone, files and all
        return dict(self.relay.stats)
