"""Open WebUI, the client of seed 000, against the lab as the README sets it up: PyPI's
open-webui with exactly the lines `invoke endpoints` prints (the key from `invoke keys.add` in
place of the hidden one), driven in headless Chromium (Debian's, through Playwright's
executable_path). Both models are listed; a chat is answered, streamed; a chat with Open WebUI's
built-in tools on offer and one that asks for a tool both end in a text answer; a key revoked
meanwhile shows as an error, not a spinner. The gateways' request records say what Open WebUI
sent. Screenshots: .test-output/open-webui/."""
import json
import secrets
import socket
import time

import pytest

from tests.lab import open_webui
from tests.lab.conftest import deploy_json, invoke
from tests.conftest import ROOT

SHOTS = ROOT / ".test-output" / "open-webui"
# as the guide's machine notes start Chromium as root on this closed network
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(key_name: str, since: float = 0, model: str | None = None) -> list[dict]:
    """The gateways' records of the key's chat completions from ``since`` (epoch seconds) on."""
    proc = invoke("logs", "--requests", "--key", key_name, "--lines", "200", "--json", "-")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [r for r in json.loads(proc.stdout)["records"] if r["t"] >= since and r["path"] == "/v1/chat/completions"
            and (model is None or r["model"] == model)]


@pytest.fixture(scope="module")
def webui(lab, tmp_path_factory):
    proc, _ = deploy_json()
    assert proc.returncode == 0, proc.stdout[-3000:]
    name = f"open-webui-{secrets.token_hex(3)}"
    added = invoke("keys.add", name)
    assert added.returncode == 0, added.stdout[-2000:] + added.stderr[-2000:]
    key = added.stdout.strip().splitlines()[-1]
    lines = open_webui.endpoint_lines(invoke("endpoints", check=True).stdout)
    # the README's step: the key keys.add printed goes where endpoints hides the inventory's
    env = {**lines, "OPENAI_API_KEYS": key}
    assert {"OPENAI_API_BASE_URLS", "AIOHTTP_CLIENT_SSL_CERT_FILE", "TASK_MODEL_EXTERNAL"} <= set(env), lines
    SHOTS.mkdir(parents=True, exist_ok=True)
    installed = open_webui.install()
    data = tmp_path_factory.mktemp("open-webui")
    server = open_webui.Server(env, data / "data", free_port(), SHOTS / "open-webui.log")
    try:
        started = server.start()
        print(f"Open WebUI {open_webui.VERSION}: installed in {installed:.0f} s, up in {started:.1f} s")
        server.key_name = name
        yield server
    finally:
        server.stop()
        open_webui.remove()
        invoke("keys.revoke", name)


@pytest.fixture(scope="module")
def browser(webui):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, webui, request):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(webui.url + "/", wait_until="domcontentloaded", timeout=60000)
    page.locator("#chat-input").wait_for(timeout=60000)
    page.wait_for_timeout(1000)
    dismiss = page.get_by_text("Okay, Let's Go!")  # the release notes, shown once
    if dismiss.is_visible():
        dismiss.click()
    yield page
    page.screenshot(path=str(SHOTS / f"{request.node.name}.png"))
    context.close()


def send(page, text: str) -> float:
    page.locator("#chat-input").click()
    page.keyboard.type(text)
    page.keyboard.press("Enter")
    return time.monotonic()


def last_answer(page) -> str:
    answers = page.locator("#response-content-container")
    return answers.last.inner_text() if answers.count() else ""


def idle(page) -> bool:
    """Open WebUI is done with the chat: its send area shows voice mode again, not the stop
    button it shows while anything of the chat (its own tasks too) is still generating."""
    return page.get_by_role("button", name="Voice mode").count() > 0


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_both_models_are_listed_and_a_chat_is_answered_streamed(webui, page):
    page.locator("#model-selector-model-button").click()
    # the smallest block with the model search box and gemma4 in it: the list
    menu = page.locator("div").filter(has=page.get_by_placeholder("Search a model")).filter(has_text="gemma4")
    wait_for(lambda: menu.count() > 0, 10, "gemma4 is not in Open WebUI's model list")
    listed = [w for w in menu.last.inner_text().split() if "gemma" in w]
    assert listed == ["diffusiongemma", "gemma4"], menu.last.inner_text()
    page.screenshot(path=str(SHOTS / "models.png"))
    page.keyboard.press("Escape")
    since = time.time()
    started = send(page, "Write a long story about the lab.")
    # a long answer: three of DiffusionGemma's 256-token canvases, nothing cut at 256
    wait_for(lambda: len(last_answer(page).split()) >= 600 and idle(page), 30,
             f"no whole answer: {last_answer(page)[:200]!r}")
    took = time.monotonic() - started
    chats = records(webui.key_name, since, "diffusiongemma")
    assert len(chats) == 1 and chats[0]["status"] == 200 and chats[0]["completion_tokens"] == 600, chats
    assert chats[0]["ttft_ms"] is not None  # the gateway saw a stream (a time to first token: streams alone)
    print(f"a 600-token answer in Open WebUI {took:.1f} s after Enter")


def test_a_chat_with_the_builtin_tools_on_offer_ends_in_text(webui, page):
    """Small talk calls no tool; asking for one is a round trip that ends: the tool's result
    shown, then the answer, in under 10 s, and no more requests after it."""
    since = time.time()
    started = send(page, "What time is it now? Use get_current_timestamp.")
    wait_for(lambda: page.get_by_text("get_current_timestamp").count() > 0 and len(last_answer(page).split()) >= 12
             and idle(page), 10, f"no tool result, answer and end within 10 s: {page.inner_text('body')[-500:]!r}")
    took = time.monotonic() - started
    time.sleep(3)  # a model that kept calling the tool would be asked again meanwhile
    # two of DiffusionGemma's: the one its tool call answered, the one its answer did
    chats = records(webui.key_name, since, "diffusiongemma")
    assert [r["status"] for r in chats] == [200, 200], chats
    tasks = records(webui.key_name, since, "gemma4")
    assert tasks, "Open WebUI's titles and follow-ups go to gemma4 (TASK_MODEL_EXTERNAL)"
    assert all(r["completion_tokens"] < 50 for r in tasks), tasks  # short JSON answers, as a model gives them
    # its title, from the JSON gemma4 answered (the stand-in's: the prompt's own example)
    wait_for(lambda: page.get_by_text("your concise title here").count() > 0, 10, "no title from gemma4")
    print(f"a chat with a tool round trip ended in {took:.1f} s; {len(tasks)} of Open WebUI's own tasks went to gemma4")


def test_a_revoked_key_shows_as_an_error_not_a_spinner(webui, page):
    revoked = invoke("keys.revoke", webui.key_name)
    assert revoked.returncode == 0, revoked.stdout[-2000:]
    started = send(page, "Say hi in one sentence.")
    wait_for(lambda: "401" in page.inner_text("body") or "Unauthorized" in page.inner_text("body"), 20,
             f"no error shown: {page.inner_text('body')[-500:]!r}")
    print(f"the revoked key's error shown {time.monotonic() - started:.1f} s after Enter")
