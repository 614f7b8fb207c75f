"""``fairseq-modattn serve`` under faults: a port in use is one
error line, JSON nested thousands deep is a 400, and a server started with SIGINT ignored (any
background job of a shell script) stops on SIGTERM after finishing the requests in flight.

Every server a test starts is killed on every path (``Server.stop`` in ``finally``)."""

import json
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest

from conftest import MODATTN, bpe_codes, cli_environment

pytest.importorskip("flask", reason="the demo needs Flask: pip install -e '.[demo]'")
pytest.importorskip("plotly", reason="the demo needs plotly: pip install -e '.[demo]'")

# about 0.4 s each for the tiny model on one CPU thread (beam search, then the attention views);
# the translator answers one request at a time
LONG_TEXT = " ".join(["Zwei Hunde spielen im Schnee."] * 6)
REQUESTS = 6
# what importing fairseq 0.12.x prints by itself (fairseq.tasks.text_to_speech without tensorboardX)
IMPORT_NOISE = re.compile(r"INFO:fairseq\.")


def serve_command(checkpoint, data, *extra, port=0):
    return [MODATTN, "serve", "--path", str(checkpoint), "--data", str(data), "--port", str(port),
            "--bpe", "subword_nmt", "--bpe-codes", str(bpe_codes(data)), *extra]


def ignore_sigint():
    """What a non-interactive shell does to a job it starts with ``&``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Server:
    """A ``fairseq-modattn serve`` process; its output is read by a thread (no pipe can fill up)."""

    def __init__(self, args, **popen):
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=cli_environment(), **popen)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def url(self, timeout=180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving on (http://127\.0\.0\.1:\d+/)", self.output)
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail("the server did not start:\n" + self.output)

    def wait(self, timeout) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)
        self.proc.stdout.close()


def post(url, body: bytes, timeout=120):
    request = urllib.request.Request(url + "translate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_port_in_use_is_one_error_line_naming_the_port(tiny_checkpoints, multi30k_bin):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = subprocess.run(serve_command(tiny_checkpoints["dma"], multi30k_bin, port=port),
                              capture_output=True, text=True, timeout=300, env=cli_environment())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not IMPORT_NOISE.match(line)]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fairseq-modattn serve: error: ") and f":{port}" in lines[0], lines
    assert "serving on" not in proc.stdout


@pytest.fixture(scope="module")
def client(tiny_checkpoints, multi30k_bin):
    from fairseq_modattn.demo.app import create_app
    from fairseq_modattn.demo.translator import Translator

    translator = Translator(tiny_checkpoints["dma"], multi30k_bin, bpe="subword_nmt",
                            bpe_codes=bpe_codes(multi30k_bin), max_len_b=20)
    return create_app(translator).test_client()


DEEP = 5000


@pytest.mark.parametrize("body", [
    "[" * DEEP + "]" * DEEP,
    '{"text": "Hallo Welt.", "extra": ' + "[" * DEEP + "]" * DEEP + "}",
    '{"text": ' + "[" * DEEP + '"Hallo Welt."' + "]" * DEEP + "}",
], ids=["list", "beside-text", "as-text"])
def test_json_nested_thousands_deep_is_a_400_with_a_json_error(client, body):
    assert len(body.encode()) < 12 * 1000 + 4096  # under the body limit: not a 413
    response = client.post("/translate", data=body, content_type="application/json")
    assert response.status_code == 400, response.get_data(as_text=True)[:500]
    assert response.is_json and "nested" in response.get_json()["error"], response.get_json()
    # the server goes on answering
    assert client.post("/translate", json={"text": "Hallo Welt."}).status_code == 200


def test_sigterm_stops_a_server_ignoring_sigint_after_the_requests_in_flight(tiny_checkpoints, multi30k_bin):
    server = Server(serve_command(tiny_checkpoints["dma"], multi30k_bin), preexec_fn=ignore_sigint)
    try:
        url = server.url()
        body = json.dumps({"text": LONG_TEXT}).encode()
        with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
            futures = [pool.submit(post, url, body) for _ in range(REQUESTS)]
            # once one is answered, the others have long reached the server and wait for the model
            wait(futures, timeout=120, return_when=FIRST_COMPLETED)
            in_flight = sum(not f.done() for f in futures)
            assert in_flight > 0, "every request was answered before SIGTERM: make LONG_TEXT longer"
            server.proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=180) for f in futures]
        assert [status for status, _ in answers] == [200] * REQUESTS, [a for s, a in answers if s != 200]
        assert all(answer["translation"] for _, answer in answers)
        rc = server.wait(timeout=60)
        assert rc == 0, server.output
        finishing = re.search(r"stopping on SIGTERM: finishing (\d+) request", server.output)
        assert finishing and int(finishing.group(1)) >= 1, server.output
        assert server.output.rstrip().endswith("fairseq-modattn serve: stopped"), server.output
        with pytest.raises(urllib.error.URLError):  # nothing listens any more
            urllib.request.urlopen(url + "info", timeout=10)
    finally:
        server.stop()
