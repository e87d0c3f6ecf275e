"""The HAProxy instances of the fleet, rendered from variables: a host's front
door (TLS, keys, allowlist, then vLLM on loopback) and the gateway (the same
door, then every host's front door over TLS). Their configuration, key-hash list
and unit. Pure functions."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

from roles.service.container import RUNTIME_PATHS, log_options

from roles.preflight.declared import DEFAULT_FAMILY, served_name

from .pools import UPSTREAM_KEYS, Pool, model_names, models_list
from roles import scrape_targets
from roles.service.serve import command_line

HERE = Path(__file__).parent
CONTAINER_DIR = "/usr/local/etc/haproxy"  # where the official image looks for haproxy.cfg
# vLLM's routes a user needs (OpenAI's API); every other route vLLM registers stays on loopback
ALLOWED = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class Proxy:
    """One kind of HAProxy instance on a host."""
    kind: str  # what people call it
    name_var: str  # the variable that names its container and unit
    default_name: str
    dir: str  # its files on the host (mounted read-only at CONTAINER_DIR)
    socket_dir: str  # its runtime API
    upstream_key: str  # the environment variable whose key it sends upstream
    metrics_port: int  # HAProxy's stats and Prometheus exporter, on loopback

    def name(self, v: dict) -> str:
        return v.get(self.name_var, self.default_name)

    def unit_name(self, v: dict) -> str:
        return f"{v.get('container_runtime', 'podman')}-{self.name(v)}.service"

    def unit_path(self, v: dict) -> str:
        return f"/etc/systemd/system/{self.unit_name(v)}"


FRONTDOOR = Proxy("front door", "frontdoor_name", "dgemma-frontdoor", "/etc/dgemma/frontdoor",
                  "/run/dgemma-frontdoor", "VLLM_API_KEY", 8404)
# how often the gateway checks each front door for each pool, and how long one check may take
GATEWAY_CHECK_INTERVAL_S = 1
GATEWAY_CHECK_TIMEOUT_S = 2
# a roll taking a pool's last replicas out raises its flag, then waits this long for every
# gateway to see it: a check answered just before the flag may reach its gateway up to its
# timeout later, and the next begins an interval after that one ends (waiting one interval
# alone, a gateway slow to check on a busy host still sent requests to the drained pool: 503)
GATEWAY_SEES_FLAG_S = GATEWAY_CHECK_TIMEOUT_S + GATEWAY_CHECK_INTERVAL_S + 0.5
GATEWAY = Proxy("gateway", "gateway_name", "dgemma-gateway", "/etc/dgemma/gateway", "/run/dgemma-gateway",
                "GATEWAY_KEY", 8405)
DIR = FRONTDOOR.dir
SOCKET_DIR = FRONTDOOR.socket_dir


STATE_FILE = "servers.state"  # beside the runtime API's socket: written before a reload, read by the new instance


def runtime_socket(proxy: Proxy) -> str:
    """HAProxy's runtime API (root only)."""
    return f"{proxy.socket_dir}/admin.sock"


def state_file(proxy: Proxy) -> str:
    return f"{proxy.socket_dir}/{STATE_FILE}"


def admin_socket(proxy: Proxy) -> str:
    """The instance's stats page with its admin actions (drain, ready), over HTTP on a unix
    socket that only root on the host reaches (curl --unix-socket)."""
    return f"{proxy.socket_dir}/admin-http.sock"


@dataclass(frozen=True)
class Server:
    name: str
    address: str
    options: str = ""  # HAProxy server options (TLS to a front door)


def unit_name(v: dict) -> str:
    return FRONTDOOR.unit_name(v)


def unit_path(v: dict) -> str:
    return FRONTDOOR.unit_path(v)


def image_ref(v: dict) -> str:
    """HAProxy's image (the inventory's, or the catalog's), through the inventory's registry
    mirror when it names one."""
    from roles.preflight import catalog
    return catalog.image_ref(v, catalog.images()["frontdoor"], v.get("frontdoor_image"))


def bind_address(v: dict) -> str:
    host = v.get("api_host", "0.0.0.0")
    host = "" if host in ("0.0.0.0",) else f"[{host}]" if ":" in host else host
    return f"{host}:{v.get('api_port', 8000)}"


def _templates() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), keep_trailing_newline=True,
                              undefined=jinja2.StrictUndefined)


@dataclass(frozen=True)
class ScrapedReplica:
    """A replica whose /metrics the front door passes to the monitoring key."""
    name: str
    address: str
    path: str


