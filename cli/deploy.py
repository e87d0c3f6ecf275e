"""Tasks that converge and check hosts: inventory.check, facts, deploy, verify,
trust, render."""
from __future__ import annotations

import sys

from invoke import Collection, Exit, task

from converge.errors import ConvergeError
from converge.hostlock import changing_line

from . import runs


@task(help={"inventory": runs.HELP["inventory"], "set": runs.HELP["set"]}, iterable=["set"])
def inventory_check(c, inventory=None, set=None):
    """Validate the inventory and every host's variables against the schemas, and the files a deploy
    will read on this machine (keys, certificates, secrets: there, readable, a secret 0600)."""
    from serving.control_files import problems
    from serving.host_roles import host_roles
    play = runs.load_play(inventory, set)
    missing = problems(play)
    if missing:
        raise Exit("inventory check failed: files this machine must hold for a deploy:\n  " + "\n  ".join(missing),
                   code=2)
    hosts = play.inventory.host_names
    roles = host_roles({h: play.hostvars(h) for h in hosts})
    refused = [f"{_origin(play, r.host, r.problem)}{r.host}: {r.problem}" for r in roles if r.problem]
    if refused:
        raise Exit("inventory check failed:\n  " + "\n  ".join(refused), code=2)
    listed = ", ".join(hosts[:12]) + (f", … ({len(hosts) - 12} more)" if len(hosts) > 12 else "")
    print(f"{play.inventory.root}: {len(hosts)} hosts ({listed}), {len(play.inventory.groups) - 1} groups: OK")
    width = max((len(h) for h in hosts), default=0)
    for r in roles:
        print(f"  {r.host:<{width}}  {'; '.join(r.roles) or 'nothing'}")


def _origin(play, host: str, problem: str) -> str:
    """``file:line: `` of the variable a host's problem names first (``models[0].family: ...``),
    or nothing where it names none."""
    import re
    found = re.match(r"([A-Za-z_][\w]*)((?:\[\d+\]|\.[A-Za-z_][\w]*)*):", problem)
    if not found:
        return ""
    path = (found.group(1),) + tuple(int(p[1:-1]) if p.startswith("[") else p[1:]
                                     for p in re.findall(r"\[\d+\]|\.[A-Za-z_][\w]*", found.group(2)))
    where = runs.where_set(play, host, path)
    return f"{where}: " if where else ""


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "json": runs.HELP["json"],
                            "local": "read this machine through a local connection instead of SSH",
                            "set": runs.HELP["set"], "ask_become_pass": runs.HELP["ask_become_pass"]},
      iterable=["set"])
def facts(c, inventory=None, hosts=None, local=False, json=None, set=None, ask_become_pass=False):
    """Gather facts and show the chosen image, model and memory, with reasons."""
    from roles.preflight import show
    from roles.preflight.role import FACTS_ROLE
    play = runs.load_play(inventory, set, ask_become_pass and not local)
    report = runs.run(play, [FACTS_ROLE], hosts, json, local=local, check=True)  # reads: takes no lock
    data = show.facts_document(report)
    show.print_tables(report, data, console=report.console)
    runs.finish(report, data, json)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "json": runs.HELP["json"],
                            "set": runs.HELP["set"], "ask_become_pass": runs.HELP["ask_become_pass"],
                            "check": "change nothing; show the diffs and commands a real run would make",
                            "diff": "show diffs of changed files", "forks": "hosts converged at once (default 10)",
                            "lock_wait": "seconds to wait for another run's lock on a host (default 300)",
                            **runs.SERIAL_HELP},
      iterable=["set"])
