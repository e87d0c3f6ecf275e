"""The roles' Jinja environments: one per template folder (and syntax) a process, so that its
cache keeps each template compiled (a compile costs about 25 ms, once per render before)."""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2


@functools.cache
def environment(folder: Path | tuple[Path, ...], **syntax: str) -> jinja2.Environment:
    """Strict (an undefined name fails the render), trailing newlines kept; ``folder``: one, or
    several searched in order; ``syntax``: other delimiters (variable_start_string...) where the
    template's own language uses Jinja's."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(folder), keep_trailing_newline=True,
                              undefined=jinja2.StrictUndefined, **syntax)
