"""The chat page at `/` in a real headless browser: Debian's chromium driven by Selenium, against a
real `serve --api-key` process. The page asks for the key once, streams an answer, shows its sources
(document names with their sections, and snippets) and its TTFT and cached/prompt tokens, keeps the conversation for a
second turn, and "New chat" clears it. The server serves a second corpus (`ferries`): the page's corpus
picker lists both and answers from the one chosen. A screenshot is saved under out/test-artifacts/ (path printed).

Skipped only when chromium or chromedriver is absent (`make browser` installs both)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest

from tests.test_server import MODEL, QUESTIONS, ROOT, build_corpus, start_server

pytestmark = pytest.mark.smollm
KEY = "page-key-9d1e"
FERRIES = {"ferries.txt": "The night ferry to Osk departs from pier 4 at 23:10 and takes nine hours.",
           "harbour.txt": "The harbour office opens at 7 and sells ferry tickets and maps of Osk."}
ARTIFACTS = ROOT / "out" / "test-artifacts"


@pytest.fixture(scope="module")
def url(smollm, tmp_path_factory):
    path = build_corpus(smollm, tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("srv") / MODEL)
    other = build_corpus(smollm, tmp_path_factory.mktemp("ferry-docs"), tmp_path_factory.mktemp("srv2") / "ferries", FERRIES)
    proc, url = start_server(path, tmp_path_factory.mktemp("log") / "server.log", "--corpus", str(other), "--k", "2",
                             "--api-key", KEY)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("chromium and chromedriver are not installed (make browser: apt-get install chromium chromium-driver)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900"):
        options.add_argument(arg)
    b = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    yield b
    b.quit()


def _wait(what: str, check: Callable[[], object], timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while True:
        if value := check():
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _opened(b, url: str):
    """The page with the key already kept (as the key dialog keeps it), once it shows the first corpus."""
    from selenium.webdriver.common.by import By

    b.get(f"{url}/")
    b.execute_script(f"localStorage.setItem('rag-promptcache-api-key', {KEY!r})")
    b.get(f"{url}/")
    _wait("the model's name", lambda: MODEL in b.find_element(By.ID, "model").text, 30)
    return b


def _ask(b, question: str) -> tuple[object, set[int]]:
    """Type a question, press Enter; return the answer's element once done, and the lengths its text
    had while it streamed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    b.find_element(By.ID, "question").send_keys(question, Keys.ENTER)
    answer = _wait("the answer's bubble", lambda: b.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before:])[0]
    seen: set[int] = set()
    while answer.get_attribute("data-done") != "true":
        seen.add(len(answer.find_element(By.CSS_SELECTOR, ".text").text))
        time.sleep(0.02)
    return answer, seen - {0}


def test_the_page_asks_for_the_key_streams_answers_with_sources_and_starts_new_chats(url, browser):
    from selenium.webdriver.common.by import By

    b = browser
    b.get(f"{url}/")
    dialog = b.find_element(By.ID, "key-dialog")
    _wait("the key dialog", dialog.is_displayed, 30)
    b.find_element(By.ID, "key-input").send_keys(KEY)
    b.find_element(By.CSS_SELECTOR, "#key-form button").click()
    _wait("the model's name", lambda: MODEL in b.find_element(By.ID, "model").text, 30)
    assert not dialog.is_displayed()

    answer, lengths = _ask(b, QUESTIONS[0])
    text = answer.find_element(By.CSS_SELECTOR, ".text").text
    assert "purple" in text.lower(), text
    assert len(lengths) >= 2, f"the text did not stream in: lengths seen {sorted(lengths)}"
    sources = answer.find_elements(By.CSS_SELECTOR, ".sources li")
    assert len(sources) == 2  # --k 2
    assert sources[0].find_element(By.CSS_SELECTOR, ".doc").text.endswith("zorblat.txt")
    assert "purple fruit" in sources[0].find_element(By.CSS_SELECTOR, ".snippet").text
    # a source with a section shows it after the file: the page renders the server's `where`
    shown = b.execute_script("""const div = document.createElement("div");
        showSources(div, [{module_id: "m", label: "trains.md", section: "Trains", where: "trains.md › Trains",
                           score: 0.5, snippet: "The Blue Line"}]);
        return div.querySelector(".sources .doc").textContent;""")
    assert shown == "trains.md › Trains"
    stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert "TTFT" in stats and "cached" in stats and "prompt" in stats and "finish: " in stats, stats

    # a second turn carries the first: the request holds both questions and the first answer
    second, _ = _ask(b, "Where does it grow?")
    assert second.find_element(By.CSS_SELECTOR, ".text").text
    sent = b.execute_script("return conversation")
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant"] and sent[1]["content"] == text

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "chat-page.png"
    assert b.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

    b.find_element(By.ID, "new-chat").click()
    assert b.find_elements(By.CSS_SELECTOR, ".msg") == [] and b.execute_script("return conversation") == []
    third, _ = _ask(b, QUESTIONS[2])
    assert "1342" in third.find_element(By.CSS_SELECTOR, ".text").text
    assert b.execute_script("return conversation.length") == 2  # the new chat holds only its own turn

    b.refresh()  # the key is asked for once: a reload uses the stored one
    _wait("the model's name after a reload", lambda: MODEL in b.find_element(By.ID, "model").text, 30)
    assert not b.find_element(By.ID, "key-dialog").is_displayed()


