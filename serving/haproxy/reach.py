"""Whether a gateway reaches every serving host's front door, asked on the gateway before
anything changes on it: a gateway that cannot (a serving host behind a bastion, on a network the
gateway is not on) would leave that host DOWN in its pool, its alert firing, after a deploy that
said nothing."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Command
from converge.errors import StepFailed
from serving.host_programs import Program

REACH_PROGRAM = Program((Path(__file__).parent / "files" / "front_doors_reached.sh",))


def doors_parameter(doors) -> str:
    """The program's DOORS: a line "NAME ADDRESS PORT" per front door (schema-checked names and
    addresses; quoted as a whole by the program's parameters)."""
    return "".join(f"{door.host} {door.address} {door.port}\n" for door in doors)


def unreachable(output: str) -> dict[str, str]:
    """Each front door the program did not reach -> why (its output's "door NAME unreachable WHY")."""
    out = {}
    for line in output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == "door" and parts[2] == "unreachable":
            out[parts[1]] = parts[3] if len(parts) > 3 else "no answer"
    return out


def reach_step(host: str, doors, role: str = "gateway") -> Command:
    """The probe: it fails (nothing changed yet) naming each front door ``host`` cannot reach."""
    doors = tuple(doors)
    by_name = {door.host: door for door in doors}

    def interpret(result):
        missing = unreachable(result.stdout)
        if result.rc != 0 and not missing:
            raise StepFailed(f"the reach of the front doors could not be asked on {host} (exit {result.rc}): "
                             f"{(result.stderr or result.stdout).strip()[-300:]}")
        if missing:
            hops = "; ".join(f"{host} -> {name} ({by_name[name].address}:{by_name[name].port}): {why}"
                             for name, why in missing.items() if name in by_name)
            raise StepFailed(f"{hops}: a {role} must reach every serving host's front door, and nothing was changed "
                             f"on {host}; make the {role} a host on that network (or open the port to it), or take "
                             f"{', '.join(missing)} out of the serving hosts")
        return f"reaches the front doors of {', '.join(by_name)}"

    return Command(f"{role} reaches the front doors", script=REACH_PROGRAM.script({"DOORS": doors_parameter(doors)}),
                   changes=False, probe=True, timeout=30, interpret=interpret,
                   describe=f"connect to each serving host's front door ({len(doors)}), 3 s each at most")
