"""invoke lab.up | lab.status | lab.down | lab.gpu | lab.uplink | lab.hub | lab.image | lab.haproxy"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from invoke import Collection, Exit, task

from . import config, haproxy_package, hubdata, images, inventory, lock, machines, network, rootfs, services, sh


def _say(text):
    print(text, flush=True)


def _state_hosts() -> list[config.LabHost]:
    try:
        extra = json.loads((config.STATE / "lab.json").read_text()).get("extra", 0)
    except (OSError, ValueError):
        extra = 0
    return config.hosts(extra)


@task(help={"hosts": "extra plain x86_64 hosts for scale tests (default 0)",
            "fresh": "rebuild every host's rootfs from the base (forgets what was deployed)",
            "fresh_hosts": "rebuild these hosts' rootfs alone (comma-separated names)",
            "cold_start": f"seconds the vLLM stand-in takes to start (default {config.COLD_START_S:g})"})
def up(c, hosts=0, fresh=False, fresh_hosts="", cold_start=config.COLD_START_S):
    """Bring up the lab: spark01 (aarch64, GB10), rtx01 (RTX 5090), h100-01 (H100)."""
    started = time.monotonic()
    renew = {n for n in fresh_hosts.split(",") if n}
    unknown = renew - {h.name for h in config.hosts(int(hosts))}
    if unknown:
        raise Exit(f"--fresh-hosts: {', '.join(sorted(unknown))}: not a host of this lab "
                   f"({', '.join(h.name for h in config.hosts(int(hosts)))})", code=2)
    try:
        with lock.held("lab.up"):
            path = _up(int(hosts), fresh, renew, cold_start)
    except sh.LabError as exc:
        raise Exit(f"lab.up failed: {exc}\nRun `invoke lab.up` again once fixed: it picks up where it stopped.",
                   code=1)
    _say(f"lab up in {time.monotonic() - started:.0f} s; inventory: {path}\n"
         f"  export DGEMMA_INVENTORY={path}")


def _up(hosts: int, fresh: bool, renew: set, cold_start):
    """lab.up's work, under the lab's lock; the inventory it wrote."""
    config.STATE.mkdir(parents=True, exist_ok=True)
    rootfs.ensure_machine_packages(_say)
    rootfs.ensure_binfmt()
    lab_hosts = config.hosts(hosts)
    for host in config.hosts(64)[len(lab_hosts):]:  # scale hosts of an earlier, larger lab
        if machines.running_pid(host) or Path(f"/run/netns/{host.netns}").exists():
            machines.crash(host)  # its disk goes next: no orderly shutdown (see below)
            network.remove_host(host)
        if host.dir.exists():  # plain copies of the base, made again in a second: give the disk back
            machines.release_disk(host)
            shutil.rmtree(host.dir, ignore_errors=True)
    (config.STATE / "lab.json").write_text(json.dumps({"extra": int(hosts)}))
    # x86_64 first: arm64 takes its runc
    rootfs.ensure_bases(sorted({h.arch for h in lab_hosts}, reverse=True), _say)
    network.ensure_bridge()
    machines.raise_inotify_limits(len(lab_hosts))
    services.ensure_registry()
    services.ensure_hub()
    services.ensure_uplink()
    images.ensure_images(float(cold_start), _say)
    for host in lab_hosts:
        renewed = fresh or host.name in renew
        if renewed and machines.running_pid(host):
            # its disk is thrown away: killed, not shut down (an orderly poweroff, Docker's
            # and podman's containers stopped one by one, took 30 s a host, for nothing)
            machines.crash(host)
        # a host whose disk is of an older base is stopped and given a new disk; a running
        # one of the current base gets its identity and settings written again (idempotent)
        rootfs.prepare_host(host, fresh=renewed, log=_say)
        network.ensure_host(host)
        machines.boot(host)
    inventory.write_known_hosts(lab_hosts)
    path = inventory.write(lab_hosts)
    for host in lab_hosts:
        took = machines.wait_ssh(host)
        _say(f"{host.name:<9} {host.arch:<8} {host.address:<12} sshd up ({took:.1f} s)")
        for done in machines.restart_units_failed_at_boot(host):
            _say(f"{host.name:<9} {done} (it failed at boot: status 219/CGROUP or short of a resource)")
    return path


@task(help={"json_out": "write the status as JSON to FILE ('-' for standard output)"})
def status(c, json_out=None):
    """Each lab host's arch, address and state."""
    from rich.console import Console
    from rich.table import Table
    table = Table("host", "arch", "profile", "address", "login", "state", "systemd")
    rows = []
    for host in _state_hosts():
        pid = machines.running_pid(host)
        state, systemd = ("running", "") if pid else ("stopped", "")
        if pid:
            try:  # on the host's console: some hosts take no root login, some are not reachable from here
                proc = machines.console(host, "systemctl is-system-running", timeout=30, check=False)
                systemd = proc.stdout.strip() or "no answer"
            except (sh.LabError, OSError, subprocess.TimeoutExpired) as exc:
                systemd = f"no answer ({exc})"
        addresses = ", ".join(host.address_on(n) for n in host.networks)
        rows.append({"host": host.name, "arch": host.arch, "profile": host.profile, "address": host.address,
                     "addresses": addresses, "login": host.login, "state": state, "systemd": systemd})
        role = "(gateway)" if host.gateway else "(monitoring)" if host.monitoring else "(bastion)"
        table.add_row(host.name, host.arch, host.profile or role, addresses, host.login, state, systemd)
    for name in ("registry", "hub"):
        table.add_row(name, "", "", f"{config.GATEWAY}:{config.REGISTRY_PORT if name == 'registry' else config.HUB_PORT}",
                      "", "running" if services.running(name) else "stopped", "through the uplink")
    knobs = json.loads(services.UPLINK_KNOBS.read_text()) if services.UPLINK_KNOBS.exists() else {}
    table.add_row("uplink", "", "", f"{knobs.get('rate_mb_s') or 'unlimited'} MB/s"
                  f"{', stalled' if knobs.get('stalled') else ''}", "",
                  "running" if services.running("uplink") else "stopped", "")
    Console().print(table)
    if json_out:
        text = json.dumps({"hosts": rows}, indent=2)
        print(text) if json_out == "-" else open(json_out, "w").write(text)


