"""Broken and hostile inventories, generated: every one is refused with clean lines
(file, line, key, what to do) or accepted, never a traceback, never a hang; and
every accepted value that reaches a shell script or a file name is provably
quoted there.

The cases are mutations of the shipped inventory (hypothesis, derandomized so
that CI runs the same ones every time and a failure shrinks to a small example):
types, ranges, unknown keys, nulls, lists for maps, unicode and control
characters, huge values, shell metacharacters and newlines in every string (at
the data level); tabs, BOMs, other encodings, duplicate keys, alias bombs,
truncation, byte noise (at the text level); group loops, recursive aliases,
deep nesting (in the structure). A sample goes through the real CLI.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import roles
from converge.changes import Command, Decision, File, HostContext
from converge.errors import ConvergeError, InventoryError
from converge.facts import Facts
from converge.facts.host import parse_meminfo
from converge.facts.nvidia import parse_nvidia_smi_sections
from converge.play import Play
from tests import reliability
from tests.conftest import FIXTURES, ROOT

SHIPPED = ROOT / "inventory"
# a case that spends this much CPU is a hang (a loop, a bomb): counted in CPU time, so that a
# busy machine (the lab's tests beside this one) cannot make a slow case look like one
CASE_CPU_SECONDS = 10
# and one that answers nothing for this long (at the lowest priority, on a busy machine): stuck waiting
CASE_SECONDS = 600
SAFE_WORD = re.compile(r"^[A-Za-z0-9_./:@%+=,~-]*$")  # a shell word needing no quotes
EVIL = ["; rm -rf /", "$(reboot)", "`id`", "a\nb", "'quote", '"dq"', "a b", "x|y", "x&y", "x>y", "*", "?", "~root",
        "\\", "\x00", "\x07bell", "\u202egnp.exe", "ünïcødé", "🐍", "\t", "--option", "-", "", " ", "../..", "#c"]



def shipped_files() -> dict[str, bytes]:
    return {str(p.relative_to(SHIPPED)): p.read_bytes() for p in SHIPPED.rglob("*") if p.is_file()}


# ---- mutations ---------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EVIL),
    st.text(max_size=40), st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x1F), max_size=8),
    st.builds(lambda n: "x" * n, st.sampled_from([300, 5000, 200_000])))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=8)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _paths(value, prefix + (index,))


def _set(data, path, value):
    if not path:
        return value
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


@st.composite
def data_mutation(draw):
    """Change one value of one YAML file: replace it, add a key beside it, or drop it."""
    files = shipped_files()
    name = draw(st.sampled_from(sorted(files)))
    data = yaml.safe_load(files[name]) or {}
    path = draw(st.sampled_from(list(_paths(data))))
    how = draw(st.sampled_from(["replace", "replace", "add_key", "drop"]))
    if how == "replace":
        data = _set(data, path, draw(values))
    elif how == "add_key":
        parent = data
        for part in path:
            parent = parent[part] if isinstance(parent, (dict, list)) else parent
        if isinstance(parent, dict):
            parent[draw(st.one_of(st.sampled_from(EVIL), st.text(max_size=20)))] = draw(values)
    elif path:
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        del parent[path[-1]]
    files[name] = yaml.safe_dump(data, allow_unicode=True).encode("utf-8", "surrogatepass")
    return files


ALIAS_BOMB = (b"a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
              b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
              b"e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
              b"g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]\n"
              b"conflicts: *h\n")


@st.composite
def text_mutation(draw):
    """Damage one file's bytes the ways files get damaged."""
    files = shipped_files()
    name = draw(st.sampled_from(sorted(files)))
    text = files[name]
    how = draw(st.sampled_from(["tab", "bom", "utf16", "latin1", "dup", "bomb", "truncate", "noise", "nul",
                                "deep", "huge"]))
    lines = text.split(b"\n")
    at = draw(st.integers(min_value=0, max_value=max(len(lines) - 1, 0)))
    if how == "tab":
        lines[at] = b"\t" + lines[at]
        text = b"\n".join(lines)
    elif how == "bom":
        text = b"\xef\xbb\xbf" + text
    elif how == "utf16":
        text = text.decode().encode("utf-16")
    elif how == "latin1":
        text = text + "\n# r\xe9glage\n".encode("latin-1")
    elif how == "dup":
        key = next((line for line in lines if re.match(rb"^[a-z_]+:", line)), b"a: 1")
        text = text + b"\n" + key + b"\n"
    elif how == "bomb":
        text = ALIAS_BOMB if name.endswith(".yml") and "vars" in name else text + b"\n" + ALIAS_BOMB
    elif how == "truncate":
        text = text[:draw(st.integers(min_value=0, max_value=len(text)))]
    elif how == "noise":
        where = draw(st.integers(min_value=0, max_value=len(text)))
        text = text[:where] + draw(st.binary(min_size=1, max_size=8)) + text[where:]
    elif how == "nul":
        text = text.replace(b":", b":\x00", 1)
    elif how == "deep":
        text = text + b"\ndeep: " + b"[" * 5000 + b"]" * 5000 + b"\n"
    elif how == "huge":
        text = text + b"\nmodel: " + b"x" * (3 * 1024 * 1024) + b"\n"
    files[name] = text
    return files


