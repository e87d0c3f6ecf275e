#!/usr/bin/python3
# Managed by dgemma-fleet (roles/gateway): edits here are replaced on the next deploy.
"""The gateway's usage service: HAProxy sends it every request's record (its log line, over a
unix datagram socket); it writes the record to the journal, counts usage per day, key (or a
front end's user) and model family in /var/lib/dgemma/usage/DAY.json, adds each answer's tokens
to the gateways' shared table `tokens_day` (one counting place, whose counts it keeps through
a restart) and then gives back what its request held in the gateway's `tokens_held`, puts the
day's counts back there when HAProxy has lost them (a restart), and shows its counts to Prometheus on loopback (/metrics, which the gateway's /metrics/usage passes on).
Several reader processes share the records' socket (one Python thread reads about 20,000 records a
second); this one takes their batches, writes their lines and holds the counts.

Python's standard library only: it runs on the gateway host as root (HAProxy's runtime API is
root's alone), with what systemd's sandbox leaves it (the unit)."""
from __future__ import annotations

import argparse
import ctypes
import datetime
import fcntl
import http.server
import json
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time

RECORD = " @record "  # what comes before a record in HAProxy's log line
DAY_S = 86400
# vLLM 0.33 reports per-request steps only for speculative decoding (--per-request-spec-decode-metrics
# needs --speculative-config); a DiffusionGemma replica's passes are counted for all its requests alone
PASSES = ("not reported per request by vLLM 0.33; vllm:diffusion_num_denoising_steps counts the replica's "
          "passes over all its requests")
COUNTER_MAX = 2 ** 32 - 1  # a stick-table's gpc0
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "errors", "refused", "fallbacks",
          "upstream_requests", "upstream_prompt_tokens", "upstream_completion_tokens")
REFUSED = (401, 403, 429)
# the mark usage.lua waits for (with the worker's pid): this process holds the shared counts
MARK = "@counts:"
ALL_USERS = "*"  # KEY/*: a front end's count over all its users (gateway.cfg.j2 reads it under that name)
RECORD_LINE = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps(separators=) makes one a call
READERS = 4  # reader processes, when the unit names no number (--readers)
HELD, HELD_COUNTERS = "tokens_held", 3  # subject:day -> given back (this service's), reserved, refused
TOKENS, MINUTES = "tokens_day", "requests_minute"  # HAProxy's tables: subject:day, subject:minute  # the gateway's own answers to a key's limits


def log(message: str):
    print(message, file=sys.stderr, flush=True)


def number_of(value) -> int | None:
    """A number as HAProxy writes one in the record (ASCII digits, maybe signed); None for "-" (a
    variable the request never set) or anything else."""
    if type(value) is not str:
        value = str(value)
    if value.isascii():
        if value.isdigit():
            return int(value)
        if value[:1] == "-" and value[1:].isdigit():
            return -int(value[1:])
    return None


def text_of(raw: dict, name: str) -> str:
    # HAProxy writes "-" for a variable the request never set, <NOSRV> for no server
    value = raw.get(name)
    return "" if value is None or value == "-" or value == "<NOSRV>" else value


def record_of(line: str) -> dict | None:
    """The record a log line carries after its access-log part, its fields typed; None when
    the line carries none (HAProxy's own messages) or it is not JSON. Written for speed (every
    answer's record passes here, tens of thousands a second on a busy gateway): no per-field
    closure, no second dict of the raw fields."""
    at = line.find(RECORD)
    if at < 0:
        return None
    try:
        raw = json.loads(line[at + len(RECORD):])
    except ValueError:
        return None
    if type(raw) is not dict:
        return None
    key, user = text_of(raw, "key"), text_of(raw, "user")
    subject = f"{key}/{user}" if key and user else key  # a front end's user counts apart
    diffusion = text_of(raw, "diffusion")
    diffusion = dict(part.split("=", 1) for part in diffusion.split() if "=" in part) if diffusion else None
    if diffusion:
        diffusion["passes"] = PASSES
    # when it was answered (the log's own time: HAProxy's accept date, %Ts, is a kept-alive
    # connection's previous answer, seconds before this request came)
    t_ms = number_of(raw.get("t_ms", ""))
    when = t_ms / 1000 if t_ms is not None and t_ms >= 0 else time.time()
    # a count is never below 0: a record of negative tokens (the socket takes any local
    # process's) would give a key back what it spent
    prompt, completion = number_of(raw.get("prompt_tokens", "")), number_of(raw.get("completion_tokens", ""))
    return {"t": when, "key": key, "user": user,
            "subject": subject, "model": text_of(raw, "model"), "pool": text_of(raw, "pool"),
            "fallback": text_of(raw, "fallback"), "host": text_of(raw, "host"), "replica": text_of(raw, "replica"),
            "status": number_of(raw.get("status", "")), "prompt_tokens": prompt if prompt and prompt > 0 else 0,
            "completion_tokens": completion if completion and completion > 0 else 0,
            "ttft_ms": number_of(raw.get("ttft_ms", "")),
            "ms": number_of(raw.get("ms", "")), "path": text_of(raw, "path"), "diffusion": diffusion,
            # the place the request took in its minute's count (requests a minute), and that minute
            "rpm_n": number_of(raw.get("rpm_n", "")), "minute": number_of(raw.get("minute", "")),
            "settle": settle_of(raw, subject, key, user)}


