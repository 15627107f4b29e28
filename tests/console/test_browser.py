"""The web console in a real headless Chromium (Debian's chromium + chromedriver, via Selenium).

A broker carries live traffic on one topic (a producer and an acking consumer in
threads) while another topic and group stay still, so that what the pages show
can be compared with `describe` exactly. The reset and the redrive go through the
UI: the form, the confirmation page, the button. Screenshots of each page go to
$ZBROKER_SCREENSHOTS (docs/console/ when making the docs), else to tmp_path.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.console.conftest import eventually
from contextlib import closing

from zbroker.client import Admin, Connection, Consumer, Producer, fetch

pytestmark = [pytest.mark.processes, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _require_browser() -> None:
    if CHROMIUM and CHROMEDRIVER:
        return
    missing = "chromium" if not CHROMIUM else "chromedriver"
    if os.environ.get("CI") == "true" or os.environ.get("ZBROKER_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{missing} is missing: apt-get install -y chromium chromium-driver (.ci/run does)")
    pytest.skip(f"{missing} is not installed (apt-get install -y chromium chromium-driver)")


@pytest.fixture
def browser():
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class Traffic:
    """A producer and an acking consumer on `topic`, until stopped."""

    def __init__(self, url: str, topic: str, group: str) -> None:
        self.url, self.topic, self.group = url, topic, group
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._produce, daemon=True),
                        threading.Thread(target=self._consume, daemon=True)]
        self.errors: list = []

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(20)
        assert not self.errors, self.errors

    def _produce(self) -> None:
        try:
            producer = Producer(self.url)
            i = 0
            while not self.stop.wait(0.02):
                producer.send(self.topic, value=b"tick %d" % i)
                i += 1
                if i % 10 == 0:
                    producer.flush()
            producer.flush()
            producer.close()
        except Exception as err:  # shown by __exit__
            self.errors.append(err)

    def _consume(self) -> None:
        try:
            with Consumer(self.url, group=self.group, topics=[self.topic]) as consumer:
                while not self.stop.is_set():
                    for rec in consumer.poll(max_records=100, timeout=0.2):
                        consumer.ack(rec)
                consumer.flush_acks()
        except Exception as err:
            self.errors.append(err)


def _shots_dir(tmp_path: Path) -> Path:
    path = Path(os.environ.get("ZBROKER_SCREENSHOTS") or tmp_path / "shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cells(driver, css: str) -> list[str]:
    from selenium.webdriver.common.by import By
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def _shown_matches(driver, url: str, check) -> bool:
    """Reload until `check(driver)` holds: the pages show the latest one-second sample."""
    def attempt():
        driver.get(url)
        return check(driver)
    return eventually(attempt, what=f"{url} showing the described figures")


def _text_after_click(driver, by: str, value: str, expected: str) -> str:
    """The text of the element once the page a click led to shows `expected`: a click that
    submits a form returns before the new page is loaded, and an element found on the old
    one goes stale (StaleElementReferenceException) or still holds the old text."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    def attempt():
        try:
            text = driver.find_element(by, value).text
        except (NoSuchElementException, StaleElementReferenceException):
            return None
        return text if expected in text else None
    return eventually(attempt, what=f"{expected!r} in {value}")