LOOPS = {
    "group loop": b"all:\n  children:\n    a:\n      children:\n        b:\n    b:\n      children:\n        a:\n",
    "self child": b"all:\n  children:\n    a:\n      children:\n        a:\n      hosts:\n        h1:\n",
    "recursive alias": b"all: &top\n  children:\n    a: *top\n",
    "all as child": b"all:\n  children:\n    a:\n      children:\n        all:\n",
    "many hosts": b"all:\n  hosts:\n" + b"".join(b"    h%d:\n" % i for i in range(3000)),
    "host name": b"all:\n  hosts:\n    'rtx01\nHost evil':\n      ansible_host: 10.0.0.1\n",
    "group name": b"all:\n  children:\n    'a b;c':\n      hosts:\n        h1:\n",
}


@st.composite
def structure_mutation(draw):
    files = {k: v for k, v in shipped_files().items() if not k.startswith(("group_vars", "host_vars"))}
    files["hosts.yml"] = LOOPS[draw(st.sampled_from(sorted(LOOPS)))]
    return files


overrides_strategy = st.lists(st.one_of(st.sampled_from(["max_num_seqs=8", "gpu_memory_utilization=2",
                                                         "conflicts=[a; b]", "=x", "noequals", "a=b=c",
                                                         "model=&a [*a]", "api_port=" + "9" * 5000]),
                                        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["model", "registry",
                                                  "service_name", "unknown"]), st.sampled_from(EVIL))),
                              max_size=2)
cases = st.tuples(st.one_of(data_mutation(), data_mutation(), text_mutation(), structure_mutation()),
                  overrides_strategy)


# ---- checking one case -------------------------------------------------------------------

class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def clean_line(line: str):
    assert isinstance(line, str) and line, line
    assert "\n" not in line and "Traceback" not in line, line
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", line), f"control characters in {line!r}"
    assert ": " in line, f"no 'where: what' in {line!r}"


def facts_for_plans() -> Facts:
    """What a healthy H100 host reports (real captures), for planning without SSH."""
    h100 = FIXTURES / "nvidia-smi" / "h100"
    nvidia = parse_nvidia_smi_sections(f"@query 0\n{(h100 / 'idle-query.csv').read_text()}\n@version 0\n"
                                       f"{(h100 / 'idle-version.txt').read_text()}\n@apps 0\n")
    runtimes = {"podman": {"version": "4.3.1"}, "cdi_specs": ["/etc/cdi/nvidia.yaml"],
                "docker": {"version": "20.10.24", "runtimes": ["nvidia", "runc"], "daemon": True, "nvidia_hook": True}}
    return Facts({"arch": "x86_64", "os": {"ID": "debian"}, "nvidia": nvidia, "runtimes": runtimes,
                  "meminfo": parse_meminfo("MemTotal: 264000000 kB\nMemAvailable: 250000000 kB\n"),
                  "systemd": {"present": True, "version": 252, "state": "running"},
                  "commands": {c: f"/usr/bin/{c}" for c in ("flock", "base64", "sha256sum", "curl", "timeout")},
                  "disk_cache": {"path": "/srv", "mount": "/", "free_mib": 10 ** 7},
                  "disk_images": {"path": "/var", "mount": "/", "free_mib": 10 ** 7},
                  "replica_units": {}, "env_file": None,
                  "images": [], "image_record": None, "weights": {}, "nixos_module": None, "nixos_configuration": {}})


