#!/usr/bin/env python3
"""Speed of a fleet run: our engine, ansible-core and pyinfra doing the same
no-op work on the same lab hosts, in one run, beside the floor (`ssh host true`
to every host in parallel). One command reproduces it all (as root, on the lab
machine):

    python3 bench/fleet/run.py [--sizes 3,8,16] [--rtts 0,20] [--runs 5]

Peers are installed in their own virtual environments by this script, with their
recommended speed settings (ansible: pipelining, ControlPersist, forks 32;
pyinfra: its defaults, which already run hosts in parallel). Results go to
docs/PERFORMANCE.md, docs/fleet-bench.json and docs/fleet-bench.png.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from bench.toolkit import in_toolkit_env  # noqa: E402

in_toolkit_env()

from lab import config  # noqa: E402

WORK = config.CACHE / "fleet-bench"
VENVS = {"ansible": ["ansible-core==2.19.*"], "pyinfra": ["pyinfra==3.10.*", "matplotlib"]}
KEY = config.STATE / "ssh" / "id_ed25519"
PROXY_BASE_PORT = 23000
SLOW_TOOLS = {"ansible"}
RESET = "rm -rf /etc/fleetbench /srv/fleetbench /var/cache/fleetbench /etc/systemd/system/fleetbench.service; " \
        "systemctl daemon-reload"


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, text=True, capture_output=True, **kw)


def venv(name) -> Path:
    path = WORK / f"venv-{name}"
    if not (path / ".done").exists():
        shutil.rmtree(path, ignore_errors=True)
        sh(sys.executable, "-m", "venv", path)
        sh(path / "bin/python", "-m", "pip", "install", "-q", *VENVS[name], timeout=1800)
        (path / ".done").touch()
    return path


def nodes(n):
    return [h for h in config.hosts(n) if h.name.startswith("node")][:n]


BASTION = next(h for h in config.DEFAULT_HOSTS if h.bastion)
BASTION_PROXY_PORT = PROXY_BASE_PORT + 999


def _keys(host, name: str) -> list[str]:
    lines = []
    for pub in sorted((host.root / "etc/ssh").glob("ssh_host_*_key.pub")):
        keytype, key = pub.read_text().split()[:2]
        lines.append(f"{name} {keytype} {key}\n")
    return lines


def bastion_endpoint(rtt) -> tuple[str, int]:
    """bastion01, through the delay proxy when rtt > 0 (the WAN is in front of it)."""
    return (config.GATEWAY, BASTION_PROXY_PORT) if rtt else (BASTION.address, 22)


def write_inventories(hosts, rtt, folder: Path, bastion: bool = False) -> dict:
    """The same hosts for all three tools; through the delay proxy when rtt > 0.
    ``bastion``: every host behind bastion01 (ProxyJump), the delay in front of it."""
    folder.mkdir(parents=True, exist_ok=True)
    known = folder / "known_hosts"
    lines, entries = [], {}
    for i, h in enumerate(hosts):
        addr, port = (config.GATEWAY, PROXY_BASE_PORT + i) if rtt and not bastion else (h.address, 22)
        lines += _keys(h, addr if port == 22 else f"[{addr}]:{port}")
        entries[h.name] = (addr, port)
    common = f"-o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes"
    if bastion:
        addr, port = bastion_endpoint(rtt)
        lines += _keys(BASTION, addr if port == 22 else f"[{addr}]:{port}")
        common += f" -o ProxyJump={BASTION.login}@{addr}:{port}"
    known.write_text("".join(lines))
    hosts_yml = {"all": {"vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(KEY), "bench_port": 8000,
                                  "known_hosts_file": str(known), "ansible_ssh_common_args": common},
                         "hosts": {n: {"ansible_host": a, "ansible_port": p} for n, (a, p) in entries.items()}}}
    import yaml
    (folder / "hosts.yml").write_text(yaml.safe_dump(hosts_yml))
    if bastion:  # OpenSSH's view of the same, for the floor: `ssh -J bastion host true`
        addr, port = bastion_endpoint(rtt)
        blocks = [f"Host bastion\n  HostName {addr}\n  Port {port}\n  User {BASTION.login}\n"]
        blocks += [f"Host {n}\n  HostName {a}\n  User root\n  ProxyJump bastion\n" for n, (a, _) in entries.items()]
        options = (f"  IdentityFile {KEY}\n  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n"
                   "  StrictHostKeyChecking yes\n  BatchMode yes\n  ControlMaster no\n")
        (folder / "ssh_config").write_text("".join(b + options + "\n" for b in blocks))
        return entries
    py = ["hosts = ["]
    for n, (a, p) in entries.items():
        py.append(f"    ({n!r}, {{'ssh_hostname': {a!r}, 'ssh_port': {p}, 'ssh_user': 'root', "
                  f"'ssh_key': {str(KEY)!r}, 'ssh_known_hosts_file': {str(known)!r}, "
                  f"'ssh_strict_host_key_checking': 'yes', 'bench_port': 8000}}),")
    py.append("]")
    (folder / "inventory.py").write_text("\n".join(py) + "\n")
    return entries


def start_proxy(hosts, rtt, stats: Path):
    specs = [f"{PROXY_BASE_PORT + i}:{h.address}:22" for i, h in enumerate(hosts)]
    specs.append(f"{BASTION_PROXY_PORT}:{BASTION.address}:22")
    proc = subprocess.Popen([sys.executable, str(HERE / "proxy.py"), str(stats), str(rtt), config.GATEWAY, *specs],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop_proxy(proc, stats: Path) -> dict:
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    return json.loads(stats.read_text()) if stats.exists() else {}


@contextlib.contextmanager
def proxied(hosts, rtt, stats: Path):
    """The delay proxy for the length of a block; yields a dict that holds its counts after."""
    proc = start_proxy(hosts, rtt, stats)
    counts: dict = {}
    try:
        yield counts
    finally:
        counts.update(stop_proxy(proc, stats))


def lab_up(extra_hosts: int = 0):
    subprocess.run([sys.executable, "-m", "invoke", "lab.up", "--hosts", str(extra_hosts)], cwd=ROOT, check=True)


def timed(cmd, cwd=None, env=None) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (kB) of the largest process of the run, output."""
    wrapper = ("import resource, subprocess, sys, time\n"
               "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "w = time.perf_counter() - t\n"
               "print(w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)\n"
               "sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, *map(str, cmd)], cwd=cwd, env=env, capture_output=True,
                          text=True)
    wall, rss, rc = proc.stdout.split()
    if rc != "0":
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({rc}):\n{proc.stderr}")
    return float(wall), int(rss), proc.stderr


