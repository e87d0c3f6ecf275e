"""Glue for `invoke tune`: for each bound a trial (the replica rolled to it and held out of
service), its counters read, the prompts sent to it alone, its counters read again; then the
host deployed as the inventory says (with ``--apply``, once the bound is written there), which
puts the replica back on its settings and in service, however the trials ended (Ctrl-C and
SIGTERM included). One connection to the host for the whole run."""
from __future__ import annotations

import signal
import ssl
import time
import urllib.error

from rich.console import Console
from rich.table import Table

import roles
from converge.errors import InventoryError
from converge.inventory_write import file_for, set_variable
from converge.report import write_json
from serving.declared import served_name
from roles.preflight.role import FACTS_ROLE
from serving.replicas import replica as replica_of

from . import benchmark
from .endpoints import YOUR_KEY, api_key, endpoints
from .tune import (BOUND, HOW_TO_READ, Answer, Prompt, Trial, answers_page, document, reading_role, request_body,
                   trial_role)

# a replica held out of service by a trial, as its front door says it (MAINT: never put back)
HELD_STATES = ("DRAIN", "MAINT")


class Stopped(Exception):
    """Ctrl-C or SIGTERM between the engine's runs (its own runs say theirs in the report)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _on_terminate(signum, frame):
    raise Stopped("SIGTERM")


class Tune:
    """``run_roles``: the command line's way to run roles on hosts (its errors, its recap: cli/runs.py's
    run); ``load_play``: its way to load the inventory again (after --apply wrote it)."""

    def __init__(self, play, host: str, load_play, inventory, run_roles, console: Console | None = None):
        self.play, self.host, self.load_play, self.inventory = play, host, load_play, inventory
        self.run_roles = run_roles
        self.console = console or Console(highlight=False)
        self.connections = None
        self.index: int | None = None  # the replica the trials take
        self.interrupted: str | None = None
        # every trial begun, its answers so far (one interrupted mid-way included): once one has
        # begun, the host is deployed back whatever happens
        self.trials: list[Trial] = []

    # ------------------------------------------------------------ the engine's runs

    def _run(self, role_list, title: str | None, play=None):
        return self.run_roles(play or self.play, role_list, self.host, title=title, connections=self.connections)

    def _failure(self, report) -> str:
        if report.interrupted:
            return f"interrupted ({report.interrupted})"
        failed = [t for t in report.tasks if t.host == self.host and t.status in ("failed", "unreachable")]
        return (failed[-1].message if failed else report.halted or "the run failed").strip()

    def reading(self) -> dict:
        """The host's replicas (their settings in force, health, diffusion counters) and their front
        door states, over the run's connection."""
        report = self._run([reading_role()], None)
        return (report.extra.get(self.host) or {}).get("tune") or {}

    # ------------------------------------------------------------ one trial

    def trial(self, bound: float, prompts: list[Prompt], repeats: int, base_url: str, key: str, model: str,
              timeout: float) -> Trial:
        trial = Trial(bound)
        self.trials.append(trial)
        report = self._run([FACTS_ROLE, trial_role(bound, self.index)], f"TRIAL {BOUND} {bound:g}")
        if report.interrupted:
            self.interrupted = report.interrupted
            trial.failed = f"interrupted ({report.interrupted}) during its roll"
            return trial
        if report.failed:
            trial.failed = self._failure(report)
            return trial
        if self.index is None:
            self.index = _trial_index(report, self.host)
        seen = self.reading()
        problem = self._not_held(seen, bound)
        if problem:
            trial.failed = problem
            return trial
        trial.settings = (seen["replicas"].get(self.index) or {}).get("diffusion")
        trial.counters_before = (seen["replicas"].get(self.index) or {}).get("denoising")
        for repeat in range(repeats):
            for i, prompt in enumerate(prompts):
                self.console.print(f"[dim]  … {self.host} replica {self.index} {BOUND} {bound:g}: prompt {i + 1}/"
                                   f"{len(prompts)}{f', repeat {repeat + 1}/{repeats}' if repeats > 1 else ''}[/dim]")
                trial.answers.append(_ask(base_url, key, model, prompt, i, repeat, self.index, timeout))
        after = self.reading()
        trial.counters_after = (after.get("replicas", {}).get(self.index) or {}).get("denoising")
        return trial

    def _not_held(self, seen: dict, bound: float) -> str | None:
        """Why the trial's replica cannot be measured: not on the bound, or not out of users' way."""
        probe = (seen.get("replicas") or {}).get(self.index) or {}
        in_force = (probe.get("diffusion") or {}).get(BOUND)
        if in_force is None or float(in_force) != bound:
            return f"replica {self.index} runs {BOUND} {in_force}, not {bound:g}, after its roll"
        server = replica_of(self.play.hostvars(self.host), self.index).server
        state = ((seen.get("frontdoor") or {}).get(server) or {}).get("status", "")
        if not state.startswith(HELD_STATES):
            return (f"replica {self.index} is {state or 'not seen'} in its front door, not held out of service: its "
                    f"prompts would share it with users' requests")
        return None

    # ------------------------------------------------------------ back on the inventory's settings

    def restore(self, apply_bound: float | None, apply_to: tuple[str, str] | None) -> tuple[bool, str]:
        """The host deployed as the inventory says (with ``apply_bound`` written there first):
        the trial's replica rolled back and put in service, the flags lowered."""
        play = self.play
        written = ""
        if apply_bound is not None:
            kind, name = apply_to
            path = file_for(self.play.inventory, kind, name, BOUND)
            try:
                set_variable(path, BOUND, apply_bound)
            except InventoryError as exc:
                return False, "; ".join(exc.problems)
            written = f"{BOUND}: {apply_bound:g} written to {path}"
            self.console.print(written)
            play = self.load_play(self.inventory)
        title = f"TUNE: {self.host} on {'the bound applied' if apply_bound is not None else 'the inventory’s settings'}"
        report = self._run(roles.load(), title, play)
        if report.failed:
            return False, self._failure(report)
        return True, written


