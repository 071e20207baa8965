"""The comparison report: figures and ``report.html`` from a synthetic comparison directory with known
numbers, then the page loaded in a real headless Chromium over the DevTools protocol.

Chromium comes from Debian (``apt-get install chromium``, done by the fixture below when it is
absent); it is driven through ``--remote-debugging-pipe`` (JSON messages ended by NUL on fds 3/4), so
no browser download and no client library are needed. Every process the test starts is stopped.
"""

from __future__ import annotations

import base64
import csv
import fcntl
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from flguard.compare.figures import FIGURES, build_figures
from flguard.compare.report import write_report
from flguard.compare.tables import EXTRA_ROUND_COLUMNS, ROUND_COLUMNS, SUMMARY_COLUMNS

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
DEFENSES = ("none", "gaussian", "localdp", "pruning")  # pruning: never attacked (empty attack columns)
#: defense → (final_accuracy, attack_psnr_best, how it is written in the table)
SUMMARY = {"none": (0.875, 24.5, ("87.5%", "24.50")), "gaussian": (0.83, 11.25, ("83.0%", "11.25")),
           "localdp": (0.61, 13.75, ("61.0%", "13.75")), "pruning": (0.79, None, ("79.0%", "—"))}
CONFIG = 'name = "synthetic"\n# a <b>comment</b> & more\n[task]\nrounds = 3\n'


def _write_csv(path: Path, columns, rows) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows({k: "" if row.get(k) is None else row[k] for k in columns} for row in rows)


def make_comparison(root: Path, *, classes: bool = True, same_originals: bool = True) -> Path:
    """A comparison directory as the runner writes it: 4 defenses × 3 rounds × 2 clients, one victim a round."""
    root.mkdir(parents=True, exist_ok=True)
    generator, rows = torch.Generator().manual_seed(0), []
    for r in (1, 2, 3):
        original = torch.rand(2, 1, 8, 8, generator=generator)
        for k, defense in enumerate(DEFENSES):
            for client in (0, 1):
                row = {"round": r, "defense": defense, "client": client, "kind": defense,
                       "num_examples": 8 + 8 * client,
                       "test_accuracy": 0.5 + 0.1 * r - 0.05 * k + 0.02 * client, "test_loss": 1.0 / r,
                       "grad_norm": 10.0, "noise_norm": 2.0 * k, "rel_noise": 0.2 * k, "train_seconds": 0.1,
                       "guard_seconds": 0.01 * k, "min_pred_rmse": {"none": 0.0, "localdp": None}.get(defense, 0.5)}
                if client == r % 2 and defense != "pruning":
                    victim = original if same_originals else torch.rand(2, 1, 8, 8, generator=generator)
                    image = f"runs/{defense}/images/round-{r:04d}_gs.pt"
                    (root / image).parent.mkdir(parents=True, exist_ok=True)
                    noise = 0.1 * (k + 1) * torch.randn(victim.shape, generator=generator)
                    torch.save({"reconstruction": (victim + noise).clamp(0, 1).half(), "original": victim.half()},
                               root / image)
                    exact = (r, defense) == (3, "none")  # PSNR +inf: an exact reconstruction
                    row |= {"attack_method": "gs", "attack_psnr": "inf" if exact else 25.0 - 4 * k + r * 0.1,
                            "attack_ssim": 0.5 - 0.1 * k, "attack_rmse": 0.3 + 0.2 * k, "attack_labels": f"{r % 3} {(r + 1) % 3}",
                            "attack_image": image}
                rows.append(row)
    _write_csv(root / "rounds.csv", ROUND_COLUMNS + EXTRA_ROUND_COLUMNS, rows)
    summary = [{"defense": d, "kind": d, "tau": 0.5, "rounds": 3, "final_accuracy": acc, "attack_psnr_best": psnr,
                "attacks": 0 if psnr is None else 3, "final_loss": 0.4 + 0.1 * k, "run_seconds": 10 + k}
               for k, (d, (acc, psnr, _)) in enumerate(SUMMARY.items())]
    _write_csv(root / "summary.csv", SUMMARY_COLUMNS, summary)
    if classes:
        _write_csv(root / "classes.csv", ("class", "label", "samples", "grad_norm", "lambda_max", "i2f_lb_unit",
                                          "sigma_for_tau"),
                   [{"class": c, "label": name, "samples": 4, "grad_norm": 1.0, "lambda_max": 0.3, "i2f_lb_unit": 0.4,
                     "sigma_for_tau": 20 + 5 * c} for c, name in enumerate(("cat", "dog", "owl"))])
    (root / "config.toml").write_text(CONFIG, encoding="utf-8")
    return root


