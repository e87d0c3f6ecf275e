"""A container of ours beside vLLM that is not a front door: the node exporter, NVIDIA's
DCGM exporter, Prometheus, Alertmanager. Its systemd unit (the oci-containers style of
the others: ``rm -f``, ``run --rm`` in the foreground, ``stop``), its image pulled (through
the run's artifact relay when there is one), and started, restarted or reloaded, then
waited for until it answers. Shared by the roles that run such containers (the runtimes' paths, their
log options and systemd's quoting of a command line serve vLLM's and HAProxy's units too);
it imports no role."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from converge.changes import Check, Command, File
from converge.errors import StepFailed
from converge.facts.containers import find_image

from serving.relay_probe import fallback_note, relay_steps, usable_relay

from serving.host_programs import RESULT_LIBRARY as RESULT_FILE, Program, Protocol, ended
from serving.systemd import SYSTEMD_FILE, systemd_parameters

RUNTIME_PATHS = {"podman": "/usr/bin/podman", "docker": "/usr/bin/docker"}


def log_options(runtime: str) -> list[str]:
    """Podman hands the container our unit's own stdout and stderr (the journal's stream):
    each line is logged once, by the unit, where `invoke logs` reads it. Its default (the
    journald driver, while the attached ``podman run`` relays the same lines to the unit) logs
    every line twice, through conmon and podman: with vLLM's and HAProxy's access logs, that
    relay took a quarter of a core at 3,000 requests a second (bench/gateway). Docker's
    attached client has no such mode; its lines stay as they are."""
    return ["--log-driver", "passthrough"] if runtime == "podman" else []


def systemd_quote(arg: str) -> str:
    """One argument as systemd reads it in ExecStart (systemd.service, Command lines)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg):
        return arg
    return "'" + arg.replace("\\", "\\\\").replace("'", "\\'") + "'"


def command_line(args: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in args)


@dataclass(frozen=True)
class Container:
    name: str  # the container's, and the unit's after the runtime
    description: str
    image: str
    args: tuple = ()  # after the image: the image's own entrypoint runs them
    options: tuple = ()  # `run` options before the image (--network=host, --user ...)
    volumes: tuple = ()
    # a signal that makes it read its files again (Prometheus, Alertmanager: SIGHUP); None: restart
    reload_signal: str | None = None
    # it answers once this URL does (on loopback; empty: at once), and, for a program that
    # reloads (``reloaded``: prometheus, alertmanager), once its metrics at ``metrics_url`` say
    # its last (re)load since the step began succeeded
    ready_url: str = ""
    reloaded: str = ""
    metrics_url: str = ""
    stop_seconds: int = 10


def unit_name(v: dict, container: Container | str) -> str:
    """The unit of a container (or of a container's name) under the host's runtime."""
    name = container if isinstance(container, str) else container.name
    return f"{v.get('container_runtime', 'podman')}-{name}.service"


def unit_path(v: dict, container: Container | str) -> str:
    return f"/etc/systemd/system/{unit_name(v, container)}"


def run_command(v: dict, container: Container) -> list[str]:
    runtime = v.get("container_runtime", "podman")
    run = [RUNTIME_PATHS[runtime], "run", "--rm", "--name", container.name, *log_options(runtime), *container.options]
    for volume in container.volumes:
        run += ["-v", volume]
    return run + [container.image, *container.args]


def render_unit(v: dict, container: Container, role: str) -> str:
    runtime = v.get("container_runtime", "podman")
    rt = RUNTIME_PATHS[runtime]
    docker = runtime == "docker"
    reload = (f"# it reads its files again on {container.reload_signal}: a new configuration is no restart\n"
              f"ExecReload={rt} kill --signal {container.reload_signal} {container.name}\n"
              if container.reload_signal else "")
    return (f"# Managed by dgemma-fleet (roles/{role}): edits here are replaced on the next deploy.\n"
            f"[Unit]\nDescription={container.description} ({container.name})\n"
            f"Wants=network-online.target\nAfter=network-online.target{' docker.service' if docker else ''}\n"
            + ("Requires=docker.service\n" if docker else "")
            + f"StartLimitIntervalSec={int(v.get('start_limit_interval_sec', 900))}\n"
              f"StartLimitBurst={int(v.get('start_limit_burst', 3))}\n\n"
              f"[Service]\nType=simple\nExecStartPre=-{rt} rm -f {container.name}\n"
              f"ExecStart={command_line(run_command(v, container))}\n{reload}"
              f"ExecStop={rt} stop -t {container.stop_seconds} {container.name}\n"
              f"Restart=on-failure\nRestartSec=5\nTimeoutStopSec={container.stop_seconds + 20}\n\n"
              f"[Install]\nWantedBy=multi-user.target\n")


FILES = Path(__file__).parent / "files"
PULL = Protocol("pull a container's image", markers={"relay-failed": "the run's relay failed the pull"})
PULL_PROGRAM = Program((FILES / "pull.sh",), PULL)
ANSWERING = Protocol("a container answering", result={"state": "ready, failed (its unit) or timeout",
                                                       "seconds": "since the action"},
                     exits={"failed": 3, "timeout": 4})
ANSWERING_PROGRAM = Program((SYSTEMD_FILE, RESULT_FILE, FILES / "answering.sh"), ANSWERING)


