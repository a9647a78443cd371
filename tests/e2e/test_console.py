"""The run console in a real browser (Playwright driving Debian's Chromium) against a real
stack: API (gunicorn), two workers and beat, started once for the module by the same
:class:`~cli.devstack.DevStack` ``dar dev`` runs. Tokens are set, as in production: an
operator token and a read-only one.

Each test leaves PNG screenshots in ``artifacts/console/`` (``DAR_ARTIFACTS`` to move it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api as playwright_api
from sqlalchemy import Engine, text

from api.auth import hash_token
from cli.devstack import CODE_ROOT, DevStack
from cli.embedded import free_port
from db.engine import make_engine
from db.records import NewRun
from db.schema import metadata
from db.store import RunStore

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(120)]

CHROMIUM = os.environ.get("DAR_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("DAR_ARTIFACTS", CODE_ROOT / "artifacts")) / "console"
OPS = "console-ops-token"
VIEWER = "console-viewer-token"
HOSTILE = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2"> overdue?'
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"}

if os.environ.get("DAR_SKIP_BROWSER") == "1":  # pragma: no cover - an explicit choice
    pytest.skip("DAR_SKIP_BROWSER=1", allow_module_level=True)


@dataclass
class Console:
    stack: DevStack

    @property
    def url(self) -> str:
        return self.stack.api_url

    def call(self, method: str, path: str, body: Any = None, token: str | None = OPS) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def submit(self, agent: str, value: Any) -> str:
        run_id: str = self.call("POST", "/api/runs", {"agent": agent, "input": value})["id"]
        return run_id

    def wait_status(self, run_id: str, *statuses: str, timeout: float = 45) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run: dict[str, Any] = self.call("GET", f"/api/runs/{run_id}")
            if run["status"] in statuses:
                return run
            assert time.monotonic() < deadline, f"run stayed {run['status']}: {run['error']}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def console(
    test_db: str, _truncator: Engine, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Console]:
    tables = ", ".join(f'"{t.name}"' for t in reversed(metadata.sorted_tables))
    with _truncator.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    tmp = tmp_path_factory.mktemp("console")
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    tokens = (
        f"ops:admin+approve+support_lead:{hash_token(OPS)}:acme,"
        f"viewer:read:{hash_token(VIEWER)}:acme"
    )
    log_path = tmp / "stack.log"
    with log_path.open("wb") as log:
        stack = DevStack(
            data_dir=tmp,
            port=free_port(),
            workers=2,
            concurrency=4,
            env={
                **os.environ,
                "DATABASE_URL": test_db,
                "REDIS_URL": redis_url,
                "DAR_QUEUE": f"dar-console-{uuid.uuid4().hex[:8]}",
                "DAR_LEASE_SECONDS": "3",
                "DAR_HEARTBEAT_SECONDS": "1",
                "DAR_REAPER_INTERVAL_SECONDS": "0.5",
                "DAR_DEMO_LATENCY_MS": "300",
                "DAR_PRICES": json.dumps({"demo": {"input": 3, "output": 15}}),
                "DAR_AGENT_MODULES": "examples.ticket_triage,tests.e2e.console_agents",
                "DAR_API_TOKENS": tokens,
                "DAR_CONSOLE_CRASH_FLAG": str(tmp / "crashed-once"),
                "ANTHROPIC_API_KEY": "",
            },
            output=log,
        )
        stop = threading.Event()
        supervisor = threading.Thread(target=stack.supervise, args=(stop.is_set,), daemon=True)
        try:
            stack.start(timeout=60)
            supervisor.start()  # restarts the worker console-crash kills
            yield Console(stack)
        finally:
            stop.set()
            if supervisor.is_alive():
                supervisor.join(timeout=10)
            stack.stop()
            print(log_path.read_text(errors="replace")[-8000:])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():  # .ci/run installs it; failing beats a silent skip
        pytest.fail(
            f"no Chromium at {CHROMIUM}: apt-get install chromium (or DAR_CHROMIUM=path; "
            "DAR_SKIP_BROWSER=1 to leave the browser tests out)"
        )
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@dataclass
class Tab:
    page: Any
    errors: list[str]

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.fixture
def tab(browser: Any, console: Console) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1280, "height": 860}, base_url=console.url)
    page = context.new_page()
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on(
        "console",
        lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None,
    )
    try:
        yield Tab(page, errors)
    finally:
        context.close()
    # A 401/403 the test provoked on purpose is logged by the browser as a failed load.
    unexpected = [e for e in errors if "status of 40" not in e]
    assert unexpected == [], "no script errors, no Content-Security-Policy violations"


def sign_in(tab: Tab, token: str, path: str = "/") -> None:
    page = tab.page
    page.goto(path)
    page.get_by_label("API token").wait_for()
    # The keyboard alone: the field has the focus, Enter signs in.
    page.keyboard.type(token)
    page.keyboard.press("Enter")
    page.locator("body[data-ready='1']").wait_for()
    assert token not in page.url
    assert token not in (page.evaluate("document.cookie") or "")


def assert_every_control_labelled(tab: Tab) -> None:
    unlabelled = tab.page.evaluate(
        """() => [...document.querySelectorAll('input, select, textarea, button')]
            .filter((el) => el.offsetParent !== null || el.type === 'radio')
            .filter((el) => {
              if (el.tagName === 'BUTTON') return !el.textContent.trim()
                && !el.getAttribute('aria-label');
              return !(el.labels && el.labels.length) && !el.getAttribute('aria-label');
            })
            .map((el) => el.outerHTML.slice(0, 120))"""
    )
    assert unlabelled == []


def row(tab: Tab, run_id: str) -> Any:
    return tab.page.locator(f"#runs tr[data-run-id='{run_id}']")


# -- the tests ------------------------------------------------------------------------------


def test_submit_from_the_page_and_watch_it_succeed_without_reloading(
    tab: Tab, console: Console
) -> None:
    page = tab.page
    sign_in(tab, OPS)
    assert_every_control_labelled(tab)
    page.evaluate("window.__sameDocument = true")
    page.get_by_label("Agent to run").select_option("acme-tickets")
    page.get_by_label("Input").fill(HOSTILE)
    page.get_by_role("button", name="Submit run").click()
    link = page.locator("#flash a")
    link.wait_for()
    run_id = link.inner_text()
    uuid.UUID(run_id)
    badge = row(tab, run_id).locator(".badge")
    badge.filter(has_text="SUCCEEDED").wait_for(timeout=45_000)
    assert page.evaluate("window.__sameDocument") is True, "the list updated without a reload"
    assert page.evaluate("window.__xss") is None, "hostile input never runs as script"
    cells = row(tab, run_id).locator("td").all_inner_texts()
    assert cells[2] == "acme-tickets"
    assert int(cells[4]) == 3, "three steps"
    assert int(cells[5].replace(",", "")) > 0, "tokens"
    assert cells[6].startswith("$")
    assert cells[7] == "ops"
    succeeded = page.locator("#counts button[data-status='SUCCEEDED'] .n")
    assert int(succeeded.inner_text()) >= 1
    tab.shot("runs")

    # The keyboard: a status count is a real button; focused, Enter filters by it.
    page.locator("#counts button[data-status='SUCCEEDED']").focus()
    page.keyboard.press("Enter")
    page.locator("#counts button[data-status='SUCCEEDED'][aria-pressed='true']").wait_for()
    assert page.get_by_label("Status", exact=True).input_value() == "SUCCEEDED"
    assert "status=SUCCEEDED" in page.url
    page.get_by_label("Status", exact=True).select_option("")

    # Filters: an id prefix finds exactly this run; the agent filter keeps it.
    page.get_by_label("Run id starts with").fill(run_id[:8])
    page.get_by_role("button", name="Apply").click()
    # (Locator waits only: a predicate given as a string is evaluated, which the page's
    # Content-Security-Policy rightly refuses.)
    playwright_api.expect(page.locator("#runs tbody tr")).to_have_count(1)
    assert "idPrefix=" in page.url
    assert OPS not in page.url

    # Its page: header, waterfall and conversation, the hostile input shown as text.
    row(tab, run_id).get_by_role("link").click()
    page.wait_for_url(re.compile(f"/runs/{run_id}$"))
    page.locator("body[data-status='SUCCEEDED']").wait_for()
    kinds = page.locator("#timeline tbody tr").evaluate_all("rs => rs.map(r => r.dataset.kind)")
    assert kinds == ["MODEL", "TOOL", "MODEL"]
    bars = page.locator("#timeline .bar").evaluate_all(
        "bs => bs.map(b => [parseFloat(b.style.left), parseFloat(b.style.width)])"
    )
    assert all(0 <= left <= 100 and width > 0 for left, width in bars)
    assert bars[0][0] <= bars[1][0] <= bars[2][0], "bars placed by start on one axis"
    tokens = page.locator("#timeline tbody tr").first.locator("td").nth(4).inner_text()
    assert re.fullmatch(r"\d+ / \d+", tokens)
    conversation = page.locator("#conversation")
    assert conversation.locator(".m-input pre").inner_text() == HOSTILE
    assert (
        conversation.locator(".m-tool_call .who")
        .first.inner_text()
        .startswith("Tool call list_tickets")
    )
    assert conversation.locator(".m-tool_result").count() == 1
    assert conversation.locator(".m-text").count() >= 1
    assert page.locator("#timeline img, #conversation img, #conversation script").count() == 0
    assert page.evaluate("window.__xss") is None
    assert page.locator("#facts").inner_text().count("SUCCEEDED") == 1
    assert page.get_by_label("Tokens").count() == 1, "the token budget as a labelled bar"
    assert page.get_by_role("button", name="Cancel run").count() == 0, "nothing to cancel"
    assert_every_control_labelled(tab)
    tab.shot("run")


def test_approve_a_durable_functions_approval_and_see_it_continue(
    tab: Tab, console: Console
) -> None:
    page = tab.page
    ticket = {"id": 101, "subject": "Invoice wrong", "body": "VAT is 19%, should be 7%"}
    run_id = console.submit("ticket-triage", ticket)
    console.wait_status(run_id, "WAITING")
    pending = console.call("GET", f"/api/approvals?runId={run_id}")["items"]
    assert len(pending) == 1

    sign_in(tab, OPS, "/approvals")
    card = page.locator(f"li[data-approval-id='{pending[0]['id']}']")
    card.wait_for()
    assert card.locator(".hash").inner_text() == pending[0]["payloadHash"]
    assert "Invoice PDF shows wrong VAT rate" in card.locator(".payload").inner_text()
    assert_every_control_labelled(tab)
    tab.shot("approvals")
    card.get_by_label("Comment (optional)").fill("looks right")
    card.get_by_role("button", name="Approve").click()
    page.locator("#flash").filter(has_text="approved by ops").wait_for()

    page.goto(f"/runs/{run_id}")
    page.locator("body[data-status='SUCCEEDED']").wait_for(timeout=45_000)
    timeline = page.locator("#timeline tbody")
    assert timeline.locator("tr[data-kind='APPROVAL']").count() == 1
    audit = timeline.locator("tr[data-kind='AUDIT']")
    assert audit.count() == 1
    assert "approve by ops" in audit.inner_text()
    decided = console.call("GET", f"/api/approvals/{pending[0]['id']}")
    assert decided["comment"] == "looks right"
    assert decided["decidedBy"] == "ops"
    tab.shot("run-approved")


def test_resolve_a_run_that_needs_attention(tab: Tab, console: Console) -> None:
    page = tab.page
    run_id = console.submit("console-crash", {"amount": 12.5})
    console.wait_status(run_id, "NEEDS_ATTENTION")

    sign_in(tab, OPS, "/attention")
    card = page.locator(f"li[data-run-id='{run_id}']")
    card.wait_for()
    assert "In doubt: step charge:0 (STEP)" in card.inner_text(), "the in-doubt step is named"
    for name in ("Supply result", "Retry step", "Fail run"):
        assert card.get_by_role("button", name=name).count() == 1
    assert_every_control_labelled(tab)
    tab.shot("attention")
    card.get_by_label("Result (JSON, or plain text)").fill('"charged 12.50 (checked by hand)"')
    card.get_by_role("button", name="Supply result").click()
    page.locator("#flash").filter(has_text="Resolved (result supplied)").wait_for()
    run = console.wait_status(run_id, *TERMINAL)
    assert run["status"] == "SUCCEEDED", run["error"]
    assert run["result"] == "notified: charged 12.50 (checked by hand)"
    page.locator(f"li[data-run-id='{run_id}']").wait_for(state="detached")

    # On its page: the supplied step, the resolution as the point it resumed, the retry.
    page.goto(f"/runs/{run_id}")
    page.locator("body[data-status='SUCCEEDED']").wait_for()
    rows = page.locator("#timeline tbody tr")
    charge = rows.filter(has_text="charge:0")
    assert "resolution: supplied" in charge.inner_text()
    resolve = rows.filter(has_text="resolve by ops")
    assert "resumed here" in resolve.inner_text()
    notify = rows.filter(has_text="notify:0")
    assert "attempt 2" in notify.inner_text(), "the retry is visible"
    tab.shot("run-resolved")


def test_a_parent_links_its_children_and_a_message_interrupts(tab: Tab, console: Console) -> None:
    page = tab.page
    parent = console.submit("console-family", {})
    assert console.wait_status(parent, *TERMINAL)["status"] == "SUCCEEDED"
    kids = [c["id"] for c in console.call("GET", f"/api/runs/{parent}")["children"]]
    assert len(kids) == 2
    sign_in(tab, OPS, f"/runs/{parent}")
    page.locator("body[data-status='SUCCEEDED']").wait_for()
    links = page.locator("#timeline tbody tr[data-kind='CHILD'] a.child-run")
    links.nth(1).wait_for()
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    assert sorted(hrefs) == sorted(f"/runs/{k}" for k in kids), "each child step links its run"
    assert page.locator("#run-tree li").count() == 3, "the run and its two children"
    tab.shot("run-family")
    links.first.click()
    page.wait_for_url(re.compile(r"/runs/[0-9a-f-]{36}$"))
    assert page.url.endswith(hrefs[0] or "")
    back = page.locator("#family-parent a")
    back.wait_for()
    assert back.get_attribute("href") == f"/runs/{parent}", "the child links its parent"

    # The message box sends with policy interrupt when asked to.
    run_id = console.submit("acme-tickets", "Which acme tickets are overdue?")
    console.wait_status(run_id, "SUCCEEDED")
    page.goto(f"/runs/{run_id}")
    page.locator("body[data-status='SUCCEEDED']").wait_for()
    page.get_by_label("Message", exact=True).fill("And the globex ones?")
    page.get_by_label("Interrupt the model call in flight", exact=False).check()
    assert_every_control_labelled(tab)
    page.get_by_role("button", name="Send").click()
    page.locator("#flash").filter(has_text="interrupted for it").wait_for()
    deadline = time.monotonic() + 45
    while True:
        steps = console.call("GET", f"/api/runs/{run_id}/timeline")
        run = console.call("GET", f"/api/runs/{run_id}")
        if run["status"] == "SUCCEEDED" and any(s["kind"] == "MESSAGE" for s in steps):
            break
        assert time.monotonic() < deadline, f"the message was not answered: {run['status']}"
        time.sleep(0.3)
    kinds = [s["kind"] for s in steps if s["kind"] != "AUDIT"]
    assert kinds.count("MESSAGE") == 1
    assert kinds[-1] == "MODEL", "the model answered the next turn"


def test_the_run_page_draws_the_whole_tree_and_links_each_run(tab: Tab, console: Console) -> None:
    """Three levels: console-tree starts console-family (which starts two console-kids) and a
    console-kid. Any run's page draws the whole tree from the root, this run marked, and the
    links (tree and timeline) go to the right runs."""
    page = tab.page
    root = console.submit("console-tree", {})
    assert console.wait_status(root, *TERMINAL)["status"] == "SUCCEEDED"

    def kids(run_id: str) -> list[str]:
        return [c["id"] for c in console.call("GET", f"/api/runs/{run_id}")["children"]]

    family, kid5 = kids(root)
    grand = kids(family)
    assert len(grand) == 2
    assert kids(kid5) == []
    depth = {root: 0, family: 1, grand[0]: 2, grand[1]: 2, kid5: 1}
    agent = {root: "console-tree", family: "console-family", kid5: "console-kid"}
    agent.update(dict.fromkeys(grand, "console-kid"))

    def check_tree(current: str) -> None:
        nodes = page.locator("#run-tree li[data-run-id]")
        page.locator(f"#run-tree li.current[data-run-id='{current}']").wait_for()
        assert nodes.count() == 5, page.locator("#run-tree").inner_text()
        shown = [nodes.nth(i).get_attribute("data-run-id") for i in range(5)]
        assert shown == [root, family, *grand, kid5], "depth first, children oldest first"
        for run_id in shown:
            item = page.locator(f"#run-tree li[data-run-id='{run_id}']")
            assert item.get_attribute("data-depth") == str(depth[run_id])
            link = item.locator(":scope > .node a")
            assert link.get_attribute("href") == f"/runs/{run_id}"
            text = item.locator(":scope > .node").inner_text()
            assert agent[run_id] in text
            assert "SUCCEEDED" in text
            assert "tokens" in text
        # nested: a grandchild's item is inside its parent's, inside the root's
        nested = page.locator(
            f"#run-tree li[data-run-id='{root}'] li[data-run-id='{family}'] "
            f"li[data-run-id='{grand[0]}']"
        )
        assert nested.count() == 1
        marked = page.locator("#run-tree a[aria-current='page']")
        assert marked.count() == 1
        assert marked.get_attribute("href") == f"/runs/{current}"
        assert page.locator("#tree-note").is_hidden(), "a small tree is shown whole"

    sign_in(tab, OPS, f"/runs/{grand[1]}")  # a grandchild's page: the tree from the root
    page.locator("body[data-status='SUCCEEDED']").wait_for()
    check_tree(grand[1])
    tab.shot("run-tree")
    assert page.locator("#message-panel").is_hidden(), "no message box for a durable function"

    # The tree's links: the root's page, whose timeline links each of its children.
    page.locator(f"#run-tree li[data-run-id='{root}'] > .node a").click()
    page.wait_for_url(f"**/runs/{root}")
    check_tree(root)
    links = page.locator("#timeline tbody tr[data-kind='CHILD'] a.child-run")
    links.nth(1).wait_for()
    assert [links.nth(i).get_attribute("href") for i in range(links.count())] == [
        f"/runs/{family}",
        f"/runs/{kid5}",
    ], "each CHILD step links its child run"
    links.first.click()  # the timeline's link to the middle run
    page.wait_for_url(f"**/runs/{family}")
    check_tree(family)
    links = page.locator("#timeline tbody tr[data-kind='CHILD'] a.child-run")
    links.nth(1).wait_for()
    assert sorted(links.nth(i).get_attribute("href") or "" for i in range(2)) == sorted(
        f"/runs/{g}" for g in grand
    )
    tab.shot("run-tree-middle")


@pytest.fixture
def database(_truncator: Engine) -> Engine:
    """The stack's database, to write rows no API call makes."""
    return _truncator


