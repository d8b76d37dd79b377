"""Headless Debian chromium driven by selenium through the system chromedriver (nothing downloaded).

`make test` installs `chromium` and `chromium-driver` when they are missing and it runs as root (as CI
does); elsewhere `browser_unavailable()` says why the browser tests skip.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/lib/chromium/chromium")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--force-color-profile=srgb", "--lang=en-US")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"


def chromium_binary() -> str | None:
    return next((p for p in CHROMIUM_CANDIDATES if Path(p).is_file()), None)


def browser_unavailable() -> str | None:
    """None when a browser test can run, else the reason it cannot."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if chromium_binary() is None:
        return "Debian's chromium is not installed (make test installs it as root: apt-get install chromium chromium-driver)"
    if not Path(CHROMEDRIVER).is_file():
        return f"{CHROMEDRIVER} is missing (apt-get install chromium-driver)"
    return None


class Browser:
    """One headless chromium with a fresh profile; `phone()` / `desktop()` switch the viewport."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="kiln-ui-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium_binary()
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile}")
        options.add_argument(f"--window-size={width},{height}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.set_page_load_timeout(60)
        self.width = width

    def desktop(self, width: int = 1280, height: int = 900) -> None:
        self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        self.driver.set_window_size(width, height)
        self.width = width

    def phone(self, width: int = 390, height: int = 844) -> None:
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": True})
        self.width = width

    def screenshot(self, name: str) -> Path:
        """The whole page (not just the viewport) as PNG under test-artifacts/ui/."""
        import base64

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def console_errors(self) -> list[str]:
        try:
            logs = self.driver.get_log("browser")
        except Exception:
            return []
        return [e["message"] for e in logs if e.get("level") == "SEVERE"]

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
