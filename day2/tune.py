"""`invoke tune`: the entropy bound tried on the user's own prompts (seed 001's recipe: keep
Google's defaults for the first deploy, measure latency and output quality on ten representative
prompts, then nudge the bound).

For each bound, one replica of the host is rolled to it through the fleet's roll, held out of
service (roles/service/rollout.py, ``hold``: no user's request reaches a replica on trial
settings), the prompts are sent to it alone through its front door, and vLLM's diffusion
counters are read from it before and after (vllm/v1/spec_decode/metrics.py: there is no
per-request pass count; the counters' deltas over the prompts are the true figure). Then the
host is deployed as the inventory says, which rolls the replica back and puts it in service.

This module holds the parts with no connection: the options read and checked, the trial's and
the reading's roles (facts in, a roll out), and the report. day2/tune_run.py runs them."""
from __future__ import annotations

import dataclasses
import html
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from converge.changes import File, Role
from converge.errors import StepFailed
from converge.secrets import read_optional_secret as read_secret

from serving.declared import is_diffusion
from serving.fleet import is_serving
from serving.handoffs import CHOICE
from serving.haproxy.admin import ADMIN_SOCKET
from serving.haproxy.stats import ServerStates
from serving.replicas import Served
from roles.service.role import facts as service_facts, is_nixos, render_unit
from roles.service.rollout import command as roll_command, fleet_throttle, plan_roll
from serving.serving_host import is_running, unit_file, unit_state

from .benchmark import percentile
from .readings import ServiceProbe, denoising_ratios

BOUND = "diffusion_entropy_bound"
# the schema's (roles/service/schema.yml): greater than 0, at most 10
BOUND_MAX = 10.0
MAX_PROMPTS = 200
DEFAULT_MAX_TOKENS = 512


class TuneError(Exception):
    """An option or a prompts file that cannot be used: the message says which and why (exit 2)."""


def parse_bounds(text: str | None) -> list[float]:
    """``--bounds 0.05,0.1,0.2``: each greater than 0 and at most 10 (the schema's), each once, in
    the order given."""
    if not text or not str(text).strip():
        raise TuneError("--bounds: give the entropy bounds to try, comma-separated (e.g. --bounds 0.05,0.1,0.2)")
    out = []
    for word in str(text).split(","):
        try:
            bound = float(word.strip())
        except ValueError:
            raise TuneError(f"--bounds {text}: {word.strip()!r} is not a number") from None
        _in_range(bound, f"--bounds {text}: {word.strip()}")
        if bound in out:
            raise TuneError(f"--bounds {text}: {word.strip()} is given twice")
        out.append(bound)
    return out


def parse_bound(text, option: str = "--apply") -> float:
    """One entropy bound (``--apply 0.15``), in the schema's range."""
    try:
        bound = float(str(text).strip())
    except ValueError:
        raise TuneError(f"{option} {text}: expected one entropy bound, a number (e.g. {option} 0.15)") from None
    _in_range(bound, f"{option} {text}")
    return bound


def _in_range(bound: float, said: str):
    """The schema's range for diffusion_entropy_bound (roles/service/schema.yml)."""
    if not 0 < bound <= BOUND_MAX:
        raise TuneError(f"{said} is out of range: an entropy bound is greater than 0 and at most {BOUND_MAX:g}")


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    where: str = ""  # file:line, for the report


def read_prompts(path: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Prompt]:
    """The prompts file: plain text, one prompt a line (blank lines and ``#`` comments skipped);
    or YAML/JSON (``.yml``, ``.yaml``, ``.json``): a list of prompts, each a string or a mapping
    ``{prompt: ..., max_tokens: N}`` (a prompt of several lines). A problem names the file and line."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise TuneError(f"--prompts {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TuneError(f"--prompts {path}: not text (UTF-8)") from None
    prompts: list[Prompt] = []
    if source.suffix.lower() in (".yml", ".yaml", ".json"):
        from converge import yamlsrc
        try:
            doc = yamlsrc.load_text(text, source)
        except yamlsrc.InputError as exc:
            raise TuneError(f"{path}:{exc.line or 1}: {exc.message}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            raise TuneError(f"{path}:{mark.line + 1 if mark else 1}: not YAML ({getattr(exc, 'problem', None) or exc})") \
                from None
        if not isinstance(doc.data, list):
            raise TuneError(f"{path}:1: expected a list of prompts (each a string, or a mapping with prompt: and "
                            f"max_tokens:)")
        for i, item in enumerate(doc.data):
            line = doc.line_of((i,))
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
                raise TuneError(f"{path}:{line}: prompt {i + 1}: expected a string, or a mapping with a prompt: string")
            unknown = sorted(set(item) - {"prompt", "max_tokens"})
            if unknown:
                raise TuneError(f"{path}:{line}: prompt {i + 1}: unknown key {unknown[0]!r} (prompt and max_tokens "
                                f"are read)")
            limit = item.get("max_tokens", max_tokens)
            if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1048576:
                raise TuneError(f"{path}:{doc.line_of((i, 'max_tokens'))}: prompt {i + 1}: max_tokens must be a whole "
                                f"number from 1 to 1048576")
            prompts.append(Prompt(item["prompt"], limit, f"{path}:{line}"))
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                prompts.append(Prompt(line.strip(), max_tokens, f"{path}:{number}"))
    if not prompts:
        raise TuneError(f"--prompts {path}: no prompt in it (one a line; blank lines and # comments are skipped)")
    if len(prompts) > MAX_PROMPTS:
        raise TuneError(f"--prompts {path}: {len(prompts)} prompts; at most {MAX_PROMPTS} (seed 001's recipe "
                        f"asks ten representative ones)")
    return prompts


def request_body(model: str, prompt: Prompt) -> dict:
    """As the seeds benchmark: non-streaming, temperature 0, thinking off (DOMAIN.md)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt.text}], "temperature": 0,
            "stream": False, "max_tokens": prompt.max_tokens, "chat_template_kwargs": {"enable_thinking": False}}


