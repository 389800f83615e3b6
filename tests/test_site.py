"""The course as a website (`make site`, site_src/build.py): built once here, into a temporary folder.

* the build passes with warnings as errors (a broken internal link, a missing image, a page
  outside the table of contents);
* every chapter and exercise notebook has its page; the sidebar lists the 18 chapters in the
  course's reading order (00, a0, 01 ... 12, a1, a2, a3, a4), titled by their first heading;
* a chapter's figures are images whose files exist, one per saved PNG output;
* a chapter page's exercise link and grading link land on an existing page and anchor, and the
  exercise pages' JupyterLab-style section links (`chapter.ipynb#3.-Bucketing:-...`) on a section;
* the results pages list every GPU record with its provenance;
* in Debian's headless chromium (skipped without it or selenium), with every host but this
  machine's loopback unreachable (a dead proxy and a resolver that finds no name): chapter 07's
  sidebar shows the 18 chapters in order, its Gantt charts are loaded images, its schedule
  widget is drawn with its controls, its formulas are typeset by MathJax, every file the page
  loaded came from the site itself, and its exercise link opens the exercise page. Screenshots
  go to out/browser/site_07.png (the top of the page) and site_07_gantt.png (its first chart);
* the scripts that make this work offline (site_src/vendor/) are all there, with licences.
"""

from __future__ import annotations

import functools
import html
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("myst_nb", reason="myst-nb is missing: pip install -r requirements-dev.txt")
pytestmark = pytest.mark.timeout(600)


def _load_build():
    """site_src/build.py as a module (its name alone would clash with PyPA's `build`)."""
    spec = importlib.util.spec_from_file_location("ultrascale_site_build", ROOT / "site_src" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


site_build = _load_build()

# The course's reading order, as the brief of the site and chapter 00's map give it.
ORDER = ["00", "a0", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "a1", "a2", "a3", "a4"]
CHAPTER_07 = "07_pipeline_parallelism"
SCREENSHOTS = ROOT / "out" / "browser"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """site_src/build.py's HTML, built once into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, str(ROOT / "site_src" / "build.py"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, f"the site's build failed:\n{(done.stdout + done.stderr)[-6000:]}"
    return out / "html"


def _sidebar(page: str) -> dict[str, list[tuple[str, str]]]:
    """The sidebar's captions and, under each, its (href, text) entries, in order."""
    nav = page[page.index('<nav class="bd-links') :]
    nav = nav[: nav.index("</nav>")]
    sections, caption = {}, None
    for match in re.finditer(
        r'<span class="caption-text">(.*?)</span>|<li class="toctree-l1[^"]*">'
        r'<a class="[^"]*" href="([^"]*)">(.*?)</a>',
        nav,
        re.S,
    ):
        if match[1] is not None:
            caption = html.unescape(match[1])
            sections[caption] = []
        elif caption is not None:
            sections[caption].append((match[2], html.unescape(re.sub("<.*?>", "", match[3])).strip()))
    return sections


def _chapter_titles() -> list[str]:
    return [
        site_build.title(json.loads((ROOT / "chapters" / f"{stem}.ipynb").read_text()))
        for stem in site_build.reading_order()
    ]


def test_offline_scripts_are_kept_with_their_licences():
    """The pages load RequireJS, the widget manager and MathJax from site_src/vendor/ (in the
    site's _static/), each beside its package's licence."""
    vendor = importlib.util.spec_from_file_location("ultrascale_site_vendor", ROOT / "site_src" / "vendor.py")
    module = importlib.util.module_from_spec(vendor)
    vendor.loader.exec_module(module)
    assert not module.missing(), module.missing()
    for script in (module.REQUIRE_JS, module.WIDGETS_JS, module.MATHJAX_JS):
        folder = (module.VENDOR / script).parents[len(Path(script).parts) - 2]
        licence = [p for p in folder.iterdir() if "LICENSE" in p.name] or (
            ["require.js header"] if "@license RequireJS" in (module.VENDOR / script).read_text()[:300] else []
        )
        assert licence, f"no licence beside {script}"


def test_pages_load_the_scripts_from_the_site(site):
    page = (site / f"chapters/{CHAPTER_07}.html").read_text()
    scripts = re.findall(r'<script[^>]*src="([^"]+)"', page)
    assert not [src for src in scripts if "://" in src or src.startswith("//")], scripts
    for src in scripts:
        assert (site / "chapters").joinpath(src.split("?")[0]).resolve().is_file(), src
    for name in ("require.js", "embed-amd.js", "tex-chtml.js"):
        assert any(src.split("?")[0].endswith(name) for src in scripts), (name, scripts)


def test_reading_order_is_the_course_map():
    order = site_build.reading_order()
    assert [stem.split("_")[0] for stem in order] == ORDER
    assert sorted(order) == sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))