def settle_of(raw: dict, subject: str, key: str, user: str) -> tuple | None:
    """What a request that was let through held in its worker's table tokens_held, to give back as
    its answer is counted: (the worker's pid, ((entry, tokens), ...)); None when it held nothing."""
    pid, day = number_of(raw.get("pid", "")), number_of(raw.get("day", ""))
    if not pid or day is None or not subject:
        return None
    held = []
    holding, whole = number_of(raw.get("holding", "")), number_of(raw.get("all_holding", ""))
    if holding and holding > 0:
        held.append((f"{subject}:{day}", holding))
    if whole and whole > 0 and user:
        held.append((f"{key}/{ALL_USERS}:{day}", whole))
    return (pid, tuple(held)) if held else None


def family_of(record: dict) -> str:
    """The model family a request counts for: the one whose fallback answered it, else the pool
    that answered, else the model it asked for (a request refused before any pool)."""
    if record["fallback"]:
        return record["fallback"]
    if record["pool"] and record["pool"] != "upstream":
        return record["pool"]
    return record["model"] or "-"


DAYS: dict[int, str] = {}  # day number (since 1970) -> its name: one strftime a day, not one a record
SECONDS: dict[int, str] = {}  # second -> its ISO 8601 text up to the seconds (the records' "time")


def day_of(t: float) -> str:
    number = int(t // DAY_S)
    name = DAYS.get(number)
    if name is None:
        if len(DAYS) > 4096:
            DAYS.clear()
        name = DAYS[number] = datetime.datetime.fromtimestamp(number * DAY_S, datetime.timezone.utc).strftime("%Y-%m-%d")
    return name


def time_of(t: float) -> str:
    """``t`` as datetime's isoformat(timespec="milliseconds") in UTC writes it, its second's text
    made once (a record's time is written for every record)."""
    ms = round(t * 1000)
    second, part = divmod(ms, 1000)
    text = SECONDS.get(second)
    if text is None:
        if len(SECONDS) > 64:
            SECONDS.clear()
        text = SECONDS[second] = datetime.datetime.fromtimestamp(second, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{part:03d}+00:00"


def unix_day(day: str) -> int:
    return int(datetime.datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=datetime.timezone.utc).timestamp()) // DAY_S


class Tally:
    """What one reader of the records counted since it last handed them over (to Usage.merge): the
    counts per (day, subject, family), in COUNTS' order; the tokens per (day, subject); each
    subject's place in its minute; the records refused. Small whatever the records' number, so that
    a reader hands over a batch of thousands as a few entries."""

    __slots__ = ("usage", "tokens", "minutes", "refused", "read", "held")

    def __init__(self):
        self.held: dict[tuple[int, str], int] = {}  # (worker pid, tokens_held's entry) -> tokens to give back
        self.usage: dict[tuple[str, str, str], list[int]] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self.minutes: dict[str, int] = {}
        self.refused = 0
        self.read = 0  # HAProxy's lines taken: records, and those of connections that carried no request

    def add(self, record: dict):
        subject = record["subject"]
        if not subject:
            return
        settle = record.get("settle")
        if settle:
            pid, held = settle
            for entry, tokens in held:
                self.held[(pid, entry)] = self.held.get((pid, entry), 0) + tokens
        if record["rpm_n"] and record["minute"]:
            key = f"{subject}:{record['minute']}"
            if record["rpm_n"] > self.minutes.get(key, 0):
                self.minutes[key] = record["rpm_n"]
        day = day_of(record["t"])
        prompt, completion = record["prompt_tokens"], record["completion_tokens"]
        upstream = record["pool"] == "upstream"
        status = record["status"] or 0
        at = (day, subject, family_of(record))
        counts = self.usage.get(at)
        if counts is None:
            counts = self.usage[at] = [0] * len(COUNTS)
        # COUNTS' order: requests, prompt_tokens, completion_tokens, errors, refused, fallbacks,
        # upstream_requests, upstream_prompt_tokens, upstream_completion_tokens
        counts[0] += 1
        counts[1] += prompt
        counts[2] += completion
        counts[3] += (status >= 400 or status <= 0) and status not in REFUSED
        counts[4] += status in REFUSED
        counts[5] += bool(record["fallback"])
        if upstream:
            counts[6] += 1
            counts[7] += prompt
            counts[8] += completion
        if prompt or completion:
            self.tokens[(day, subject)] = self.tokens.get((day, subject), 0) + prompt + completion


class Usage:
    """The counts, per day: usage[subject][family][count], and spent[subject] (the tokens the
    gateways' table charges against the subject's daily budget)."""

    def __init__(self, folder: str, retention_days: int):
        self.folder, self.retention_days = folder, retention_days
        self.days: dict[str, dict] = {}
        self.dirty: set[str] = set()
        self.pending: dict[tuple[str, str], int] = {}  # (day, subject) -> tokens charged since the table was told
        self.held: dict[tuple[int, str], int] = {}  # (worker pid, tokens_held's entry) -> to give back once told
        self.minutes: dict[str, int] = {}  # subject:minute -> requests counted in it (a worker's table, again)
        self.lock = threading.Lock()
        # records HAProxy could not deliver (its DroppedLogs: a full socket queue drops a datagram, and
        # its tokens go uncharged): the workers that ended, and the one that runs (pid, count)
        self.lost_before, self.lost_now = 0, (None, 0)
        self.refused = 0  # records from a process that is not HAProxy's (Senders): not counted
        self.read = 0  # lines read from HAProxy (each record, and any line of its that carries none)
        self.charged = threading.Event()  # tokens to tell the table: it is told at once, not at the next tick
        os.makedirs(folder, mode=0o750, exist_ok=True)
        oldest = day_of(time.time() - retention_days * DAY_S)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".json") or name.startswith("."):
                continue
            day = name[:-5]
            if day < oldest:
                os.unlink(os.path.join(folder, name))
                continue
            try:
                with open(os.path.join(folder, name)) as f:
                    data = json.load(f)
                self.days[day] = {"usage": data.get("usage") or {}, "spent": data.get("spent") or {}}
            except (OSError, ValueError) as exc:
                log(f"usage: {name} unreadable ({exc}): kept aside as {name}.bad, its day counts from 0 here")
                os.replace(os.path.join(folder, name), os.path.join(folder, name + ".bad"))

    def _day(self, day: str) -> dict:
        return self.days.setdefault(day, {"usage": {}, "spent": {}})

    def merge(self, tally: "Tally"):
        """What a reader counted since it last handed over (its Tally) into the day's counts."""
        with self.lock:
            for key, n in tally.minutes.items():
                if n > self.minutes.get(key, 0):
                    self.minutes[key] = n
            for (day, subject, family), counts in tally.usage.items():
                into = self._day(day)["usage"].setdefault(subject, {}).setdefault(family, dict.fromkeys(COUNTS, 0))
                for name, n in zip(COUNTS, counts):
                    into[name] = into.get(name, 0) + n
                self.dirty.add(day)
            for (day, subject), tokens in tally.tokens.items():
                # a front end's user's answer counts for the user, and for the front end as a whole
                # (KEY/*: the gateway's cap over all its users; no user is named *)
                key, _, user = subject.partition("/")
                spent = self._day(day)["spent"]
                for charged in (subject, f"{key}/{ALL_USERS}") if user else (subject,):
                    spent[charged] = spent.get(charged, 0) + tokens
                    self.pending[(day, charged)] = self.pending.get((day, charged), 0) + tokens
            for at, tokens in tally.held.items():
                self.held[at] = self.held.get(at, 0) + tokens
            self.refused += tally.refused
            self.read += tally.read
        if tally.tokens or tally.held:
            self.charged.set()

    def note_lost(self, pid: int, dropped: int):
        """HAProxy's DroppedLogs as its worker ``pid`` counts them (from 0 for each new worker)."""
        with self.lock:
            last_pid, last = self.lost_now
            if last_pid is not None and last_pid != pid:
                self.lost_before += last
            self.lost_now = (pid, max(dropped, last if last_pid == pid else 0))

    def has_pending(self) -> bool:
        with self.lock:
            return bool(self.pending or self.held)

    def take_held(self, pid: int) -> dict[str, int]:
        """What the requests of worker ``pid`` held and its answers' records have come for (entry ->
        tokens), to give back once their tokens are in the table: taken before the tokens, so that
        each one's tokens are told first. Those of another worker are dropped: its table went with it."""
        with self.lock:
            held, self.held = self.held, {}
        out: dict[str, int] = {}
        for (worker, entry), tokens in held.items():
            if worker == pid:
                out[entry] = out.get(entry, 0) + tokens
        return out

    def put_back_held(self, pid: int, held: dict[str, int]):
        """What could not be given back (the runtime API did not answer): tried again next time."""
        with self.lock:
            for entry, tokens in held.items():
                self.held[(pid, entry)] = self.held.get((pid, entry), 0) + tokens

    def charged_counts(self) -> list[tuple[str, int]]:
        """(the table's key, count) of each subject charged since the table was last told: the
        count as this gateway knows it (the other gateway's, learned at the last merge, and ours)."""
        today = day_of(time.time())
        suffix = f":{unix_day(today)}"
        with self.lock:
            spent = self._day(today)["spent"]
            out = [(subject + suffix, spent[subject]) for (day, subject) in self.pending if day == today]
            self.pending.clear()
        return out

    def minutes_to_put(self, table: dict[str, int], reseed: bool) -> list[tuple[str, int]]:
        """The requests of this minute and the last (``table``: requests_minute's): ours where the
        table holds fewer, on ``reseed`` (a new worker); the table's into ours at any time."""
        now = int(time.time()) // 60
        out = []
        with self.lock:
            for key, n in table.items():
                self.minutes[key] = max(self.minutes.get(key, 0), n)
            for key in [k for k in self.minutes if int(k.rpartition(":")[2]) < now - 2]:
                del self.minutes[key]
            if reseed:
                out = [(key, n) for key, n in self.minutes.items()
                       if int(key.rpartition(":")[2]) >= now - 1 and table.get(key, 0) < n]
        return out

    def reconcile(self, table: dict[str, int], reseed: bool = False) -> list[tuple[str, int]]:
        """Today's spent tokens against the table's (``table``: its key -> count): each subject's
        count is the higher of the two (the other gateway served it) plus what was charged here
        since the last time. The table is told a count only when this gateway charged something
        (the gateway that serves writes; the other one learns through the peers, and writing what
        it learned back would race with newer counts), or on ``reseed`` (HAProxy restarted or
        reloaded here) where the table holds less. Returns (the table's key, count) to tell it."""
        today = day_of(time.time())
        suffix = f":{unix_day(today)}"
        out = []
        with self.lock:
            spent = self._day(today)["spent"]
            pending = {s: n for (d, s), n in self.pending.items() if d == today}
            self.pending.clear()
            subjects = set(spent) | {key[:-len(suffix)] for key in table if key.endswith(suffix)}
            for subject in subjects:
                told, charged = table.get(subject + suffix, 0), pending.get(subject, 0)
                new = max(spent.get(subject, 0) - charged, told) + charged
                if new != spent.get(subject, 0):
                    spent[subject] = new
                    self.dirty.add(today)
                if (charged and new != told) or (reseed and told < new):
                    out.append((subject + suffix, new))
        return out

    def save(self):
        with self.lock:
            dirty, self.dirty = self.dirty, set()
            texts = {day: json.dumps({"day": day, **self.days[day]}, sort_keys=True) for day in dirty}
        for day, text in texts.items():
            path = os.path.join(self.folder, f"{day}.json")
            temporary = os.path.join(self.folder, f".{day}.json.new")
            with open(temporary, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        oldest = day_of(time.time() - self.retention_days * DAY_S)
        with self.lock:
            for day in [d for d in self.days if d < oldest]:
                del self.days[day]
                try:
                    os.unlink(os.path.join(self.folder, f"{day}.json"))
                except FileNotFoundError:
                    pass

    def metrics(self, limits: dict[str, tuple[int, int]]) -> str:
        totals: dict[tuple[str, str, str], dict] = {}
        today = day_of(time.time())
        with self.lock:
            for data in self.days.values():
                for subject, families in data["usage"].items():
                    key, _, user = subject.partition("/")
                    for family, counts in families.items():
                        into = totals.setdefault((key, user, family), dict.fromkeys(COUNTS, 0))
                        for name in COUNTS:
                            into[name] += counts.get(name, 0)
            spent = dict(self._day(today)["spent"]) if today in self.days else {}
            lost = self.lost_before + self.lost_now[1]
            refused, read = self.refused, self.read
        label = lambda **kv: ",".join(f'{k}="{esc(v)}"' for k, v in kv.items())  # noqa: E731
        lines = []
        for name in COUNTS:
            metric = f"dgemma_usage_{name}_total"
            lines.append(f"# HELP {metric} {HELP[name]} (this gateway's, per key, end user and model family)")
            lines.append(f"# TYPE {metric} counter")
            for (key, user, family), counts in sorted(totals.items()):
                lines.append(f"{metric}{{{label(key=key, user=user, model=family)}}} {counts[name]}")
        lines += ["# HELP dgemma_key_tokens_today Tokens a key (or a front end's user) has spent today (UTC), "
                  "as the gateways' shared table counts them", "# TYPE dgemma_key_tokens_today gauge"]
        lines += ["# HELP dgemma_usage_records_lost_total Request records HAProxy could not deliver to the usage "
                  "service (its DroppedLogs): their tokens were not charged", "# TYPE dgemma_usage_records_lost_total counter",
                  f"dgemma_usage_records_lost_total {lost}"]
        lines += ["# HELP dgemma_usage_records_refused_total Records sent to the usage service by a local process "
                  "that is not the gateway's HAProxy: not counted", "# TYPE dgemma_usage_records_refused_total counter",
                  f"dgemma_usage_records_refused_total {refused}"]
        lines += ["# HELP dgemma_usage_records_read_total Lines the usage service read from the gateway's HAProxy: "
                  "a record each request's, and a line of each connection that carried none",
                  "# TYPE dgemma_usage_records_read_total counter", f"dgemma_usage_records_read_total {read}"]
        wholes = {s: n for s, n in spent.items() if s.endswith(f"/{ALL_USERS}")}
        for subject, n in sorted(spent.items()):
            key, _, user = subject.partition("/")
            if subject not in wholes:
                lines.append(f"dgemma_key_tokens_today{{{label(key=key, user=user)}}} {n}")
        lines += ["# HELP dgemma_key_tokens_per_day_limit A key's tokens a day (0: no limit)",
                  "# TYPE dgemma_key_tokens_per_day_limit gauge"]
        for key, (n, _) in sorted(limits.items()):
            lines.append(f"dgemma_key_tokens_per_day_limit{{{label(key=key)}}} {n}")
        lines += ["# HELP dgemma_key_all_users_tokens_today Tokens a front end has spent today (UTC) over all its users",
                  "# TYPE dgemma_key_all_users_tokens_today gauge"]
        for subject, n in sorted(wholes.items()):
            lines.append(f"dgemma_key_all_users_tokens_today{{{label(key=subject.partition('/')[0])}}} {n}")
        lines += ["# HELP dgemma_key_all_users_tokens_per_day_limit A front end's tokens a day over all its users "
                  "(0: no limit)", "# TYPE dgemma_key_all_users_tokens_per_day_limit gauge"]
        for key, (_, whole) in sorted(limits.items()):
            if whole:
                lines.append(f"dgemma_key_all_users_tokens_per_day_limit{{{label(key=key)}}} {whole}")
        return "\n".join(lines) + "\n"


HELP = {"requests": "Requests", "prompt_tokens": "Prompt tokens vLLM's answers reported",
        "completion_tokens": "Completion tokens vLLM's answers reported",
        "errors": "Requests answered with an error (not a limit's refusal)",
        "refused": "Requests refused by the key's limits (401 expired, 403 model or upstream, 429)",
        "fallbacks": "Requests its family's fallback answered",
        "upstream_requests": "Requests the external upstream answered",
        "upstream_prompt_tokens": "Prompt tokens of the external upstream's answers",
        "upstream_completion_tokens": "Completion tokens of the external upstream's answers"}


def esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RuntimeApi:
    """HAProxy's runtime API (a unix stream socket: one connection per batch of commands)."""

    def __init__(self, path: str):
        self.path = path

    def _ask(self, commands: list[str]) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.path)
            s.sendall(("; ".join(commands) + "\n").encode())
            chunks = []
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def set_counts(self, table: str, counts: list[tuple[str, int]], then: list[str] = ()):
        # HAProxy's counters are 32 bits: a count past them is held at the top, never wrapped to little
        commands = [f"set table {table} key {key} data.gpc0 {min(int(n), COUNTER_MAX)}" for key, n in counts]
        commands += then
        for i in range(0, len(commands), 50):
            answer = self._ask(commands[i:i + 50])
            if answer.strip():
                raise OSError(answer.strip()[:200])

    def entries(self, table: str, keys: list[str]) -> dict[str, list[int]]:
        """Each key's counter array (gpc(N) as `show table` writes it: gpc0=.. gpc1=..); a key the
        table does not hold is left out."""
        out = {}
        for i in range(0, len(keys), 50):
            for fields in table_rows(self._ask([f"show table {table} key {key}" for key in keys[i:i + 50]])):
                counters = sorted((int(name[3:]), int(value)) for name, value in fields.items()
                                  if name[:3] == "gpc" and name[3:].isdigit())
                out[fields["key"]] = [value for _, value in counters]
        return out

    def give_back(self, held: dict[str, int]) -> list[str]:
        """The commands that give back what requests held in tokens_held (entry -> tokens): its gpc(0),
        which this service alone writes, goes up by what they held, never past what the entry holds
        now (a reservation made before a restart is not there to give back)."""
        commands = []
        for key, counters in self.entries(HELD, sorted(held)).items():
            if len(counters) < HELD_COUNTERS:
                continue
            given, reserved, refused = counters[:HELD_COUNTERS]
            holding = (reserved - refused - given) % (COUNTER_MAX + 1)
            back = min(held[key], holding)
            if back:
                commands.append(f"set table {HELD} key {key} data.gpc {(given + back) % (COUNTER_MAX + 1)}")
        return commands

    def worker(self) -> tuple[int, int]:
        """The pid of the HAProxy worker that answers the runtime API (a new one after a reload), and
        the logs it could not send (DroppedLogs: records this service never got)."""
        info = dict(line.split(":", 1) for line in self._ask(["show info"]).splitlines() if ":" in line)
        if "Pid" not in info:
            raise OSError("show info names no Pid")
        return int(info["Pid"]), int(info.get("DroppedLogs", 0) or 0)

    def mark(self, pid: int):
        """The mark that says this worker holds the day's tokens (usage.lua waits for it)."""
        answer = self._ask([f"set table {TOKENS} key {MARK}{pid} data.gpc0 0"])
        if answer.strip():
            raise OSError(answer.strip()[:200])

    def counts(self, table: str) -> dict[str, int]:
        out = {}
        for fields in table_rows(self._ask([f"show table {table}"])):
            if "gpc0" in fields and not fields["key"].startswith("@"):
                out[fields["key"]] = int(fields["gpc0"])
        return out


