"""A learner at JupyterLab, through Selenium: open a notebook, use the menus, run cells, type code,
move widgets, and read back what the page shows (prompts, outputs, images, widget images).

Every action is a click or a key, as a learner's: JupyterLab's menus, cell prompts, dialogs of
widgets, typing (code is typed as one insertion, as a paste is). What the page shows is read
with small scripts over the rendered page: prompts, output text and MIME types, images and the
bytes behind them (to tell whether a plot changed), the status bar.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"
CELLS = f"{NOTEBOOK} .jp-Notebook .jp-Cell"
ERROR_MIME = "application/vnd.jupyter.stderr"
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
EXCEPTION = re.compile(r"^\w*(Error|Exception|Interrupt)\b.*", re.MULTILINE)


class PageTimeout(AssertionError):
    """The page did not reach the state a step waits for (the message says which; the page is
    saved as timeout_<step>.png beside the other screenshots)."""


class Learner:
    def __init__(self, driver, lab, screenshots: Path):
        self.driver, self.lab, self.screenshots = driver, lab, screenshots

    # ---- waiting ------------------------------------------------------------------------
    def wait(self, condition, timeout: float, what: str):
        """Poll ``condition`` until it returns something true. Often at first, so that a short wait
        stays short; then every half second: each poll is a script in the page, and polling a long
        run ten times a second kept a fifth of a core busy in Chromium and its driver."""
        start = time.monotonic()
        deadline = start + timeout
        last_error = None
        while time.monotonic() < deadline:
            try:
                value = condition()
                if value:
                    return value
            except StaleElementReferenceException as error:  # the page re-rendered under us
                last_error = error
            time.sleep(min(0.5, 0.1 + 0.1 * (time.monotonic() - start)))
        self.screenshot("timeout_" + re.sub(r"\W+", "_", what)[:40])
        raise PageTimeout(f"waited {timeout:.0f} s for {what}" + (f" ({last_error})" if last_error else ""))

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    # ---- notebooks ------------------------------------------------------------------------
    def open(self, path: str, cells: int, timeout: float = 180) -> None:
        """Open ``path`` in a fresh workspace and wait for its ``cells`` cells and an idle kernel."""
        self.driver.get(self.lab.url(f"/lab/tree/{path}?reset"))
        self.wait(lambda: len(self.cells()) == cells, timeout, f"the {cells} cells of {path}")
        self.wait_idle(timeout, f"{path}'s kernel to start")

    def kernel_status(self) -> str:
        found = self.driver.find_elements(By.CSS_SELECTOR, f"{NOTEBOOK} .jp-Notebook-ExecutionIndicator")
        return found[0].get_attribute("data-status") if found else ""

    def wait_idle(self, timeout: float, what: str) -> None:
        self.wait(lambda: self.kernel_status() == "idle" and "[*]:" not in self.prompts(), timeout, what)

    def cells(self):
        return self.driver.find_elements(By.CSS_SELECTOR, CELLS)

    def cell(self, index: int):
        return self.cells()[index]

    def prompts(self) -> list[str]:
        """Each cell's input prompt as shown ("[3]:", "[*]:", "[ ]:"); "" for markdown cells."""
        return self.js(f"""return [...document.querySelectorAll({CELLS!r})].map(c => {{
            const p = c.querySelector('.jp-InputPrompt'); return c.classList.contains('jp-CodeCell') && p ? p.textContent.trim() : ''; }})""")

    def menu(self, menu: str, command: str) -> None:
        """Click a menu of the menu bar, then the item running ``command`` (its data-command)."""
        self.driver.find_element(By.XPATH, f"//li[contains(@class,'lm-MenuBar-item')][.//div[text()='{menu}']]").click()
        item = self.wait(
            lambda: [
                e
                for e in self.driver.find_elements(
                    By.CSS_SELECTOR, f".lm-Menu-item[data-command='{command}']:not(.lm-mod-disabled)"
                )
                if e.is_displayed()
            ],
            10,
            f"menu item {command}",
        )
        time.sleep(0.2)  # the menu has opened: let it settle before the click
        item[0].click()
        self.wait(
            lambda: not [e for e in self.driver.find_elements(By.CSS_SELECTOR, ".lm-Menu") if e.is_displayed()],
            10,
            "the menu to close",
        )

    def clear_outputs(self) -> None:
        """Edit ▸ Clear Outputs of All Cells (the prompts go back to "[ ]:")."""
        self.select(self.first_code_cell())
        self.menu("Edit", "editmenu:clear-all")
        self.wait(
            lambda: (
                not self.js(f"return document.querySelectorAll({CELLS!r} + ' .jp-OutputArea-output').length")
                and all(p in ("", "[ ]:") for p in self.prompts())
            ),
            10,
            "outputs to clear",
        )

    def first_code_cell(self) -> int:
        return next(i for i, p in enumerate(self.prompts()) if p)

    def run_all(
        self, timeout: float, while_running=None, command: str = "runmenu:run-all", selected: int | None = None
    ) -> float:
        """Run ▸ Run All Cells (or another item of the Run menu, with cell ``selected`` selected);
        call ``while_running()`` once the run is under way; return the seconds it took.

        Seen now and then on a loaded machine: Run All chosen just after a notebook opened ran
        nothing (the prompts stayed as they were). It is chosen a second time then.
        """
        before, start = self.prompts(), time.monotonic()
        for attempt in (1, 2):
            self.select(self.first_code_cell() if selected is None else selected)  # the notebook has the focus
            self.menu("Run", command)
            try:
                self.wait(lambda: "[*]:" in (now := self.prompts()) or now != before, 10, "the run to start")
                break
            except PageTimeout:
                if attempt == 2:
                    raise
        if while_running:
            while_running()
        self.wait_idle(timeout, "the run to finish")
        return time.monotonic() - start

    def select(self, index: int) -> None:
        """Click a cell's prompt: the cell becomes the selected one, in command mode."""
        cell = self.cell(index)
        self.js("arguments[0].scrollIntoView({block: 'center'})", cell)
        try:
            cell.find_element(By.CSS_SELECTOR, ".jp-Cell-inputWrapper .jp-InputPrompt").click()
        except ElementClickInterceptedException:
            self._fail_on_dialog(f"selecting cell {index}")
            raise
        self.wait(
            lambda: (
                "jp-mod-selected" in self.cell(index).get_attribute("class")
                and self.js(f"return !!document.querySelector({NOTEBOOK!r} + ' .jp-Notebook.jp-mod-commandMode')")
            ),
            5,
            f"cell {index} selected",
        )

    def _fail_on_dialog(self, step: str) -> None:
        """A JupyterLab dialog covers the page (seen once, on a loaded machine, when a click was
        intercepted): fail with what it says, and save the page as dialog_<step>.png."""
        text = self.js("const d = document.querySelector('.jp-Dialog'); return d ? d.innerText : ''")
        if text:
            self.screenshot("dialog_" + re.sub(r"\W+", "_", step)[:40])
            raise AssertionError(f"a dialog covered the page while {step}: {' / '.join(text.split(chr(10)))[:400]}")

    def run_cell(self, index: int, timeout: float) -> None:
        """Select a cell and press Ctrl+Enter (run it, stay on it); wait for its new prompt number."""
        before = self.prompts()[index]
        for attempt in range(3):
            self.select(index)
            ActionChains(self.driver).key_down(Keys.CONTROL).send_keys(Keys.ENTER).key_up(Keys.CONTROL).perform()
            # JupyterLab shows [*] as it handles the key, before the kernel is asked: a prompt
            # still unchanged a while later means the key press was lost, not that the run is slow
            # (seen once on a loaded machine, the cell selected in command mode: 120 s waited for
            # nothing). Pressing again cannot run the cell twice: a queued run would show [*].
            try:
                self.wait(lambda: self.prompts()[index] != before, 10, f"cell {index} to be queued")
                break
            except PageTimeout:
                if attempt == 2:
                    raise
        self.wait(
            lambda: self.prompts()[index] not in (before, "[*]:", "[ ]:") and self.kernel_status() == "idle",
            timeout,
            f"cell {index} to run",
        )

    def type_into(self, index: int, code: str) -> str:
        """Click into a cell's editor, select its text, type ``code`` over it; return what the editor holds.

        The text is typed as one insertion (as a paste is), so the editor's auto-indent and
        bracket closing do not add to it.
        """
        cell = self.cell(index)
        self.js("arguments[0].scrollIntoView({block: 'center'})", cell)
        editor = cell.find_element(By.CSS_SELECTOR, ".cm-content")
        editor.click()
        ActionChains(self.driver).key_down(Keys.CONTROL).send_keys("a").key_up(Keys.CONTROL).perform()
        self.driver.execute_cdp_cmd("Input.insertText", {"text": code})
        return self.source(index)

    def source(self, index: int) -> str:
        return self.js(
            "return [...arguments[0].querySelectorAll('.cm-line')].map(l => l.textContent).join('\\n')",
            self.cell(index),
        )

    # ---- what the page shows ----------------------------------------------------------------
    def outputs(self, index: int) -> list[dict]:
        """Each output of a cell: its MIME type as rendered, its text, and its images' sizes."""
        return self.js(
            """return [...arguments[0].querySelectorAll('.jp-OutputArea-output')].map(o => ({
            mime: o.getAttribute('data-mime-type') || '',
            text: o.innerText,
            images: [...o.querySelectorAll('img')].map(i => [i.naturalWidth, i.naturalHeight]),
        }))""",
            self.cell(index),
        )

    def errors(self) -> dict[int, str]:
        """Cells showing an error: a traceback, or an exception's line, in red (stderr): index -> text.

        JupyterLab renders an error and anything printed to stderr alike (both red); a warning
        alone is not an error here.
        """
        shown = {}
        for index, prompt in enumerate(self.prompts()):
            if prompt:
                bad = [
                    o["text"]
                    for o in self.outputs(index)
                    if o["mime"] == ERROR_MIME and (TRACEBACK.search(o["text"]) or EXCEPTION.search(o["text"]))
                ]
                if bad:
                    shown[index] = "\n".join(bad)
        return shown

    def image_digest(self, element) -> str:
        """SHA-256 of the bytes behind an <img> (a data: or blob: URL), '' if it has none."""
        return self.driver.execute_async_script(
            """
            const [img, done] = arguments;
            if (!img.src) { done(''); return; }
            fetch(img.src).then(r => r.arrayBuffer()).then(b => crypto.subtle.digest('SHA-256', b))
              .then(h => done([...new Uint8Array(h)].map(x => x.toString(16).padStart(2, '0')).join('')))
              .catch(e => done('error: ' + e));""",
            element,
        )

    def watch_images(self, index: int) -> None:
        """Start noting every distinct image a cell's outputs show (for a plot redrawn in place)."""
        self.js(
            """const cell = arguments[0];
            window.__frames = []; const seen = new Set();
            const note = () => cell.querySelectorAll('.jp-OutputArea-output img').forEach(img => {
                if (img.src && !seen.has(img.src)) {
                    seen.add(img.src);
                    const prompt = cell.querySelector('.jp-InputPrompt').textContent.trim();
                    window.__frames.push({length: img.src.length, running: prompt === '[*]:',
                                          images: cell.querySelectorAll('.jp-OutputArea-output img').length});
                }});
            window.__frameObserver = new MutationObserver(note);
            window.__frameObserver.observe(cell, {subtree: true, childList: true, attributes: true,
                                                  attributeFilter: ['src']});""",
            self.cell(index),
        )

    def frames(self) -> list[dict]:
        return self.js("window.__frameObserver && window.__frameObserver.disconnect(); return window.__frames || []")

    def screenshot(self, name: str, index: int | None = None) -> Path:
        """Save what the learner sees (scrolled to cell ``index`` if given) as <name>.png."""
        if index is not None:
            self.js("arguments[0].scrollIntoView({block: 'start'})", self.cell(index))
        # images decoded and painted, not half-way through a redraw
        self.wait(lambda: self.js("return [...document.images].every(i => i.complete)"), 10, "images to load")
        time.sleep(0.3)
        path = self.screenshots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    # ---- widgets --------------------------------------------------------------------------
    def control(self, index: int, label: str):
        """The ipywidgets control labelled ``label`` in cell ``index``'s output."""
        found = [
            row
            for row in self.cell(index).find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output .widget-inline-hbox")
            if row.find_elements(By.CSS_SELECTOR, ":scope > label.widget-label")
            and row.find_element(By.CSS_SELECTOR, ":scope > label.widget-label").text == label
        ]
        assert len(found) == 1, f"{len(found)} controls labelled {label!r} in cell {index}"
        return found[0]

    def choose(self, index: int, label: str, value: str) -> None:
        """Pick ``value`` in the drop-down menu ``label``."""
        Select(self.control(index, label).find_element(By.TAG_NAME, "select")).select_by_value(value)

    def slide(self, index: int, label: str, steps: int) -> str:
        """Move the slider ``label`` by ``steps`` stops with the arrow keys; return its new readout."""
        row = self.control(index, label)
        handle = row.find_element(By.CSS_SELECTOR, ".noUi-handle")
        handle.click()
        key = Keys.ARROW_RIGHT if steps > 0 else Keys.ARROW_LEFT
        for _ in range(abs(steps)):
            handle.send_keys(key)
        return row.find_element(By.CSS_SELECTOR, ".widget-readout").text

    def enter_number(self, index: int, label: str, value) -> None:
        """Type ``value`` into the number box ``label`` and press Enter."""
        box = self.control(index, label).find_element(By.TAG_NAME, "input")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(str(value), Keys.ENTER)

    def widget_image(self, index: int) -> str:
        images = self.cell(index).find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output .widget-image")
        assert len(images) == 1, f"{len(images)} widget images in cell {index}"
        return self.image_digest(images[0])

    def widget_messages(self, index: int) -> list[tuple[str, str]]:
        """The text of each HTML widget in cell ``index``'s output and the colour it is shown in."""
        return self.js(
            """return [...arguments[0].querySelectorAll('.jp-OutputArea-output .widget-html-content')]
            .map(h => [h.innerText, h.firstElementChild ? getComputedStyle(h.firstElementChild).color : ''])""",
            self.cell(index),
        )

    def expect_redraw(self, index: int, change, what: str, timeout: float = 30) -> str:
        """Do ``change()`` to a widget of cell ``index`` and wait for its image to change.

        Fails as soon as the log console gets an entry (an exception in a widget's callback is
        not shown in the cell: JupyterLab puts its traceback in the log console and lights up
        the status bar), or when the image stays the same for ``timeout`` seconds. Returns the
        new image's digest.
        """
        before, entries = self.widget_image(index), self.log_entries()

        def redrawn():
            if self.log_entries() > entries:
                raise AssertionError(
                    f"{what}: the widget's callback raised; JupyterLab's log console shows:\n"
                    + self.log_console()[-3000:]
                )
            digest = self.widget_image(index)
            return digest if digest != before else None

        change()
        try:
            return self.wait(redrawn, timeout, f"the plot to change after {what}")
        except PageTimeout as error:
            raise AssertionError(f"{what}: the widget's plot did not change ({error})") from None

    def settled_image(self, index: int, quiet: float = 1.0, timeout: float = 30) -> str:
        """The digest of cell ``index``'s widget image once the kernel is idle and the image has
        stayed the same for ``quiet`` seconds since: a change can bring more than one redraw
        (``expect_redraw`` returns at the first), and an image read between them is not the one the
        widget ends with. Quiet alone is not enough on a loaded machine, where a callback still
        running can take longer than ``quiet`` to send its next image; the kernel reports idle only
        after its last message."""
        last, since = self.widget_image(index), time.monotonic()

        def settled():
            nonlocal last, since
            digest = self.widget_image(index)
            if digest != last or self.kernel_status() != "idle":
                last, since = digest, time.monotonic()
            return digest if time.monotonic() - since >= quiet else None

        return self.wait(settled, timeout, "the widget's plot to settle")

    # ---- the log console --------------------------------------------------------------------
    def log_entries(self) -> int:
        """How many entries the status bar's log console item reports for this notebook (0: hidden)."""
        title = self.js("""const item = document.querySelector('.jp-LogConsoleStatusItem:not(.lm-mod-hidden) [title]');
                           return item ? item.title : ''""")
        found = re.search(r"(\d+) log entr", title)
        return int(found.group(1)) if found else 0

    def log_console(self) -> str:
        """Open the log console from the status bar (as a learner would) and return its text."""
        self.driver.find_element(By.CSS_SELECTOR, ".jp-LogConsoleStatusItem").click()
        return self.wait(
            lambda: self.js("""const panel = document.querySelector('.jp-LogConsolePanel');
                                            return panel && panel.innerText.trim()"""),
            10,
            "the log console",
        )