def test_console_pages_match_describe_and_reset_and_redrive_work(console_broker, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    broker, console = console_broker
    base = console.base
    shots = _shots_dir(tmp_path)
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=2)
        admin.create_topic("clicks", partitions=1)
        producer = Producer(broker.url)
        for i in range(30):
            producer.send("orders", value=f"order {i}".encode(), key=b"\x00\xffk%d" % i,
                          headers={"note": b"<b>not bold</b>"})
        producer.flush()
        producer.close()
        billing = Consumer(broker.url, group="billing", topics=["orders"])
        held = []
        while len(held) < 30:
            held += billing.poll(max_records=30, timeout=1.0)
        for rec in held[:10]:
            billing.ack(rec)
        poison = next(r for r in held[10:] if r.partition == held[0].partition)
        assert billing.reject([poison], reason="bad <script>") == 1
        billing.flush_acks()

        with Traffic(broker.url, "clicks", "clickers"):
            # -- overview: every actor, its memory and files, the two charts drawn
            browser.get(base + "/")
            kinds = set(_cells(browser, "#actors tr.actor td:first-child"))
            assert {"group-coordinator", "commit-writer", "partition-log", "console"} <= kinds
            eventually(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#chart-produced canvas")) > 0,
                       what="the produce chart drawn")
            eventually(lambda: (browser.get(base + "/") or True) and
                       len(browser.find_elements(By.CSS_SELECTOR, ".uplot")) == 2, what="both charts")
            browser.save_screenshot(str(shots / "overview.png"))

            # -- topics: log start and end as describe_topic says (orders is still)
            described = admin.describe_topic("orders")["partitions"]

            def topics_ok(d):
                rows = d.find_elements(By.CSS_SELECTOR, 'tr.part[data-topic="orders"]')
                shown = {int(r.get_attribute("data-partition")): (r.find_element(By.CSS_SELECTOR, ".log-start").text,
                                                                  r.find_element(By.CSS_SELECTOR, ".log-end").text)
                         for r in rows}
                return shown == {p["partition"]: (str(p["log_start"]), str(p["log_end"])) for p in described}
            _shown_matches(browser, base + "/topics", topics_ok)
            browser.save_screenshot(str(shots / "topics.png"))

            # -- groups: billing's lag and in flight as describe_group says. Described afresh at
            # every look: the page samples once a second, and billing may still be settling (a
            # dead letter whose new DLQ partition was not open yet is copied again a second later).
            group = admin.describe_group("billing")
            assert sum(p["lag"] for p in group["partitions"]) > 0
            assert sum(p["in_flight"] for p in group["partitions"]) > 0

            def groups_ok(d):
                group = admin.describe_group("billing")
                lag = sum(p["lag"] for p in group["partitions"])
                in_flight = sum(p["in_flight"] for p in group["partitions"])
                row = d.find_elements(By.CSS_SELECTOR, 'tr.group[data-group="billing"]')
                return bool(row) and (row[0].find_element(By.CSS_SELECTOR, ".lag").text,
                                      row[0].find_element(By.CSS_SELECTOR, ".in-flight").text) == (str(lag), str(in_flight))
            _shown_matches(browser, base + "/groups", groups_ok)
            assert "clickers" in _cells(browser, "tr.group td:first-child")
            browser.save_screenshot(str(shots / "groups.png"))

            # -- one group: per partition committed, lag, in flight, the blocker; the status word
            def group_ok(d):
                for p in admin.describe_group("billing")["partitions"]:
                    row = d.find_element(By.CSS_SELECTOR, f'tr.part[data-topic="orders"][data-partition="{p["partition"]}"]')
                    shown = [row.find_element(By.CSS_SELECTOR, c).text
                             for c in (".committed", ".lag", ".in-flight", ".blocker-offset")]
                    if shown != [str(p["committed"]), str(p["lag"]), str(p["in_flight"]), str(p["blocker"]["offset"])]:
                        return False
                return True
            _shown_matches(browser, base + "/groups/billing", group_ok)
            assert browser.find_element(By.ID, "status").text in ("OK", "WARN", "STALL", "STOP")
            assert browser.find_element(By.ID, "why").text
            browser.save_screenshot(str(shots / "group.png"))

            # -- record browser: binary keys as hex, markup in headers shown as text
            browser.get(base + "/records?topic=orders&partition=0&offset=0&limit=50")
            rows = browser.find_elements(By.CSS_SELECTOR, "#records tr.record")
            assert len(rows) == next(p["log_end"] for p in described if p["partition"] == 0)
            first = rows[0]
            assert first.find_element(By.CSS_SELECTOR, ".key .hex").text.startswith("00 ff 6b")
            assert first.find_element(By.CSS_SELECTOR, ".value").text.startswith("order ")
            assert "<b>not bold</b>" in first.text and not first.find_elements(By.TAG_NAME, "b")[1:]
            browser.save_screenshot(str(shots / "records.png"))

            # -- the dead letter and its provenance headers
            dlq = "orders.dlq"
            eventually(lambda: dlq in admin.list_topics(), what="the dead-letter topic")

            def dead_letter_shown(d):
                return "zb-dlq-source-topic" in " ".join(_cells(d, "#records td.provenance"))
            _shown_matches(browser, base + f"/records?topic={dlq}&partition=0&offset=0", dead_letter_shown)
            provenance = browser.find_element(By.CSS_SELECTOR, "#records tr.record td.provenance").text
            assert "orders" in provenance and str(poison.offset) in provenance and "bad <script>" in provenance
            browser.save_screenshot(str(shots / "records-dlq.png"))

            # -- reset through the UI, with its confirmation step
            browser.get(base + "/groups/billing")
            Select(browser.find_element(By.NAME, "topic")).select_by_visible_text("orders")
            to = browser.find_element(By.NAME, "to")
            to.clear()
            to.send_keys("latest")
            browser.find_element(By.ID, "reset-start").click()
            _text_after_click(browser, By.TAG_NAME, "h1", "Reset group billing on orders to latest?")
            browser.save_screenshot(str(shots / "reset-confirm.png"))
            before = admin.describe_group("billing")["reset_epoch"]
            browser.find_element(By.ID, "reset-confirm").click()
            _text_after_click(browser, By.ID, "notice", "reset orders to latest")
            after = admin.describe_group("billing")
            assert after["reset_epoch"] == before + 1
            ends = {p["partition"]: p["log_end"] for p in admin.describe_topic("orders")["partitions"]}
            assert {p["partition"]: p["committed_pending"] for p in after["partitions"]} == ends

            # -- redrive through the UI, with its confirmation step: the poison goes back to orders
            _shown_matches(browser, base + "/groups/billing",
                           lambda d: bool(d.find_elements(By.ID, "redrive-start")))
            Select(browser.find_element(By.NAME, "dlq")).select_by_visible_text(dlq)
            browser.find_element(By.ID, "redrive-start").click()
            _text_after_click(browser, By.TAG_NAME, "h1", f"dead letters of {dlq} back")
            assert _cells(browser, "td.log-end") == ["1"]
            browser.save_screenshot(str(shots / "redrive-confirm.png"))
            browser.find_element(By.ID, "redrive-confirm").click()
            # The POST runs a whole redrive (a consumer joins, a produce, an ack) before it answers.
            _text_after_click(browser, By.ID, "notice", f"redrove 1 dead letter(s) from {dlq}: 1 to orders")
            back = admin.describe_topic("orders")["partitions"][poison.partition]["log_end"]
            assert back == ends[poison.partition] + 1
            cursor = admin.describe_group("zb-redrive")["partitions"]
            assert [(p["topic"], p["committed_pending"]) for p in cursor] == [(dlq, 1)]
            with closing(Connection(broker.url)) as conn:
                [copy] = fetch(conn, "orders", poison.partition, back - 1)[0]
            assert (copy.key, copy.value) == (poison.key, poison.value)
            assert copy.headers["zb-dlq-redrives"] == b"1" and copy.headers["zb-dlq-source-topic"] == b"orders"
        billing.close()


