"""`invoke endpoints`: where the fleet answers (each host's front door, and the
gateway once the inventory has one), the CA file that proves them, and the
lines Open WebUI takes (OPENAI_API_BASE_URLS / OPENAI_API_KEYS)."""
from __future__ import annotations

from credentials import directory
from credentials.ca import ca_paths
from serving.fleet import api_port, frontdoor_port

from converge.errors import StepFailed
from converge.secrets import read_optional_secret as read_secret

HIDDEN = "********"
YOUR_KEY = "<a key from: invoke keys.add NAME>"


def _url(name: str, v: dict, shared: str | None = None, gateway: bool = False) -> str:
    # the certificate names the inventory name and the address: the address works without DNS.
    # ``shared``: the gateways' one address, which their certificates name too; ``gateway``: the
    # host's gateway (at api_port; its front door moves aside on a gateway that serves too)
    host = v.get("api_host", "0.0.0.0")
    address = shared or (v.get("ansible_host", name) if host in ("0.0.0.0", "::") else host)
    address = f"[{address}]" if ":" in address else address
    return f"https://{address}:{api_port(v) if gateway else frontdoor_port(v)}/v1"


def endpoints(hostvars: dict[str, dict], gateway: dict[str, dict] | None = None) -> dict:
    """``{"gateway": URL or None, "ca_file": PATH, "hosts": [{"host", "url"}]}``: no secret in it."""
    any_vars = next(iter(hostvars.values()), None) or next(iter((gateway or {}).values()), {})
    gateway_url = next((_url(n, v, v.get("gateway_address"), gateway=True) for n, v in (gateway or {}).items()), None)
    return {"gateway": gateway_url, "ca_file": str(ca_paths(directory(any_vars))[0]),
            "hosts": [{"host": name, "url": _url(name, v)} for name, v in hostvars.items()
                      if v.get("state", "started") == "started"],
            "task_model": task_model(hostvars)}


def task_model(hostvars: dict[str, dict]) -> str | None:
    """The name of an autoregressive family the fleet serves (Gemma 4), or None: Open WebUI's
    own short tasks (a chat's title, tags, follow-ups) go to it, since a diffusion model pays a
    whole 256-token canvas for each few-word answer."""
    from serving.declared import declared, is_diffusion, served_name
    from roles.preflight.select import Refused
    for v in hostvars.values():
        try:
            families = [e.family for e in declared(v)]
        except (Refused, KeyError):
            continue
        for family in families:
            if not is_diffusion(family):
                return served_name(family, v)
    return None


def api_key(hostvars: dict[str, dict], show: bool) -> tuple[str, str | None]:
    """What goes in OPENAI_API_KEYS: the inventory's api_key_file key (hidden unless
    asked), else a placeholder for a user's key (only its hash is kept anywhere)."""
    for name, v in hostvars.items():
        try:
            key = read_secret(v.get("api_key_file"), "api_key_file", name)
        except StepFailed as exc:
            return YOUR_KEY, str(exc)
        if key:
            return (key if show else HIDDEN), None
    return YOUR_KEY, None


def open_webui_lines(doc: dict, key: str) -> str:
    """Open WebUI's environment (0.12, what tests/lab/test_lab_open_webui.py runs it with)."""
    urls = [doc["gateway"]] if doc["gateway"] else [h["url"] for h in doc["hosts"]]
    lines = (f"OPENAI_API_BASE_URLS=\"{';'.join(urls)}\"\n"
             f"OPENAI_API_KEYS=\"{';'.join(key for _ in urls)}\"\n"
             f"# its requests to the fleet check the certificate against the fleet CA\n"
             f"AIOHTTP_CLIENT_SSL_CERT_FILE=\"{doc['ca_file']}\"\n"
             f"ENABLE_OLLAMA_API=\"false\"\n")
    if doc.get("task_model"):
        lines += (f"# its titles, tags and follow-ups: to {doc['task_model']}, which pays per token (a diffusion\n"
                  f"# model pays a 256-token canvas for each few-word answer)\n"
                  f"TASK_MODEL_EXTERNAL=\"{doc['task_model']}\"\n")
    return lines


def monitoring(hostvars: dict[str, dict]) -> list[dict]:
    """Where to look at the monitoring hosts' Prometheus and Alertmanager: they listen on
    their host's loopback alone, so through an SSH tunnel (the way in the inventory gives:
    its user, port and ProxyJump)."""
    import re
    out = []
    for name, v in hostvars.items():
        user = v.get("ansible_user", "root")
        address = v.get("ansible_host", name)
        options = f" -p {int(v['ansible_port'])}" if v.get("ansible_port") else ""
        if v.get("ansible_ssh_private_key_file"):
            options += f" -i {v['ansible_ssh_private_key_file']}"
        if v.get("known_hosts_file"):
            options += f" -o UserKnownHostsFile={v['known_hosts_file']}"
        jump = re.search(r"ProxyJump=(\S+)", v.get("ansible_ssh_common_args") or "")
        options += f" -J {jump.group(1)}" if jump else ""
        forwards = " ".join(f"-L {p}:127.0.0.1:{p}" for p in (int(v.get("prometheus_port", 9090)),
                                                              int(v.get("alertmanager_port", 9093))))
        out.append({"host": name, "prometheus": f"http://127.0.0.1:{int(v.get('prometheus_port', 9090))}",
                    "alertmanager": f"http://127.0.0.1:{int(v.get('alertmanager_port', 9093))}",
                    "tunnel": f"ssh -N {forwards}{options} {user}@{address}"})
    return out


def monitoring_lines(entries: list[dict]) -> str:
    lines = []
    for m in entries:
        lines += [f"{'monitoring':<12} {m['host']}: Prometheus and Alertmanager on its loopback; to look, run",
                  f"{'':<12}   {m['tunnel']}",
                  f"{'':<12}   then open {m['prometheus']} (Prometheus) and {m['alertmanager']} (Alertmanager)"]
    if entries:
        lines += [f"{'dashboards':<12} grafana/dashboards/*.json for your Grafana (provisioning: grafana/provisioning)",
                  f"{'live':<12} invoke top (the fleet in this terminal); invoke status (load and firing alerts)"]
    return "".join(line + "\n" for line in lines)