@task(help={"purge": "also delete the hosts' disks (the base rootfs cache stays)"})
def down(c, purge=False):
    """Stop every lab host, the registry and the hub; remove namespaces and links."""
    try:
        with lock.held("lab.down"):
            _down(purge)
    except sh.LabError as exc:
        raise Exit(f"lab.down failed: {exc}", code=1)


def _down(purge: bool):
    """lab.down's work, under the lab's lock."""
    # every host a lab of any size may have started
    started = [h for h in config.hosts(64) if h.dir.exists() or Path(f"/run/netns/{h.netns}").exists()]
    for host in started:
        machines.request_poweroff(host)
    for host in started:
        machines.stop(host)
        network.remove_host(host)
        if purge:
            shutil.rmtree(host.dir, ignore_errors=True)
    for name in ("uplink", "hub", "registry"):
        services.stop(name)
    for _ in range(40):  # processes of a host whose namespace is already gone (a crash)
        stray = machines.nspawn_leftovers()
        if not stray:
            break
        for pid in stray:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        time.sleep(0.25)
    network.remove_bridge()
    left = leftovers()
    if left:
        raise Exit("lab.down left these behind: " + "; ".join(left), code=1)
    _say("lab down: no host, namespace, link, mount or service left")


def leftovers() -> list[str]:
    found = network.leftovers()
    for host in config.hosts(64):
        if machines.running_pid(host):
            found.append(f"host {host.name} (nspawn pid {machines.running_pid(host)})")
        if host.root.exists() and machines.processes_in(host):
            found.append(f"host {host.name}: {len(machines.processes_in(host))} processes still running")
    found += [f"mount {m}" for m in machines.mounts_under(str(config.STATE))]
    stray = machines.nspawn_leftovers()
    if stray:
        found.append(f"{len(stray)} processes of lab hosts (pids {stray[:5]})")
    found += [f"{n} (pid {services.running(n)})" for n in ("registry", "hub", "uplink") if services.running(n)]
    return found


