"""Each user's key's limits, as the gateways enforce them: requests a minute, requests at
once, tokens a day, the model families it may ask for, whether it may spend on an
external upstream, when it expires, and whether it is a front end many people use
(its limits then count per end user). A key's own limits (``invoke keys.add``,
``keys.set``: in keys.json) over the inventory's ``key_limits``; the inventory's
api_key_file is the operator's key, never limited.

What HAProxy reads of them: ``keys.map`` (a key's sha256 -> its name) and ``limits.map``
(a name -> its limits as one word). Pure."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

HERE = Path(__file__).parent
OPERATOR = "api_key_file"  # the inventory's own key: never limited, may use the upstream
FIELDS = ("requests_per_minute", "requests_at_once", "tokens_per_day", "models", "upstream", "expires", "front_end",
          "all_users_requests_per_minute", "all_users_tokens_per_day")
ALL_USERS = ("all_users_requests_per_minute", "all_users_tokens_per_day")  # a front end's cap as a whole


@lru_cache(maxsize=None)
def _validator() -> jsonschema.Draft202012Validator:
    # declared once, in the gateway role's argument spec (roles/gateway/schema.yml, $defs.key_limits): the
    # inventory's key_limits and keys.add are checked against the same schema
    schema = yaml.safe_load((HERE.parent / "roles" / "gateway" / "schema.yml").read_text())["$defs"]["key_limits"]
    return jsonschema.Draft202012Validator(schema)


def problems(own: dict, where: str) -> list[str]:
    """What is wrong with a key's own limits, each naming ``where`` and the limit."""
    return [f"{where}{'.' + field if field else ''}: {message}" for field, message in problem_pairs(own)]


def problem_pairs(own: dict) -> list[tuple[str, str]]:
    """(the limit, what is wrong with it) for each problem of a key's own limits."""
    out = [(".".join(str(p) for p in error.absolute_path), error.message) for error in _validator().iter_errors(own)]
    if not out and own.get("front_end") is False:
        out += [(field, "a cap over all of a key's users is a front end's: not with front_end false")
                for field in ALL_USERS if own.get(field)]
    if not out and isinstance(own.get("expires"), str):
        try:
            expires_at(own["expires"])
        except ValueError as exc:
            out.append(("expires", f"{own['expires']!r} is not a date ({exc})"))
    return out


def expires_at(text: str) -> int:
    """A UTC date (its first second) or date and time, as Unix time."""
    text = text.rstrip("Z").replace(" ", "T")
    when = datetime.datetime.fromisoformat(text if "T" in text else f"{text}T00:00:00")
    return int(when.replace(tzinfo=datetime.timezone.utc).timestamp())


@dataclass(frozen=True)
class Limits:
    """A key's limits in force (0: none; ``models`` empty: every family)."""
    requests_per_minute: int = 0
    requests_at_once: int = 0
    tokens_per_day: int = 0
    models: tuple = ()
    upstream: bool = False
    expires: int = 0  # Unix time; 0: never
    front_end: bool = False
    all_users_requests_per_minute: int = 0  # a front end's, over all its users together
    all_users_tokens_per_day: int = 0

    @property
    def limited(self) -> bool:
        """Whether anything limits it where it is used (a key the front doors then take only through
        a gateway: they would enforce none of it)."""
        return bool(self.requests_per_minute or self.requests_at_once or self.tokens_per_day or self.models
                    or self.expires or (self.front_end and (self.all_users_requests_per_minute or
                                                            self.all_users_tokens_per_day)))

    def word(self) -> str:
        """The limits as limits.map holds them: rpm:at_once:tokens:expires:models:upstream:front_end:
        all_users_rpm:all_users_tokens (the last two a front end's alone)."""
        models = "," + ",".join(self.models) + "," if self.models else "*"
        whole = (self.all_users_requests_per_minute, self.all_users_tokens_per_day) if self.front_end else (0, 0)
        return (f"{self.requests_per_minute}:{self.requests_at_once}:{self.tokens_per_day}:{self.expires}:"
                f"{models}:{int(self.upstream)}:{int(self.front_end)}:{whole[0]}:{whole[1]}")

    def shown(self) -> str:
        """In words, for keys.list."""
        parts = [f"{self.requests_per_minute}/min" if self.requests_per_minute else "",
                 f"{self.requests_at_once} at once" if self.requests_at_once else "",
                 f"{self.tokens_per_day} tokens/day" if self.tokens_per_day else "",
                 f"models {','.join(self.models)}" if self.models else "",
                 "upstream" if self.upstream else "",
                 "expires " + datetime.datetime.fromtimestamp(self.expires, datetime.timezone.utc)
                 .strftime("%Y-%m-%d %H:%M") + " UTC" if self.expires else "",
                 "front end (per user)" if self.front_end else "",
                 f"{self.all_users_requests_per_minute}/min over all users" if self.front_end and
                 self.all_users_requests_per_minute else "",
                 f"{self.all_users_tokens_per_day} tokens/day over all users" if self.front_end and
                 self.all_users_tokens_per_day else ""]
        return ", ".join(p for p in parts if p) or "no limits"


UNLIMITED = Limits(upstream=True)


def effective(defaults: dict | None, own: dict | None) -> Limits:
    """A key's own limits over the inventory's ``key_limits``."""
    merged = {**(defaults or {}), **(own or {})}
    expires = merged.get("expires")
    return Limits(int(merged.get("requests_per_minute") or 0), int(merged.get("requests_at_once") or 0),
                  int(merged.get("tokens_per_day") or 0), tuple(merged.get("models") or ()),
                  bool(merged.get("upstream", False)), expires_at(expires) if expires else 0,
                  bool(merged.get("front_end", False)), int(merged.get("all_users_requests_per_minute") or 0),
                  int(merged.get("all_users_tokens_per_day") or 0))


def unlimited_only(hashes: dict[str, str], own: dict[str, dict], defaults: dict | None) -> dict[str, str]:
    """The keys (name -> sha256) that nothing limits: what a front door takes where the fleet has
    gateways (a limited key there would bypass its limits)."""
    return {name: digest for name, digest in hashes.items()
            if name == OPERATOR or not effective(defaults, own.get(name)).limited}


def keys_map(hashes: dict[str, str]) -> str:
    """HAProxy's map of each accepted key's sha256 to its name (no secret here: hashes)."""
    return "# Managed by dgemma-fleet: the sha256 of each key the gateway takes, and whose\n" + "".join(
        f"{digest} {name}\n" for name, digest in hashes.items())


def limits_map(limits: dict[str, Limits]) -> str:
    """HAProxy's map of each key's name to its limits (Limits.word)."""
    return ("# Managed by dgemma-fleet: each key's limits, rpm:at_once:tokens_per_day:expires:models:upstream:"
            "front_end:all_users_rpm:all_users_tokens (0: none)\n" + "".join(f"{name} {limit.word()}\n" for name, limit in limits.items()))
