"""The deploy path to a NixOS host, up to the module write: rtx01 reports ID=nixos
(NixOS's os-release over its own) and has an /etc/nixos. What happens after the
write (nixos-rebuild building the unit) needs a real NixOS, which the lab has not:
the README says so."""
import shutil
import subprocess

import pytest

from tests.lab.conftest import deploy_json, ssh

OS_RELEASE = ('ANSI_COLOR="1;34"\nBUG_REPORT_URL="https://github.com/NixOS/nixpkgs/issues"\nBUILD_ID="24.11.20250101"\n'
              'DOCUMENTATION_URL="https://nixos.org/learn.html"\nHOME_URL="https://nixos.org/"\nID=nixos\n'
              'LOGO="nix-snowflake"\nNAME=NixOS\nPRETTY_NAME="NixOS 24.11 (Vicuna)"\nVERSION="24.11 (Vicuna)"\n'
              'VERSION_CODENAME=vicuna\nVERSION_ID="24.11"\n')
CONFIGURATION = "{ config, pkgs, ... }:\n{\n  imports = [ ./hardware-configuration.nix ];\n}\n"
MODULE = "/etc/nixos/dgemma-vllm-diffusiongemma.nix"
UNIT = "/etc/systemd/system/podman-vllm-diffusiongemma.service"


@pytest.fixture
def nixos_rtx01(lab):
    assert deploy_json("--hosts", "rtx01")[0].returncode == 0
    ssh("rtx01", f"cat > /run/nixos-os-release <<'EOF'\n{OS_RELEASE}EOF\n"
                 "mount --bind /run/nixos-os-release /usr/lib/os-release && mkdir -p /etc/nixos && "
                 f"cat > /etc/nixos/configuration.nix <<'EOF'\n{CONFIGURATION}EOF")
    try:
        yield
    finally:
        ssh("rtx01", "umount /usr/lib/os-release; rm -rf /etc/nixos /run/nixos-os-release")
        assert deploy_json("--hosts", "rtx01")[0].returncode == 0


def test_a_nixos_host_gets_a_module_not_a_unit(nixos_rtx01, lab_copy, tmp_path):
    unit_before = ssh("rtx01", f"stat -c '%Y %s' {UNIT}; sha256sum {UNIT}").stdout
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("max_num_seqs: 7\n")
    proc, data = deploy_json("--hosts", "rtx01", inventory=lab_copy)
    tasks = data["hosts"]["rtx01"]["tasks"]
    written = [t for t in tasks if t["task"] == "NixOS module"]
    assert written and written[0]["status"] == "changed" and MODULE in written[0]["message"]
    failed = [t for t in tasks if t["status"] == "failed"]
    assert failed[0]["task"] == "imported by the NixOS configuration"
    assert "imports = [ ./dgemma-vllm-diffusiongemma.nix ];" in failed[0]["message"]
    assert proc.returncode == 1
    # the unit under /etc/systemd/system was not touched: on NixOS it is generated, not written
    assert ssh("rtx01", f"stat -c '%Y %s' {UNIT}; sha256sum {UNIT}").stdout == unit_before
    module = ssh("rtx01", f"cat {MODULE}; stat -c '%a %U' {MODULE}").stdout
    text, mode = module.rsplit("\n", 2)[0] + "\n", module.rsplit("\n", 2)[1]
    assert mode == "644 root" and '"--max-num-seqs" "7"' in text
    if shutil.which("nix-instantiate"):
        path = tmp_path / "module.nix"
        path.write_text(text)
        assert subprocess.run(["nix-instantiate", "--parse", str(path)], capture_output=True).returncode == 0
    leftovers = ssh("rtx01", "ls -A /etc/nixos | grep '^\\.' || true").stdout.strip()
    assert leftovers == ""  # written atomically: no temp file

    # imported: the module is not applied yet (nixos-rebuild is the user's, by default)
    ssh("rtx01", "sed -i 's|./hardware-configuration.nix|./hardware-configuration.nix "
                 "./dgemma-vllm-diffusiongemma.nix|' /etc/nixos/configuration.nix")
    proc, data = deploy_json("--hosts", "rtx01", "--set", "max_num_seqs=8", inventory=lab_copy)
    failed = [t for t in data["hosts"]["rtx01"]["tasks"] if t["status"] == "failed"]
    assert failed[0]["task"] == "applied by nixos-rebuild"
    assert "run nixos-rebuild switch on rtx01" in failed[0]["message"]

    # with nixos_rebuild: true, deploy runs it (there is no nixos-rebuild on this Debian: it says so)
    proc, data = deploy_json("--hosts", "rtx01", "--set", "max_num_seqs=9", "--set", "nixos_rebuild=true",
                             inventory=lab_copy)
    tasks = data["hosts"]["rtx01"]["tasks"]
    handler = [t for t in tasks if t["task"] == "handler: nixos-rebuild switch"]
    assert handler and handler[0]["status"] == "failed" and "nixos-rebuild" in handler[0]["message"]
    assert '"--max-num-seqs" "9"' in ssh("rtx01", f"cat {MODULE}").stdout
