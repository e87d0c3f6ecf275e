"""The docs' commands run as written: the README's tour and the keys guide's walk-through, each
`sh` block of their marked section in one bash (the blocks in order, as a reader types them:
variables carry over), on the lab; where the page shows output (the `text` block after a command
block), the output holds those lines in that order (runs of blanks as one, `…` standing for
anything). And the control machine's install, as the README writes it, from a clean clone:
`./run.sh install`, then `inventory.check` and `deploy --check` against the lab from that venv."""
import os
import re
import shutil
import subprocess
import time

import pytest

from tests.conftest import ROOT
from tests.lab.conftest import LAB_INVENTORY, deploy_json



def sections(page: str, marker: str) -> list[tuple[str, str | None]]:
    """The (command, shown output or None) blocks from ``<!-- marker`` to the next heading."""
    text = (ROOT / page).read_text()
    start = text.index(f"<!-- {marker}")
    end = text.find("\n## ", start)
    body = text[start:end if end != -1 else None]
    blocks = re.findall(r"```(sh|text)\n(.*?)```", body, re.S)
    out = []
    for kind, code in blocks:
        if kind == "sh":
            out.append((code, None))
        elif out and out[-1][1] is None:
            out[-1] = (out[-1][0], code)
    assert out, f"{page}: no command block after <!-- {marker}"
    return out


def _normal(line: str) -> str:
    return " ".join(line.split())


def shows(output: str, shown: str) -> bool:
    """Every line the page shows is, in order, a line of the output (`…`: anything)."""
    lines = [_normal(line) for line in output.splitlines()]
    at = 0
    for want in shown.strip("\n").splitlines():
        pattern = re.compile(".*".join(re.escape(part) for part in _normal(want).split("…")) + "$")
        while at < len(lines) and not pattern.match(lines[at]):
            at += 1
        if at == len(lines):
            return False
        at += 1
    return True


def run_as_written(page: str, marker: str, before_block=None, names: dict | None = None):
    """``names``: a word of the page and what it stands for in this run (a key's name: its day's
    usage stays counted after it is revoked, so a second run under the same name would count twice)."""
    blocks = sections(page, marker)
    for word, instead in (names or {}).items():
        blocks = [(re.sub(rf"\b{word}\b", instead, code), shown and re.sub(rf"\b{word}\b", instead, shown))
                  for code, shown in blocks]
    env = {k: v for k, v in os.environ.items() if k not in ("DGEMMA_INVENTORY", "VIRTUAL_ENV")}
    script = "set -e\n"  # as a reader's shell: a pipeline is its last command's
    for i, (code, _) in enumerate(blocks):
        if before_block:
            script += before_block(code)
        script += code + f"printf '\\n@@block-{i}-done@@\\n'\n"
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**env, "COLUMNS": "200"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{page}: a block failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    outputs = re.split(r"\n@@block-\d+-done@@\n", proc.stdout)
    for i, (code, shown) in enumerate(blocks):
        if shown is not None:
            said = outputs[i] if i < len(outputs) else ""
            assert shows(said, shown), f"{page}: block {i + 1} printed\n{said[-2000:]}\nwhere the page shows\n{shown}"
    return proc


def test_the_shown_output_matches_only_what_it_shows():
    assert shows("a  b\nverify: 22 passed, 0 failed, 14 skipped on 1 host\n", "verify: … passed, 0 failed, …")
    assert not shows("verify: 22 passed, 3 failed\n", "verify: … passed, 0 failed")
    assert not shows("b\na\n", "a\nb")


@pytest.fixture(scope="module")
def deployed(lab):
    """The whole lab deployed, as after ./run.sh main (whatever tests ran before)."""
    proc, _ = deploy_json()
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def test_the_readme_tour_runs_as_written(deployed):
    run_as_written("README.md", "tour")


def _at_the_start_of_a_minute(code: str) -> str:
    # the walk-through sends its 80 requests "within one minute of the clock": as a reader would
    # (`date` tells), it starts them early enough in the minute
    if "xargs -P 80" not in code:
        return ""
    return 'while [ "$(date +%S | sed "s/^0//")" -gt 40 ]; do sleep 1; done\n'


def test_the_keys_guide_runs_as_written(deployed):
    name = f"alice{int(time.time())}"
    try:
        run_as_written("docs/keys.md", "keys", before_block=_at_the_start_of_a_minute, names={"alice": name})
    finally:  # a walk-through cut short leaves no key of its own behind
        subprocess.run(["bash", "-c", f". .venv/bin/activate && invoke keys.revoke {name}"], cwd=ROOT,
                       env={**os.environ, "DGEMMA_INVENTORY": str(LAB_INVENTORY)}, capture_output=True, timeout=300)


def test_the_control_machine_install_as_the_readme_writes_it(deployed, tmp_path):
    """A clean clone, the README's install command in it, then its venv's invoke against the lab."""
    readme = (ROOT / "README.md").read_text()
    assert "./run.sh install" in readme and "export DGEMMA_INVENTORY=" in readme
    clone = tmp_path / "control"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    started = time.monotonic()
    proc = subprocess.run(["./run.sh", "install"], cwd=clone, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "the toolkit is installed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    took = time.monotonic() - started
    venv = clone / ".venv" / "bin"
    installed = subprocess.run([str(venv / "python"), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                               text=True, check=True).stdout
    assert "pytest-xdist" not in installed and "mkdocs" not in installed  # the toolkit alone, not the tests'
    env = {**{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}, "DGEMMA_INVENTORY": str(LAB_INVENTORY),
           "PATH": f"{venv}:{os.environ['PATH']}"}
    check = subprocess.run(["invoke", "inventory.check"], cwd=clone, env=env, capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0 and ": OK" in check.stdout, check.stdout + check.stderr
    # each host's roles, as the deploy reads them
    for line in ("  spark01    serves diffusiongemma", "  hgx01      serves diffusiongemma on 2 GPUs, gemma4 on the GPUs left",
                 "  gateway01  gateway, first to hold 10.213.0.200",
                 "  gateway02  gateway, second in line for 10.213.0.200 (after gateway01)",
                 "  monitor01  monitoring (Prometheus, Alertmanager)"):
        assert line in check.stdout.splitlines(), check.stdout
    dry = subprocess.run(["invoke", "deploy", "--check", "--hosts", "rtx01,gateway01"], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=900)
    assert dry.returncode == 0 and "failed=0" in dry.stdout, dry.stdout[-3000:] + dry.stderr[-2000:]
    shutil.rmtree(clone, ignore_errors=True)
    print(f"./run.sh install from a clean clone: {took:.0f} s; inventory.check and deploy --check from its venv passed")
