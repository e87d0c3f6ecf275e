"""A gateway's accounting, in one folder: its HAProxy rules (templates/gateway.cfg.j2, over the
front doors' common.cfg.j2), the Lua that reads what HAProxy cannot natively (files/usage.lua)
and the usage service (files/usage_service.py: each request's record, usage per key and model, the tokens
each key spent today; files/usage_running.sh: whether it runs). docs/accounting.md has the contract
between them. Here: what they share with the gateway role (roles/gateway), which installs
them: the socket HAProxy sends the records on, the gateways' shared counts (HAProxy's
peers), the files HAProxy reads the keys' names and limits from. Pure."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from serving import catalog, scrape_targets
from serving.fleet import shared_address
from serving.haproxy.instance import CONTAINER_DIR, GATEWAY

FILES = Path(__file__).parent / "files"
SOCKET = f"{GATEWAY.socket_dir}/usage.sock"  # in the folder the gateway's container sees
STATE_DIR = "/var/lib/dgemma/usage"
PROGRAM = "/usr/local/lib/dgemma/usage_service.py"
UNIT = "dgemma-usage.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
USAGE_PORT = 9466  # the usage service's /metrics, on loopback
# the gateway's certificate among its peers (a TLS client's too) and the one CA it takes peers from
PEER_PEM = "peer.pem"
PEERS_CA = "peers-ca.crt"
KEYS_MAP = "keys.map"
LIMITS_MAP = "limits.map"
LUA = "usage.lua"
# the records' socket queue the service asks of the kernel (usage_records_queue, when the inventory sets none)
RECORDS_QUEUE = 4096
# the service's niceness: ahead of HAProxy's threads for a core (a record it has no time to read is
# lost, and its tokens uncharged; a request HAProxy has no time for waits in its queue)
USAGE_NICE = -10
# the processes that read the records (usage_readers, when the inventory sets none): one Python thread
# reads about 20,000 a second, and a gateway on 16 cores answers more than that
USAGE_READERS = 4
# the records go to the journal through the service's standard output: `invoke logs --requests` reads them there
RECORDS_IDENTIFIER = "dgemma-requests"


def longest_context() -> int:
    """What an answer may run to when its request sets no max_tokens: the longest context of the
    catalog's families (vLLM's max_model_len when a host sets none), which the gateway reserves."""
    return max(int(f.get("context_length", 0)) for f in catalog.models()["families"].values()) or 262144


@dataclass(frozen=True)
class Peer:
    name: str
    address: str  # host:port


@dataclass(frozen=True)
class Accounting:
    """What the gateway's configuration needs of its accounting (serving/haproxy/templates/gateway.cfg.j2)."""
    socket: str
    path: str  # /metrics/usage: the usage service's counts, for the monitoring key
    port: int
    bind: str  # where this gateway takes its peers' connections
    peers: tuple  # Peer, every gateway's (this one's included)
    peer_pem: str = PEER_PEM  # in the gateway's folder: its certificate among its peers, and its key
    peers_ca: str = PEERS_CA  # the fleet CA alone: a front door's own CA never vouches for a peer
    # the gateways' shared address (gateway_address) and port: a key with limits is answered there
    # alone, where one gateway at a time counts it ("": no shared address, every address counts)
    shared_address: str = ""
    shared_port: int = 8000
    # the tokens a request that sets no max_tokens may spend (usage.lua's reservation)
    context_length: int = field(default_factory=longest_context)

    @property
    def shared_url(self) -> str:
        """The API at the shared address, as a client names it (the 421 that sends a key there says it)."""
        return f"https://{_hostport(self.shared_address, self.shared_port)}/v1"


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def accounting(host: str, v: dict, gateways: dict[str, str]) -> Accounting:
    """``gateways``: each gateway's inventory name -> its ansible_host (the fleet's)."""
    port = int(v.get("gateway_peers_port", 10000))
    peers = tuple(Peer(name, _hostport(address, port)) for name, address in gateways.items())
    return Accounting(SOCKET, scrape_targets.USAGE_PATH, USAGE_PORT,
                      _hostport(gateways.get(host) or v.get("ansible_host") or host, port), peers,
                      shared_address=shared_address(v) or "", shared_port=int(v.get("api_port", 8000)))


def render_unit(v: dict, runtime_api: str, limits: str = f"{GATEWAY.dir}/{LIMITS_MAP}") -> str:
    """The usage service's unit: before the gateway's HAProxy (which sends it records), as root
    (HAProxy's runtime API is root's), in systemd's sandbox."""
    haproxy_unit = GATEWAY.unit_name(v)
    return f"""\
# Managed by dgemma-fleet (roles/gateway): edits here are replaced on the next deploy.
[Unit]
Description=The gateway's usage service: each request's record, usage per key and model, the day's tokens
Before={haproxy_unit}

[Service]
Type=simple
ExecStart=/usr/bin/python3 {PROGRAM} --socket {SOCKET} --runtime-api {runtime_api} --state {STATE_DIR} \\
  --limits {limits} --listen 127.0.0.1:{USAGE_PORT} --retention-days {int(v.get("usage_retention_days", 400))} \\
  --records-queue {int(v.get("usage_records_queue", RECORDS_QUEUE))} --readers {int(v.get("usage_readers", USAGE_READERS))}
SyslogIdentifier={RECORDS_IDENTIFIER}
# its readers take every record the gateway's threads write: where both want the CPU, they come first
Nice={USAGE_NICE}
# every request's record is a line of the journal: none may be dropped for coming fast
LogRateLimitIntervalSec=0
Restart=always
RestartSec=1
ProtectSystem=strict
# the socket's folder (the gateway container's too) is in /run, empty on a new host and after
# every boot: systemd makes it before it sets up this unit's sandbox (a ReadWritePaths= of a
# folder that is not there yet fails the start, and no ExecStartPre runs before that), and
# keeps it when this stops, as HAProxy's container holds it mounted and its sockets are there
RuntimeDirectory={GATEWAY.socket_dir.removeprefix("/run/")}
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
ProtectHome=yes
PrivateTmp=yes
NoNewPrivileges=yes
StateDirectory=dgemma/usage
StateDirectoryMode=0750

[Install]
WantedBy=multi-user.target
"""


def lua() -> str:
    return (FILES / LUA).read_text()


def program() -> str:
    return (FILES / "usage_service.py").read_text()


def container_path(name: str) -> str:
    """A file of the gateway's folder as its container sees it."""
    return f"{CONTAINER_DIR}/{name}"
