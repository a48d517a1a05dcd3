"""Open a report page in a real headless browser and take a full-page screenshot:
`python -m evals.screenshot report/index.html page.png`.

Playwright drives the system's Chromium (Debian: `apt-get install chromium`; Playwright's own browser
downloads are not used; `$HYBRID_EVAL_CHROMIUM` names another executable), so the page is laid out, its
images decoded and its requests seen exactly as a user's browser would. Used by tests/test_trends.py and
to make docs/img/nightly_report.png. Exit status 1 when an image did not load or the page requested
anything but local files; 2 (error / fix lines) without playwright or a browser that starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path


class BrowserUnavailable(RuntimeError):
    """No headless browser can be started here: the executable is missing or does not launch. A property of
    the machine, not of the page (tests/test_trends.py skips on it, with this message as the reason)."""


def chromium_path() -> Path:
    """The Chromium executable to drive: `$HYBRID_EVAL_CHROMIUM` if set, else `chromium` on PATH, else
    Debian's /usr/bin/chromium (which may not exist; `render` says so)."""
    named = os.environ.get("HYBRID_EVAL_CHROMIUM")
    if named:
        return Path(named)
    found = shutil.which("chromium")
    return Path(found) if found else Path("/usr/bin/chromium")


@dataclass
class PageCheck:
    """What the browser saw: per image (loaded, natural width in px), every URL requested, the h2 texts,
    the number of table rows, and the screenshot's path."""

    images: list[tuple[bool, int]]
    requested: list[str]
    headings: list[str]
    table_rows: int
    screenshot: Path
    problems: list[str] = field(default_factory=list)


def render(page: str | Path, screenshot: str | Path, *, width: int = 1400,
           executable: str | Path | None = None) -> PageCheck:
    """Load the HTML file `page` in headless Chromium (viewport `width` px) and screenshot the whole page.

    `executable` defaults to `chromium_path()`. Raises ImportError without the playwright package and
    BrowserUnavailable when the browser is missing or fails to launch; errors after the launch propagate.
    """
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    executable = Path(executable) if executable is not None else chromium_path()
    if not executable.is_file():
        raise BrowserUnavailable(f"no browser at {executable} (apt-get install chromium, or set "
                                 "HYBRID_EVAL_CHROMIUM to a Chromium executable)")
    requested: list[str] = []
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=str(executable), args=["--no-sandbox"])
        except PlaywrightError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BrowserUnavailable(f"{executable} did not launch: {first}") from exc
        try:
            tab = browser.new_page(viewport={"width": width, "height": 900})
            tab.on("request", lambda r: requested.append(r.url))
            tab.goto(Path(page).resolve().as_uri())
            images = [tuple(x) for x in tab.evaluate(
                "Array.from(document.images).map(i => [i.complete, i.naturalWidth])")]
            headings = tab.evaluate("Array.from(document.querySelectorAll('h2')).map(h => h.textContent)")
            rows = int(tab.evaluate("document.querySelectorAll('table tr').length"))
            tab.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    check = PageCheck(images, requested, headings, rows, Path(screenshot))
    check.problems += [f"image {i} did not load" for i, (done, w) in enumerate(images) if not done or w == 0]
    check.problems += [f"requested {u}" for u in requested if not u.startswith("file://")]
    return check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.screenshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path, help="the HTML file (e.g. report/index.html)")
    parser.add_argument("png", type=Path, help="where to write the full-page screenshot")
    parser.add_argument("--width", type=int, default=1400, help="viewport width in px (default 1400)")
    args = parser.parse_args(argv)
    try:
        check = render(args.page, args.png, width=args.width)
    except (ImportError, BrowserUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        print('  fix: pip install ".[test]" (playwright) and apt-get install chromium', file=sys.stderr)
        return 2
    print(f"{args.png}: {len(check.images)} images, {check.table_rows} table rows, "
          f"{len(check.requested)} requests")
    for problem in check.problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if check.problems else 0


if __name__ == "__main__":
    sys.exit(main())
