"""The fleet benchmark's work written on our engine (converge): GPU facts, two
directories, an environment file, a templated unit, an image check and the
unit's enabled state. Run: python3 ours.py INVENTORY_DIR [--forks N] [--ask-podman] [--connect-only]."""
from __future__ import annotations

import sys
from pathlib import Path

import jinja2

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from converge import play as playlib  # noqa: E402
from converge.changes import Command, File, Role  # noqa: E402
from converge.errors import StepFailed  # noqa: E402
from converge.facts import Fact  # noqa: E402
from converge.facts.host import FileState, UnitState  # noqa: E402
from converge.facts import FactError  # noqa: E402
from converge.facts.containers import ImagePresent  # noqa: E402
from converge.facts.nvidia import QUERY, parse_gpu_query  # noqa: E402
from converge.inventory import load_inventory  # noqa: E402
from converge.report import Report  # noqa: E402

DIRS = ["/etc/fleetbench", "/srv/fleetbench/cache"]
ENV = "/etc/fleetbench/bench.env"
UNIT = "/etc/systemd/system/fleetbench.service"
IMAGE = "10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130"


class GpuQuery(Fact):
    """The peers' GPU facts: one nvidia-smi query (the toolkit's own fact also asks
    --version for the CUDA version and the compute apps, which this work does not need)."""

    command = f"timeout 15 nvidia-smi {QUERY}"

    def process(self, output, rc):
        if rc != 0:
            raise FactError(f"nvidia-smi failed (exit {rc}): {output.strip()[:200]}")
        return parse_gpu_query(output)


class MissingDirs(Fact):
    command = "for d in " + " ".join(DIRS) + "; do [ -d $d ] || echo $d; done"

    def process(self, output, rc):
        return output.split()


READ_INDEX = "--ask-podman" not in sys.argv  # --ask-podman: the image check starts podman, as the peers' does


def facts(v):
    return {"nvidia": GpuQuery(), "dirs": MissingDirs(), "env": FileState(ENV, secret=True),
            "unit_file": FileState(UNIT), "unit": UnitState("fleetbench.service"), "image": ImagePresent("podman", IMAGE, read_index=READ_INDEX)}


def plan(ctx):
    missing = ctx.facts["dirs"]
    yield Command("directories", script="mkdir -p " + " ".join(missing) + "\n", when=bool(missing))
    yield File("environment file", path=ENV, content="VLLM_API_KEY=benchkey\n", mode="0600", secret=True,
               current=ctx.facts["env"])
    text = jinja2.Template((HERE / "templates" / "unit.j2").read_text(), keep_trailing_newline=True).render(
        inventory_hostname=ctx.name, bench_port=ctx.vars.get("bench_port", 8000))
    yield File("unit file", path=UNIT, content=text, current=ctx.facts["unit_file"], notify=("daemon-reload",))
    try:
        ctx.facts["nvidia"]  # GPU facts read: a host whose nvidia-smi fails stops here
    except Exception as exc:
        raise StepFailed(str(exc)) from exc
    enabled = (ctx.facts["unit"] or {}).get("UnitFileState") == "enabled"
    yield Command("not enabled", script="systemctl disable fleetbench.service\n", when=enabled)


def handlers(ctx):
    return {"daemon-reload": Command("daemon-reload", script="systemctl daemon-reload\n")}


ROLE = Role("fleetbench", facts, plan, handlers)


def main(argv):
    inventory = argv[0]
    forks = int(argv[argv.index("--forks") + 1]) if "--forks" in argv else 32
    play = playlib.Play(load_inventory(inventory), {}, [], {})
    if "--connect-only" in argv:  # the handshake alone, for counting round trips
        with play.connections() as connections:
            for target in play.targets(None, connections):
                target.connect()
        return 0
    report = Report(quiet=True)
    playlib.run(play, [ROLE], None, forks=forks, report=report, lock_name="fleetbench")
    changed = sum(r.changed for r in report.recap.values())
    failed = [h for h, r in report.recap.items() if r.failed or r.unreachable]
    print(f"changed={changed} failed={len(failed)}")
    for t in report.tasks:
        if t.status in ("failed", "unreachable"):
            print(f"{t.host}: {t.message}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