# ---------------------------------------------------------------- the roles

def _trial_replica(ctx, index: int | None):
    """The placed replica a trial takes: ``index``, else the host's first diffusion replica."""
    placed = [p for p in ctx.results[CHOICE].replicas if is_diffusion(p.family)]
    if not placed:
        raise StepFailed(f"{ctx.name} serves no diffusion model: the entropy bound means nothing there")
    if index is None:
        return placed[0]
    found = [p for p in placed if p.index == index]
    if not found:
        raise StepFailed(f"{ctx.name} has no diffusion replica {index} (its diffusion replicas: "
                         f"{', '.join(str(p.index) for p in placed)}): see invoke status --hosts {ctx.name}")
    return found[0]


def trial_role(bound: float, index: int | None = None) -> Role:
    """One replica of the host rolled to ``bound`` and held out of service once it passed its gate
    (its unit rewritten with the bound; a failed gate goes back to what it ran, in service). Its
    summary names the replica it took."""
    chosen: dict[str, int] = {}

    def plan(ctx):
        v = ctx.vars
        if is_nixos(ctx):
            raise StepFailed(f"{ctx.name} runs NixOS: its units are declared by its configuration, and a trial "
                             f"cannot roll one replica alone there. Set {BOUND} in its inventory and deploy, or "
                             f"tune on a host of the same GPU that is not NixOS")
        placed = _trial_replica(ctx, index)
        chosen[ctx.name] = placed.index
        served = Served.of(v, placed)
        replica = served.replica
        if not is_running(unit_state(ctx, replica)):
            raise StepFailed(f"{ctx.name}: {replica.unit} is not running: a trial rolls a running replica. "
                             f"Start it first: invoke start --hosts {ctx.name} --replica {replica.index}")
        trial = dataclasses.replace(served, settings=served.settings + ((BOUND, bound),))
        has_token = bool(read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name))
        image = ctx.results[CHOICE].image
        current = unit_file(ctx, replica) or {}
        written = File(f"replica {replica.index} unit with {BOUND} {bound:g}", path=replica.unit_path,
                       content=render_unit(v, image, trial, has_token), mode="0644", current=current)
        roll = plan_roll(ctx, "restart", [replica], unit_file=written, unit_path=replica.unit_path, image=image,
                         same_image_ref=image in current.get("content", ""), hold=True)
        yield roll_command(roll, f"trial {BOUND} {bound:g} (replica {replica.index})", throttle=fleet_throttle(ctx),
                           describe=f"roll {replica.unit} to {BOUND} {bound:g}: out of service in the front door, "
                                    f"write the unit, restart, gate, and held out of service for the trial",
                           diff=written.diff())

    def summary(ctx):
        return {"tune_trial": {"replica": chosen.get(ctx.name)}}

    return Role("tune trial", service_facts, plan, summary=summary, hosts=is_serving)


def reading_role() -> Role:
    """Each replica's settings in force, health and vLLM's diffusion counters (the status probe),
    and each one's state in its front door."""
    def summary(ctx):
        if ctx.facts is None:
            return {}
        return {"tune": {"replicas": ctx.facts.get("probe") or {},
                         "frontdoor": ctx.facts.get("frontdoor_servers") or {}}}

    return Role("tune reading", lambda v: {"probe": ServiceProbe(v), "frontdoor_servers": ServerStates(ADMIN_SOCKET)},
                lambda ctx: iter(()), summary=summary, hosts=is_serving)


# ---------------------------------------------------------------- the report

@dataclass
class Answer:
    prompt: int  # its index in the prompts
    repeat: int
    latency_s: float
    completion_tokens: int = 0
    text: str = ""
    error: str = ""