def deploy(c, inventory=None, hosts=None, check=False, diff=False, forks=10, json=None, set=None, lock_wait=300,
           ask_become_pass=False, serial=None, max_fail=None):
    """Converge hosts: image, weights, systemd unit, started and answering."""
    import roles
    from relay.service import RelayService
    runs.check_batches(serial, max_fail)
    play = runs.load_play(inventory, set, ask_become_pass)
    report = runs.run(play, roles.load(), hosts, json, title="CHECK RECAP (nothing was changed)" if check else "PLAY RECAP",
                  show_diff=diff or check, check=check, forks=int(forks), lock_wait=float(lock_wait),
                  services=(RelayService(),), serial=serial, max_fail=max_fail)
    runs.finish(report, report.as_dict(), json)


@task(help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"],
            "yes": "pin the keys shown without asking"})
def trust(c, inventory=None, hosts=None, yes=False):
    """Show and pin host keys: each jump host's on the way, then the host's own."""
    from converge import hostkeys
    from converge.ssh_settings import SSHSettings
    from converge.trust import walk
    play = runs.load_play(inventory)
    failed = False

    def decide(seen):
        print(f"{name}: {seen.label + ' ' if seen.label != name else ''}{seen.where} {seen.key.get_name()} "
              f"{hostkeys.fingerprint(seen.key)}")
        if yes:
            return True
        if not sys.stdin.isatty():
            print("  not pinned: run with --yes, or from a terminal, after checking the fingerprint")
            return False
        return input("  trust this key? [y/N] ").strip().lower() in ("y", "yes")

    for name in runs.select(play, hosts):
        try:
            # trust needs no become password: only the way in
            settings = SSHSettings.from_vars(name, {**play.hostvars(name), "ansible_become": False})
            seen = walk(settings, decide)
        except ConvergeError as exc:
            print(str(exc))
            failed = True
            continue
        for entry in seen:
            what = entry.label + " " if entry.label != name else ""
            if entry.state == "trusted":
                print(f"{name}: {what}{entry.where} {entry.key.get_name()} {hostkeys.fingerprint(entry.key)} "
                      f"already trusted")
            elif entry.state == "pinned":
                print(f"  pinned in {settings.known_hosts or hostkeys.USER_KNOWN_HOSTS}")
            elif entry.state == "changed":
                print(f"{name}: {what}{entry.where} offers {hostkeys.fingerprint(entry.key)} but known_hosts has "
                      f"{hostkeys.fingerprint(entry.expected)}. Remove the old key first if the machine was "
                      f"reinstalled: ssh-keygen -R '{entry.where}' -f "
                      f"{settings.known_hosts or hostkeys.USER_KNOWN_HOSTS}")
                failed = True
            else:
                failed = failed or not yes
    if failed:
        raise Exit(code=1)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "json": runs.HELP["json"],
                            "set": runs.HELP["set"], "junit": "write JUnit XML to FILE",
                            "ask_become_pass": runs.HELP["ask_become_pass"]}, iterable=["set"])
def verify(c, inventory=None, hosts=None, json=None, junit=None, set=None, ask_become_pass=False):
    """Check every host with testinfra over SSH: units, secrets, image, weights, API."""
    from pathlib import Path
    import roles
    from converge import verify as verifylib
    from converge.verify_report import print_table, verify_document
    runs.writable(junit, "--junit")
    play = runs.load_play(inventory, set, ask_become_pass)
    with play.connections() as connections:  # the check run and the checks: one connection per host
        # what each host should look like: the roles' plan in check mode (changes nothing)
        report = runs.run(play, roles.load(), hosts, json, check=True, connections=connections)
        expected = {h: {**x.get("expected", {}), "frontdoor": x.get("frontdoor"), "gateway": x.get("gateway"),
                        "shared_address": x.get("shared_address"), "exporters": x.get("exporters"),
                        "monitoring": x.get("monitoring"), "serving": "expected" in x}
                    for h, x in report.extra.items() if "expected" in x or "gateway" in x or "monitoring" in x}
        # hosts the check run could not reach or become on are failures of their own
        unreachable = {t.host: t.message for t in report.tasks if t.status == "unreachable"
                       or (t.role == "connect" and t.status == "failed")}
        reached = {h: t for h, t in connections.opened().items() if h not in unreachable}
        results, output = verifylib.run(reached, [str(Path(roles.HERE))], expected, junit=junit) \
            if reached else ([], "")
    data = verify_document(results, unreachable, expected)
    print_table(data, report.console)
    for host, extra in report.extra.items():
        if extra.get("lock_held_by"):  # read, not waited for: the checks saw the host mid-run
            report.console.print(f"[yellow]{changing_line(host, extra['lock_held_by'], 'invoke verify')}[/yellow]",
                                 highlight=False)
    if not results and reached:
        report.console.print(output[-3000:])
    runs.finish(report, data, json, ok=data["ok"])



