"""The fleet page (``GET /dashboard``): its files served in-process, then the page run in a real browser.

In-process: the page, its script and its style sheet are open, typed, under the strict
Content-Security-Policy, relative and free of any external URL; the JSON routes the script reads
still need the admin key; the script holds no copy of the verdict's rule. In a browser: headless
Chromium, driven over its DevTools protocol (with aiohttp's websocket client, no browser package),
opens the page of a real router in front of two real workers; every row it shows is compared with
the router's verdict (``GET /fleet/status``, what ``omni-router status`` prints), through the key
prompt, an update, a disabled worker and a fenced one (a router restarted over the journal its
update left).
``OMNI_DASHBOARD_SCREENSHOT=1`` also writes the last view to ``docs/images/dashboard.png``.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import json
import math
import os
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from router.contract.fleet import JournalState, JournalTarget
from router.contract.fleet_status import FleetStatus, WorkerStatus
from router.contract.web.openapi import paths_with_access
from router.gateway.admin.fence import RESOLVE_HINT
from router.gateway.admin.journal import JOURNAL_FILE
from router.gateway.api.dashboard import ASSETS, CONTENT_SECURITY_POLICY, FILES, PATH, asset
from router.gateway.app import create_app, routes
from router.gateway.config import RouterConfig
from router.gateway.fleet.registry import worker_id_for
from tests._router_fixtures import ADMIN_KEY, Fleet, auth, start_router
from tests.procs import free_port, http_json

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"
#: Nothing listens on the discard port of these loopback addresses.
UNREACHABLE = ["http://127.0.0.2:9", "http://127.0.0.3:9"]
#: What the page must never hold: a URL that leaves the router.
EXTERNAL = ("http://", "https://", "//cdn")
#: The page polls every 2 s: a change shows within two polls, and this bound is only reached when it does not.
SHOWN_WITHIN_S = 10.0
#: The version an update sets: markup the page must show as text.
VERSION = "dash-v1 <i>as text</i>"
#: The browser window: a laptop's.
VIEWPORT = (1280, 900)


def _chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


CHROMIUM = _chromium()


# --- in-process: the files and the access rule ---------------------------------------------------


def _config(tmp_path: Path, key: str | None) -> RouterConfig:
    return RouterConfig(
        worker_urls=UNREACHABLE,
        admin_api_key=key,
        state_dir=tmp_path / "state",
        connect_timeout_s=2.0,
        health_check_interval_s=3600.0,  # one probe at start-up: nothing here needs more
    )


@pytest.fixture
async def client(aiohttp_client: Any, tmp_path: Path) -> TestClient:
    return await aiohttp_client(create_app(_config(tmp_path, ADMIN_KEY)))


def _script_routes() -> dict[str, str]:
    """The routes the script reads (its ``ROUTES`` constant), relative to the page."""
    found = re.search(r"const ROUTES = \{([^}]*)\}", asset("dashboard.js").decode())
    assert found, "dashboard.js names the routes it reads in one ROUTES constant"
    return dict(re.findall(r'(\w+): "([^"]+)"', found.group(1)))


async def test_the_page_and_its_files_are_open_typed_and_under_the_policy(client: TestClient) -> None:
    for path, name, media_type in FILES:
        async with client.get(path) as resp:  # no key: a browser navigating sends none
            assert resp.status == 200, await resp.text()
            assert resp.content_type == media_type and resp.charset == "utf-8"
            assert resp.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            body = await resp.text()
        assert body.encode() == asset(name)
        for url in EXTERNAL:
            assert url not in body, f"{name} holds {url!r}"
    assert CONTENT_SECURITY_POLICY == (
        "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'"
    )
    assert {path for path, _, _ in FILES} <= set(paths_with_access(routes(), "open"))


def test_the_page_runs_under_its_policy_and_escapes_what_it_shows() -> None:
    """No inline script, style or handler (the policy would block them); every link relative; text set as text."""
    html = asset("index.html").decode()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, flags=re.S)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=", html)
    for link in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert not link.startswith("/") and ":" not in link, f"{link!r} is not relative to the page"
    js = asset("dashboard.js").decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, f"dashboard.js uses {sink}"
    assert not re.search(r"setAttribute\(\s*[\"']style", js)
    # The verdict and its words are the router's (GET /fleet/status): the page keeps no copy that could drift.
    for words in (RESOLVE_HINT, "disabled by the operator's flag", "fenced by the", "paused by the router"):
        assert words not in js, f"dashboard.js words the verdict itself: {words!r}"


async def test_the_data_the_page_reads_still_needs_the_admin_key(client: TestClient) -> None:
    read = _script_routes()
    assert read == {"status": "fleet/status", "health": "health"}
    admin = set(paths_with_access(routes(), "admin"))
    for route in read.values():
        path = "/" + route
        async with client.get(path) as resp:
            assert resp.status == (200 if path == "/health" else 401), path
        async with client.get(path, headers=auth()) as resp:
            assert resp.status == 200, path
        assert (path in admin) == (path != "/health")


async def test_a_router_without_an_admin_key_serves_the_data_without_one(aiohttp_client: Any, tmp_path: Path) -> None:
    client = await aiohttp_client(create_app(_config(tmp_path, None)))
    for route in _script_routes().values():
        async with client.get("/" + route) as resp:
            assert resp.status == 200, route
    async with client.get(PATH) as resp:
        assert resp.status == 200


def test_the_files_are_package_data() -> None:
    """A wheel carries them: the package is found (it has an ``__init__``) and its patterns name every file."""
    package = ROOT.joinpath(*ASSETS.split("."))
    assert (package / "__init__.py").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert any(fnmatch.fnmatch(ASSETS, pattern) for pattern in config["packages"]["find"]["include"])
    patterns = config["package-data"][ASSETS]
    for _, name, _ in FILES:
        assert (package / name).is_file() and any(fnmatch.fnmatch(name, p) for p in patterns), name


# --- the page in a real browser --------------------------------------------------------------------


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def walk(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.walk()


class _Tree(HTMLParser):
    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.open = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.open[-1].children.append(element)
        if tag not in self.VOID:
            self.open.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.open[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.open) - 1, 0, -1):
            if self.open[i].tag == tag:
                del self.open[i:]
                return

    def handle_data(self, data: str) -> None:
        self.open[-1].children.append(data)


class Page:
    """The page's DOM as the browser holds it after its script ran."""

    def __init__(self, html: str):
        tree = _Tree()
        tree.feed(html)
        self.elements = list(tree.root.walk())

    def by_id(self, element_id: str) -> Element:
        (found,) = [e for e in self.elements if e.attrs.get("id") == element_id]
        return found

    def text(self, element_id: str) -> str:
        return self.by_id(element_id).text()

    def shown(self, element_id: str) -> bool:
        return "hidden" not in self.by_id(element_id).attrs

    def rows(self) -> dict[str, dict[str, str]]:
        """Each worker's row of the table, by worker id: its cells by column."""
        return {
            row.attrs["data-worker"]: {cell.attrs["data-col"]: cell.text() for cell in row.walk() if cell.tag == "td"}
            for row in self.by_id("worker-rows").walk()
            if row.tag == "tr" and "data-worker" in row.attrs
        }

    def bars(self, worker: str) -> list[tuple[str, str]]:
        """The timeline's bars of ``worker``: (version, state), oldest first."""
        return [
            (e.attrs["data-version"], e.attrs["data-mark"])
            for e in self.elements
            if e.tag == "rect" and e.attrs.get("data-worker") == worker
        ]

    def events(self) -> str:
        return self.text("events")