@dataclass
class Trial:
    bound: float
    answers: list = field(default_factory=list)
    counters_before: dict | None = None
    counters_after: dict | None = None
    settings: dict | None = None  # the diffusion settings the replica ran (its command line)
    failed: str = ""  # why the trial did not run to its end

    def figures(self) -> dict:
        good = [a for a in self.answers if not a.error]
        latencies = [a.latency_s for a in good]
        tokens = sum(a.completion_tokens for a in good)
        grown = counter_delta(self.counters_before, self.counters_after)
        return {"bound": self.bound, "requests": len(self.answers), "errors": len(self.answers) - len(good),
                "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
                "latency_p90_s": round(percentile(latencies, 0.9), 3) if latencies else None,
                "tokens_per_s": round(tokens / sum(latencies), 1) if latencies and sum(latencies) > 0 else None,
                "completion_tokens": tokens,
                **(grown or {"denoising_steps": None, "canvas_positions": None, "committed_tokens": None,
                             "steps_per_committed_token": None, "canvas_fill": None}),
                "settings": self.settings, "failed": self.failed or None}


COUNTERS = ("denoising_steps", "canvas_positions", "committed_tokens")


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the prompts cost the replica, from its counters before and after them; None when either
    reading is missing, or the counters went back (the replica restarted in between)."""
    if not before or not after:
        return None
    grown = {k: after[k] - before[k] for k in COUNTERS}
    if any(v < 0 for v in grown.values()):
        return None
    return {**grown, **denoising_ratios(grown["denoising_steps"], grown["canvas_positions"],
                                        grown["committed_tokens"])}


def document(host: str, replica: int | None, inventory_bound, prompts: list[Prompt], repeats: int,
             trials: list[Trial], answers_file: str | None, restored: bool | None, applied,
             interrupted: str | None) -> dict:
    """``--json``: the figures per bound, each answer, and how the run ended."""
    return {"host": host, "replica": replica, "inventory_bound": inventory_bound, "repeats": repeats,
            "prompts": [{"prompt": p.text, "max_tokens": p.max_tokens, "where": p.where} for p in prompts],
            "trials": [{**t.figures(), "answers": [dataclasses.asdict(a) for a in t.answers]} for t in trials],
            "answers_file": answers_file, "restored": restored, "applied": applied, "interrupted": interrupted,
            "how_to_read": HOW_TO_READ.replace("HOST", host)}


HOW_TO_READ = ("steps_per_committed_token: vLLM's denoising steps over the tokens it committed (whole canvases) "
               "while the replica answered these prompts; fewer is faster and rougher (a higher bound). Judge the "
               "answers' quality side by side in the answers file, then: invoke tune --hosts HOST --apply BOUND")


def answers_page(host: str, prompts: list[Prompt], trials: list[Trial]) -> str:
    """The answers side by side, a prompt a row and a bound a column, as a page a person reads in
    a browser (every text escaped)."""
    head = "".join(f"<th>entropy bound {t.bound:g}<br><small>{_figures_line(t)}</small></th>" for t in trials)
    rows = []
    for i, prompt in enumerate(prompts):
        cells = []
        for t in trials:
            mine = [a for a in t.answers if a.prompt == i]
            shown = "".join(
                f"<div class=answer><div class=meta>{'repeat ' + str(a.repeat + 1) + ' · ' if len(mine) > 1 else ''}"
                f"{a.latency_s:.2f} s · {a.completion_tokens} tokens</div>"
                f"<pre>{html.escape(a.error or a.text)}</pre></div>" for a in mine)
            cells.append(f"<td>{shown or '<em>not run</em>'}</td>")
        rows.append(f"<tr><th class=prompt><pre>{html.escape(prompt.text)}</pre><small>{html.escape(prompt.where)}"
                    f"</small></th>{''.join(cells)}</tr>")
    return ("<!doctype html><html><head><meta charset=utf-8><title>invoke tune: " + html.escape(host) +
            "</title><style>body{font-family:sans-serif}table{border-collapse:collapse;width:100%}"
            "td,th{border:1px solid #ccc;vertical-align:top;padding:6px;text-align:left}"
            "pre{white-space:pre-wrap;margin:0}.meta{color:#666;font-size:small}th.prompt{width:20%}</style></head>"
            f"<body><h1>Entropy bound trials on {html.escape(host)}</h1><p>{html.escape(HOW_TO_READ.replace('HOST', host))}</p>"
            f"<table><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table></body></html>\n")


def _figures_line(trial: Trial) -> str:
    f = trial.figures()
    parts = []
    if f["steps_per_committed_token"] is not None:
        parts.append(f"{f['steps_per_committed_token']:.3f} steps/token")
    if f["latency_p50_s"] is not None:
        parts.append(f"p50 {f['latency_p50_s']:.2f} s")
    if f["errors"]:
        parts.append(f"{f['errors']} errors")
    if trial.failed:
        parts.append("failed: " + trial.failed[:80])
    return html.escape(" · ".join(parts))


def prompts_sample() -> str:
    """What a prompts file looks like (the guide's, and --help's)."""
    return yaml.safe_dump([{"prompt": "Summarise this ticket in two sentences: ...", "max_tokens": 128},
                           "Write a Python function that parses ISO 8601 dates."], sort_keys=False)


def json_dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2)
