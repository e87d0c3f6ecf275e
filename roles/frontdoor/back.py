"""Deploy's "replicas in service": replicas a roll cut short left drained put back in
service, and the roll's flags lowered (files/back.sh, on the front door's admin library)."""
from __future__ import annotations

from pathlib import Path

from roles.haproxy.admin import ADMIN_LIBRARY
from roles.host_programs import Program, Protocol

BACK = Protocol("replicas in service", markers={"still-drained": "SERVER: the front door refused to put it back"},
                exits={"refused": 1})
BACK_PROGRAM = Program((ADMIN_LIBRARY, Path(__file__).parent / "files" / "back.sh"), BACK)