def test_a_tree_past_the_cap_says_what_it_leaves_out(
    tab: Tab, console: Console, database: Engine
) -> None:
    """A finished root with 250 finished children (written straight to the database: no
    worker touches an ended run): the tree shows the first 200 runs, says the root has more
    children than it shows, and the asked run is there whatever its place."""
    page = tab.page
    root = str(uuid.uuid4())
    ids = [root] + [str(uuid.uuid4()) for _ in range(250)]
    with database.begin() as conn:
        for i, run_id in enumerate(ids):
            conn.execute(
                text(
                    "INSERT INTO run (id, agent, status, input, model, max_steps, "
                    "token_budget, timeout_seconds, deadline_at, parent_run_id, tenant, "
                    "dispatch_token, created_at, finished_at) VALUES (:id, :agent, "
                    "'SUCCEEDED', '{}', 'demo', 10, 1000, 60, now(), :parent, 'acme', "
                    "gen_random_uuid(), now() + :i * interval '1 ms', now())"
                ),
                {
                    "id": run_id,
                    "agent": "console-tree" if i == 0 else "console-kid",
                    "parent": None if i == 0 else root,
                    "i": i,
                },
            )
    last = ids[-1]
    sign_in(tab, OPS, f"/runs/{last}")  # the youngest child: past the cap, shown all the same
    page.locator(f"#run-tree li.current[data-run-id='{last}']").wait_for()
    assert page.locator("#run-tree li[data-run-id]").count() == 201
    # Asked in the page, as one check of one layout: the tree is rebuilt on each reload, and
    # two bounding boxes read from here could straddle a rebuild (CI once read none).
    in_view = """() => {
        const panel = document.querySelector('#run-tree');
        const here = document.querySelector('#run-tree li.current > .node');
        if (!panel || !here || panel.offsetParent === null) return false;
        const p = panel.getBoundingClientRect(), h = here.getBoundingClientRect();
        return p.height > 0 && p.top <= h.top && h.bottom <= p.bottom;
    }"""
    try:
        page.wait_for_function(in_view, timeout=10_000)
    except playwright_api.TimeoutError:
        state = page.evaluate(
            "() => ({main: !document.querySelector('#main').hidden,"
            " login: document.querySelector('#login-error').textContent,"
            " top: document.querySelector('#run-tree').scrollTop})"
        )
        raise AssertionError(f"the tall tree does not scroll this run into view: {state}") from None
    more = page.locator(f"#run-tree li[data-run-id='{root}'] li.more")
    assert "More child runs not shown (more than 200 in all)" in more.inner_text()
    assert more.locator("a").get_attribute("href") == f"/runs/{root}"
    note = page.locator("#tree-note")
    assert note.is_visible()
    assert "first 200 runs" in note.inner_text()
    tab.shot("run-tree-cut")