def test_every_notebook_has_a_page(site):
    for notebook in [*(ROOT / "chapters").glob("*.ipynb"), *(ROOT / "exercises").glob("*_exercises.ipynb")]:
        page = site / notebook.parent.name / f"{notebook.stem}.html"
        assert page.is_file(), f"no page for {notebook.relative_to(ROOT)}"
    for page in ("index.html", "results/README.html", "results/records.html", "README.html"):
        assert (site / page).is_file(), page


def test_sidebar_lists_the_chapters_in_reading_order(site):
    for page in ("index.html", f"chapters/{CHAPTER_07}.html", "exercises/a1_profiling_exercises.html"):
        sidebar = _sidebar((site / page).read_text())
        assert list(sidebar)[:2] == ["Chapters", "Exercises"], (page, list(sidebar))
        chapters = sidebar["Chapters"]
        assert [text for _, text in chapters] == _chapter_titles(), page
        assert [text.split(" ")[0].lower() for _, text in chapters] == ORDER, page
        assert len(sidebar["Exercises"]) == len(list((ROOT / "exercises").glob("*_exercises.ipynb"))), page
        for href, _ in chapters + sidebar["Exercises"]:
            assert href == "#" or (site / page).parent.joinpath(href).resolve().is_file(), (page, href)


def test_previous_and_next_follow_the_order(site):
    page = (site / f"chapters/{CHAPTER_07}.html").read_text()
    prev = re.search(r'<a class="left-prev"\s+href="([^"]+)"', page)
    nxt = re.search(r'<a class="right-next"\s+href="([^"]+)"', page)
    assert prev and prev[1] == "06_context_parallelism.html"
    assert nxt and nxt[1] == "08_expert_parallelism.html"
    a0 = (site / "chapters/a0_collectives.html").read_text()
    assert re.search(r'<a class="left-prev"\s+href="00_orientation.html"', a0)
    assert re.search(r'<a class="right-next"\s+href="01_one_gpu.html"', a0)


@pytest.mark.parametrize("stem", [CHAPTER_07, "01_one_gpu", "a0_collectives"])
def test_chapter_figures_are_images_that_exist(site, stem):
    notebook = json.loads((ROOT / "chapters" / f"{stem}.ipynb").read_text())
    pngs = sum(
        "image/png" in output.get("data", {}) for cell in notebook["cells"] for output in cell.get("outputs", [])
    )
    page = site / "chapters" / f"{stem}.html"
    images = re.findall(r'<img [^>]*src="([^"]+)"', page.read_text())
    assert pngs > 0 and len(images) >= pngs, (stem, pngs, images)
    for src in images:
        assert page.parent.joinpath(src).resolve().is_file(), src


def test_chapter_links_to_its_exercises_and_the_grading_command(site):
    page = (site / f"chapters/{CHAPTER_07}.html").read_text()
    box = page[page.index("This chapter") :][:3000]
    href = re.search(r'href="(\.\./exercises/[^"#]+\.html)"', page[page.index("This chapter") - 300 :])[1]
    assert href == f"../exercises/{CHAPTER_07}_exercises.html"
    assert "Chapter 7 exercises" in (site / "chapters" / href).resolve().read_text()
    assert f"make grade NB=work/exercises/{CHAPTER_07}_exercises.ipynb" in re.sub("<.*?>", "", box)
    grading = re.search(r'href="\.\./README\.html#([^"]+)"', box)
    readme = (site / "README.html").read_text()
    assert grading and f'id="{grading[1]}"' in readme
    section = re.sub("<.*?>", "", readme[readme.index(f'id="{grading[1]}"') :])[:3000]
    assert "make grade" in section  # the anchor is the README's section on the grading command


def test_exercise_section_links_land_on_sections(site):
    """The exercises link to a chapter's sections by JupyterLab's anchors; the site keeps them."""
    checked = 0
    for page in sorted((site / "exercises").glob("*.html")):
        for target, anchor in re.findall(r'href="\.\./chapters/([^"#]+\.html)#([^"]+)"', page.read_text()):
            assert f'id="{anchor}"' in (site / "chapters" / target).read_text(), (page.name, target, anchor)
            checked += 1
    assert checked >= 20


def test_results_pages_list_every_record_with_its_provenance(site):
    records = (site / "results/records.html").read_text()
    for path in sorted((ROOT / "results").glob("*.json")):
        record = json.loads(path.read_text())
        assert path.name in records
        for field in ("device", "torch", "date"):
            assert str(record[field])[:10] in records, (path.name, field)
        assert (site / "results" / re.search(rf'href="([^"]*{re.escape(path.name)})"', records)[1]).is_file()
    assert "Recorded GPU results" in (site / "results/README.html").read_text()