def commands(tool, folder: Path):
    if tool == "floor":
        return None
    if tool == "paramiko-handshake":  # our engine connecting and closing, nothing else
        return [sys.executable, HERE / "ours.py", folder / "hosts.yml", "--connect-only"]
    if tool in ("ours", "ours-podman"):
        return [sys.executable, HERE / "ours.py", folder / "hosts.yml", "--forks", "32"] + \
            (["--ask-podman"] if tool == "ours-podman" else [])
    if tool.startswith("ours@"):  # the engine of another revision, on the same work (--against)
        return [sys.executable, tree_of(tool[5:]) / "bench/fleet/ours.py", folder / "hosts.yml", "--forks", "32"]
    if tool == "ansible":
        return [WORK / "venv-ansible/bin/ansible-playbook", "-i", folder / "hosts.yml", HERE / "playbook.yml"]
    return [WORK / "venv-pyinfra/bin/pyinfra", "-y", "--parallel", "32", folder / "inventory.py",
            HERE / "pyinfra_deploy.py"]


def tree_of(rev: str) -> Path:
    """The files of ``rev`` (git archive), once, for ``ours@REV``."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    tree = WORK / f"tree-{commit}"
    if not (tree / "bench/fleet/ours.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def floor_through_bastion(entries, folder: Path) -> float:
    """`ssh -J bastion host true` to every host in parallel: each its own bastion connection."""
    started = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-F", str(folder / "ssh_config"), name, "true"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for name in entries]
    rcs = [p.wait() for p in procs]
    if any(rcs):
        raise RuntimeError(f"ssh -J bastion host true failed on some hosts: {rcs}")
    return time.perf_counter() - started


def floor(entries, known: Path) -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                               f"UserKnownHostsFile={known}", "-o", "ControlMaster=no", "-i", str(KEY), "-p",
                               str(p), f"root@{a}", "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for a, p in entries.values()]
    rcs = [p.wait() for p in procs]
    if any(rcs):
        raise RuntimeError(f"ssh true failed on some hosts: {rcs}")
    return time.perf_counter() - started


def reset(hosts):
    procs = [subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                               f"UserKnownHostsFile={config.STATE}/ssh/known_hosts", "-i", str(KEY),
                               f"root@{h.address}", RESET]) for h in hosts]
    [p.wait() for p in procs]


def summary(values):
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "runs": [round(v, 3) for v in values]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="3,8,16,64")
    parser.add_argument("--rtts", default="0,20")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tools", default="ours,ours-podman,pyinfra,ansible")
    parser.add_argument("--against", metavar="REV",
                        help="also measure our engine as it was at REV (ours@REV), interleaved with today's")
    parser.add_argument("--merge", action="store_true",
                        help="keep the scenarios of docs/fleet-bench.json that this run does not measure")
    parser.add_argument("--only-round-trips", action="store_true",
                        help="count round trips again and rewrite the report, keeping the timings")
    parser.add_argument("--slow-max-hosts", type=int, default=16,
                        help="run ansible only up to this many hosts (at 64 hosts one no-op run takes over a minute)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rtts = [float(r) for r in args.rtts.split(",")]
    tools = args.tools.split(",") + ([f"ours@{args.against}"] if args.against else [])
    WORK.mkdir(parents=True, exist_ok=True)
    out = ROOT / "docs" / "fleet-bench.json"
    if args.only_round_trips:
        lab_up(min(sizes))
        results = json.loads(out.read_text())
        results["round_trips"] = count_round_trips(nodes(min(sizes)), tools)
        lab_up()
        return write_report(results, out)
    for name in ("ansible", "pyinfra"):
        print(f"venv {name}: {venv(name)}", flush=True)
    lab_up(max(sizes))
    results = {"machine": os.uname().nodename, "cores": os.cpu_count(), "runs": args.runs, "scenarios": []}
    for size in sizes:
        for rtt in rtts:
            results["scenarios"].append(measure(nodes(size), rtt, tools, args.runs, args.slow_max_hosts))
            (WORK / "partial.json").write_text(json.dumps(results, indent=2))  # a late failure loses nothing
    results["round_trips"] = count_round_trips(nodes(min(sizes)), tools)
    lab_up()  # back to the default lab: the scale hosts' disks (~390 MB each) are given back
    if args.merge and out.exists():
        measured = {(x["hosts"], x["rtt_ms"]) for x in results["scenarios"]}
        kept = [x for x in json.loads(out.read_text())["scenarios"] if (x["hosts"], x["rtt_ms"]) not in measured]
        results["scenarios"] = sorted(kept + results["scenarios"], key=lambda x: (x["hosts"], x["rtt_ms"]))
    write_report(results, out)


def measure(hosts, rtt, tools, runs, slow_max_hosts) -> dict:
    """One cell: each tool's first converge, then ``runs`` rounds of the floor and each
    tool's no-op, interleaved (floor, tool, tool..., floor, ...): the machine drifts (hosts
    just booted settle, neighbours come and go) and interleaving lays the drift on every
    side alike, where measuring one side after the other laid it on one. The tools do the
    same work, so after the last first converge every tool's run is a no-op."""
    size = len(hosts)
    folder = WORK / f"n{size}-rtt{int(rtt)}"
    entries = write_inventories(hosts, rtt, folder)
    scenario = {"hosts": size, "rtt_ms": rtt, "tools": {}, "interleaved": True}
    with proxied(hosts, rtt, folder / "proxy.json") if rtt else contextlib.nullcontext():
        floor(entries, folder / "known_hosts")  # a warm-up, not counted
        active = []
        for tool in tools:
            if tool in SLOW_TOOLS and size > slow_max_hosts:
                scenario["tools"][tool] = {"skipped": f"not run above {slow_max_hosts} hosts"}
                continue
            reset(hosts)
            first, rss_first, _ = timed(commands(tool, folder), cwd=HERE)
            scenario["tools"][tool] = {"first": round(first, 3), "rss": [rss_first], "noop": []}
            active.append(tool)
        floors = []
        for _ in range(runs):
            floors.append(floor(entries, folder / "known_hosts"))
            for tool in active:
                wall, peak, _ = timed(commands(tool, folder), cwd=HERE)
                scenario["tools"][tool]["noop"].append(wall)
                scenario["tools"][tool]["rss"].append(peak)
        scenario["floor"] = summary(floors)
        for tool in active:
            entry = scenario["tools"][tool]
            noop, rss = entry.pop("noop"), entry.pop("rss")
            entry.update(noop=summary(noop), peak_rss_mb=round(max(rss) / 1024, 1))
            print(f"n={size} rtt={rtt:g} {tool}: first {entry['first']:.2f} s, no-op median "
                  f"{statistics.median(noop):.2f} s (floor {scenario['floor']['median']:.2f} s)", flush=True)
    if "ours" in tools:
        scenario["bastion"] = measure_bastion(hosts, rtt, runs, folder.with_name(folder.name + "-bastion"))
    return scenario