@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "set": runs.HELP["set"],
                            "format": "systemd (the unit), nixos (a NixOS oci-containers module) or prometheus "
                                      "(scrape configuration, targets, rules and credentials for a Prometheus "
                                      "of your own)",
                            "target": "kubernetes: the whole fleet as production-stack values, Deployments, Envoy "
                                      "Gateway policies, a PrometheusRule, ServiceMonitors and dashboards, written "
                                      "to --out (each checked against its project's schema)",
                            "out": "the folder --target kubernetes writes to",
                            "gateway_certificate": "with --target kubernetes: also make the Gateway's certificate "
                                                   "from the fleet CA (kept in credentials_dir, its key 0600): the "
                                                   "one thing render then writes on this machine",
                            "ask_become_pass": runs.HELP["ask_become_pass"]}, iterable=["set"])
def render(c, inventory=None, hosts=None, format="systemd", set=None, ask_become_pass=False, target=None, out=None,
           gateway_certificate=False):
    """Print the unit (or NixOS module) deploy would write, or the fleet's scrape configuration;
    --target kubernetes: write the fleet for Kubernetes."""
    from roles.preflight.role import FACTS_ROLE
    from roles.service.render import FORMATS, RENDER_ROLE
    if target not in (None, "kubernetes"):
        raise Exit(f"--target {target}: expected kubernetes (or no --target: --format's unit or module)", code=2)
    if target and not out:
        raise Exit("--target kubernetes writes files: give --out FOLDER", code=2)
    if format not in FORMATS + ("prometheus",):
        raise Exit(f"--format {format}: expected one of {', '.join(FORMATS + ('prometheus',))}", code=2)
    play = runs.load_play(inventory, set, ask_become_pass)
    if target:
        _render_kubernetes(play, hosts, out, gateway_certificate)
        return
    if format == "prometheus":
        _render_prometheus(play, hosts)
        return
    report = runs.run(play, [FACTS_ROLE, RENDER_ROLE], hosts, check=True)
    failed = False
    for host in report.recap:
        rendered = report.extra.get(host, {}).get("render")
        if not rendered:
            problems = [t.message for t in report.tasks if t.host == host and t.status in ("failed", "unreachable")]
            print(f"# {host}: nothing to render: {'; '.join(problems) or 'no choice of image and model'}",
                  file=sys.stderr)
            failed = True
            continue
        for path, text in rendered[format]:
            print(f"# ---- {host}: {path}")
            print(text, end="")
    runs.finish(report, None, None, ok=not failed)