def embedded_images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return write_report(make_comparison(tmp_path_factory.mktemp("cmp") / "out"))


def test_figures_exist_decode_and_are_exactly_the_embedded_images(report):
    pngs = sorted((report.parent / "figures").glob("*.png"))
    assert {p.stem for p in pngs} == set(FIGURES)
    for png in pngs:
        with Image.open(png) as image:
            image.load()
            assert image.width > 200 and image.height > 200
    page = report.read_text(encoding="utf-8")
    assert sorted(embedded_images(page)) == sorted(p.read_bytes() for p in pngs)
    assert page.count("<img ") == len(pngs)
    assert not re.search(r"(src|href)=\"(?!data:)", page) and "<script" not in page and "@import" not in page


def test_summary_table_numbers_best_cells_and_escaped_config(report):
    page = report.read_text(encoding="utf-8")
    table = page[page.index("<table>"):page.index("</table>")]  # privacy and utility
    for defense, (_, _, shown) in SUMMARY.items():
        row = next(r for r in table.split("<tr>") if r.startswith(f"<td>{defense}</td>"))
        for text in shown:
            assert f">{text}</td>" in row, (defense, text)
    assert '<td class="best">87.5%</td>' in table  # highest accuracy
    assert '<td class="best">11.25</td>' in table  # lowest best-attack PSNR
    assert "flguard comparison: synthetic" in page
    assert "# a &lt;b&gt;comment&lt;/b&gt; &amp; more" in page and "<b>comment</b>" not in page


def test_missing_classes_and_differing_originals_still_report(tmp_path):
    shared = make_comparison(tmp_path / "shared")
    paired = make_comparison(tmp_path / "paired", classes=False, same_originals=False)
    (paired / "figures").mkdir()
    (paired / "figures" / "class_risk.png").write_bytes(b"stale")
    rows = list(csv.DictReader(io.StringIO((paired / "rounds.csv").read_text(encoding="utf-8"))))
    for row in rows:
        if row["defense"] == "localdp":  # a defense that was never attacked
            row.update(attack_method="", attack_psnr="", attack_image="")
    _write_csv(paired / "rounds.csv", ROUND_COLUMNS + EXTRA_ROUND_COLUMNS, rows)
    figures = build_figures(paired)
    assert figures["class_risk"] is None and not (paired / "figures" / "class_risk.png").exists()
    with Image.open(figures["reconstructions"]) as wide, \
            Image.open(build_figures(shared, ["reconstructions"])["reconstructions"]) as narrow:
        assert wide.width > narrow.width  # an original beside every reconstruction
    page = write_report(paired).read_text(encoding="utf-8")
    assert len(embedded_images(page)) == len(FIGURES) - 1 and "Not drawn" in page


# ----------------------------------------------------------------------------------------- real browser

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                  "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--mute-audio",
                  "--remote-debugging-pipe")