# ---- in a real browser --------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    pytest.importorskip("selenium", reason="selenium is missing: pip install -r requirements-dev.txt")
    sys.path.insert(0, str(ROOT / "tests"))
    from browser.lab import Unavailable, browser_paths

    def start_browser(chromium, driver, profile, log):
        """As browser.lab's, with the network off but for this machine's loopback (the site's server)."""
        from browser.lab import chrome_options
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, if ever reached, must not download
        options = chrome_options(chromium, profile)
        # Chromium never proxies loopback; every other host goes to a closed port, and no name resolves
        options.add_argument("--proxy-server=http://127.0.0.1:9")
        options.add_argument("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        return webdriver.Chrome(service=Service(executable_path=driver, log_output=str(log)), options=options)

    try:
        chromium, driver = browser_paths()
    except Unavailable as why:
        pytest.skip(str(why))
    where = tmp_path_factory.mktemp("chromium")
    session = start_browser(chromium, driver, where / "profile", where / "chromedriver.log")
    try:
        yield session
    finally:
        session.quit()


@pytest.fixture(scope="module")
def served(site):
    """The site over http on a free localhost port (as `python -m http.server -d site/html`)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.browser
def test_chapter_07_in_chromium(browser, served):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.set_page_load_timeout(60)
    browser.get(f"{served}/chapters/{CHAPTER_07}.html")
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")

    # The network is off: the widget manager, RequireJS and MathJax come from the site itself.
    # The schedule explorer (an ipywidgets view restored from the saved state) is drawn with its
    # drop-down menus and sliders, in place of the script tag that holds its state.
    controls = WebDriverWait(browser, 60).until(
        lambda b: b.execute_script("""
        const views = document.querySelectorAll('.jupyter-widgets select, .jupyter-widgets .slider-container');
        return [...views].filter(v => v.getBoundingClientRect().width > 0).length;""")
    )
    assert controls >= 2, controls
    # Every formula typeset: MathJax replaced each math element's TeX with its rendering.
    math = WebDriverWait(browser, 60).until(
        lambda b: b.execute_script("""
        const math = [...document.querySelectorAll('article .math')];
        return math.length && math.every(m => m.querySelector('mjx-container')) ? math.length : 0;""")
    )
    assert math >= 5, math
    errors = browser.execute_script("return document.querySelectorAll('article mjx-merror').length")
    assert errors == 0, f"{errors} formulas MathJax could not typeset"
    outside = browser.execute_script("""return performance.getEntriesByType('resource')
        .map(e => e.name).filter(u => !u.startsWith(location.origin));""")
    assert not outside, f"the page asked for files from outside the site: {outside}"
    missing = browser.execute_script("""return performance.getEntriesByType('resource')
        .filter(e => e.responseStatus >= 400 && !e.name.endsWith('/favicon.ico'))   // the browser's own
        .map(e => [e.name, e.responseStatus]);""")
    assert not missing, f"files the page asked for and the site does not have: {missing}"
    # No script threw (the widget manager once did, calling MathJax 2's Hub on MathJax 3).
    thrown = [entry["message"] for entry in browser.get_log("browser") if entry.get("source") == "javascript"]
    assert not thrown, thrown

    entries = browser.execute_script("""
        const caption = [...document.querySelectorAll('nav.bd-links .caption-text')]
            .find(c => c.textContent.trim() === 'Chapters');
        const list = caption.closest('p').nextElementSibling;
        return [...list.querySelectorAll(':scope > li > a')].map(a => {
            const box = a.getBoundingClientRect();
            return [a.textContent.trim(), box.width > 0 && box.height > 0];
        });""")
    assert [text for text, _ in entries] == _chapter_titles()
    assert all(visible for _, visible in entries), entries

    # The Gantt charts: the schedules drawn by the simulator, loaded and laid out on the page.
    images = browser.execute_script("""
        return [...document.querySelectorAll('article img')].map(
            i => [i.getAttribute('src'), i.complete, i.naturalWidth, i.getBoundingClientRect().width]);""")
    assert len(images) >= 7, images
    for src, complete, natural, shown in images:
        assert complete and natural > 0 and shown > 0, (src, complete, natural, shown)

    browser.execute_script("window.scrollTo(0, 0)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "site_07.png"))
    browser.execute_script("document.querySelector('article img').scrollIntoView({block: 'center'})")
    browser.save_screenshot(str(SCREENSHOTS / "site_07_gantt.png"))

    link = browser.find_element(By.XPATH, "//article//a[contains(., 'This chapter')]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", link)
    link.click()
    WebDriverWait(browser, 30).until(lambda b: b.current_url.endswith(f"/exercises/{CHAPTER_07}_exercises.html"))
    heading = browser.find_element(By.CSS_SELECTOR, "article h1").get_attribute("textContent")
    assert heading.strip().startswith("Chapter 7 exercises"), heading
