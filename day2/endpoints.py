"""`invoke endpoints`: where the fleet answers (each host's front door, and the
gateway once the inventory has one), the CA file that proves them, and the
lines Open WebUI takes (OPENAI_API_BASE_URLS / OPENAI_API_KEYS)."""
from __future__ import annotations

from credentials import directory
from credentials.ca import ca_paths

from converge.errors import StepFailed
from converge.secrets import read_optional_secret as read_secret

HIDDEN = "********"
YOUR_KEY = "<a key from: invoke keys.add NAME>"


def _url(name: str, v: dict, shared: str | None = None) -> str:
    # the certificate names the inventory name and the address: the address works without DNS.
    # ``shared``: the gateways' one address, which their certificates name too
    host = v.get("api_host", "0.0.0.0")
    address = shared or (v.get("ansible_host", name) if host in ("0.0.0.0", "::") else host)
    address = f"[{address}]" if ":" in address else address
    return f"https://{address}:{v.get('api_port', 8000)}/v1"


def endpoints(hostvars: dict[str, dict], gateway: dict[str, dict] | None = None) -> dict:
    """``{"gateway": URL or None, "ca_file": PATH, "hosts": [{"host", "url"}]}``: no secret in it."""
    any_vars = next(iter(hostvars.values()), None) or next(iter((gateway or {}).values()), {})
    gateway_url = next((_url(n, v, v.get("gateway_address")) for n, v in (gateway or {}).items()), None)
    return {"gateway": gateway_url, "ca_file": str(ca_paths(directory(any_vars))[0]),
            "hosts": [{"host": name, "url": _url(name, v)} for name, v in hostvars.items()
                      if v.get("state", "started") == "started"]}


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
    urls = [doc["gateway"]] if doc["gateway"] else [h["url"] for h in doc["hosts"]]
    return (f"OPENAI_API_BASE_URLS=\"{';'.join(urls)}\"\n"
            f"OPENAI_API_KEYS=\"{';'.join(key for _ in urls)}\"\n"
            f"# Open WebUI must trust the fleet CA: SSL_CERT_FILE={doc['ca_file']} "
            f"(and REQUESTS_CA_BUNDLE, AIOHTTP_CLIENT_SESSION_SSL=true)\n")