def table_rows(text: str):
    """The entries `show table` writes, each as its fields (key=K gpc0=N ...): its other lines left out."""
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "key" in fields:
            yield fields


def read_limits(path: str) -> dict[str, tuple[int, int]]:
    """Each key's tokens a day, and a front end's over all its users, from the gateway's limits.map
    (name rpm:at_once:tokens:expires:models:upstream:front_end:all_users_rpm:all_users_tokens)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and not line.startswith("#"):
                    fields = parts[1].split(":")
                    out[parts[0]] = (int(fields[2]), int(fields[8]) if len(fields) > 8 else 0)
    except (OSError, ValueError, IndexError):
        pass
    return out


UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (SO_PASSCRED's message, SO_PEERCRED's answer)


class Senders:
    """Who may send a record: HAProxy's own processes, those in the control group of the process
    that opened its runtime API (its master; SO_PEERCRED names it: the workers are its children,
    in its container or its unit). Every datagram carries its sender's pid (SO_PASSCRED, set by
    the kernel, translated to this pid namespace), so that no other local process can charge a
    key (the socket's mode lets HAProxy's workers, another user, write to it). A pid found to be
    HAProxy's is remembered with its start time: a pid used again by another process is checked
    again, and a worker that sent and then ended (a reload) is still the one that sent."""

    REMEMBERED = 4096
    RELEARN_S = 1.0
    TRUSTED_S = 1.0

    def __init__(self, runtime_api: str, proc: str = "/proc"):
        self.runtime_api, self.proc = runtime_api, proc
        self.group: str | None = None  # HAProxy's control group
        self.learned = -self.RELEARN_S
        self.known: dict[int, str] = {}  # pid -> its start time
        self.trusted: dict[int, float] = {}  # pid -> until when it is taken without reading /proc again
        self.last_refused = (None, None)  # (pid, its command line), for the log

    def _read(self, pid: int, name: str) -> str | None:
        try:
            with open(f"{self.proc}/{pid}/{name}", "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return None

    def _started(self, pid: int) -> str | None:
        stat = self._read(pid, "stat")
        return None if stat is None else stat.rpartition(")")[2].split()[19]  # field 22, starttime

    def _haproxy_group(self) -> str | None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(self.runtime_api)
            pid, _, _ = UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
        return self._read(pid, "cgroup")

    def allows(self, pid: int) -> bool:
        # a worker sends thousands of records a second: its pid, once checked, is trusted for a
        # second before its start time is read again (a pid is not given to another process within
        # a second of its last record: the kernel hands out every other pid first)
        now = time.monotonic()
        if self.trusted.get(pid, 0.0) > now:
            return True
        started = self._started(pid)
        if pid in self.known and (started is None or started == self.known[pid]):
            if started is not None:
                self.trusted[pid] = now + self.TRUSTED_S
            return True
        group = self._read(pid, "cgroup") if started is not None else None
        if group is not None and group != self.group and time.monotonic() - self.learned >= self.RELEARN_S:
            # not HAProxy's as last known: a restarted HAProxy may be in another group now
            self.learned = time.monotonic()
            try:
                self.group = self._haproxy_group()
            except OSError:
                pass
        if group is not None and group == self.group:
            if len(self.known) >= self.REMEMBERED:
                self.known.clear()
                self.trusted.clear()
            self.known[pid] = started
            self.trusted[pid] = now + self.TRUSTED_S
            return True
        command = (self._read(pid, "cmdline") or "").replace("\0", " ").strip() or "?"
        if (pid, command) != self.last_refused:
            log(f"usage: refused a record from pid {pid} ({command[:120]}): not one of HAProxy's processes "
                f"(those of {self.runtime_api}'s); it is not counted")
            self.last_refused = (pid, command)
        return False


BATCH = 512  # records a reader hands over at most at once (sooner when the socket holds no more)


def receive(sock: socket.socket, deliver, senders: Senders | None = None, batch: int = BATCH):
    """Each record as it comes: its sender checked, its line made, its counts added to a Tally;
    the lines and the tally go to ``deliver(lines, tally)`` once the socket holds no more, or every
    ``batch`` records (not a write a record: a busy gateway sends tens of thousands a second, and
    HAProxy drops what the socket cannot queue). Several readers may share ``sock``: the kernel
    gives each datagram to one of them."""
    space = socket.CMSG_SPACE(UCRED.size)
    waiting, lines, tally, n = False, [], Tally(), 0
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(65536, space, 0 if waiting else socket.MSG_DONTWAIT)
        except BlockingIOError:
            if n:
                deliver("".join(lines), tally)
                lines, tally, n = [], Tally(), 0
            waiting = True
            continue
        waiting = False
        n += 1
        if n >= batch:
            deliver("".join(lines), tally)
            lines, tally, n = [], Tally(), 1
        if senders is not None:
            sender = next((UCRED.unpack(d[:UCRED.size])[0] for level, kind, d in ancillary
                           if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            if sender is None or not senders.allows(sender):
                tally.refused += 1
                continue
        tally.read += 1
        line = data.decode(errors="replace")
        record = record_of(line)
        if record is None:  # a line of HAProxy's with no record (its own message): kept as it came
            lines.append(RECORD_LINE.encode({"time": time_of(time.time()), "access": line.rstrip("\n")}) + "\n")
            continue
        # HAProxy's access-log part (client, timers, flags, request line): the journal's only copy (the
        # gateway's front end logs nowhere else: gateway.cfg.j2 says why)
        access = line[:line.find(RECORD)]
        settle = record.pop("settle")  # for the count alone: the journal's record says what was used
        if record["subject"] or record["path"].startswith("/v1/"):
            record["time"], record["access"] = time_of(record["t"]), access
            lines.append(RECORD_LINE.encode(record) + "\n")
        else:  # no key's and no API's (a health check, a scrape): its access line alone
            lines.append(RECORD_LINE.encode({"time": time_of(record["t"]), "access": access}) + "\n")
        if settle:
            record["settle"] = settle
        tally.add(record)


def delivering_to(usage: Usage, out):
    """``deliver`` for receive() in this process: the lines to ``out``, the counts into ``usage``."""
    def deliver(lines: str, tally: Tally):
        if lines:
            out.write(lines)
            out.flush()
        usage.merge(tally)
    return deliver


PR_SET_PDEATHSIG = 1
F_SETPIPE_SZ, PIPE_SIZE = 1031, 1 << 20  # fcntl's; the kernel's fs.pipe-max-size by default


def read_records(sock: socket.socket, to_parent, runtime_api: str, parent: int):
    """A reader process: the records it takes from ``sock`` go to its parent (``to_parent``, a
    pipe's end) as batches, each its lines and its Tally pickled. It ends with its parent
    (the kernel kills it then: a reader left behind would take records no one counts)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before the kernel was told
        os._exit(0)

    def deliver(lines: str, tally: Tally):
        to_parent.send_bytes(pickle.dumps((lines, tally), pickle.HIGHEST_PROTOCOL))
    receive(sock, deliver, Senders(runtime_api))


def start_readers(sock: socket.socket, count: int, runtime_api: str) -> dict:
    """``count`` reader processes sharing ``sock`` (one Python thread reads about 20,000 records a
    second: a busy gateway sends more). Made before this process starts a thread (a fork copies
    only the thread that forks). Returns each one's pipe end -> its pid."""
    readers, parent = {}, os.getpid()
    for _ in range(count):
        receiving, sending = multiprocessing.connection.Pipe(duplex=False)
        try:
            # a batch whole in the pipe (its default 64 KiB holds about 100 records' lines): the
            # reader goes back to the socket while this process writes the last batch out
            fcntl.fcntl(sending.fileno(), F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # fs.pipe-max-size below it: the default, a reader waiting sooner
        pid = os.fork()
        if pid == 0:
            try:
                receiving.close()
                for other in readers:
                    other.close()
                read_records(sock, sending, runtime_api, parent)
            except BaseException as exc:  # noqa: BLE001 - said, then the parent sees the pipe close
                if not isinstance(exc, (KeyboardInterrupt, BrokenPipeError)):
                    log(f"usage: a records reader failed: {exc!r}")
            finally:
                os._exit(1)
        sending.close()
        readers[receiving] = pid
    return readers


def collect(readers: dict, usage: Usage, out) -> int:
    """The readers' batches as they come: their lines to ``out`` (the journal), their counts into
    ``usage``. A reader that ends ends the service, which systemd starts again (its share of the
    records would otherwise queue unread, then be lost)."""
    deliver = delivering_to(usage, out)
    while True:
        for conn in multiprocessing.connection.wait(list(readers)):
            try:
                lines, tally = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                pid = readers[conn]
                _, status = os.waitpid(pid, 0)
                log(f"usage: the records reader {pid} ended (status {os.waitstatus_to_exitcode(status)}): "
                    f"the service ends, and systemd starts it again")
                return 1
            deliver(lines, tally)


def keep_table(usage: Usage, api: RuntimeApi, interval: float, merge_every: float, batch: float = 0.005):
    """What was charged here goes into the table of tokens as it comes (the answers of ``batch``
    seconds together); every ``merge_every``, what the tables hold (the other gateway's counts,
    through HAProxy's peers) into ours, and ours where they hold less. A new HAProxy worker (a
    reload, a restart; looked for every ``interval``) starts with empty tables: ours go in, then it
    is marked and counts (usage.lua: until then it asks counted requests to come back)."""
    last_merge, last_look, failing, marked, pid = 0.0, 0.0, False, None, None
    while True:
        if usage.charged.wait(interval):
            time.sleep(batch)
            usage.charged.clear()
        try:
            now = time.monotonic()
            if pid is None or now - last_look >= interval:
                (pid, dropped), last_look = api.worker(), now
                usage.note_lost(pid, dropped)
            fresh = pid != marked
            # what the answers' requests held, given back in the same batch as their tokens are told,
            # after them: an answer is never counted neither spent nor held
            held = usage.take_held(pid)
            try:
                back = api.give_back(held) if held else []
                if fresh or now - last_merge >= merge_every:
                    api.set_counts(MINUTES, usage.minutes_to_put(api.counts(MINUTES), reseed=fresh))
                    api.set_counts(TOKENS, usage.reconcile(api.counts(TOKENS), reseed=fresh), then=back)
                    if fresh:
                        api.mark(pid)
                        marked = pid
                    last_merge = now
                    usage.save()
                elif usage.has_pending() or back:
                    api.set_counts(TOKENS, usage.charged_counts(), then=back)
            except OSError:
                usage.put_back_held(pid, held)
                raise
            if failing:
                log("usage: HAProxy's runtime API answers again")
            failing = False
        except OSError as exc:
            pid = None
            if not failing:
                log(f"usage: HAProxy's runtime API ({api.path}): {exc}; the table gets the day's counts once it answers")
            failing = True
            try:
                usage.save()
            except OSError as save_exc:
                log(f"usage: cannot save the counts in {usage.folder}: {save_exc}")


def serve_metrics(address: str, usage: Usage, limits_path: str):
    host, _, port = address.rpartition(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = usage.metrics(read_limits(limits_path)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer((host, int(port)), Handler).serve_forever()


QUEUE = "/proc/sys/net/unix/max_dgram_qlen"


def deepen_records_queue(depth: int):
    """The records' socket queues that many datagrams while this service catches up (the kernel's
    default, 10, dropped all but 11 of 300 records while this service was held: HAProxy then counts
    them in DroppedLogs, and their tokens go uncharged). A socket takes the depth in force when it is
    made: set here, before ours is, on every start (a boot included). Never lowered; the host's
    network namespace's setting (a gateway host's own)."""
    try:
        with open(QUEUE) as f:
            now = int(f.read().strip())
        if now < depth:
            with open(QUEUE, "w") as f:
                f.write(f"{depth}\n")
            log(f"usage: net.unix.max_dgram_qlen raised from {now} to {depth}: records wait there while this "
                f"service catches up")
    except (OSError, ValueError) as exc:
        log(f"usage: cannot raise net.unix.max_dgram_qlen to {depth} ({exc}): a burst of records past the "
            f"kernel's queue is lost (dgemma_usage_records_lost_total counts them)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="the unix datagram socket HAProxy logs to")
    p.add_argument("--runtime-api", required=True, help="HAProxy's runtime API (unix socket)")
    p.add_argument("--state", required=True, help="the folder of the daily counts")
    p.add_argument("--limits", required=True, help="the gateway's limits.map")
    p.add_argument("--listen", default="127.0.0.1:9466", help="/metrics, for Prometheus")
    p.add_argument("--retention-days", type=int, default=400)
    p.add_argument("--records-queue", type=int, default=0,
                   help="the records' socket queue depth to raise net.unix.max_dgram_qlen to (0: leave it)")
    p.add_argument("--readers", type=int, default=READERS,
                   help="processes that read the records (one reads about 20,000 a second)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between two updates of the table")
    p.add_argument("--merge-every", type=float, default=0.5, help="seconds between two reads of the table")
    args = p.parse_args(argv)
    if not 1 <= args.readers <= 64:
        p.error(f"--readers {args.readers}: from 1 to 64")
    usage = Usage(args.state, args.retention_days)
    if args.records_queue:
        deepen_records_queue(args.records_queue)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each datagram's sender (Senders)
    os.makedirs(os.path.dirname(args.socket), exist_ok=True)
    try:
        os.unlink(args.socket)
    except FileNotFoundError:
        pass
    sock.bind(args.socket)
    # HAProxy's workers (its own user, in their container) write here; no one reads it but this service,
    # and it takes records from HAProxy's processes alone (Senders)
    os.chmod(args.socket, 0o622)
    readers = start_readers(sock, args.readers, args.runtime_api)
    sock.close()  # the readers hold it
    api = RuntimeApi(args.runtime_api)
    threading.Thread(target=keep_table, args=(usage, api, args.interval, args.merge_every), daemon=True).start()
    threading.Thread(target=serve_metrics, args=(args.listen, usage, args.limits), daemon=True).start()
    log(f"usage: records from {args.socket} ({args.readers} readers), counts in {args.state}, /metrics on {args.listen}")
    return collect(readers, usage, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
