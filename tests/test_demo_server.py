"""``fairseq-modattn serve`` as a user runs it: start-up errors, 50 concurrent requests on
loopback, and the page driven in headless Chromium (Debian's chromium + chromium-driver through
selenium; skipped with the reason when they are not installed)."""

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import MODATTN, MODATTN_MAIN, bpe_codes, cli_environment, run_commands

pytest.importorskip("flask", reason="the demo needs Flask: pip install -e '.[demo]'")
pytest.importorskip("plotly", reason="the demo needs plotly: pip install -e '.[demo]'")

SENTENCE = "Zwei Hunde spielen im Schnee."
CONCURRENT_REQUESTS = 50


def serve_command(checkpoint, data, *extra):
    return [MODATTN, "serve", "--path", str(checkpoint), "--data", str(data), "--port", "0",
            "--bpe", "subword_nmt", "--bpe-codes", str(bpe_codes(data)), *extra]


@pytest.fixture(scope="module")
def server(tiny_checkpoints, multi30k_bin):
    """A running ``fairseq-modattn serve`` of the tiny DMA model: its base URL. Stopped with
    SIGTERM (SIGINT is ignored when the suite runs as a background job of a shell script), and
    killed on every other path."""
    # --max-len-b 40: the tiny model repeats a word up to the length limit; 200-token answers
    # would only make the load test slower
    proc = subprocess.Popen(serve_command(tiny_checkpoints["dma"], multi30k_bin, "--max-len-b", "40"),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_environment())
    try:
        lines = []
        deadline = time.monotonic() + 180
        url = None
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            found = re.search(r"serving on (http://127\.0\.0\.1:\d+/)", line)
            url = found.group(1) if found else None
        if url is None:
            pytest.fail("the server did not start:\n" + "".join(lines))
        yield url
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest
        assert "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


