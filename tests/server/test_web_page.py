"""The web page in a real headless Chromium: a reply streams in, Stop cuts one, a reload resumes the session.

Chromium is driven through chromedriver's W3C WebDriver HTTP API by the few
calls below (http.client, no new dependency). Without Debian's `chromium` and
`chromium-driver` the test is skipped; `make test` installs them.
Set STREAMCHAT_WEB_SCREENSHOT=docs/web.png to save the README's screenshot.
"""

import asyncio
import base64
import http.client
import os
import shutil
import socket
import subprocess
import time

import orjson
import pytest
from conftest import Client, settled_stats

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver; "
           "make test installs them)")]

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference


class Browser:
    """One headless Chromium session through a chromedriver subprocess."""

    def __init__(self, profile_dir):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.driver = subprocess.Popen([shutil.which("chromedriver"), f"--port={self.port}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self._call("GET", "/status")["ready"]:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.1)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                "--window-size=1100,760", f"--user-data-dir={profile_dir}"]
        caps = {"browserName": "chrome", "goog:loggingPrefs": {"browser": "ALL"},
                "goog:chromeOptions": {"binary": shutil.which("chromium"), "args": args}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def _call(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, orjson.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            answer = orjson.loads(conn.getresponse().read())["value"]
        finally:
            conn.close()
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(f"webdriver {path}: {answer['error']}: {answer.get('message')}")
        return answer

    def call(self, method, path, body=None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def open(self, url):
        self.call("POST", "/url", {"url": url})

    def js(self, script, *args):
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def element(self, css):
        return self.call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def click(self, css):
        self.call("POST", f"/element/{self.element(css)}/click", {})

    def type(self, css, text):
        """Replaces the field's text by typing `text` into it."""
        el = self.element(css)
        self.call("POST", f"/element/{el}/clear", {})
        self.call("POST", f"/element/{el}/value", {"text": text})

    def text(self, css):
        return self.js("return document.querySelector(arguments[0]).textContent", css)

    def wait(self, script, *args, timeout=60):
        """The first truthy value of `script`, polled."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(script, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for: {script}")
            time.sleep(0.05)

    def console_errors(self):
        return [e["message"] for e in self.call("POST", "/se/log", {"type": "browser"}) if e["level"] == "SEVERE"]

    def screenshot(self):
        return base64.b64decode(self.call("GET", "/screenshot"))

    def quit(self):
        try:
            self.call("DELETE", "")
        finally:
            self.driver.terminate()
            self.driver.wait(timeout=10)


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "profile")
    yield b
    b.quit()


MESSAGES = "return [...document.querySelectorAll('#log .msg')].map(m => [m.classList[1], " \
           "m.querySelector('.text').textContent, m.dataset.status])"
LAST_STATUS = "const m = [...document.querySelectorAll('#log .msg.assistant')].pop(); return m && m.dataset.status"
# Records the length of the last reply's text at every DOM change, to see it grow delta by delta.
WATCH_GROWTH = """
window.lengths = [];
new MutationObserver(() => {
  const m = [...document.querySelectorAll('#log .msg.assistant')].pop();
  if (m) window.lengths.push(m.querySelector('.text').textContent.length);
}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
"""


def say(browser, text):
    browser.type("#input", text)
    browser.click("#send")
    browser.wait("return document.querySelectorAll('#log .msg.assistant').length > 0")


def finished(browser, timeout=60):
    return browser.wait(f"const s = (() => {{ {LAST_STATUS} }})(); return s !== 'in_progress' && s",
                        timeout=timeout)


def stat(browser, name):
    return browser.text(f"#stat-{name}")


def shown_figures(browser):
    return {name: stat(browser, name) for name in ("context", "total", "evicted", "cached", "prefix", "tier", "blocks")}


def daemon_figures(daemon, session_id, token):
    """The session's settled stats from the daemon over a websocket of the test's own, as the page words them."""

    async def go():
        c = await Client.open(daemon.url)
        await c.send({"type": "streamchat.session.resume", "session_id": session_id, "resume_token": token})
        assert (await c.recv())["type"] == "streamchat.session.resumed"
        s = await settled_stats(c)
        await c.close()
        return s

    s = asyncio.run(go())
    return {"context": str(s["context_tokens"]), "total": str(s["total_tokens"]), "evicted": str(s["evicted_tokens"]),
            "cached": str(s["cached_tokens"]), "tier": s["tier"] + (" (saved on disk)" if s["on_disk"] else ""),
            "prefix": f"{s['prefix']['hit_tokens']} of {s['prefix']['queried_tokens']} tokens",
            "blocks": f"{s['blocks']['owned']} owned, {s['blocks']['shared']} shared"}


def test_chat_streams_stops_and_resumes_after_a_reload(daemon, browser):
    """Type, watch the reply grow, stop one mid-way, reload: same session, same messages, a new answer."""
    page = f"http://127.0.0.1:{daemon.port}/"
    browser.open(page)
    assert browser.wait("return document.getElementById('status').textContent === 'new session'")
    session_id = browser.text("#session-id")
    assert session_id.startswith("sess_")

    browser.type("#instructions", "You are a helpful assistant who answers briefly.")
    browser.click("#set-instructions")
    browser.wait("return document.getElementById('status').textContent === 'system prompt set'")

    browser.type("#temperature", "0")
    browser.type("#max_output_tokens", "24")
    browser.js(WATCH_GROWTH)
    say(browser, "Hello! Who are you?")
    assert finished(browser) in ("completed", "incomplete")
    lengths = browser.js("return window.lengths")
    reply = browser.js(MESSAGES)[-1][1]
    growth = sorted(set(n for n in lengths if 0 < n < len(reply)))
    assert reply and len(growth) >= 2, (lengths, reply)  # text arrived in several deltas before the end

    browser.type("#max_output_tokens", "200")
    say(browser, "Write a long story about a dragon who learns to bake bread.")
    browser.wait("return document.querySelector('#log .msg.assistant:last-child .text').textContent.length > 0")
    browser.click("#stop")
    assert finished(browser) == "cancelled"
    assert "stopped" in browser.text("#log .msg.assistant:last-child .meta")

    browser.wait("return document.getElementById('stat-context').textContent !== '–'")
    assert int(stat(browser, "context")) > 0 and stat(browser, "tier") == "device"
    total_before = int(stat(browser, "total"))
    before = browser.js(MESSAGES)
    assert [role for role, _, _ in before] == ["user", "assistant", "user", "assistant"]
    assert before[1][2] in ("completed", "incomplete") and before[3][2] == "cancelled"

    browser.open(page)  # a reload
    assert browser.wait("const t = document.getElementById('status').textContent; "
                        "return t.startsWith('resumed') && t")
    assert browser.text("#session-id") == session_id
    assert browser.js(MESSAGES) == before
    assert browser.js("return document.getElementById('instructions').value") == \
        "You are a helpful assistant who answers briefly."

    browser.type("#max_output_tokens", "16")
    say(browser, "Thank you!")
    assert finished(browser) in ("completed", "incomplete")
    assert browser.js(MESSAGES)[-1][1]
    browser.wait("return Number(document.getElementById('stat-total').textContent) > arguments[0]", total_before)
    assert browser.text("#session-id") == session_id
    # the figures shown are the daemon's for this session. The page asks when a reply ends, while the reply's
    # close still waits to enter the cache (3 tokens short); once the session settled, one more request shows
    # the daemon's figures exactly
    token = browser.js("return JSON.parse(localStorage.getItem('streamchat.session')).resume_token")
    figures = daemon_figures(daemon, session_id, token)
    browser.js("requestStats()")
    browser.wait(f"return document.getElementById('stat-context').textContent === '{figures['context']}'")
    assert shown_figures(browser) == figures
    assert browser.console_errors() == []

    if os.environ.get("STREAMCHAT_WEB_SCREENSHOT"):
        browser.js("document.querySelector('aside').scrollTop = 0")
        with open(os.environ["STREAMCHAT_WEB_SCREENSHOT"], "wb") as f:
            f.write(browser.screenshot())


    browser.click("#new-session")  # a new session, empty, with the system prompt carried over
    browser.wait("return document.getElementById('status').textContent === 'system prompt set'")
    new_id = browser.text("#session-id")
    assert new_id.startswith("sess_") and new_id != session_id and browser.js(MESSAGES) == []
    assert browser.js("return JSON.parse(localStorage.getItem('streamchat.session')).id") == new_id