def _trial_index(report, host: str) -> int | None:
    found = (report.extra.get(host) or {}).get("tune_trial") or {}
    return found.get("replica")


def _ask(base_url, key, model, prompt: Prompt, index: int, repeat: int, replica: int, timeout: float) -> Answer:
    started = time.perf_counter()
    try:
        reply = benchmark._post(base_url, key, request_body(model, prompt), timeout, replica)
        message = reply["choices"][0]["message"]
        return Answer(index, repeat, time.perf_counter() - started, int(reply["usage"]["completion_tokens"]),
                      message.get("content") or "")
    except urllib.error.HTTPError as exc:
        body = exc.read()[:300].decode(errors="replace")
        return Answer(index, repeat, time.perf_counter() - started, error=f"HTTP {exc.code}: {body}")
    except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError, ValueError) as exc:
        return Answer(index, repeat, time.perf_counter() - started, error=str(exc)[:300])


def run(play, load_play, run_roles, inventory, host: str, bounds: list[float], prompts: list[Prompt], repeats: int,
        json_target: str | None, answers_path: str | None, apply_bound: float | None,
        apply_to: tuple[str, str] | None, replica: int | None, timeout: float) -> int:
    """The whole tune; returns the exit code (0, 1: a trial or the way back failed, 130/143)."""
    console = Console(stderr=json_target == "-", highlight=False)
    hostvars = {h: play.hostvars(h) for h in play.inventory.host_names}
    v = hostvars[host]
    tune = Tune(play, host, load_play, inventory, run_roles, console)
    tune.index = replica
    trials = tune.trials
    restored, why, written = None, "", ""
    old = signal.signal(signal.SIGTERM, _on_terminate)
    try:
        with play.connections() as connections:
            tune.connections = connections
            try:
                if bounds:
                    key, problem = api_key(hostvars, show=True)
                    if problem or key == YOUR_KEY:
                        console.print(f"[red]{problem or 'tune sends its prompts with the inventory’s key: set api_key_file (a 0600 file)'}[/red]")
                        return 2
                    benchmark.TLS["context"] = ssl.create_default_context(cafile=endpoints(hostvars)["ca_file"])
                    base_url = next(h["url"] for h in endpoints({host: v})["hosts"])
                    model = served_name("diffusiongemma", v)
                    for bound in bounds:
                        trial = tune.trial(bound, prompts, repeats, base_url, key, model, timeout)
                        if trial.failed or tune.interrupted:
                            break
            except KeyboardInterrupt:
                tune.interrupted = "Ctrl-C"
            except Stopped as exc:
                tune.interrupted = exc.why
            # always: back on the inventory's settings (or the bound applied), in service
            if tune.interrupted:
                console.print(f"[yellow]{tune.interrupted}: putting {host} back on its settings and in service"
                              f"{'' if tune.interrupted == 'SIGTERM' else ' (Ctrl-C again stops that too)'}[/yellow]")
            failed_trial = any(t.failed for t in trials)
            apply_now = apply_bound if not tune.interrupted and not failed_trial else None
            if trials or apply_now is not None:
                try:
                    restored, why = tune.restore(apply_now, apply_to)
                except (KeyboardInterrupt, Stopped) as exc:
                    restored, why = False, f"interrupted ({getattr(exc, 'why', 'Ctrl-C')})"
                written = why if restored else ""
    finally:
        signal.signal(signal.SIGTERM, old)
    if answers_path and trials:
        with open(answers_path, "w") as handle:
            handle.write(answers_page(host, prompts, trials))
    write_json(document(host, tune.index, v.get(BOUND, 0.1), prompts, repeats, trials,
                        answers_path if trials else None, restored, apply_now if restored else None,
                        tune.interrupted), json_target)
    _print(console, host, tune.index, v.get(BOUND, 0.1), trials, answers_path)
    for trial in trials:
        if trial.failed:
            console.print(f"[red]{host}: the trial of {BOUND} {trial.bound:g} failed: {trial.failed}[/red]",
                          soft_wrap=True)
    if restored is False:
        console.print(f"[red]{host}: putting it back on the inventory's settings failed: {why}. Run: invoke deploy "
                      f"--hosts {host}[/red]", soft_wrap=True)
    elif restored and trials:
        console.print(f"{host}: replica {tune.index} back on "
                      f"{'the bound applied' if written else 'the inventory’s settings'} and in service")
    elif restored:
        console.print(f"{host}: its replicas run {BOUND} {apply_bound:g}, in service")
    if tune.interrupted:
        return 143 if tune.interrupted == "SIGTERM" else 130
    return 1 if restored is False or any(t.failed for t in trials) else 0


def _print(console: Console, host: str, index, inventory_bound, trials: list[Trial], answers_path):
    if not trials:
        return
    table = Table("bound", "requests", "errors", "p50 s", "p90 s", "tok/s", "steps/tok", "fill",
                  title=f"TUNE {host} replica {index} (the inventory's bound: {inventory_bound})", title_justify="left")
    for trial in trials:
        f = trial.figures()
        table.add_row(f"{trial.bound:g}", str(f["requests"]), str(f["errors"]), _n(f["latency_p50_s"], 3),
                      _n(f["latency_p90_s"], 3), _n(f["tokens_per_s"], 1), _n(f["steps_per_committed_token"], 4),
                      _n(f["canvas_fill"], 4))
    console.print(table)
    console.print(HOW_TO_READ.replace("HOST", host), soft_wrap=True)
    if answers_path:
        console.print(f"the answers side by side: {answers_path}")


def _n(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
