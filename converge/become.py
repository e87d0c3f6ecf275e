"""Become (Ansible's word): run a host's scripts as another user through sudo.

Without a password, ``sudo -n`` (it fails at once if sudo would ask). With one,
``sudo -S -p ''`` reads it from standard input, so it is never on a command line,
in an environment variable or in a log. What follows the password on stdin:

    PASSWORD\\n  #\\n  #\\n  END\\n  SCRIPT...

The command sudo runs first reads stdin up to the END line, then runs the script
that follows (``exec sh -s``). Whatever sudo did, nothing is misread:
- sudo asked and the password was right: it took the first line; the two
  comment lines and END are skipped;
- sudo did not ask (NOPASSWD, or a cached timestamp): the password line is
  skipped too, by a root shell that never shows it;
- the password was wrong: sudo's three tries (its default ``passwd_tries``) take
  the password and the two comment lines, and it stops before END: the script
  never runs and sudo's words say why (``diagnose``).
The shell's ``read`` takes one byte at a time from a pipe, so it never swallows
the script's first bytes.
"""
from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass, field

# sudo's own words, in the C locale we ask for
_REFUSED = re.compile(r"incorrect password attempt|Sorry, try again|Authentication failure", re.I)
_NEEDS_PASSWORD = re.compile(r"a password is required|a terminal is required|no password was provided", re.I)
_NOT_ALLOWED = re.compile(r"is not in the sudoers file|is not allowed to (run|execute)|may not run sudo", re.I)
_NO_SUDO = re.compile(r"sudo: (command )?not found|sudo: No such file", re.I)


@dataclass(frozen=True)
class Become:
    """Run as ``user`` through ``method`` (sudo), with ``password`` if sudo asks one."""

    user: str = "root"
    method: str = "sudo"
    password: str | None = field(default=None, repr=False, compare=False)
    # the line that ends the password preamble: random per run, so no script line can be it
    end: str = field(default_factory=lambda: "#become-end-" + secrets.token_hex(8), repr=False, compare=False)

    def command(self, inline_script: str | None = None) -> str:
        """The command line that runs our shell as ``user``: ``sh -s`` reading the
        script from stdin, or ``sh -c SCRIPT`` when the script travels inline
        (which needs no password on stdin: then it is inline only without one)."""
        user = shlex.quote(self.user)
        if self.password is None:
            shell = "sh -s" if inline_script is None else f"sh -c {shlex.quote(inline_script)}"
            return f"LC_ALL=C sudo -n -u {user} -- {shell}"
        skip = f'while IFS= read -r l; do [ "$l" = {shlex.quote(self.end)} ] && break; done; exec sh -s'
        return f"LC_ALL=C sudo -S -p '' -u {user} -- sh -c {shlex.quote(skip)}"

    @property
    def inline_ok(self) -> bool:
        """Whether a script may travel in the exec request: only when no password
        has to go first on stdin."""
        return self.password is None

    def preamble(self) -> bytes:
        """What goes on stdin before the script (nothing without a password)."""
        if self.password is None:
            return b""
        return f"{self.password}\n#\n#\n{self.end}\n".encode()


def check_password(password: str, source: str) -> str:
    """A become password as read from a file or a prompt: one line, nothing else."""
    password = password.rstrip("\n")
    if not password:
        raise ValueError(f"{source}: the become password is empty")
    if "\n" in password or "\r" in password or "\0" in password:
        raise ValueError(f"{source}: the become password must be one line")
    return password


def diagnose(output: str, login_user: str, become: Become, host: str) -> str | None:
    """What sudo's own messages in ``output`` mean for the user, or None when
    the output is not sudo refusing to run the script."""
    if _REFUSED.search(output):
        return (f"sudo refused the password for {login_user} on {host}: check --ask-become-pass (-K) "
                f"or become_password_file")
    if _NEEDS_PASSWORD.search(output):
        return (f"sudo on {host} asks {login_user}'s password: run with --ask-become-pass (-K), or set "
                f"become_password_file to a 0600 file that holds it")
    if _NOT_ALLOWED.search(output):
        return (f"{login_user} may not run commands as {become.user} with sudo on {host}: add {login_user} "
                f"to the sudo group (or sudoers) there")
    if _NO_SUDO.search(output):
        return f"sudo is not installed on {host}: install it, or log in as {become.user} (ansible_user)"
    return None