def scripts_of(play: Play, host: str) -> list[tuple[str, str]]:
    """(what, text) of every script and file name the roles would send to this host."""
    ctx = HostContext(host, play.hostvars(host), facts_for_plans(), check=True)
    out = []
    for role in roles.load():
        try:
            for step in role.plan(ctx):
                if isinstance(step, Decision):  # what the runner records for the roles after it
                    ctx.results.record(step.produces, step.value, step.name)
                elif isinstance(step, Command):
                    out.append((f"{role.name}: {step.name}", step.script))
                    if step.probe:
                        break  # what follows depends on what the probe reads on the host
                elif isinstance(step, File):
                    out.append((f"{role.name}: {step.name} (path)", step.path))
                    out.append((f"{role.name}: {step.name}", step.script()))
        except ConvergeError:
            break  # a refusal in words (e.g. a secret file that is not there): fine
        for handler in (role.handlers(ctx).values() if role.handlers else []):
            out.append((f"{role.name}: handler {handler.name}", handler.script))
    return out


def strings_in(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_in(k)
            yield from strings_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)


def assert_quoted(play: Play):
    """Every accepted string value reaches a script only as one shell word: either it
    needs no quoting, or each occurrence is inside its shlex.quote()."""
    for host in play.inventory.host_names[:8]:  # thousands of like hosts add time, not cases
        values = {s for s in strings_in(play.hostvars(host)) if s and not SAFE_WORD.match(s)}
        for what, text in scripts_of(play, host):
            if what.endswith("(path)"):
                assert text.startswith("/") and "\n" not in text and "/../" not in text, (host, what, text)
            for value in values:
                if value in text or shlex.quote(value) in text:
                    quoted = shlex.quote(value)
                    ok = text.count(value) == text.count(quoted) if value in quoted else value not in text
                    assert ok, f"{host}: {what}: {value!r} reaches the script unquoted"