def measure_bastion(hosts, rtt, runs, folder: Path) -> dict:
    """The same hosts behind bastion01 (the delay in front of it): ours, beside its own
    floor, `ssh -J bastion host true` to every host in parallel."""
    entries = write_inventories(hosts, rtt, folder, bastion=True)
    with proxied(hosts, rtt, folder / "proxy.json") if rtt else contextlib.nullcontext():
        floor_through_bastion(entries, folder)  # a warm-up, not counted
        reset(hosts)
        cmd = commands("ours", folder)
        first, rss_first, _ = timed(cmd, cwd=HERE)
        floors, noop, rss = [], [], []
        for _ in range(runs):  # interleaved, as in measure()
            floors.append(floor_through_bastion(entries, folder))
            wall, peak, _ = timed(cmd, cwd=HERE)
            noop.append(wall)
            rss.append(peak)
        floor_s = summary(floors)
    print(f"n={len(hosts)} rtt={rtt:g} ours behind the bastion: no-op median {statistics.median(noop):.2f} s "
          f"(floor through the bastion {floor_s['median']:.2f} s)", flush=True)
    return {"floor": floor_s, "ours": {"first": round(first, 3), "noop": summary(noop),
                                       "peak_rss_mb": round(max(rss + [rss_first]) / 1024, 1)}}