def test_cancel_a_running_run(tab: Tab, console: Console) -> None:
    page = tab.page
    run_id = console.submit("console-slow", {"ticks": 80})
    console.wait_status(run_id, "RUNNING")
    sign_in(tab, OPS, f"/runs/{run_id}")
    page.locator("body[data-status='RUNNING']").wait_for()
    page.locator("#timeline tbody tr").nth(1).wait_for()
    tab.shot("run-live")
    page.get_by_role("button", name="Cancel run").click()
    page.locator("body[data-status='CANCELLED']").wait_for(timeout=30_000)
    assert page.get_by_role("button", name="Cancel run").count() == 0
    audit = page.locator("#timeline tbody tr[data-kind='AUDIT']")
    assert "cancel by ops" in audit.inner_text()
    steps = console.call("GET", f"/api/runs/{run_id}/timeline")
    assert len([s for s in steps if s["kind"] == "STEP"]) < 80, "stopped early"


def test_fork_from_a_step_with_an_edited_tool_result_and_land_on_the_fork(
    tab: Tab, console: Console
) -> None:
    page = tab.page
    original = console.submit("acme-tickets", "Which acme tickets are overdue?")
    console.wait_status(original, "SUCCEEDED")
    sign_in(tab, OPS, f"/runs/{original}")
    page.locator("body[data-status='SUCCEEDED']").wait_for()
    rows = page.locator("#timeline tbody tr")
    assert rows.locator("button.fork").count() == 3, "every completed step is a fork point"

    # A refusal is shown on the form, the field the API named marked: not swallowed.
    page.get_by_role("button", name="Fork from step 3").click()
    form = page.locator("#fork-panel")
    assert form.is_visible()
    assert "copies steps 1 to 2" in form.locator("#fork-explain").inner_text()
    assert_every_control_labelled(tab)
    form.get_by_label("Token budget (empty: the original's)").fill("999999999999")
    form.get_by_role("button", name="Fork run").click()
    error = form.locator("#fork-error")
    error.filter(has_text="Invalid request (HTTP 400): tokenBudget").wait_for()
    assert form.locator("#fork-budget[aria-invalid='true']").count() == 1
    assert page.url.endswith(f"/runs/{original}"), "no fork, no navigation"

    # What if the tool had found nothing? Edit step 2's result, fork from step 3.
    form.get_by_label("Token budget (empty: the original's)").fill("")
    form.get_by_label("Edit the result of").select_option(label="step 2: TOOL list_tickets")
    form.get_by_label("New result (JSON, or plain text)").fill("[]")
    form.get_by_label("Replay the model").check()
    tab.shot("fork-form")
    form.get_by_role("button", name="Fork run").click()
    page.wait_for_url(re.compile(r"/runs/(?!" + original + r")[0-9a-f-]{36}$"))
    fork_id = page.url.rsplit("/", 1)[1]
    page.locator("body[data-status='SUCCEEDED']").wait_for(timeout=45_000)
    facts = page.locator("#facts").inner_text()
    assert f"Forked from\n{original[:8]} at step 3 (replaying the model)" in facts, facts
    origins = page.locator("#timeline tbody tr[data-seq]").evaluate_all(
        "rs => rs.filter(r => r.dataset.seq).map(r => [r.dataset.seq, r.dataset.origin])"
    )
    assert origins == [["1", "copied"], ["2", "edited"], ["3", ""]]
    fork = console.call("GET", f"/api/runs/{fork_id}")
    assert fork["forkedFrom"] == {"runId": original, "seq": 3, "replayModel": True}
    assert fork["submittedBy"] == "ops"
    audit = console.call("GET", f"/api/runs/{original}")["audit"]
    (event,) = [e for e in audit if e["action"] != "submit"]
    assert event["detail"]["fork"] == fork_id, "one fork made, by this form"
    tab.shot("run-fork")


