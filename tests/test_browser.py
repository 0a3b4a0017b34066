"""A real browser (Chromium, driven by Playwright) runs notebook 01 in JupyterLab: Run → Run All Cells, then the
page must show the plotly waterfall with its bars, the control panel's widgets with the last request's
bit-exact flag, and no traceback. The server, its kernel and every process they started are gone afterwards.

JupyterLab serves a temporary copy of `notebooks/` (the committed notebook is not modified), on loopback, with
a token and its config, data and runtime dirs under `tmp_path`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from epd_lab.sweep import JUPYTER_DIRS
from helpers import alive, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "01_epd_protocol_step_by_step.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
# Every cell stays in the page (JupyterLab's default windowing would detach cells scrolled out of view);
# no news or update checks (there is no network).
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's Chromium at /usr/bin/chromium (apt-get install chromium)")


def _children() -> dict[int, list[tuple[int, str]]]:
    """ppid → [(pid, start time)] of every process, from /proc."""
    out: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    return out


def _descendants(pid: int) -> set[tuple[int, str]]:
    """The (pid, start time) of every process below `pid`: the kernel, the encoders it started, ..."""
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


def _api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = resp.read()
    return json.loads(body) if body else None


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 serving a copy of notebooks/: yields (base URL, token)."""
    root = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    dirs = {var: tmp_path / "jupyter" / sub for var, sub in JUPYTER_DIRS.items()}
    for name, settings in USER_SETTINGS.items():
        path = dirs["JUPYTER_CONFIG_DIR"] / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    env = {**os.environ, **{k: str(v) for k, v in dirs.items()}}
    token, base = secrets.token_hex(16), None
    log = tmp_path / "jupyterlab.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={free_port()}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
             *(["--allow-root"] if os.geteuid() == 0 else [])],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        def listening() -> str | None:
            """The server's URL once it answers; the port may have moved on (--port-retries): the server's own
            runtime file says where it listens."""
            assert server.poll() is None, f"JupyterLab exited with {server.returncode}:\n{log.read_text()[-3000:]}"
            try:  # an OSError: the file is not written yet, or the server does not answer yet
                url = json.loads((dirs["JUPYTER_RUNTIME_DIR"] / f"jpserver-{server.pid}.json").read_text())["url"]
                _api(url, token, "api/status")
            except (ValueError, KeyError, OSError):
                return None
            return url

        base = wait_for(listening, 90, lambda: f"JupyterLab started:\n{log.read_text()[-3000:]}", interval=0.2)
        yield base, token
    finally:
        _stop(server, base, token)


