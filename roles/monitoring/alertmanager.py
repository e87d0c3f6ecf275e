"""Alertmanager's configuration: every alert to each receiver of the inventory
(``alert_receivers``) whose ``min_severity`` it reaches, grouped by alert and place,
resolved ones too. Secrets (a webhook's token, Slack's URL, an SMTP password) are files
the configuration names, never in it. Pure."""
from __future__ import annotations

import yaml

CONTAINER_DIR = "/etc/alertmanager"  # where the official image reads its configuration
NOBODY = "none"  # the receiver of alerts no receiver takes: Alertmanager's API still shows them

# what a notification says: each alert's summary, description and the command that fixes it
SLACK_TEXT = ('{{ range .Alerts }}*{{ .Annotations.summary }}*\n{{ .Annotations.description }}\n'
              'Fix: `{{ .Annotations.fix }}`\n{{ end }}')
SLACK_TITLE = '[{{ .Status | toUpper }}] {{ .CommonLabels.alertname }}'
EMAIL_SUBJECT = '[{{ .Status | toUpper }}] {{ .CommonLabels.alertname }} ({{ .Alerts | len }})'
EMAIL_TEXT = ('{{ range .Alerts }}{{ .Annotations.summary }}\n{{ .Annotations.description }}\n'
              'Fix: {{ .Annotations.fix }}\n\n{{ end }}')


def secret_path(receiver: str, kind: str, files: str = CONTAINER_DIR) -> str:
    return f"{files}/secrets/{receiver}-{kind}"


def render(v: dict, files: str = CONTAINER_DIR) -> str:
    receivers = [{"name": NOBODY}]
    routes = []
    for r in v.get("alert_receivers") or []:
        name = r["name"]
        receiver: dict = {"name": name}
        if r.get("webhook"):
            hook = {"url": r["webhook"]["url"], "send_resolved": True}
            if r["webhook"].get("bearer_token_file"):
                hook["http_config"] = {"authorization": {"type": "Bearer",
                                                         "credentials_file": secret_path(name, "webhook-token", files)}}
            receiver["webhook_configs"] = [hook]
        if r.get("slack"):
            slack = {"api_url_file": secret_path(name, "slack-url", files), "send_resolved": True,
                     "title": SLACK_TITLE, "text": SLACK_TEXT}
            if r["slack"].get("channel"):
                slack["channel"] = r["slack"]["channel"]
            receiver["slack_configs"] = [slack]
        if r.get("email"):
            e = r["email"]
            mail = {"to": e["to"], "from": e["from"], "smarthost": e["smarthost"], "send_resolved": True,
                    "require_tls": bool(e.get("require_tls", True)),
                    "headers": {"Subject": EMAIL_SUBJECT}, "text": EMAIL_TEXT}
            if e.get("username"):
                mail["auth_username"] = e["username"]
            if e.get("password_file"):
                mail["auth_password_file"] = secret_path(name, "smtp-password", files)
            receiver["email_configs"] = [mail]
        receivers.append(receiver)
        route = {"receiver": name, "continue": True}
        if r.get("min_severity") == "critical":
            route["matchers"] = ['severity="critical"']
        routes.append(route)
    config = {"route": {"receiver": NOBODY, "group_by": ["alertname", "host", "replica", "server"],
                        "group_wait": f"{int(v.get('alert_group_wait_s', 10))}s", "group_interval": "30s",
                        "repeat_interval": str(v.get("alert_repeat_interval", "4h")), "routes": routes},
              "receivers": receivers}
    header = "# Managed by dgemma-fleet (roles/monitoring): edits here are replaced on the next deploy.\n"
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=1000)


def secrets(v: dict) -> list[tuple[str, str, str]]:
    """(receiver, kind, the file on the control machine) of every secret the receivers read."""
    out = []
    for r in v.get("alert_receivers") or []:
        for kind, section, key in (("webhook-token", "webhook", "bearer_token_file"),
                                   ("slack-url", "slack", "api_url_file"),
                                   ("smtp-password", "email", "password_file")):
            path = (r.get(section) or {}).get(key)
            if path:
                out.append((r["name"], kind, path))
    return out