def post(url, text, timeout=120):
    request = urllib.request.Request(url + "translate", data=json.dumps({"text": text, "attention": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_start_up_errors_are_one_line_and_exit_1(tiny_checkpoints, multi30k_bin, tmp_path):
    truncated = tmp_path / "broken.pt"
    truncated.write_bytes(Path(tiny_checkpoints["dma"]).read_bytes()[:1000])
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    commands = [
        serve_command(tmp_path / "nope.pt", multi30k_bin),
        [MODATTN, "serve", "--path", str(tiny_checkpoints["dma"]), "--data", str(tmp_path / "x")],
        # the data-bin of the tests holds no subword model, and none was named
        [MODATTN, "serve", "--path", str(tiny_checkpoints["dma"]), "--data", str(multi30k_bin)],
        serve_command(truncated, multi30k_bin),
        # a user's own file given by mistake: never advised deleted; a folder is not "missing"
        serve_command(notes, multi30k_bin),
        serve_command(Path(tiny_checkpoints["dma"]).parent, multi30k_bin),
    ]
    errors = []
    for code, out, err in run_commands([(MODATTN_MAIN, command[1:]) for command in commands]):
        assert code == 1, out + err
        # the error is the last line: importing fairseq 0.12.x may print an INFO line of its
        # own first (fairseq.tasks.text_to_speech asks for tensorboardX at import time)
        errors.append(err.strip().splitlines()[-1])
    assert errors[0].startswith("fairseq-modattn serve: error: checkpoint") and "nope.pt does not exist" in errors[0]
    assert "data-bin" in errors[1]
    assert "no subword model in" in errors[2] and "--bpe-codes" in errors[2]
    assert "cannot load checkpoint" in errors[3]
    assert errors[4] == (f"fairseq-modattn serve: error: cannot load checkpoint {notes}: it is not a torch checkpoint "
                         "(neither a zip archive nor a pickle); pass a .pt file that fairseq-train saved")
    assert notes.read_text() == "my notes\n"
    folder = Path(tiny_checkpoints["dma"]).parent
    assert errors[5].startswith(f"fairseq-modattn serve: error: checkpoint {folder} is a folder: pass the .pt file "
                                "in it") and "does not exist" not in errors[5]


def test_fifty_concurrent_requests_are_all_answered(server):
    status, first = post(server, SENTENCE)
    assert status == 200, first
    sentences = [SENTENCE if i % 2 == 0 else f"Ein Kind spielt mit {i} Bällen." for i in range(CONCURRENT_REQUESTS)]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=CONCURRENT_REQUESTS) as pool:
        answers = list(pool.map(lambda s: post(server, s), sentences))
    elapsed = time.monotonic() - started
    print(f"{CONCURRENT_REQUESTS} concurrent requests answered in {elapsed:.1f} s")
    assert [status for status, _ in answers] == [200] * CONCURRENT_REQUESTS, [a for s, a in answers if s != 200]
    for sentence, (_, answer) in zip(sentences, answers):
        assert answer["translation"]
        if sentence == SENTENCE:  # one model, one lock: the same sentence, the same answer
            assert answer["translation"] == first["translation"]
            assert answer["attention"] == first["attention"]


def browser_or_skip():
    """(chromium, chromedriver) paths, or skip naming what is missing."""
    pytest.importorskip("selenium", reason="the browser test drives Chromium through selenium: pip install selenium")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or next(
        (p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if os.path.exists(p)), None)
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium chromium-driver; "
                    ".ci/run installs them when it runs as root)")
    return chromium, driver


# The colour of a plot's value 0 as Plotly drew it (after Plotly's own defaults: an unknown
# colour-scale name silently becomes its default scale), and the lightness of a colour.
ZERO_COLOUR = "return document.getElementById(arguments[0])._fullData[0].colorscale[0][1];"


def lightness(colour: str) -> float:
    """0 (black) to 1 (white) for a colour Plotly writes: #rrggbb or rgb(r, g, b)."""
    if colour.startswith("#"):
        channels = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    else:
        channels = [float(v) for v in re.findall(r"[\d.]+", colour)[:3]]
    return (max(channels) + min(channels)) / 2 / 255


def tick_labels(browser, plot, axis):
    from selenium.webdriver.common.by import By

    # textContent: selenium's .text is '' for SVG labels it deems hidden (rotated, overlapping)
    return [t.get_attribute("textContent")
            for t in browser.find_elements(By.CSS_SELECTOR, f"#{plot} .{axis}tick text")]


@pytest.fixture(scope="module")
def method_answers(tiny_checkpoints, multi30k_bin):
    """The API's answers of the tiny TIM and RIM-LSTM models to SENTENCE (Flask's test client)."""
    from fairseq_modattn.demo.app import create_app
    from fairseq_modattn.demo.translator import Translator

    answers = {}
    for family in ("tim", "rim"):
        translator = Translator(tiny_checkpoints[family], multi30k_bin, bpe="subword_nmt",
                                bpe_codes=bpe_codes(multi30k_bin), max_len_b=20)
        response = create_app(translator).test_client().post("/translate", json={"text": SENTENCE, "attention": True})
        assert response.status_code == 200, response.get_json()
        answers[family] = response.get_json()
    return answers


def test_the_page_translates_and_draws_the_heatmaps_in_chromium(server, method_answers, tmp_path):
    chromium, driver_path = browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,2200"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    keep = os.environ.get("FAIRSEQ_MODATTN_SCREENSHOTS")  # a folder to keep the screenshots in

    def screenshot(name):
        path = tmp_path / f"demo-{name}.png"
        browser.save_screenshot(str(path))
        assert path.stat().st_size > 10000
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(keep) / path.name)
        print(f"screenshot: {Path(keep) / path.name if keep else path}")

    def title(plot):
        return browser.find_element(By.CSS_SELECTOR, f"#{plot} .gtitle").text

    def x_title(plot):
        return browser.find_element(By.CSS_SELECTOR, f"#{plot} .g-xtitle").get_attribute("textContent")

    try:
        wait = WebDriverWait(browser, 60)
        browser.get(server)
        wait.until(EC.text_to_be_present_in_element((By.ID, "model-info"), "dma_transformer"))

        # an empty request shows the server's error
        browser.find_element(By.ID, "translate").click()
        wait.until(EC.visibility_of_element_located((By.ID, "error")))
        assert "empty" in browser.find_element(By.ID, "error").text

        browser.find_element(By.ID, "source").send_keys(SENTENCE)
        browser.find_element(By.ID, "translate").click()
        wait.until(lambda b: b.find_element(By.ID, "translation").text.strip())
        assert not browser.find_element(By.ID, "error").is_displayed()
        translation = browser.find_element(By.ID, "translation").text
        assert translation

        # the attention heatmap (Plotly draws a heatmap trace as an <image> in its heat-map layer)
        heat = "#{} .heatmaplayer image"
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, heat.format("attention-heatmap")))
        assert title("attention-heatmap") == "encoder layer 1 self-attention, head 1"
        Select(browser.find_element(By.ID, "attention-type")).select_by_value("enc_dec")
        Select(browser.find_element(By.ID, "attention-layer")).select_by_index(1)
        Select(browser.find_element(By.ID, "attention-head")).select_by_index(2)
        wait.until(EC.text_to_be_present_in_element(
            (By.CSS_SELECTOR, "#attention-heatmap .gtitle"), "decoder layer 2 encoder-decoder attention, head 3"))
        source_labels = tick_labels(browser, "attention-heatmap", "x")
        assert source_labels[-1] == "</s>" and "hun" in "".join(source_labels), source_labels  # as BPE split it
        # weight 0 is drawn (nearly) white: Plotly's own "Blues" is dark blue at 0
        assert lightness(browser.execute_script(ZERO_COLOUR, "attention-heatmap")) > 0.9

        # the DMA views: cluster probabilities of the queries, then of the keys, and the semantic mask
        assert browser.find_element(By.ID, "dma-view").is_displayed()
        for plot in ("dma-clusters", "dma-mask"):
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, heat.format(plot)))
        assert "γ = " in browser.find_element(By.ID, "dma-gamma").text
        assert x_title("dma-clusters") == "cluster" and tick_labels(browser, "dma-clusters", "x")[0] == "1"
        Select(browser.find_element(By.ID, "dma-type")).select_by_value("enc_dec")
        Select(browser.find_element(By.ID, "dma-side")).select_by_value("keys")
        wait.until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, "#dma-clusters .gtitle"), "of the keys"))
        assert tick_labels(browser, "dma-clusters", "y") == source_labels  # keys of enc-dec: the source
        assert not browser.find_element(By.ID, "tim-view").is_displayed()
        screenshot("dma")

        # TIM's and RIM-LSTM's answers drawn by the same page (show() is the page's own renderer)
        for family, plot, axis_title in (("tim", "tim-heatmap", "mechanism"), ("rim", "rim-heatmap", "RIM")):
            answer = method_answers[family]
            browser.execute_script("show(arguments[0]);", answer)
            assert browser.find_element(By.ID, f"{family}-view").is_displayed()
            assert not browser.find_element(By.ID, "dma-view").is_displayed()
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, heat.format(plot)))
            assert x_title(plot) == axis_title
            assert lightness(browser.execute_script(ZERO_COLOUR, plot)) > 0.9
            first_layer = answer[family][0]
            rows = answer["target_tokens"] if first_layer.get("side") == "decoder" else answer["source_tokens"]
            assert len(tick_labels(browser, plot, "y")) == len(rows)
            assert title(plot).endswith(first_layer["layer"])
            screenshot(family)
        print(f"translation: {translation}")
    finally:
        browser.quit()