def test_diff_view_shows_the_first_differing_step(tab: Tab, console: Console) -> None:
    page = tab.page
    original = console.submit("acme-tickets", "Which acme tickets are overdue?")
    console.wait_status(original, "SUCCEEDED")
    fork_id = console.call(
        "POST",
        f"/api/runs/{original}/fork",
        {"fromSeq": 3, "toolResult": {"seq": 2, "output": "no tickets"}},
    )["id"]
    console.wait_status(fork_id, *TERMINAL)

    sign_in(tab, OPS, f"/runs/{fork_id}")
    page.locator("#diff-original").click()
    page.wait_for_url(re.compile(f"/runs/{original}/diff/{fork_id}$"))
    page.locator("body[data-first-different-seq='2']").wait_for()
    assert page.locator("#first-diff").inner_text() == "First difference at step 2: output."
    first = page.locator("#diff-steps tbody.first")
    assert first.get_attribute("data-seq") == "2"
    assert first.is_visible()
    assert first.locator("td.changed").count() == 2, "the output cell of A and of B"
    assert first.locator("tr.side-b").inner_text().count("edited") == 1
    copied = page.locator("#seq-1")
    assert "copied" in copied.locator("tr.side-b").inner_text()
    assert "copied" not in copied.locator("tr.side-a").inner_text()
    assert "same" in copied.locator("td.differences").inner_text()
    kinds = page.locator("#diff-steps tbody tr.side-a td:nth-of-type(1)").all_inner_texts()
    assert kinds == ["MODEL", "TOOL", "MODEL"]
    assert page.locator("#diff-runs").inner_text().count("Forked from") == 1
    assert_every_control_labelled(tab)
    tab.shot("diff")

    # From any run's page: another run's id, or the start of it.
    page.goto(f"/runs/{original}")
    page.locator("body[data-ready='1']").wait_for()
    page.get_by_label("Compare with run").fill("ffffffff")
    page.get_by_role("button", name="Compare").click()
    page.locator("#compare-error").filter(has_text="no run starts with ffffffff").wait_for()
    page.get_by_label("Compare with run").fill(fork_id[:8])
    page.get_by_role("button", name="Compare").click()
    page.wait_for_url(re.compile(f"/runs/{original}/diff/{fork_id}$"))
    page.locator("body[data-first-different-seq='2']").wait_for()