@task(help={"host": "lab host", "held_mib": "GPU memory held by another process (MiB)",
            "gpu": "the GPU (index) that process holds it on (default 0)",
            "hang": "make nvidia-smi hang (a wedged GPU)", "clear": "back to idle GPUs"})
def gpu(c, host, held_mib=None, gpu=None, hang=False, clear=False):
    """Turn the GPU stand-in's knobs on one lab host."""
    match = [h for h in _state_hosts() if h.name == host and h.has_gpu]
    if not match:
        raise Exit(f"no lab GPU host {host!r}; lab GPU hosts: "
                   f"{', '.join(h.name for h in _state_hosts() if h.has_gpu)}", code=2)
    count = len(json.loads((match[0].root / "etc/nvidia-stub/profile.json").read_text()).get("gpus") or [0])
    index = None if gpu is None else _number(gpu, "gpu", 0, count - 1, integer=True)
    set_gpu(match[0], held_mib=None if held_mib is None else _number(held_mib, "held-mib", 0, 1 << 22, integer=True),
            held_gpu=index, hang=hang, clear=clear)
    _say(f"{host}: {(match[0].root / 'etc/nvidia-stub/state.json').read_text().strip()}")


def set_gpu(host: config.LabHost, held_mib: int | None = None, hang: bool = False, clear: bool = False,
            held_gpu: int | None = None):
    path = host.root / "etc/nvidia-stub/state.json"
    state = {} if clear else json.loads(path.read_text() or "{}")
    if held_mib is not None:
        state["held_mib"] = held_mib
    if held_gpu is not None:
        state["held_gpu"] = held_gpu
    if hang:
        state["hang"] = True
    elif clear:
        state.pop("hang", None)
    path.write_text(json.dumps(state) + "\n")
    profile = json.loads((host.root / "etc/nvidia-stub/profile.json").read_text())
    if profile.get("unified_memory"):
        rootfs.write_meminfo(host.root, profile, state.get("held_mib", 0))


def _number(text, name, low, high, integer=False):
    try:
        value = int(text) if integer else float(text)
    except (TypeError, ValueError):
        raise Exit(f"--{name}: {text!r} is not a{'n integer' if integer else ' number'}", code=2) from None
    if not low <= value <= high or value != value:
        raise Exit(f"--{name}: {text} is outside {low}..{high}", code=2)
    return value


@task(help={"rate_mb_s": "throttle the hub and the registry, as seen from the lab, to this many MB/s "
                         "(0: no limit)",
            "stall": "accept connections and move no bytes (a hung upstream)",
            "resume": "move bytes again after --stall"})
def uplink(c, rate_mb_s=None, stall=False, resume=False):
    """The lab's uplink: its speed, a stall, and the bytes that crossed it."""
    knobs = {}
    if rate_mb_s is not None:
        knobs["rate_mb_s"] = _number(rate_mb_s, "rate-mb-s", 0, 100000)
    if stall and resume:
        raise Exit("--stall and --resume: choose one", code=2)
    if stall or resume:
        knobs["stalled"] = bool(stall)
    if knobs:
        services.set_uplink(**knobs)
    now = services.uplink_knobs()
    rate = now.get("rate_mb_s") or 0
    _say(f"uplink: {f'{rate:g} MB/s' if rate else 'no limit'}{', stalled' if now.get('stalled') else ''}")
    for name, count in sorted(services.uplink_bytes().items()):
        _say(f"  {name}: {count.get('down', 0)} bytes down, {count.get('up', 0)} up")


@task(help={"size_mib": "size of the synthetic checkpoint the hub serves, in MiB (default "
                        f"{hubdata.DEFAULT_MIB})",
            "corrupt": "FILE: the next GET of FILE sends one wrong byte (repeatable)",
            "reset": "back to the default checkpoint, nothing corrupt"},
      iterable=["corrupt"])