def pull_script(runtime: str, ref: str, relayed: str | None) -> str:
    """Pull ``ref``; through the run's relay when there is one (files/pull.sh)."""
    return PULL_PROGRAM.script({"RUNTIME": runtime, "REF": ref, "RELAYED": relayed or ""})


def pull_steps(ctx, ref: str, images_fact: str = "images", timeout: float | None = None):
    """The image, pulled when the host lacks it (podman through the run's relay)."""
    v = ctx.vars
    runtime = v.get("container_runtime", "podman")
    missing = find_image(ctx.facts.get(images_fact), ref) is None
    relayed = None
    if missing and runtime == "podman":  # docker takes mirrors for Docker Hub only: it pulls itself
        yield from relay_steps(ctx)
        relay = usable_relay(ctx)
        relayed = relay.registry_ref(ref) if relay else None
    via = ", through the run's relay" if relayed else ""
    yield Command(f"pull {ref}", script=pull_script(runtime, ref, relayed), when=missing,
                  describe=f"{runtime} pull {ref} (not present{via})",
                  interpret=lambda result: pulled(result, runtime, ref, via),
                  timeout=timeout or v.get("image_pull_timeout", 3600))


def pulled(result, runtime: str, ref: str, via: str) -> str:
    """What the pull did; the step fails, with the runtime's words, when it did not pull."""
    if not result.ok:
        said = (result.stdout + result.stderr).strip()
        remedy = ("the registry has no build of it for this host's architecture: push one (a multi-arch image) or "
                  "name another image" if "no matching manifest" in said or "no image found in manifest list" in said
                  else "check that the host reaches the registry and that the image is there")
        raise StepFailed(f"{runtime} pull {ref} failed (exit {result.rc}): {said[-400:] or 'it printed nothing'}; "
                         f"{remedy}")
    return f"{ref} pulled{via}{fallback_note(result.stdout)}"


def steps(ctx, container: Container, role: str, *, unit_fact: str, unit_file_fact: str, files_changed: bool,
          timeout: int = 60):
    """Its image, its unit, then started (inactive), restarted (its unit changed, or it has no
    reload and its files changed), reloaded (its files changed) or left alone; each change
    waits until it answers (``container.ready``)."""
    v = ctx.vars
    yield from pull_steps(ctx, container.image)
    unit = unit_name(v, container)
    unit_file = File(f"{container.name} unit", path=unit_path(v, container), content=render_unit(v, container, role),
                     mode="0644", current=ctx.facts.get(unit_file_fact))
    yield unit_file
    state = ctx.facts.get(unit_fact) or {}
    if state.get("ActiveState") != "active":
        action, why = "start", f"was {state.get('ActiveState', 'absent')}"
    elif unit_file.needed() or (files_changed and not container.reload_signal):
        action, why = "restart", "its unit changed" if unit_file.needed() else "its files changed"
    elif files_changed:
        action, why = "reload", "its files changed: reloaded, not restarted"
    else:
        action, why = "none", ""
    enabled = state.get("UnitFileState") == "enabled"
    yield Command(f"{container.name} answering", when=action != "none" or not enabled,
                  script=answering_script(unit, container, action, timeout),
                  describe=(f"systemctl {action} {unit}; wait until it answers ({why})" if action != "none"
                            else f"systemctl enable {unit} (not enabled at boot)"),
                  timeout=timeout + 30, interpret=_interpret(unit, timeout, why or "enabled at boot",
                                                             waited=action != "none"))


def answering_script(unit: str, container: Container, action: str, timeout: int) -> str:
    """files/answering.sh: enabled at boot, ``action`` (start, restart, reload, none), then
    waited for until it answers."""
    return ANSWERING_PROGRAM.script({**systemd_parameters(unit, action, daemon_reload=action in ("start", "restart"),
                                                          enable=True),
                                     "READY_URL": container.ready_url, "RELOADED": container.reloaded,
                                     "METRICS_URL": container.metrics_url, "TIMEOUT_S": int(timeout)})


def _interpret(unit: str, timeout: int, why: str, waited: bool = True):
    def interpret(result):
        if not waited and result.rc == 0:
            return f"{unit} enabled at boot ({why})"  # ACTION none: nothing to wait for
        said, journal = ended(ANSWERING, result, unit)
        if result.rc == 0 and said["state"] == "ready":
            took = f" after {said['seconds']} s" if said["seconds"] else ""
            return f"{unit} answers{took} ({why})"
        first = (f"its unit failed after {said['seconds']} s" if said["state"] == "failed" else
                 f"no answer after {said['seconds']} s")
        raise StepFailed(f"{unit} did not answer within {timeout} s ({first}). Last log lines:\n{journal}\n"
                         f"See: journalctl -u {unit}")
    return interpret


def declared_by_nixos(ctx, container: Container, unit_fact: str):
    """On NixOS the service role's module declares the container: a Check that it is loaded."""
    state = ctx.facts.get(unit_fact) or {}
    if state.get("LoadState") != "loaded" and not ctx.check:
        yield Check(f"{container.name} declared by the NixOS module", ok=False,
                    message=f"{unit_name(ctx.vars, container)} is not loaded: apply the module (nixos-rebuild "
                            f"switch), then deploy again")