def test_an_action_needs_its_confirmation(console_broker):
    import urllib.error
    import urllib.request

    broker, console = console_broker
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=1)
        admin.configure_group("g", max_deliveries=3)
    eventually(lambda: "g" in console.get("/groups"), what="the group listed")
    request = urllib.request.Request(console.base + "/groups/g/reset", data=b"topic=t&to=earliest", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 400
    err.value.close()
    cross = urllib.request.Request(console.base + "/groups/g/reset", data=b"topic=t&to=earliest&confirm=yes",
                                   method="POST", headers={"Origin": "http://evil.example"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(cross, timeout=5)
    assert err.value.code == 403
    err.value.close()
    unconfirmed = urllib.request.Request(console.base + "/groups/g/redrive", data=b"dlq=t.dlq", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(unconfirmed, timeout=5)
    assert err.value.code == 400
    err.value.close()
    def redrive_page():
        try:
            return console.get("/groups/g/redrive?dlq=t")
        except urllib.error.HTTPError as missing:  # 404 until the console has sampled the group
            missing.close()
    assert "is not a dead-letter topic of group g" in eventually(redrive_page, what="the group sampled")
    with Admin(broker.url) as admin:
        assert admin.describe_group("g")["reset_epoch"] == 0
        assert "zb-redrive" not in [g["group"] for g in admin.list_groups()]