def _render_kubernetes(play, hosts, out, gateway_certificate=False):
    """Every serving host's facts (read-only, one round trip each), the same choices as deploy's,
    rendered for Kubernetes and checked, then written; nothing is written when anything fails."""
    from pathlib import Path

    from credentials import CredentialError, directory
    from credentials.keys import KeyStore
    from kubernetes_manifests.collect import KUBERNETES_ROLE
    from kubernetes_manifests.render import RenderError, Settings, render, write
    from serving.key_limits import OPERATOR, UNLIMITED, effective
    from roles.preflight.role import FACTS_ROLE
    report = runs.run(play, [FACTS_ROLE, KUBERNETES_ROLE], hosts, check=True)
    failed = [f"{t.host}: {t.message}" for t in report.tasks if t.status in ("failed", "unreachable")]
    if failed:
        raise Exit("render --target kubernetes: these hosts' facts or choices failed, nothing was written:\n  "
                   + "\n  ".join(failed), code=1)
    serving = [extra["kubernetes"] for extra in report.extra.values() if extra.get("kubernetes")]
    if not serving:
        raise Exit("render --target kubernetes: no serving host among --hosts (models: or the serving groups)", code=2)
    # one cluster, one set of names: the serving hosts' `kubernetes` must agree
    first = play.hostvars(serving[0].name)
    apart = [h.name for h in serving if h.vars.get("kubernetes") != first.get("kubernetes")]
    if apart:
        raise Exit(f"render --target kubernetes: the variable kubernetes differs between {serving[0].name} and "
                   f"{', '.join(apart)}: set it once for every host (the inventory's all: vars or group_vars/all)",
                   code=2)
    where = runs.where_set(play, serving[0].name, ("kubernetes", "values")) or ""
    try:
        store = KeyStore(directory(first)).load()
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    keys = {name: effective(first.get("key_limits"), entry.get("limits")) for name, entry in store.items()}
    keys[OPERATOR] = UNLIMITED
    settings = Settings.of(first, where)
    # the Gateway's certificate, the fleet CA's, kept with the hosts' (its key 0600, never in the render):
    # made only when asked (a render otherwise makes nothing on this machine); named when it is there
    from credentials.ca import certificate_paths, host_certificate
    holder = f"kubernetes-{settings.gateway}"
    if gateway_certificate:
        try:
            host_certificate(directory(first), holder, settings.certificate_names(), make=True)
        except CredentialError as exc:
            raise Exit(str(exc), code=2)
    cert, key = certificate_paths(directory(first), holder)
    settings.tls_files = (str(cert), str(key)) if cert.is_file() and key.is_file() else ()
    try:
        files = render(serving, keys, settings, first)
    except RenderError as exc:
        raise Exit("render --target kubernetes: nothing was written:\n  " + "\n  ".join(exc.problems), code=1)
    written = write(files, Path(out))
    print(f"render --target kubernetes: {len(written)} files in {out} for {len(serving)} serving hosts, each "
          f"checked against its project's schema and every reference resolved; {Path(out) / 'README.md'} says how "
          f"to install them; the Gateway's certificate: "
          f"{settings.tls_files[0] if settings.tls_files else 'none yet (--gateway-certificate makes it)'}")
    for path in written:
        print(f"  {path}")


def _render_prometheus(play, hosts):
    """Every exporting host's scrape targets (their replicas placed by this run's facts), then
    the files a Prometheus of one's own takes."""
    from credentials import CredentialError
    from roles.monitoring import render as prometheus_render
    from roles.preflight.role import FACTS_ROLE
    report = runs.run(play, [FACTS_ROLE, prometheus_render.RENDER_ROLE], hosts, check=True)
    groups, failed = {}, False
    for host in report.recap:
        found = report.extra.get(host, {}).get("scrape_targets")
        if found is None:
            problems = [t.message for t in report.tasks if t.host == host and t.status in ("failed", "unreachable")]
            if problems:
                print(f"# {host}: not in the targets: {'; '.join(problems)}", file=sys.stderr)
                failed = True
            continue
        groups[host] = found
    any_vars = play.hostvars(next(iter(play.inventory.host_names)))
    try:
        rendered = prometheus_render.files(groups, any_vars)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    for name, text in rendered:
        print(f"# ---- {name}")
        print(text, end="" if text.endswith("\n") else "\n")
    runs.finish(report, None, None, ok=not failed)


inventory_ns = Collection("inventory")
inventory_ns.add_task(inventory_check, name="check")

ns = Collection(facts, deploy, verify, trust, render)
ns.add_collection(inventory_ns)
