"""The fleet's two kinds of HAProxy instance (a host's front door, a gateway): where each
keeps its files and sockets, its container and its unit. Pure."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

from serving.container_unit import RUNTIME_PATHS, command_line, log_options
from serving.fleet import api_port, frontdoor_port, is_serving
from serving.templates import environment

HERE = Path(__file__).parent
CONTAINER_DIR = "/usr/local/etc/haproxy"  # where the official image looks for haproxy.cfg
STATE_FILE = "servers.state"  # beside the runtime API's socket: written before a reload, read by the new instance


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
    template: str  # its configuration's template (serving/haproxy/templates, serving/accounting/templates)
    role: str  # the role that runs it, as its files say

    def name(self, v: dict) -> str:
        return v.get(self.name_var, self.default_name)

    def port(self, v: dict) -> int:
        """Where it listens: the gateway at ``api_port``; the front door there too, unless its
        host is a gateway as well (serving/fleet.py: frontdoor_port)."""
        return frontdoor_port(v) if self.role == "frontdoor" else api_port(v)

    def unit_name(self, v: dict) -> str:
        return f"{v.get('container_runtime', 'podman')}-{self.name(v)}.service"

    def unit_path(self, v: dict) -> str:
        return f"/etc/systemd/system/{self.unit_name(v)}"


FRONTDOOR = Proxy("front door", "frontdoor_name", "dgemma-frontdoor", "/etc/dgemma/frontdoor",
                  "/run/dgemma-frontdoor", "VLLM_API_KEY", 8404, "frontdoor.cfg.j2", "frontdoor")
GATEWAY = Proxy("gateway", "gateway_name", "dgemma-gateway", "/etc/dgemma/gateway", "/run/dgemma-gateway",
                "GATEWAY_KEY", 8405, "gateway.cfg.j2", "gateway")
# the gateway's environment file: the key it reaches the front doors with (0600)
GATEWAY_ENV_FILE = "/etc/dgemma/gateway.env"
# how often the gateway checks each front door for each pool, and how long one check may take
GATEWAY_CHECK_INTERVAL_S = 1
GATEWAY_CHECK_TIMEOUT_S = 2
# a roll taking a pool's last replicas out raises its flag, then waits for every gateway that
# checks the host to check that pool once more (the front door counts each gateway's checks), and
# this long at most, when one does not: a check answered just before the flag may reach its gateway
# up to its timeout later, and the next begins an interval after that one ends (waiting one interval
# alone, a gateway slow to check on a busy host still sent requests to the drained pool: 503)
GATEWAY_SEES_FLAG_S = GATEWAY_CHECK_TIMEOUT_S + GATEWAY_CHECK_INTERVAL_S + 0.5
# a check answered after the flag went up takes the host out once its answer reaches the gateway;
# what the gateway sent meanwhile is on its way: the roll drains this much later
GATEWAY_SAW_MARGIN_S = 0.3


# the gateway's guard of its health checks (files/live_answers.lua), in its folder beside haproxy.cfg
LIVE_ANSWERS = "live_answers.lua"
# ... and when it counts the gateway busy: its threads idle less than this share of the time (HAProxy's
# Idle_pct; saturated, it reads 0-20). A gateway with time to spare keeps no server: a timeout is the server's
LIVE_ANSWERS_BUSY_IDLE_PCT = 50


def live_answers() -> str:
    return (HERE / "files" / LIVE_ANSWERS).read_text()


def runtime_socket(proxy: Proxy) -> str:
    """HAProxy's runtime API (root only)."""
    return f"{proxy.socket_dir}/admin.sock"


def state_file(proxy: Proxy) -> str:
    return f"{proxy.socket_dir}/{STATE_FILE}"


def admin_socket(proxy: Proxy) -> str:
    """The instance's stats page with its admin actions (drain, ready), over HTTP on a unix
    socket that only root on the host reaches (curl --unix-socket)."""
    return f"{proxy.socket_dir}/admin-http.sock"


def image_ref(v: dict) -> str:
    """HAProxy's image (the inventory's, or the catalog's), through the inventory's registry
    mirror when it names one."""
    from serving import catalog
    return catalog.image_ref(v, catalog.images()["frontdoor"], v.get("frontdoor_image"))


# the gateway's template lives with the rest of its accounting (its Lua, its usage service)
ACCOUNTING_TEMPLATES = HERE.parent / "accounting" / "templates"


def templates() -> jinja2.Environment:
    return environment((HERE / "templates", ACCOUNTING_TEMPLATES))


def set_apart(v: dict, proxy: Proxy) -> dict:
    """What a gateway on a host that serves too may take of it (``threads``, ``memory_mib``),
    so that vLLM keeps the rest: HAProxy's own bounds (nbthread, -m), which hold under any
    runtime and cgroup setup. Empty for a front door and a gateway that serves nothing."""
    if proxy is not GATEWAY or not is_serving(v):
        return {}
    return {"threads": int(v.get("gateway_threads", 2)), "memory_mib": int(v.get("gateway_memory_mib", 1024))}


def container(v: dict, proxy: Proxy = FRONTDOOR) -> dict:
    """The proxy's container, whatever declares it (our unit, or a NixOS module)."""
    bounds = set_apart(v, proxy)
    memory = ["-m", str(bounds["memory_mib"])] if bounds else []
    return {"name": proxy.name(v), "image": image_ref(v),
            # the master reads the 0600 files as root; its workers drop to the haproxy user.
            # The upstream key by name only: its value comes from the unit's EnvironmentFile
            "options": ["--network=host", "--user", "root", "-e", proxy.upstream_key],
            "volumes": [f"{proxy.dir}:{CONTAINER_DIR}:ro", f"{proxy.socket_dir}:{proxy.socket_dir}"],
            "cmd": ["haproxy", *memory, "-f", f"{CONTAINER_DIR}/haproxy.cfg"]}


def run_command(v: dict, proxy: Proxy = FRONTDOOR) -> list[str]:
    spec = container(v, proxy)
    runtime = v.get("container_runtime", "podman")
    run = [RUNTIME_PATHS[runtime], "run", "--rm", "--name", spec["name"], *log_options(runtime), *spec["options"]]
    for volume in spec["volumes"]:
        run += ["-v", volume]
    return run + [spec["image"], *spec["cmd"]]


def render_unit(v: dict, env_file: str, proxy: Proxy = FRONTDOOR) -> str:
    runtime = v.get("container_runtime", "podman")
    return templates().get_template("unit.j2").render(
        kind=proxy.kind, name=proxy.name(v), runtime=runtime, runtime_path=RUNTIME_PATHS[runtime],
        env_file=env_file, exec_start=command_line(run_command(v, proxy)), socket_dir=proxy.socket_dir,
        interval=v.get("start_limit_interval_sec", 900), burst=v.get("start_limit_burst", 3))


def nixos_container(v: dict) -> dict:
    """The front door as the NixOS module declares it (oci-containers)."""
    runtime = v.get("container_runtime", "podman")
    spec = container(v)
    return {**spec, "unit": FRONTDOOR.unit_name(v),
            "reload": f"{RUNTIME_PATHS[runtime]} kill --signal USR2 {spec['name']}"}
