"""Make the fixed credentials of the plan cases (tests/plans/credentials/): a fleet CA
and the cases' hosts' certificates, valid for a century so that the cases' expected
files never change with the date, a user's key hash, the gateway's key and the monitoring key. Test
fixtures only: no real host trusts this CA. ``python3 -m tests.plans.make_credentials``
(rerun only to replace them; the cases' snapshots then change: PLAN_CASES_WRITE=1)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from credentials import ca
from credentials.keys import digest

HERE = Path(__file__).parent
# the names the roles ask for: the cases give no ansible_host, so the inventory name alone
HOSTS = {"rtx01": ["rtx01"], "spark01": ["spark01"], "h100-01": ["h100-01"], "gateway01": ["gateway01"]}
GATEWAYS = ["gateway01"]  # and their certificates among their peers


def main():
    target = HERE / "credentials"
    shutil.rmtree(target, ignore_errors=True)
    ca.CA_DAYS = ca.CERT_DAYS = 36500
    for host, names in HOSTS.items():
        ca.host_certificate(target, host, names, make=True)
    for host in GATEWAYS:
        ca.peer_certificate(target, host, make=True)
    (target / "keys.json").write_text(json.dumps({"alice": {"sha256": digest("dgk-plan-test-alice"),
                                                            "added": "2026-11-23T00:00:00+00:00"}}, indent=2) + "\n")
    (target / "gateway.key").write_text("dgk-plan-test-gateway\n")
    (target / "monitoring.key").write_text("dgk-plan-test-monitoring\n")
    (target / ".lock").unlink(missing_ok=True)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
