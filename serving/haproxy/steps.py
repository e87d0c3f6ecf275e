"""The steps of one HAProxy instance on a host, shared by the front door and the
gateway: its files (configuration, key hashes, certificate, CA), its image, its
unit, then start, restart or reload and wait until it answers with the new
configuration.

A change of keys, certificate or servers is a reload (SIGUSR2 to HAProxy's master:
connections in flight finish); the unit or its environment changing is a
restart. Either way the step waits for the generation header of /health, so a
revoked key is refused when the step returns."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from converge.changes import Check, Command, Decision, File, Output, Throttle
from converge.errors import StepFailed
from converge.facts.containers import Images
from converge.facts.host import FileState, HttpHeader, OsRelease, UnitState

from serving.container_unit import pull_steps
from serving.handoffs import CERTIFICATES
from serving.host_programs import RESULT_LIBRARY, Program, Protocol, ended
from serving.systemd import SYSTEMD_FILE, systemd_parameters
from serving.serving_host import connect_address

from . import tls
from .config import Server, render_config, render_keys
from .instance import Proxy, image_ref, render_unit, runtime_socket
from .instance import state_file as state_file_of


@dataclass(frozen=True)
class Wanted:
    bundle: tls.Bundle
    keys: str
    config: str
    generation: str
    monitoring_keys: str = ""  # the sha256 of the key that opens this host's metrics
    targets: str = ""  # what to scrape here (/metrics/sd: serving/scrape_targets.py)


GENERATION_HEADER = "X-Frontdoor-Generation"


def local_url(v: dict, proxy: Proxy, path: str = "/health") -> str:
    """The instance as the host itself reaches it."""
    return f"https://{connect_address(v)}:{proxy.port(v)}{path}"


# the files a keys run rewrites (`reload_steps`), by their facts' suffixes
KEYS_RUN_FILES = {"config": "haproxy.cfg", "keys": "keys.sha256", "monitoring_keys": "monitoring.sha256",
                  "targets": "targets.json"}


def keys_facts(v: dict, proxy: Proxy, prefix: str) -> dict:
    """What `reload_steps` reads: the files it rewrites and the unit's state. A keys run neither
    pulls, nor renews the certificate, nor asks what the instance answers as (a deploy does):
    each of those facts costs an emulated host a program start or more."""
    return {**{f"{prefix}_{name}": FileState(f"{proxy.dir}/{file}") for name, file in KEYS_RUN_FILES.items()},
            f"{prefix}_unit": UnitState(proxy.unit_name(v))}


def facts(v: dict, proxy: Proxy, prefix: str) -> dict:
    return {**keys_facts(v, proxy, prefix),
            f"{prefix}_served": HttpHeader(local_url(v, proxy), GENERATION_HEADER),
            f"{prefix}_tls": FileState(f"{proxy.dir}/tls.pem", secret=True),
            f"{prefix}_ca": FileState(f"{proxy.dir}/ca.crt"),
            f"{prefix}_unit_file": FileState(proxy.unit_path(v)),
            "os": OsRelease(),
            "images": Images(v.get("container_runtime", "podman"))}


def wanted(ctx, proxy: Proxy, servers: list[Server], accepted: dict[str, str], backend: dict | None = None,
           extra_ca_files: tuple = (), pools: list | None = None, secret_files: str = "", targets: str = "",
           dcgm: bool = False, accounting=None, diffusion: dict | None = None) -> Wanted:
    """The certificate, the key lists, the configuration, the scrape targets, and the
    generation that names them (any change to one of them is a new generation).
    ``secret_files``: the text of other files it reads (the gateway's upstream keys): only
    their digest counts. ``accounting``, ``diffusion``: config.render_config's."""
    make = not ctx.check  # a read-only run makes nothing on the control machine
    bundle = tls.bundle(ctx.name, ctx.vars, extra_ca_files, make=make)
    keys = render_keys(accepted)
    monitoring = render_keys(tls.monitoring_keys(ctx.name, ctx.vars, make=make))
    rendered = dict(proxy=proxy, backend=backend, pools=pools, dcgm=dcgm, accounting=accounting, diffusion=diffusion)
    unnamed = render_config(ctx.name, ctx.vars, servers, "", **rendered)
    secrets = hashlib.sha256(secret_files.encode()).hexdigest() if secret_files else ""
    generation = hashlib.sha256((unnamed + keys + monitoring + targets + bundle.cert_pem + secrets).encode()
                                ).hexdigest()[:16]
    return Wanted(bundle, keys, render_config(ctx.name, ctx.vars, servers, generation, **rendered), generation,
                  monitoring, targets)


ANSWERING = Protocol("an HAProxy instance answering", markers={
    "handed-off": "GOT: the gateway's shared address is held and answered by another gateway: this one restarts",
    "reload-signalled-again": "GOT: the reload had not taken after AGAIN_S s: signalled once more",
    "reload-did-not-take": "GOT: the reload had not taken after GRACE_S s: restarted instead"},
    result={"state": "ready, failed (its unit; its last log lines before) or timeout", "seconds": "since the action",
            "unit_state": "systemctl is-active", "answered": "the generation it answered as",
            "files": "(timeout) the generation its configuration file names"},
    exits={"failed": 3, "timeout": 4})
FILES = Path(__file__).parent / "files"
KEEP_STATES = FILES / "keep_states.sh"
ANSWERING_PROGRAM = Program((RESULT_LIBRARY, KEEP_STATES, FILES / "states.sh", FILES / "handoff.sh", SYSTEMD_FILE,
                             FILES / "answering.sh"), ANSWERING)
# a restart of the gateways, one at a time across a run: each hands the shared address to another first
GATEWAY_RESTARTS = Throttle("gateway restart", 1)


@dataclass(frozen=True)
class Handoff:
    """Where a gateway's restart hands the shared address first (files/handoff.sh)."""
    address: str  # the shared address
    port: int  # the gateway's port there
    keepalived: str  # the unit that holds it

    def parameters(self, ca_file: str) -> dict:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return {"SHARED_ADDRESS": self.address, "SHARED_URL": f"https://{host}:{self.port}/health",
                "KEEPALIVED": self.keepalived, "CA_FILE": ca_file}


NO_HANDOFF = {"SHARED_ADDRESS": "", "SHARED_URL": "", "KEEPALIVED": ""}


def wait_script(ctx, proxy: Proxy, action: str, generation: str, timeout: int, fallback: bool = False,
                kept: tuple = (), enable: bool = True, grace: int = 10, again: int = 3,
                state_file: str | None = None, handoff: Handoff | None = None) -> str:
    """Start, restart or reload (``action``) the instance, then wait until https /health on this
    host answers with ``generation`` (files/answering.sh). A reload keeps the states of the servers
    ``kept`` (`kept_servers`). ``fallback``: a reload that has not taken after ``grace`` seconds
    becomes a restart: the running instance reads files other than those written (a container that
    still sees a directory replaced or remounted since it started). Before that, after ``again``
    seconds, the reload is signalled once more: HAProxy's master now and then acts on no SIGUSR2
    (seen on 2.6 on a loaded machine, 13 in about 100 reloads of a unit test's gateway; a second signal took it
    each time, and one that comes during a reload merges into it), and a reload keeps the
    connections in flight where a restart would cut them."""
    v = ctx.vars
    port = proxy.port(v)
    return ANSWERING_PROGRAM.script(
        {**systemd_parameters(proxy.unit_name(v), action, daemon_reload=action in ("start", "restart"),
                              enable=enable),
         "STATE_FILE": state_file or state_file_of(proxy), "RUNTIME_SOCKET": runtime_socket(proxy),
         "KEPT_SERVERS": "\n".join(kept), "URL": f"https://{ctx.name}:{port}/health",
         "RESOLVE": f"{ctx.name}:{port}:{connect_address(v)}", "CA_FILE": f"{proxy.dir}/ca.crt",
         "GENERATION": generation, "TIMEOUT_S": int(timeout), "FALLBACK": int(fallback),
         "GRACE_S": int(grace), "AGAIN_S": int(again), "CONFIG": f"{proxy.dir}/haproxy.cfg",
         **(handoff.parameters(f"{proxy.dir}/ca.crt") if handoff else NO_HANDOFF)})


def kept_servers(config: str) -> list[str]:
    """``backend server address port`` of each server of ``config`` at a literal address: the
    servers whose state a reload may carry over. HAProxy would otherwise restore a server's
    old address and port from the state file over a new one in the configuration."""
    out, backend = [], None
    for line in config.splitlines():
        head = re.match(r"(backend|frontend|listen|defaults|global)\b\s*(\S*)", line)
        if head:
            backend = head.group(2) if head.group(1) in ("backend", "listen") else None
            continue
        server = re.match(r"\s+server\s+(\S+)\s+\[?([0-9a-fA-F.:]+?)\]?:([0-9]+)(\s|$)", line)
        if backend and server and re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", server.group(2)):
            out.append(f"{backend} {server.group(1)} {server.group(2)} {server.group(3)}")
    return out


def _interpret(proxy: Proxy, unit: str, timeout: int, done: str):
    def interpret(result):
        out = result.stdout
        said, journal = ended(ANSWERING, result, unit)
        if result.rc == 0 and said["state"] == "ready":
            took = f" in {said['seconds']} s" if said["seconds"] else ""
            stale = ANSWERING.rest(out, "reload-did-not-take")
            if stale is not None:
                return (f"{done}{took}; the reload did not take (it still answered as {stale}: the container "
                        f"read other files than those written), so it was restarted")
            if ANSWERING.first(out, "reload-signalled-again") is not None:
                return f"{done}{took}; HAProxy acted on the second reload signal, not the first"
            handed = ANSWERING.rest(out, "handed-off")
            if handed is not None:
                return f"{done}{took}; {handed} handed to another gateway first (this one is a backup now)"
            return done + took
        why = (f"its unit is {said['unit_state']} after {said['seconds']} s" if said["state"] == "failed" else
               f"after {said['seconds']} s {said['unit_state']}, it answered as {said['answered']} "
               f"(files: {said['files']})")
        raise StepFailed(f"{unit} did not answer with its new configuration within {timeout} s "
                         f"({why}). Last log lines:\n{journal}\nSee: journalctl -u {unit}")
    return interpret


def file_steps(ctx, proxy: Proxy, prefix: str, want: Wanted) -> list[File]:
    d, f = proxy.dir, ctx.facts
    return [File(f"{proxy.kind} configuration", path=f"{d}/haproxy.cfg", content=want.config, mode="0644",
                 current=f.get(f"{prefix}_config")),
            File(f"{proxy.kind} keys (sha256)", path=f"{d}/keys.sha256", content=want.keys, mode="0600",
                 current=f.get(f"{prefix}_keys")),
            File(f"{proxy.kind} monitoring key (sha256)", path=f"{d}/monitoring.sha256", content=want.monitoring_keys,
                 mode="0600", current=f.get(f"{prefix}_monitoring_keys")),
            File(f"{proxy.kind} scrape targets", path=f"{d}/targets.json", content=want.targets, mode="0644",
                 current=f.get(f"{prefix}_targets")),
            File(f"{proxy.kind} certificate", path=f"{d}/tls.pem", content=want.bundle.cert_pem + want.bundle.key_pem,
                 mode="0600", secret=True, current=f.get(f"{prefix}_tls")),
            File("fleet CA certificate", path=f"{d}/ca.crt", content=want.bundle.ca_pem, mode="0644",
                 current=f.get(f"{prefix}_ca"))]


def steps(ctx, proxy: Proxy, prefix: str, want: Wanted, env_file: str, env_changed: bool = False,
          extra_files: tuple = (), handoff: Handoff | None = None):
    """Everything the instance needs, in order; ``env_changed``: its environment file changed in this run;
    ``extra_files``: other files it reads at start and reload (a change is a reload); ``handoff``: a
    gateway's shared address, handed to another gateway before a restart (one gateway of the run at a time)."""
    v = ctx.vars
    nixos = (ctx.facts.get("os") or {}).get("ID") == "nixos"
    # for the node exporter's textfiles (roles/exporters): when they expire
    yield Decision("certificates", produces=CERTIFICATES, value=tls.expiries(want.bundle, prefix))
    files = file_steps(ctx, proxy, prefix, want) + list(extra_files)
    reload = any(f.needed() for f in files)
    yield from files
    yield from pull_steps(ctx, image_ref(v))
    unit = proxy.unit_name(v)
    unit_changed = False
    state = ctx.facts.get(f"{prefix}_unit") or {}
    if nixos:
        # the module the service role wrote declares this container too
        if state.get("LoadState") != "loaded" and not ctx.check:
            yield Check(f"{proxy.kind} declared by the NixOS module", ok=False,
                        message=f"{unit} is not loaded: apply the module (nixos-rebuild switch), then deploy again")
            return
    else:
        unit_file = File(f"{proxy.kind} unit", path=proxy.unit_path(v), content=render_unit(v, env_file, proxy),
                         mode="0644", current=ctx.facts.get(f"{prefix}_unit_file"))
        unit_changed = unit_file.needed()
        yield unit_file
    active = state.get("ActiveState") == "active"
    served = ctx.facts.get(f"{prefix}_served")
    fallback = False
    if not active:
        action, why = "start", f"was {state.get('ActiveState', 'absent')}"
    elif unit_changed or env_changed:
        action, why = "restart", "its unit or environment changed"
    elif reload:
        action, why = "reload", "keys, certificate or servers changed: reloaded, not restarted"
        fallback = True
    elif served != want.generation:
        # its files are right but it serves something else: a reload would read the same
        # stale view (a container started while its directory was replaced or remounted)
        action, why = "restart", (f"its files are current but it answers as {served}"
                                  if served else "active, but https /health does not answer")
    else:
        action, why = "", ""
    timeout = int(v.get("frontdoor_ready_timeout", 60))
    yield Command(f"{proxy.kind} answering",
                  script=wait_script(ctx, proxy, action or "none", want.generation, timeout, fallback=fallback,
                                     kept=tuple(kept_servers(want.config)) if action == "reload" else (),
                                     enable=not nixos, handoff=handoff),
                  when=bool(action), throttle=GATEWAY_RESTARTS if handoff and action == "restart" else None,
                  describe=(f"systemctl {action} {unit}; wait for https /health ({why})" if action else
                            f"{unit} answers as its files say ({want.generation})"),
                  timeout=timeout + 30,
                  interpret=_interpret(proxy, unit, timeout,
                                       f"{unit} answers https on port {proxy.port(v)} ({why})"))


def reload_steps(ctx, proxy: Proxy, prefix: str, want: Wanted, extra_files: tuple = ()):
    """`invoke keys.add` and `keys.revoke`: the key list and the configuration naming its
    generation (and ``extra_files``, which that generation counts), then a reload (a restart
    only if the reload does not take). A host where the instance is not deployed yet gets
    its keys at its first deploy."""
    state = ctx.facts.get(f"{prefix}_unit") or {}
    if state.get("ActiveState") != "active" or ctx.facts.get(f"{prefix}_config") is None:
        yield Check(f"{proxy.kind} deployed", ok=True,
                    message="not deployed here yet: the keys take effect at its first deploy")
        return
    files = [f for f in file_steps(ctx, proxy, prefix, want)
             if f.path.endswith(tuple(f"/{file}" for file in KEYS_RUN_FILES.values()))]
    files += list(extra_files)
    needed = any(f.needed() for f in files)
    yield from files
    unit = proxy.unit_name(ctx.vars)
    timeout = int(ctx.vars.get("frontdoor_ready_timeout", 60))
    yield Command(f"{proxy.kind} reloaded",
                  script=wait_script(ctx, proxy, "reload", want.generation, timeout, fallback=True,
                                     kept=tuple(kept_servers(want.config)), enable=False),
                  when=needed, describe=f"systemctl reload {unit}; wait for the new keys to answer",
                  timeout=timeout + 30, interpret=_interpret(proxy, unit, timeout, "reloaded: the new keys answer"))


def summary(ctx, proxy: Proxy, key: str, generation: Output) -> dict:
    """What verify checks the instance against (no secret in here)."""
    v = ctx.vars
    if ctx.results.get(generation) is None:
        return {}
    return {key: {"unit": proxy.unit_name(v), "port": proxy.port(v), "dir": proxy.dir,
                  "connect": connect_address(v), "generation": ctx.results[generation]}}