def hub(c, size_mib=None, corrupt=None, reset=False):
    """The lab's model hub: the checkpoint's size and corrupt answers."""
    knobs = {} if reset else services.hub_knobs()
    if size_mib is not None:
        knobs["size_mib"] = _number(size_mib, "size-mib", 1, 65536, integer=True)
    for name in corrupt or []:
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*", name or ""):
            raise Exit(f"--corrupt: {name!r} is not a file name of the checkpoint", code=2)
        knobs.setdefault("corrupt", {})[name] = knobs.get("corrupt", {}).get(name, 0) + 1
    if knobs != services.hub_knobs():
        services.set_hub(**knobs)
    _say(f"hub: checkpoint of {knobs.get('size_mib') or hubdata.DEFAULT_MIB} MiB"
         + (f"; corrupt next: {', '.join(f'{k} x{v}' for k, v in knobs['corrupt'].items())}"
            if knobs.get("corrupt") else ""))


@task(help={"fault": "a bad release to push: 'exits' (loads, then exits) or '500' (answers 500 to every "
                     "generation)",
            "release": "a good release N to push (1-999): the same stand-in under <tag>-rN, with a layer of its own"})
def image(c, fault=None, release=None):
    """Push another release of the vLLM stand-in beside the good tags, for rollout and prune tests:
    prints, per arch, the reference to deploy (--set image=REF)."""
    if (fault is None) == (release is None):
        raise Exit("lab.image: give --fault exits|500 (a bad release) or --release N (a good one)", code=2)
    if fault is not None and fault not in images.FAULTS:
        raise Exit(f"--fault: {fault!r} is not one of {', '.join(images.FAULTS)}", code=2)
    if release is not None and (not str(release).isdigit() or not 1 <= int(release) <= 999):
        raise Exit(f"--release {release}: expected a number from 1 to 999", code=2)
    try:
        refs = (images.ensure_fault_image(fault, _say) if fault is not None else
                images.ensure_release_image(int(release), _say))
    except (RuntimeError, sh.LabError) as exc:
        raise Exit(str(exc), code=1) from None
    for arch, ref in refs.items():
        _say(f"{arch}: {ref}")


@task
def haproxy(c):
    """Unpack Debian 13's HAProxy 3.0 LTS package (the front door image's) for this machine and
    print the program's path: what the tests and the gateway benchmarks run."""
    try:
        path = haproxy_package.program(_say)
    except sh.LabError as exc:
        raise Exit(f"lab.haproxy: {exc}", code=1) from None
    _say(f"{haproxy_package.installed()}: {path}")


@task(help={"timeout": "seconds to wait for the answer (default 60)"})
def serves(c, timeout=60):
    """Whether the lab serves as a user reaches it: a chat completion through the fleet's shared
    address (the gateways' VRRP address), with the lab's key, its certificate checked against
    the lab's fleet CA. Exit 0 with who answered, or 1 with what went wrong."""
    import ssl
    import urllib.error
    import urllib.request
    url = f"https://{config.GATEWAY_ADDRESS}:8000/v1/chat/completions"
    try:
        key = config.API_KEY_FILE.read_text().strip()
        context = ssl.create_default_context(cafile=str(config.CA_FILE))
    except (OSError, ssl.SSLError) as exc:
        raise Exit(f"lab.serves: the lab's key or CA cannot be read ({exc}): run invoke lab.up, then invoke deploy",
                   code=1) from None
    body = json.dumps({"model": "diffusiongemma", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    request = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {key}",
                                                              "Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=float(timeout), context=context) as answer:
            reply = json.loads(answer.read())
            gateway = answer.headers.get("X-Dgemma-Gateway", "?")
            replica = answer.headers.get("X-Dgemma-Replica", "?")
    except urllib.error.HTTPError as exc:
        raise Exit(f"lab.serves: {url} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}\n"
                   f"  see: invoke status", code=1) from None
    except (OSError, ValueError) as exc:
        raise Exit(f"lab.serves: no answer from {url} ({exc}): no gateway holds the address, or none serves; "
                   f"see: invoke status", code=1) from None
    text = ((reply.get("choices") or [{}])[0].get("message") or {}).get("content")
    if not text:
        raise Exit(f"lab.serves: {url} answered with no text: {json.dumps(reply)[:300]}", code=1)
    _say(f"the lab serves: a chat through {url} answered in {time.monotonic() - started:.1f} s "
         f"(gateway {gateway}, replica {replica}): {text[:60]!r}")


ns = Collection(up, status, down, gpu, uplink, hub, image, haproxy, serves)