def test_a_read_only_token_sees_no_actions_and_a_forged_request_is_refused(
    tab: Tab, console: Console
) -> None:
    page = tab.page
    running = console.submit("console-slow", {"ticks": 200})
    waiting = console.submit(
        "ticket-triage", {"id": 102, "subject": "SSO login loops", "body": "Safari"}
    )
    console.wait_status(waiting, "WAITING")
    console.wait_status(running, "RUNNING")
    page.goto("/")
    page.get_by_label("API token").fill("not-a-token")
    page.keyboard.press("Enter")
    page.locator("#login-error").filter(has_text="send a valid API token").wait_for()
    assert page.locator("#main").is_hidden(), "a wrong token sees nothing"
    sign_in(tab, VIEWER)
    assert page.locator("#whoami").inner_text().startswith("viewer (read)")
    assert page.locator("#submit-section").is_hidden()
    assert page.get_by_role("button", name="Submit run").count() == 0

    page.goto(f"/runs/{running}")
    page.locator("body[data-status='RUNNING']").wait_for()
    assert page.locator("#actions button").count() == 0
    page.goto(f"/runs/{waiting}")
    page.locator("body[data-status='WAITING']").wait_for()
    page.locator("#approval-panel .hash").wait_for()
    assert page.locator("#actions button, #approval-panel button").count() == 0
    page.goto("/approvals")
    page.locator("#approvals li").first.wait_for()
    assert page.locator("#approvals button").count() == 0
    tab.shot("read-only")

    # The buttons are missing, and the server refuses the action anyway: a request forged
    # with the read-only token is 403, one without a token (what another site could send,
    # cookies and all) is 401.
    forged = page.evaluate(
        """async ([id]) => {
          const token = sessionStorage.getItem('dar.token');
          const post = (headers) => fetch(`/api/runs/${id}/cancel`,
            {method: 'POST', headers, credentials: 'include'}).then((r) => r.status);
          return [await post({Authorization: `Bearer ${token}`}), await post({})];
        }""",
        [running],
    )
    assert forged == [403, 401]
    assert console.call("GET", f"/api/runs/{running}")["cancelRequested"] is False
    console.call("POST", f"/api/runs/{running}/cancel")  # tidy up with the operator token