def test_a_cut_off_answer_is_marked_on_the_page(url, browser):
    from selenium.webdriver.common.by import By

    b = browser
    b.get(f"{url}/?max_tokens=3")
    b.execute_script(f"localStorage.setItem('rag-promptcache-api-key', {KEY!r})")  # as the key dialog keeps it
    b.get(f"{url}/?max_tokens=3")
    if b.find_element(By.ID, "key-dialog").is_displayed():
        b.find_element(By.ID, "key-input").send_keys(KEY)
        b.find_element(By.CSS_SELECTOR, "#key-form button").click()
    _wait("the model's name", lambda: MODEL in b.find_element(By.ID, "model").text, 30)
    answer, _ = _ask(b, QUESTIONS[0])
    assert "finish: length" in answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert answer.find_element(By.CSS_SELECTOR, ".cutoff").text.startswith("[cut off: the answer reached max_tokens (3)")


def test_the_corpus_picker_lists_each_corpus_and_answers_from_the_one_chosen(url, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    b = _opened(browser, url)
    picker = Select(b.find_element(By.ID, "corpus"))
    assert [o.get_attribute("value") for o in picker.options] == [MODEL, "ferries"]
    assert picker.first_selected_option.get_attribute("value") == MODEL  # the first served, as /v1/models lists it
    first, _ = _ask(b, QUESTIONS[0])
    assert first.find_element(By.CSS_SELECTOR, ".sources li .doc").text.endswith("zorblat.txt")

    picker.select_by_value("ferries")
    _wait("the chosen corpus's name", lambda: "ferries" in b.find_element(By.ID, "model").text, 30)
    assert b.find_elements(By.CSS_SELECTOR, ".msg") == []  # another corpus starts a new chat
    answer, _ = _ask(b, QUESTIONS[0])  # the zorblat: only the first corpus knows it
    docs = {li.text for li in answer.find_elements(By.CSS_SELECTOR, ".sources li .doc")}
    assert docs and all(d.endswith(tuple(FERRIES)) for d in docs), docs
    assert "purple" not in answer.find_element(By.CSS_SELECTOR, ".text").text.lower()
    ferry, _ = _ask(b, "When does the night ferry to Osk depart?")
    assert "23" in ferry.find_element(By.CSS_SELECTOR, ".text").text
    assert b.execute_script("return model.id") == "ferries"


def test_the_filter_box_narrows_the_search_and_a_bad_key_is_named(url, browser):
    from selenium.webdriver.common.by import By

    b = _opened(browser, url)
    box = b.find_element(By.ID, "filter")
    box.send_keys("source=castle.txt")
    answer, _ = _ask(b, QUESTIONS[0])  # the zorblat's question, searched only in castle.txt
    docs = {li.text for li in answer.find_elements(By.CSS_SELECTOR, ".sources li .doc")}
    assert docs and all(d.endswith("castle.txt") for d in docs), docs
    box.clear()
    box.send_keys("colour=purple")
    refused, _ = _ask(b, QUESTIONS[0])
    assert "unknown filter key" in refused.text and "colour" in refused.text, refused.text
