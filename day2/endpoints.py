"""`invoke endpoints`: the OpenAI base URLs of the serving hosts, and the lines
Open WebUI takes (OPENAI_API_BASE_URLS / OPENAI_API_KEYS, ';'-separated)."""
from __future__ import annotations

from converge.errors import StepFailed
from roles.service.role import read_secret

HIDDEN = "********"


def endpoints(hostvars: dict[str, dict], show_keys: bool = False) -> list[dict]:
    out = []
    for name, v in hostvars.items():
        if v.get("state", "started") != "started":
            continue
        host = v.get("api_host", "0.0.0.0")
        address = v.get("ansible_host", name) if host in ("0.0.0.0", "::") else host
        problem = None
        try:
            key = read_secret(v.get("api_key_file"), "api_key_file", name)
        except StepFailed as exc:
            key, problem = None, str(exc)  # unusable: listed as keyless, and said why
        out.append({"host": name, "base_url": f"http://{address}:{v.get('api_port', 8000)}/v1",
                    "key": (key if show_keys else HIDDEN) if key else "EMPTY", "problem": problem})
    return out


def open_webui_lines(rows: list[dict]) -> str:
    return (f"OPENAI_API_BASE_URLS=\"{';'.join(r['base_url'] for r in rows)}\"\n"
            f"OPENAI_API_KEYS=\"{';'.join(r['key'] for r in rows)}\"\n")