def test_overview_charts_over_24h_and_7d(tab: Tab, console: Console) -> None:
    page = tab.page
    sign_in(tab, OPS, "/overview")
    for chart in ("c-finished", "c-cost", "c-latency"):
        page.locator(f"#{chart} canvas").wait_for()
    page.locator("#c-finished-sum").filter(has_text="SUCCEEDED").wait_for()
    summary = page.locator("#c-finished-sum").inner_text()
    assert re.search(r"SUCCEEDED [1-9]", summary), summary
    assert "$0.0000" not in page.locator("#c-cost-sum").inner_text(), "the demo model is priced"
    legend = page.locator("#c-latency .u-legend").inner_text()
    assert "MODEL p95" in legend
    assert "STEP p50" in legend
    tab.shot("overview")
    page.get_by_label("last 7 days").check()
    page.locator("#c-finished-sum").filter(has_text="last 7d").wait_for()
    assert_every_control_labelled(tab)


def test_versions_show_what_is_served_and_an_upgrade_shows_its_check(
    tab: Tab, console: Console
) -> None:
    """The versions panel: this stack's version, served by its two workers; a version no
    worker serves (its workers were stopped) highlighted, its runs waiting; a check, then an
    upgrade from the panel, each with its report: the run that replays clean moves and
    finishes on this version's workers, the run of an agent this version no longer has stays,
    its divergence shown."""
    page = tab.page
    current = console.call("GET", "/api/versions")["current"]
    engine = make_engine(console.stack.database_url, pool_size=1)
    old = RunStore(engine, deployment="v-old")
    try:
        runs = {}
        for agent in ("acme-tickets", "retired-agent"):
            run, _ = old.create_run(
                NewRun(
                    agent=agent,
                    input="Which acme tickets are overdue?",
                    model="claude-sonnet-4-5",
                    max_steps=20,
                    token_budget=50_000,
                    timeout_seconds=600,
                    tenant="acme",
                )
            )
            runs[agent] = str(run.id)
        clean, divergent = runs["acme-tickets"], runs["retired-agent"]

        sign_in(tab, OPS, "/versions")
        waiting = page.locator("#versions tr.unserved[data-deployment='v-old']")
        waiting.wait_for()
        assert waiting.locator("td.served").inner_text() == "no: its runs wait"
        assert waiting.locator("td.in-flight").inner_text() == "2"
        served = page.locator(f"#versions tr[data-deployment='{current}']")
        assert served.locator("td.served").inner_text() == "yes"
        assert "2 live" in served.locator("td").nth(2).inner_text()
        assert served.get_by_role("button").count() == 0, "no upgrade of this version to itself"
        page.locator("#versions-summary").filter(has_text="2 run(s) in flight wait").wait_for()
        page.locator("#policies li[data-agent='acme-tickets']").filter(has_text="pinned").wait_for()
        assert_every_control_labelled(tab)

        page.get_by_role("button", name="Check the runs of v-old").click()
        report = page.locator("#report")
        report.filter(has_text="Check (nothing moved)").wait_for()
        page.locator(f"#report-runs tr[data-run-id='{clean}'] td.outcome").filter(
            has_text="would move"
        ).wait_for()
        stays = page.locator(f"#report-runs tr.diverged[data-run-id='{divergent}']")
        assert stays.locator("td.outcome").inner_text() == "stays"
        assert "retired-agent" in stays.locator("td.divergence").inner_text()
        assert {old.get_run(uuid.UUID(r)).deployment for r in runs.values()} == {"v-old"}

        page.get_by_role("button", name=f"Upgrade the runs of v-old to {current}").click()
        page.locator(f"#report-runs tr[data-run-id='{clean}'] td.outcome").filter(
            has_text="moved"
        ).wait_for()
        assert "retired-agent" in stays.locator("td.divergence").inner_text()
        page.locator("#versions-summary").filter(has_text="1 run(s) in flight wait").wait_for()
        tab.shot("versions")
        assert console.wait_status(clean, "SUCCEEDED")["deployment"] == current
        assert old.get_run(uuid.UUID(divergent)).deployment == "v-old"
        audit = [e for e in old.audit_events(uuid.UUID(clean)) if e.action == "upgrade"]
        assert [(e.actor, e.detail["from"], e.detail["to"]) for e in audit] == [
            ("ops", "v-old", current)
        ]

        # The last check's report outlives a reload (kept in this tab's session storage).
        page.reload()
        page.locator("body[data-ready='1']").wait_for()
        page.locator(f"#report-runs tr[data-run-id='{clean}'] td.outcome").filter(
            has_text="moved"
        ).wait_for()

        # A read-only token: no versions (they take the metrics role), no upgrade.
        page.evaluate("sessionStorage.clear()")
        sign_in(tab, VIEWER, "/versions")
        page.locator("#versions-note").filter(has_text="metrics role").wait_for()
        assert page.get_by_role("button", name=re.compile("Upgrade|Check")).count() == 0
    finally:
        engine.dispose()