def write_report(results: dict, out: Path):
    out.write_text(json.dumps(results, indent=2))
    subprocess.run([WORK / "venv-pyinfra/bin/python", HERE / "report.py", out, ROOT / "docs"], check=True)


PARAMIKO_TOOLS = {"ours", "ours-podman", "pyinfra"}  # the others speak through OpenSSH's client
SLOW_LINK_MS = 200


def waited_round_trips(hosts, tools, runs=3) -> dict:
    """Round trips a run waits for after the handshake, from time: (run - connect
    only) through a 200 ms link, less the same at 0 ms (which holds the host's own
    work), over 200 ms. Unlike turns this leaves out messages nobody waits for."""
    folder = WORK / "waited"
    seconds = {}
    write_inventories(hosts, 1, folder)
    for rtt in (0, SLOW_LINK_MS):
        with proxied(hosts, rtt, folder / "proxy.json"):
            for tool in ["paramiko-handshake", *tools]:
                timed(commands(tool, folder), cwd=HERE)  # warm the page cache
                seconds[tool, rtt] = statistics.median(timed(commands(tool, folder), cwd=HERE)[0]
                                                       for _ in range(runs))
    extra = {rtt: {t: seconds[t, rtt] - seconds["paramiko-handshake", rtt] for t in tools}
             for rtt in (0, SLOW_LINK_MS)}
    return {t: round((extra[SLOW_LINK_MS][t] - extra[0][t]) / (SLOW_LINK_MS / 1000), 1) for t in tools}


def count_round_trips(hosts, tools) -> dict:
    """Turns per host for one no-op run of each tool through a zero-delay proxy, minus
    those of its SSH client's handshake: OpenSSH's is `ssh host true` less its one
    command; paramiko's (ours, pyinfra) is our engine connecting and closing."""
    folder = WORK / "round-trips"
    entries = write_inventories(hosts, 1, folder)  # through the proxy
    counts = {}
    for tool in ["floor", "paramiko-handshake", *tools]:
        stats = folder / f"{tool}.json"
        if tool in tools:  # converge first, uncounted: the count is of a no-op run
            with proxied(hosts, 0, stats):
                timed(commands(tool, folder), cwd=HERE)
        with proxied(hosts, 0, stats) as data:
            if tool == "floor":
                floor(entries, folder / "known_hosts")
            else:
                timed(commands(tool, folder), cwd=HERE)
        per_host = [v["turns"] / 2 for v in data.values()]
        conns = [v["connections"] for v in data.values()]
        counts[tool] = {"round_trips_per_host": round(statistics.mean(per_host), 1),
                        "connections_per_host": round(statistics.mean(conns), 1)}
    waited = waited_round_trips(nodes(1), [t for t in tools if t in PARAMIKO_TOOLS])
    for tool, value in waited.items():
        counts[tool]["waited_round_trips_after_handshake"] = value
    handshake = {"openssh": counts["floor"]["round_trips_per_host"] - 1,
                 "paramiko": counts["paramiko-handshake"]["round_trips_per_host"]}
    for tool in tools:
        client = "paramiko" if tool in PARAMIKO_TOOLS else "openssh"
        counts[tool]["client"] = client
        counts[tool]["command_round_trips_after_handshake"] = round(
            counts[tool]["round_trips_per_host"] - handshake[client], 1)
    return counts


if __name__ == "__main__":
    main()
