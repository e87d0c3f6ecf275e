"""`invoke logs`: the vLLM unit's journal from each host, prefixed by host."""
from __future__ import annotations

import shlex
import sys
import threading

from converge.connection import SSHConnection, SSHSettings
from converge.errors import ConvergeError

from roles.service.role import unit_name


def stream_logs(play, hosts: list[str], lines: int, follow: bool, out=sys.stdout) -> bool:
    lock = threading.Lock()
    failed = []
    width = max((len(h) for h in hosts), default=4)

    def one(host):
        v = play.hostvars(host)
        cmd = f"journalctl -u {shlex.quote(unit_name(v))} -n {int(lines)} --no-pager -o short-iso" + \
              (" -f" if follow else "") + "\n"

        def emit(line):
            with lock:
                out.write(f"{host:<{width}} | {line}\n")
                out.flush()
        try:
            with SSHConnection(SSHSettings.from_vars(host, v)).open() as conn:
                result = conn.run(cmd, timeout=None, on_output=emit)
                if result.rc != 0:
                    emit(f"journalctl failed: {result.stderr.strip()}")
                    failed.append(host)
        except ConvergeError as exc:
            emit(str(exc))
            failed.append(host)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:
        pass
    return bool(failed)