def check_case(files: dict[str, bytes], overrides: list[str]) -> str:
    """'accepted' or 'refused'; raises on a traceback or a hang."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in files.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        old = signal.signal(signal.SIGALRM, _alarm), signal.signal(signal.SIGPROF, _alarm)
        signal.alarm(CASE_SECONDS)
        signal.setitimer(signal.ITIMER_PROF, CASE_CPU_SECONDS)
        try:
            try:
                play = Play.load(tmp, roles.schemas(), roles.defaults(), overrides)
                problems = play.problems()
            except InventoryError as exc:
                problems = exc.problems
                assert problems
            for line in problems:
                clean_line(line)
            if problems:
                return "refused"
            assert_quoted(play)
            return "accepted"
        except Hang:
            raise AssertionError(f"no answer within {CASE_CPU_SECONDS} s of CPU or {CASE_SECONDS} s: "
                                 "a hang") from None
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old[0])
            signal.signal(signal.SIGPROF, old[1])


SEEN = {"accepted": 0, "refused": 0, "cases": 0, "slowest_s": 0.0}


@settings(max_examples=1000, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(cases)
def _generated(case):
    files, overrides = case
    started = time.monotonic()
    SEEN[check_case(files, overrides)] += 1
    SEEN["cases"] += 1
    SEEN["slowest_s"] = max(SEEN["slowest_s"], time.monotonic() - started)


@pytest.mark.compute_only  # in-process: its hang limit counts CPU time, not the clock
def test_1000_broken_or_hostile_inventories_are_refused_cleanly_or_safe():
    started = time.monotonic()
    _generated()
    assert SEEN["cases"] >= 1000
    reliability.record(
        "input-fuzz", "input", "1000+ generated inventories (hypothesis, derandomized): types, ranges, unknown keys, "
        "nulls, lists for maps, unicode and control characters, huge values, shell metacharacters and newlines in "
        "strings; tabs, BOMs, UTF-16, Latin-1, duplicate keys, alias bombs, truncation, byte noise; group loops, "
        "recursive aliases, deep nesting, 3000 hosts; hostile --set values",
        "in-process: load, validate, plan every role for accepted ones", None,
        f"{SEEN['refused']} refused with clean file:line: key lines, {SEEN['accepted']} accepted with every value "
        f"that reaches a script quoted; slowest case {SEEN['slowest_s']:.2f} s, all {SEEN['cases']} in "
        f"{time.monotonic() - started:.0f} s", "zero tracebacks, zero hangs", True)


def test_the_three_reported_inputs_are_refused_cleanly():
    """The inputs of issue 13, through the CLI; the time each took goes to RELIABILITY.md."""
    bomb = shipped_files()
    bomb["host_vars/rtx01.yml"] = ALIAS_BOMB
    latin = shipped_files()
    latin["host_vars/rtx01.yml"] = "api_key_file: ~/k\n# réglage du GPU\n".encode("latin-1")
    loop = shipped_files()
    loop["hosts.yml"] = LOOPS["group loop"]
    for key, what, files, words in (("input-alias-bomb", "an alias bomb in host_vars (8 levels of 10)", bomb,
                                      "aliases"),
                                     ("input-not-utf8", "a host_vars file in Latin-1", latin, "not UTF-8"),
                                     ("input-group-loop", "a group that is its own descendant", loop,
                                      "its own descendant")):
        with tempfile.TemporaryDirectory() as tmp:
            for name, content in files.items():
                (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / name).write_bytes(content)
            started = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "invoke", "inventory.check", "--inventory", tmp], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
            took = time.monotonic() - started
            assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
            assert words in proc.stdout + proc.stderr, proc.stdout + proc.stderr
            saw = next(line.strip() for line in (proc.stdout + proc.stderr).splitlines() if words in line)
            reliability.record(key, "input", what, "invoke inventory.check, the whole command", took,
                               saw.replace(tmp + "/", ""), "refused, exit 2, nothing read further", True)


@pytest.mark.parametrize("seed", range(25))
def test_a_sample_through_the_cli(seed):
    """The same kinds of cases through `invoke inventory.check`: exit 0 or 2, no traceback."""
    import random
    rng = random.Random(seed)
    files = shipped_files()
    name = rng.choice(sorted(files))
    kind = seed % 5
    if kind == 0:
        files[name] = files[name] + b"\n" + rng.choice(EVIL).encode("utf-8", "replace") + b": 1\n"
    elif kind == 1:
        files[name] = b"\xff\xfe" + files[name]
    elif kind == 2:
        files["hosts.yml"] = LOOPS[rng.choice(sorted(LOOPS))]
    elif kind == 3:
        files[name] = ALIAS_BOMB
    else:
        data = yaml.safe_load(files[name]) or {}
        key = rng.choice(list(data) or ["x"])
        data[key] = rng.choice(EVIL + [None, [], {}, 1e308, -1, math.inf])
        files[name] = yaml.safe_dump(data, allow_unicode=True).encode()
    with tempfile.TemporaryDirectory() as tmp:
        for n, content in files.items():
            (Path(tmp) / n).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / n).write_bytes(content)
        env = dict(os.environ, COLUMNS="200")
        proc = subprocess.run([sys.executable, "-m", "invoke", "inventory.check", "--inventory", tmp], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode in (0, 2), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    if proc.returncode == 2:
        for line in proc.stdout.splitlines()[1:]:
            clean_line(line.strip())