def _find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed with apt-get when absent (root on Debian); skipped only if that fails."""
    found = _find_chromium()
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("chromium is not installed, and this is not a root Debian/Ubuntu machine that could install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "fonts-dejavu-core"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=1500)
    if result.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=1500)
    found = _find_chromium()
    if not found:
        pytest.skip(f"chromium could not be installed (apt-get exit {result.returncode}): {result.stderr[-800:]}")
    return found


def process_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


class Chromium:
    """A headless Chromium on the DevTools protocol over a pipe: requests on its fd 3, replies and
    events on its fd 4, one JSON message per NUL-terminated chunk. Started in its own process group
    so that :meth:`close` can stop it and every helper process it forked."""

    def __init__(self, executable: str, profile: Path, log: Path):
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()

        def wire() -> None:  # in the child before exec: the protocol wants exactly fds 3 and 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
            os.dup2(high[0], 3), os.dup2(high[1], 4)
            os.close(high[0]), os.close(high[1])

        with log.open("wb") as sink:
            self.process = subprocess.Popen([executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                            stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, close_fds=False,
                                            preexec_fn=wire, start_new_session=True)
        os.close(to_browser), os.close(from_browser)
        self._buffer, self._id, self.events = b"", 0, []

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if not select.select([self._read], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError("chromium sent nothing (hang guard, not a timing check)")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None, wait: float = 120) -> dict:
        self._id += 1
        request = {"id": self._id, "method": method, "params": params or {}}
        if session:
            request["sessionId"] = session
        data = json.dumps(request).encode() + b"\0"
        while data:
            data = data[os.write(self._write, data):]
        deadline = time.monotonic() + wait
        while (message := self._message(deadline)).get("id") != self._id:
            self.events.append(message)
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        return message.get("result", {})

    def wait_event(self, method: str, session: str, wait: float = 120) -> dict:
        deadline = time.monotonic() + wait
        seen = 0
        while True:
            for event in self.events[seen:]:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            seen = len(self.events)
            self.events.append(self._message(deadline))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries (failed loads included) so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params.get("exceptionDetails", {}))[:400])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def open(self, url: str, width: int, height: int) -> str:
        """A new tab on ``url`` at a desktop-like viewport, loaded; returns its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable", session=session)
        self.viewport(session, width, height)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_event("Page.loadEventFired", session)
        return session

    def viewport(self, session: str, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)

    def evaluate(self, session: str, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def screenshot(self, session: str, path: Path, width: int, max_height: int = 12000) -> Path:
        height = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]["height"]
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": {
            "x": 0, "y": 0, "width": width, "height": min(height, max_height), "scale": 1}}, session)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        """Ask the browser to quit, then kill what is left of its process group (by its id) and reap it."""
        try:
            self.send("Browser.close", wait=15)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 60  # helpers may still be exiting after their browser: kill until none is left
        while process_group(self.process.pid) and time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.process.wait()
        os.close(self._read), os.close(self._write)


IMAGES_JS = """(async () => {
  const images = Array.from(document.images);
  await Promise.all(images.map(i => i.decode().catch(() => null)));
  return images.map(i => ({figure: i.dataset.figure, complete: i.complete, width: i.naturalWidth,
                           inline: i.src.startsWith("data:image/png;base64,")}));
})()"""
OVERFLOW_JS = "document.documentElement.scrollWidth - window.innerWidth"


def artifacts_dir() -> Path:
    return Path(os.environ.get("FLGUARD_TEST_ARTIFACTS") or REPO / "test-artifacts")


@pytest.mark.timeout(2400)  # the first run may install chromium
def test_report_in_headless_chromium(report, chromium, tmp_path):
    browser = Chromium(chromium, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        session = browser.open(report.resolve().as_uri(), 1280, 900)
        images = browser.evaluate(session, IMAGES_JS)
        assert sorted(i["figure"] for i in images) == sorted(FIGURES)
        assert all(i["complete"] and i["width"] > 0 and i["inline"] for i in images), images
        assert browser.evaluate(session, OVERFLOW_JS) <= 0  # nothing wider than a desktop window
        shot = browser.screenshot(session, tmp_path / "tests" / "artifacts" / "report.png", 1280)
        browser.viewport(session, 400, 800)  # a phone: the layout reflows instead of scrolling sideways
        assert browser.evaluate(session, OVERFLOW_JS) <= 0
        assert browser.errors() == [], browser.errors()
        browser.evaluate(session, "console.error('flguard-probe')")  # the error listener itself works
        assert any("flguard-probe" in e for e in browser.errors())
    finally:
        browser.close()
    assert process_group(browser.process.pid) == []
    with Image.open(shot) as image:
        assert image.width == 1280 and image.height > 900
        assert len(image.convert("L").getcolors(256)) > 16  # not a blank page
    artifacts_dir().mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, artifacts_dir() / "report.png")


def test_promise_is_per_sample_and_per_kind_of_attack() -> None:
    """τ met = the share of attacked samples with RMSE ≥ τ, over all attacks and per kind (closed form)."""
    from flguard.compare.tables import sample_rmses, tau_met_share

    probe = {"attack_target": "probe", "attack_rmse": 0.5, "attack_rmse_samples": None}
    upload = {"attack_target": "fedavg-upload", "attack_rmse": 0.6, "attack_rmse_samples": "0.1 0.4 0.9 1.0"}
    assert sample_rmses(probe) == [0.5] and sample_rmses(upload) == [0.1, 0.4, 0.9, 1.0]
    assert tau_met_share([probe], 0.45) == 1.0
    assert tau_met_share([upload], 0.45) == 0.5          # 2 of 4 samples, though the batch mean 0.6 ≥ τ
    assert tau_met_share([probe, upload], 0.45) == 0.6   # 3 of 5 samples
    assert tau_met_share([], 0.45) is None and tau_met_share([probe], None) is None