def render_config(host: str, v: dict, servers: list[Server], generation: str, *, proxy: Proxy = FRONTDOOR,
                  files: str = CONTAINER_DIR, socket: str | None = None, admin: str | None = None,
                  backend: dict | None = None, pools: list | None = None, dcgm: bool = False) -> str:
    """``files``: where HAProxy reads tls.pem, ca.crt and keys.sha256 (the container's
    view of the proxy's folder); ``socket``, ``admin``: its runtime API and its stats page
    with admin actions (both unix sockets); ``backend``: how servers are checked and retried;
    ``pools``: the pools (pools.Pool) requests are routed to by the model they name;
    ``dcgm``: the host runs NVIDIA's DCGM exporter (scraped at /metrics/gpu)."""
    pools = pools or [Pool(DEFAULT_FAMILY, model_names(DEFAULT_FAMILY, [served_name(DEFAULT_FAMILY, v)]), tuple(servers))]
    socket = socket or runtime_socket(proxy)
    st = scrape_targets
    replicas = [ScrapedReplica(s.name, s.address, st.replica_path(int(s.name.removeprefix("replica"))))
                for s in servers] if proxy is FRONTDOOR else []
    metrics_paths = [st.SD_PATH, st.HAPROXY_PATH, st.NODE_PATH] + ([st.GPU_PATH] if dcgm else []) + \
        [r.path for r in replicas]
    return _templates().get_template("haproxy.cfg.j2").render(
        host=host, kind=proxy.kind, bind=bind_address(v), dir=files, socket=socket,
        state_file=str(Path(socket).parent / STATE_FILE), admin_http=admin or admin_socket(proxy), allowed=ALLOWED,
        servers=servers, pools=pools, models_json=models_list(pools), aliases=[p.names[0] for p in pools],
        request_timeout=int(v.get("request_timeout_sec", 600)), metrics_port=proxy.metrics_port,
        generation=generation, upstream_key=proxy.upstream_key, upstream_keys=UPSTREAM_KEYS, backend=backend or {},
        metrics_paths=metrics_paths, metrics_replicas=replicas, dcgm=dcgm, sd_path=st.SD_PATH,
        haproxy_path=st.HAPROXY_PATH, node_path=st.NODE_PATH, gpu_path=st.GPU_PATH,
        node_port=st.NODE_EXPORTER_PORT, gpu_port=st.DCGM_EXPORTER_PORT)


def render_keys(hashes: dict[str, str]) -> str:
    """HAProxy's pattern file: one sha256 per line, a comment naming whose (no secret here)."""
    lines = ["# Managed by dgemma-fleet: sha256 of the API keys accepted here\n"]
    for name, digest in hashes.items():
        lines.append(f"# {name}\n{digest}\n")
    return "".join(lines)


def container(v: dict, proxy: Proxy = FRONTDOOR) -> dict:
    """The proxy's container, whatever declares it (our unit, or a NixOS module)."""
    return {"name": proxy.name(v), "image": image_ref(v),
            # the master reads the 0600 files as root; its workers drop to the haproxy user.
            # The upstream key by name only: its value comes from the unit's EnvironmentFile
            "options": ["--network=host", "--user", "root", "-e", proxy.upstream_key],
            "volumes": [f"{proxy.dir}:{CONTAINER_DIR}:ro", f"{proxy.socket_dir}:{proxy.socket_dir}"],
            "cmd": ["haproxy", "-f", f"{CONTAINER_DIR}/haproxy.cfg"]}


def run_command(v: dict, proxy: Proxy = FRONTDOOR) -> list[str]:
    spec = container(v, proxy)
    runtime = v.get("container_runtime", "podman")
    run = [RUNTIME_PATHS[runtime], "run", "--rm", "--name", spec["name"], *log_options(runtime), *spec["options"]]
    for volume in spec["volumes"]:
        run += ["-v", volume]
    return run + [spec["image"], *spec["cmd"]]


def render_unit(v: dict, env_file: str, proxy: Proxy = FRONTDOOR) -> str:
    runtime = v.get("container_runtime", "podman")
    return _templates().get_template("unit.j2").render(
        kind=proxy.kind, name=proxy.name(v), runtime=runtime, runtime_path=RUNTIME_PATHS[runtime],
        env_file=env_file, exec_start=command_line(run_command(v, proxy)), socket_dir=proxy.socket_dir,
        interval=v.get("start_limit_interval_sec", 900), burst=v.get("start_limit_burst", 3))


def nixos_container(v: dict) -> dict:
    """The front door as the NixOS module declares it (oci-containers)."""
    runtime = v.get("container_runtime", "podman")
    spec = container(v)
    return {**spec, "unit": unit_name(v), "reload": f"{RUNTIME_PATHS[runtime]} kill --signal USR2 {spec['name']}"}