class Browser:
    """Headless Chromium with one tab, driven over the DevTools protocol (a websocket, aiohttp's client)."""

    def __init__(self, profile: Path):
        assert CHROMIUM is not None
        profile.mkdir(parents=True)
        self.log = profile / "chromium.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    CHROMIUM,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--no-default-browser-check",
                    "--disable-extensions",
                    "--remote-debugging-port=0",
                    f"--user-data-dir={profile}",
                    f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
                    "about:blank",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.loop = asyncio.new_event_loop()
        self.calls = 0
        try:
            port_file = profile / "DevToolsActivePort"  # Chromium writes its port here once it listens
            deadline = time.monotonic() + 30
            while not (port_file.is_file() and port_file.read_text().strip()):
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            self.session, self.ws = self.loop.run_until_complete(self._connect(port))
            self.viewport(*VIEWPORT)
        except BaseException:
            self.close()
            raise

    async def _connect(self, port: int) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
        session = aiohttp.ClientSession()
        async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json(content_type=None)
        (tab,) = [t for t in targets if t["type"] == "page"]
        return session, await session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.calls += 1
        return self.loop.run_until_complete(asyncio.wait_for(self._call(self.calls, method, params), 30))

    async def _call(self, call_id: int, method: str, params: dict[str, Any]) -> dict[str, Any]:
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            message = json.loads(await self.ws.receive_str())
            if message.get("id") == call_id:  # anything else is an event nobody subscribed to
                assert "error" not in message, message
                result: dict[str, Any] = message["result"]
                return result

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in answer, answer
        return answer["result"].get("value")

    def polls(self) -> int:
        """How many times the page has drawn the router's answers."""
        return int(self.evaluate("document.body.dataset.polls || '0'"))

    def page(self) -> Page:
        return Page(self.evaluate("document.documentElement ? document.documentElement.outerHTML : ''") or "")

    def wait(self, what: str, shown: Callable[[Page], bool]) -> Page:
        """The page once ``shown`` holds of it (polled); past the bound the test fails with what it shows."""
        deadline = time.monotonic() + SHOWN_WITHIN_S
        while True:
            page = self.page()
            try:
                if shown(page):
                    return page
            except (KeyError, ValueError):
                pass  # not drawn yet
            if time.monotonic() > deadline:
                problem = page.text("problem") if any(e.attrs.get("id") == "problem" for e in page.elements) else ""
                pytest.fail(f"the page did not show {what} within {SHOWN_WITHIN_S:g}s; it says {problem!r}")
            time.sleep(0.2)

    def viewport(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: Path) -> None:
        """The whole page, 1280 pixels wide."""
        content = self.call("Page.getLayoutMetrics")["cssContentSize"]
        self.viewport(VIEWPORT[0], max(VIEWPORT[1], math.ceil(content["height"])))
        shot = self.call("Page.captureScreenshot", format="png")
        self.viewport(*VIEWPORT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        if hasattr(self, "ws"):
            self.loop.run_until_complete(self.ws.close())
        if hasattr(self, "session"):
            self.loop.run_until_complete(self.session.close())
        self.loop.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("no Chromium (/usr/bin/chromium or chromium on PATH): the page is not run in a browser here")
    browser = Browser(tmp_path / "chromium-profile")
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def fleet(worker_fleet: Any) -> Fleet:
    if CHROMIUM is None:
        pytest.skip("no Chromium (/usr/bin/chromium or chromium on PATH): the page is not run in a browser here")
    return worker_fleet(2, seeds=(0, 1))


def fleet_status(router: str) -> FleetStatus:
    """The router's verdict, as ``omni-router status`` prints it and the page reads it."""
    status, body = http_json("GET", router + "/fleet/status", headers=auth(), timeout=10)
    assert status == 200, body
    return FleetStatus.model_validate(body)


def cells(s: WorkerStatus) -> dict[str, str]:
    """The row the page draws for ``s``, as ``omni-router status`` words each field."""
    version = s.weight_version or "-"
    catch_up = "-"
    if s.catch_up is not None:
        source = f" from {s.catch_up.source}" if s.catch_up.source else ""
        catch_up = (
            f"copying{source}"
            if s.catch_up.state == "copying"
            else f"{s.catch_up.state}{source} ({s.catch_up.attempts} attempt(s))"
        )
    return {
        "id": s.id,
        "url": s.url,
        "engine": s.engine or "-",
        "health": s.health,
        "version": f"{version} ({s.staleness} behind)" if s.staleness else version,
        "paused": "yes" if s.paused else "own" if s.reported_paused else "no",
        "disabled": "fenced" if s.fenced else "yes" if s.disabled else "no",
        "pending": s.pending or "no",
        "catch-up": catch_up,
        "routable": "yes" if s.routable else f"no: {s.out_of_rotation}",
    }


def matches(page: Page, router: str) -> bool:
    """Every row shows what ``omni-router status`` says of its worker now (in-flight counts aside), and the
    heading the router's summary of the fleet."""
    rows = page.rows()
    status = fleet_status(router)
    expected = {s.id: cells(s) for s in status.workers}
    return (
        rows.keys() == expected.keys()
        and all({k: v for k, v in rows[wid].items() if k != "inflight"} == want for wid, want in expected.items())
        and page.text("summary").startswith(f"{status.summary}. Read at ")
        and page.by_id("summary").attrs.get("data-exit-code") == str(status.exit_code)
    )


def test_the_page_in_a_browser_follows_the_fleet(fleet: Fleet, browser: Browser, tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    proc, router = start_router(fleet.urls, admin_key=ADMIN_KEY, state_dir=state, port=port)
    first, second = (worker_id_for(url) for url in fleet.urls)
    try:
        # No key yet: the page asks for one and shows nothing; typed in, the fleet appears.
        browser.open(f"{router}{PATH}")
        page = browser.wait("the key prompt", lambda p: p.shown("key-form"))
        assert "requires an admin key" in page.text("problem") and page.rows() == {}
        browser.evaluate(
            f"document.getElementById('key-input').value = {json.dumps(ADMIN_KEY)};"
            "document.getElementById('key-form').requestSubmit()"
        )
        page = browser.wait("both workers as `omni-router status` does", lambda p: matches(p, router))
        assert not page.shown("key-form") and not page.shown("problem") and not page.shown("blocked")
        assert "No unresolved update" in page.text("journal")
        booted = {wid: row["version"] for wid, row in page.rows().items()}

        # An update through the router: both rows and both timeline rows move to its version (markup in it is text).
        body = {"model_path": str(fleet.others[0]), "weight_version": VERSION}
        status, answer = http_json("POST", router + "/update_weights_from_disk", body, headers=auth(), timeout=120)
        assert status == 200, answer
        page = browser.wait(
            "the update", lambda p: {r["version"] for r in p.rows().values()} == {VERSION} and matches(p, router)
        )
        for wid in (first, second):
            assert page.bars(wid)[-1] == (VERSION, "serving")
            assert f"{wid}: version {booted[wid]} → {VERSION}" in page.events()
        assert any(e.tag == "line" and e.attrs.get("data-version") == VERSION for e in page.elements)
        assert VERSION in page.text("version-rows") and str(fleet.others[0]) in page.text("version-rows")
        assert not any(e.tag == "i" for e in page.elements)

        # An operator disables the second worker.
        assert http_json("PUT", f"{router}/workers/{second}", {"disabled": True}, headers=auth())[0] == 200
        page = browser.wait(
            "the disabled worker", lambda p: p.rows()[second]["disabled"] == "yes" and matches(p, router)
        )
        assert page.rows()[second]["routable"] == "no: disabled by the operator's flag"
        assert page.by_id("summary").attrs["data-exit-code"] == "1" and second in page.text("summary")
        assert page.bars(second)[-1] == (VERSION, "disabled") and f"{second}: serving → disabled" in page.events()
    finally:
        proc.stop()

    # The router stopped during an update of the first worker: restarted (same port, same tab), it fences it.
    entry = JournalState(
        state="in_flight",
        path="/update_weights_from_disk",
        started_at=time.time(),
        targets=[JournalTarget(id=first, url=fleet.urls[0], previous_disabled=False)],
    )
    (state / JOURNAL_FILE).write_text(entry.model_dump_json())
    proc, router = start_router(fleet.urls, admin_key=ADMIN_KEY, state_dir=state, port=port)
    try:
        page = browser.wait(
            "the fenced worker", lambda p: p.rows()[first]["disabled"] == "fenced" and matches(p, router)
        )
        assert page.rows()[first]["routable"] == "no: fenced by the failed update /update_weights_from_disk"
        journal = page.text("journal")
        assert "/update_weights_from_disk" in journal and first in journal
        assert page.text("resolve-hint") == RESOLVE_HINT
        assert page.bars(first)[-1] == (VERSION, "fenced") and f"{first}: serving → fenced" in page.events()
        assert any(e.tag == "path" and "fence-mark" in e.attrs.get("class", "") for e in page.elements)
        assert not page.shown("problem") and not page.shown("blocked")  # no refusal left; nothing the policy blocked
        if os.environ.get("OMNI_DASHBOARD_SCREENSHOT") == "1":
            seen = browser.polls()
            browser.wait("two more polls, for the fenced worker's bar", lambda _: browser.polls() >= seen + 2)
            browser.screenshot(SCREENSHOT)

        # A key handed in the fragment is taken, and the fragment leaves the address bar.
        browser.evaluate("sessionStorage.clear()")
        browser.open("about:blank")
        browser.open(f"{router}{PATH}#key={ADMIN_KEY}")
        browser.wait("the fleet from a key in the fragment", lambda p: matches(p, router))
        assert browser.evaluate("location.href") == f"{router}{PATH}"
        assert browser.evaluate("sessionStorage.getItem('omni-router.dashboard.admin-key')") == ADMIN_KEY
    finally:
        proc.stop()
