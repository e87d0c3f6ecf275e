"""docs/accounting.md's contract table says, for every variable the gateway's rules and its Lua
share, who writes it and who reads it: checked here against the code, so that the table is the
code's and a change to either fails until both agree."""
import re
import sys
from pathlib import Path

from tests.conftest import ROOT

ACCOUNTING = ROOT / "serving" / "accounting"  # the gateway's rules, its Lua and its usage service
COMMON = ROOT / "serving" / "haproxy" / "templates" / "common.cfg.j2"  # what the front doors share with it
LUA = ACCOUNTING / "files" / "usage.lua"
DOC = ROOT / "docs" / "accounting.md"
NAME = r"(?:txn|proc)\.[a-z0-9_]+"


def _rules() -> tuple[str, str]:
    """The gateway's rules (its template and the common one) less the record's log-format, and the
    log-format alone."""
    text = (ACCOUNTING / "templates" / "gateway.cfg.j2").read_text() + COMMON.read_text()
    record = next(line for line in text.splitlines() if line.strip().startswith("log-format"))
    return text.replace(record, ""), record


def _lua() -> str:
    return "\n".join(line for line in LUA.read_text().splitlines() if not line.lstrip().startswith("--"))


def code_contract() -> dict[str, tuple[set, set]]:
    """Each variable: who writes it and who reads it, as the code says."""
    rules, record = _rules()
    lua = _lua()
    # usage.lua's budgets name their variables in a table (KEY_BUDGET, WHOLE_BUDGET) and write them
    # through it: txn:set_var(budget.left, ...)
    budget_fields = re.findall(rf'(\w+) = "({NAME})"', lua)
    names = set(re.findall(NAME, rules)) | set(re.findall(NAME, record)) | set(re.findall(rf'"({NAME})"', lua))
    contract = {}
    for name in names:
        q = re.escape(name)
        fields = [f for f, n in budget_fields if n == name]
        writers, readers = set(), set()
        if re.search(rf"set-var\({q}\)", rules):
            writers.add("rules")
        if re.search(rf'set_var\("{q}"', lua) or any(re.search(rf"set_var\(budget\.{f}\b", lua) for f in fields):
            writers.add("Lua")
        if re.search(rf"(?<!set-)var\({q}\)|concat\([^)]*,{q}\)|sub\({q}\)", rules):
            readers.add("rules")
        if re.search(rf'(get_var|yes)\("{q}"', lua) or any(re.search(rf"get_var\(budget\.{f}\b", lua) for f in fields):
            readers.add("Lua")
        if re.search(rf"var\({q}\)", record):
            readers.add("record")
        contract[name] = (writers, readers)
    return contract


def doc_contract() -> dict[str, tuple[set, set]]:
    rows = re.findall(rf"^\| `({NAME})` \| [^|]+ \| ([^|]+) \| ([^|]+) \|$", DOC.read_text(), re.M)

    def parts(cell: str) -> set:
        return {p.strip() for p in cell.split(",") if p.strip() and p.strip() != "(nothing)"}
    return {name: (parts(w), parts(r)) for name, w, r in rows}


def test_the_docs_contract_table_is_the_codes():
    code, doc = code_contract(), doc_contract()
    assert sorted(set(code) - set(doc)) == [], "variables the code shares that the table does not name"
    assert sorted(set(doc) - set(code)) == [], "variables the table names that the code no longer has"
    wrong = {name: {"code": code[name], "table": doc[name]} for name in code if code[name] != doc[name]}
    assert wrong == {}, "docs/accounting.md's contract table says otherwise"


def test_the_check_sees_a_variable_it_is_not_told_of(tmp_path, monkeypatch):
    """The check fails when the rules gain a variable the table does not name."""
    template = tmp_path / "templates" / "gateway.cfg.j2"
    template.parent.mkdir()
    template.write_text((ACCOUNTING / "templates" / "gateway.cfg.j2").read_text() + "\n    http-request set-var(txn.brand_new) int(1)\n")
    monkeypatch.setattr(sys.modules[__name__], "ACCOUNTING", tmp_path)
    code = code_contract()
    assert code["txn.brand_new"] == ({"rules"}, set()) and "txn.brand_new" not in doc_contract()
