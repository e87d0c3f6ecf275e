"""The configuration of a fleet's HAProxy instance, rendered from variables: a host's
front door (TLS, keys, allowlist, then vLLM's replicas on loopback) and the gateway (the
same door, then every host's front door over TLS), each its own template
(templates/frontdoor.cfg.j2, gateway.cfg.j2) over the parts both share
(templates/common.cfg.j2); and the key-hash list both read. Pure functions."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serving import scrape_targets
from serving.catalog import DEFAULT_FAMILY
from serving.declared import served_name

from .instance import (CONTAINER_DIR, FRONTDOOR, LIVE_ANSWERS_BUSY_IDLE_PCT, STATE_FILE, Proxy, admin_socket,
                       runtime_socket, set_apart, templates)
from .pools import UPSTREAM_KEYS, Pool, model_names, models_list

# vLLM's routes a user needs (OpenAI's API); every other route vLLM registers stays on loopback
ALLOWED = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class Server:
    name: str
    address: str
    options: str = ""  # HAProxy server options (TLS to a front door)
    replica: int | None = None  # a front door's: the index of the replica it is (X-Dgemma-Replica names it)


@dataclass(frozen=True)
class ScrapedReplica:
    """A replica whose /metrics the front door passes to the monitoring key."""
    name: str
    address: str
    path: str


def bind_address(v: dict, proxy: Proxy = FRONTDOOR) -> str:
    host = v.get("api_host", "0.0.0.0")
    host = "" if host in ("0.0.0.0",) else f"[{host}]" if ":" in host else host
    return f"{host}:{proxy.port(v)}"


def render_config(host: str, v: dict, servers: list[Server], generation: str, *, proxy: Proxy = FRONTDOOR,
                  files: str = CONTAINER_DIR, socket: str | None = None, admin: str | None = None,
                  backend: dict | None = None, pools: list | None = None, dcgm: bool = False,
                  accounting=None, diffusion: dict | None = None) -> str:
    """``files``: where HAProxy reads tls.pem, ca.crt and keys.sha256 (the container's
    view of the proxy's folder); ``socket``, ``admin``: its runtime API and its stats page
    with admin actions (both unix sockets); ``backend``: how servers are checked and retried;
    ``pools``: the pools (pools.Pool) requests are routed to by the model they name;
    ``dcgm``: the host runs NVIDIA's DCGM exporter (scraped at /metrics/gpu); ``accounting``: a
    gateway's limits and records (serving/accounting: Accounting); ``diffusion``: a front
    door's diffusion settings per pool, which its answers name (X-Dgemma-Diffusion)."""
    pools = pools or [Pool(DEFAULT_FAMILY, model_names(DEFAULT_FAMILY, [served_name(DEFAULT_FAMILY, v)]), tuple(servers))]
    socket = socket or runtime_socket(proxy)
    st = scrape_targets
    replicas = [ScrapedReplica(s.name, s.address, st.replica_path(s.replica))
                for s in servers] if proxy is FRONTDOOR else []
    metrics_paths = [st.SD_PATH, st.HAPROXY_PATH, st.NODE_PATH] + ([st.GPU_PATH] if dcgm else []) + \
        [r.path for r in replicas] + ([accounting.path] if accounting else [])
    return templates().get_template(proxy.template).render(
        host=host, kind=proxy.kind, role=proxy.role, bind=bind_address(v, proxy), dir=files, socket=socket,
        state_file=str(Path(socket).parent / STATE_FILE), admin_http=admin or admin_socket(proxy), allowed=ALLOWED,
        servers=servers, pools=pools, models_json=models_list(pools), aliases=[p.names[0] for p in pools],
        request_timeout=int(v.get("request_timeout_sec", 600)), metrics_port=proxy.metrics_port,
        generation=generation, upstream_key=proxy.upstream_key, upstream_keys=UPSTREAM_KEYS, backend=backend or {},
        metrics_paths=metrics_paths, metrics_replicas=replicas, dcgm=dcgm, sd_path=st.SD_PATH,
        haproxy_path=st.HAPROXY_PATH, node_path=st.NODE_PATH, gpu_path=st.GPU_PATH,
        node_port=st.NODE_EXPORTER_PORT, gpu_port=st.DCGM_EXPORTER_PORT, accounting=accounting,
        diffusion=diffusion or {}, threads=set_apart(v, proxy).get("threads"), live_answers_busy=LIVE_ANSWERS_BUSY_IDLE_PCT)


def render_keys(hashes: dict[str, str]) -> str:
    """HAProxy's pattern file: one sha256 per line, a comment naming whose (no secret here)."""
    lines = ["# Managed by dgemma-fleet: sha256 of the API keys accepted here\n"]
    for name, digest in hashes.items():
        lines.append(f"# {name}\n{digest}\n")
    return "".join(lines)
