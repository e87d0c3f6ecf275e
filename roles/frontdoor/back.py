"""Deploy's "replicas in service": replicas a roll cut short left drained put back in
service, and the roll's flags lowered (files/back.sh, on the front door's admin library)."""
from __future__ import annotations

from pathlib import Path

from serving.haproxy.admin import ADMIN_LIBRARY
from serving.host_programs import RESULT_LIBRARY, Program, Protocol

BACK = Protocol("replicas in service", exits={"refused": 1}, result={
    "in_service": "the servers put back in service", "refused": "the servers the front door refused to put back",
    "flags_refused": "the roll's flags it refused to lower"})
BACK_PROGRAM = Program((RESULT_LIBRARY, ADMIN_LIBRARY, Path(__file__).parent / "files" / "back.sh"), BACK)