def _stop(server: subprocess.Popen, base: str | None, token: str) -> None:
    """Shut the kernels down through the API, stop the server's process group, and check that nothing the
    server started (kernel, encoders) is left."""
    below = _descendants(server.pid)
    if base is not None and server.poll() is None:
        try:
            for kernel in _api(base, token, "api/kernels"):
                _api(base, token, f"api/kernels/{kernel['id']}", method="DELETE")
        except OSError:
            pass  # the group kill below and the check after it still apply
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass
        try:
            server.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 20
    while any(alive(*p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in below if alive(*p)]
    for pid, _ in left:  # do not leave them to the next test, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind by JupyterLab's kernel: {[pid for pid, _ in left]}"


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(".jp-Notebook .jp-CodeCell .jp-InputPrompt",
                                     "els => els.map(e => e.textContent.trim())")


@pytest.mark.timeout(300)
def test_notebook_01_runs_in_jupyterlab(lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    base, token = lab
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            try:
                page.goto(f"{base}lab/tree/{NOTEBOOK}?token={token}")
                _run_all(page)
                _check_outputs(page)
                _send_from_panel(page)
            finally:
                _screenshot(page, tmp_path / "notebook01_jupyterlab.png")  # of a failure too
        finally:
            browser.close()


def _run_all(page) -> None:
    """Clear the committed outputs (their execution counts would pass for this run's), Run → Run All Cells,
    and wait until no cell is running."""
    # the notebook fully rendered and its kernel ready (run commands do nothing before that)
    n_code = sum(c["cell_type"] == "code" for c in json.loads((ROOT / "notebooks" / NOTEBOOK).read_text())["cells"])
    page.wait_for_function(f"() => document.querySelectorAll('.jp-Notebook .jp-CodeCell').length == {n_code}")
    idle = page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle$"))
    idle.wait_for()
    _menu(page, "Edit", "Clear Outputs of All Cells")
    page.wait_for_function("() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]"
                           ".every(e => !/\\d/.test(e.textContent))")
    _menu(page, "Run", "Run All Cells")
    page.wait_for_function("() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]"
                           ".some(e => /[*\\d]/.test(e.textContent))", timeout=30_000)
    wait_for(lambda: "[*]:" not in _prompts(page), 240, lambda: f"every cell run; still running: {_prompts(page)}",
             interval=0.5)
    idle.wait_for()


def _check_outputs(page) -> None:
    """Every cell ran without a traceback; the waterfall and the panel rendered, with bit-exact results."""
    errors = [t for t in page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
              .all_inner_texts() if "Traceback" in t]
    assert not errors, "\n\n".join(errors)
    prompts = _prompts(page)
    assert all(re.fullmatch(r"\[\d+\]:", p) for p in prompts), f"cells that did not run: {prompts}"
    # the waterfall and the panel's FigureWidget: plotly drew them, with bars. A figure whose output carries its
    # PNG too (static_pngs) shows the PNG until the pointer comes over it, then plotly draws it
    assert page.locator(".jp-Notebook .jp-RenderedPlotly img.plot-img").count() >= 1
    for figure in page.locator(".jp-Notebook .jp-RenderedPlotly").all():
        figure.hover()
    wait_for(lambda: page.locator(".jp-Notebook .js-plotly-plot .plot-container").count() >= 2, 30,
             "plotly drew the waterfall and the panel's figure")
    assert page.locator(".jp-Notebook .js-plotly-plot .barlayer .point path").count() > 0
    # the panel's widgets, with its request's status
    assert page.locator(".jp-Notebook .jupyter-widgets").count() > 0
    assert page.locator(".jp-Notebook .widget-button", has_text="Launch").count() == 1
    exact = "bit-identical to the monolithic model: True"
    assert page.locator(".jp-Notebook .widget-html", has_text=exact).count() == 1
    stdout = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"]'
    assert page.locator(stdout, has_text="logits " + exact).count() == 1


def _send_from_panel(page) -> None:
    """The last cell closed the panel: run its cell again (a new panel, launched), then press its Send button
    and see the request's status and waterfall arrive from the kernel."""
    cell = page.locator(".jp-Notebook .jp-CodeCell", has_text="from epd_lab.panel import ControlPanel")
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")
    send = cell.locator(".widget-button", has_text="Send")
    send.wait_for()
    page.wait_for_function("cell => /\\[\\d+\\]/.test(cell.querySelector('.jp-InputPrompt').textContent)",
                           arg=cell.element_handle(), timeout=120_000)
    assert send.is_enabled()
    send.click()
    status = cell.locator(".widget-html", has_text="request panel1")
    status.wait_for(timeout=120_000)
    assert "bit-identical to the monolithic model: True" in status.inner_text()
    cell.locator(".js-plotly-plot .gtitle", has_text="request panel1").wait_for()
    status.scroll_into_view_if_needed()


def _screenshot(page, path: Path) -> None:
    """The page as it is, under tmp_path and, when EPD_ARTIFACTS is set, there too."""
    page.screenshot(path=str(path))
    if os.environ.get("EPD_ARTIFACTS"):
        os.makedirs(os.environ["EPD_ARTIFACTS"], exist_ok=True)
        shutil.copy(path, os.environ["EPD_ARTIFACTS"])


def _menu(page, menu: str, item: str) -> None:
    """Click `item` in the menu bar's `menu`, as a user does."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()
