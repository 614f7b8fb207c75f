"""``fairseq-modattn serve``: the translation demo with attention views on 127.0.0.1.

    fairseq-modattn serve --path CKPT --data DATA-BIN [--port 8000] [--bpe auto] [--beam 5]

Loads the checkpoint (any model of this package, or a plain fairseq transformer / LSTM), reads
the text settings and subword model the data recipe recorded in DATA-BIN
(``data/text_pipeline.py``; guesses for a data-bin without them, which the start-up line says),
and serves the page and the JSON API of ``fairseq_modattn/demo/app.py`` until stopped. Bad
start-up input (a missing checkpoint, data-bin or subword model, a port in use, Flask or plotly
not installed) is one line on stderr and exit status 1; the port is taken before the checkpoint
is loaded, so a port in use fails within seconds.

Stopping: SIGTERM, or Ctrl-C (SIGINT) unless the server was started with SIGINT ignored, as a
shell starts its background jobs (``serve ... &`` in a script): the server stops accepting
connections, answers those it accepted (one request a connection; one that sends nothing is
dropped after 30 s), says "stopped" and exits 0. A second signal stops it at once (exit status
1, the requests left unanswered).
"""

import argparse
import errno
import os
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from ..data.text_pipeline import LOWERCASE, SUBWORDS, TOKENIZERS, subword_choice
from ..demo import MAX_RESPONSE_BYTES
from ..help_format import DefaultsHelpFormatter


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn serve",
        formatter_class=DefaultsHelpFormatter,
        description="Serve a translation demo of one checkpoint: a page with the translation, a per-layer / "
                    "per-head attention heatmap and the method's own views (DMA clusters and semantic masks, "
                    "TIM competition, RIM activation), and its JSON API (POST /translate {\"text\": ...}).",
    )
    p.add_argument("--path", type=Path, required=True, help="the checkpoint (.pt) to load")
    p.add_argument("--data", type=Path, required=True,
                   help="the data-bin the model was trained on (dictionaries; subword model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; the default answers this machine only (the demo has no authentication)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed at start)")
    p.add_argument("--beam", type=int, default=5, help="beam size")
    p.add_argument("--max-len-b", type=int, default=200, help="the longest translation, in target tokens")
    p.add_argument("--max-chars", type=int, default=1000,
                   help="the longest text a request may send, in characters (longer: HTTP 413)")
    p.add_argument("--max-response-bytes", type=int, default=MAX_RESPONSE_BYTES, metavar="BYTES",
                   help="the longest answer, in bytes of JSON: attention views that would make it longer are "
                        "averaged over blocks of consecutive tokens (the answer's view_pooling says how many); "
                        "an answer over it even so is HTTP 413. The views come only with {\"attention\": true} "
                        "in the request, which the page sends")
    # the input goes through the text steps `fairseq-modattn prepare` recorded in --data (its
    # prepare-manifest.json); each auto takes the recorded setting, any other value overrides it
    p.add_argument("--bpe", type=subword_choice, choices=SUBWORDS, default="auto",
                   help="the subword model: auto takes the one prepare recorded in --data; for a data-bin without "
                        "recorded settings it finds code / code.SRC (subword-nmt) or spm.model / spm.SRC.model "
                        "(sentencepiece) there (subword_nmt is accepted for subword-nmt)")
    p.add_argument("--bpe-codes", type=Path, help="the subword model file, with --bpe subword-nmt or sentencepiece")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="auto",
                   help="auto: the tokenizer prepare recorded in --data, with its normalisation, escaping and dash "
                        "splitting; without recorded settings jieba for Chinese, none before sentencepiece, Moses "
                        "otherwise")
    p.add_argument("--lowercase", choices=LOWERCASE, default="auto",
                   help="auto: as prepare recorded in --data; without recorded settings, lower-case the input when "
                        "the source dictionary holds no upper-case letter")
    p.add_argument("--gpu", action="store_true", help="run the model on CUDA when it is available")
    return p


class StopSignal:
    """The signal handler: the first SIGTERM / SIGINT asks for a graceful stop, a second one for
    an immediate one. It only sets attributes (the main thread polls them): a handler that took
    a lock or started a thread could deadlock with the main thread it interrupts."""

    def __init__(self):
        self.name: Optional[str] = None
        self.again = False

    def __call__(self, signum, frame):
        if self.name is None:
            self.name = signal.Signals(signum).name
        else:
            self.again = True

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self)
        # SIGINT only where it has Python's default handler: a background job of a shell script
        # starts with SIGINT ignored, so that Ctrl-C at the terminal spares it; keep it so
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self)


def make_demo_server(host: str, port: int, app, fd: int):
    """werkzeug's threaded server on the listening socket FD, counting its open connections.

    One request a connection (HTTP/1.0, no keep-alive), so that an open connection is a request
    in flight: counted from its accept, in the serving thread, until its answer is written and
    it is closed; a client that sends nothing is dropped after ``Handler.timeout`` seconds.
    """
    from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        protocol_version = "HTTP/1.0"
        timeout = 30  # seconds a socket operation may wait for the client

    class DemoServer(ThreadedWSGIServer):
        def __init__(self):
            super().__init__(host, port, app, Handler, fd=fd)
            self.open = 0
            self.changed = threading.Condition()

        def get_request(self):  # the accept: every accepted connection reaches shutdown_request once
            connection = super().get_request()
            with self.changed:
                self.open += 1
            return connection

        def shutdown_request(self, request):
            try:
                super().shutdown_request(request)
            finally:
                with self.changed:
                    self.open -= 1
                    self.changed.notify_all()

        def in_flight(self) -> int:
            with self.changed:
                return self.open

        def wait(self, stop: "StopSignal") -> int:
            """Wait until every connection is answered, or for a second signal; those left."""
            with self.changed:
                while self.open and not stop.again:
                    self.changed.wait(0.2)
                return self.open

    return DemoServer()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT as werkzeug binds one (OSError when it cannot be)."""
    from werkzeug.serving import get_sockaddr, select_address_family

    family = select_address_family(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family in (socket.AF_INET, getattr(socket, "AF_INET6", None)):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug: restart at once
        sock.bind(get_sockaddr(host, port, family))
    except BaseException:
        sock.close()
        raise
    return sock


def serve(argv: List[str]) -> int:
    args = parser().parse_args(argv)
    prog = "fairseq-modattn serve"

    def fail(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1

    # checked before Flask and the checkpoint are loaded, so that a typo fails within seconds
    from ..analysis.loading import path_problem

    problem = path_problem(args.path, args.data)
    if problem is not None:
        return fail(problem)
    if not 0 <= args.port <= 65535:
        return fail(f"--port must lie in 0..65535, got {args.port}")
    try:
        import flask  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as e:
        return fail(f"the demo needs Flask and plotly ({e}): pip install 'fairseq-modattn[demo]'")

    # the port is ours before the checkpoint loads; it listens once the model is ready (werkzeug's
    # own binding would print two lines of its own and exit for a port in use)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        hint = ""
        if getattr(e, "errno", None) == errno.EADDRINUSE:
            hint = " (another program listens there: stop it, or pass another --port; --port 0 picks a free one)"
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}{hint}")
    try:
        return run(args, sock, prog, fail)
    finally:
        sock.close()


def run(args, sock: socket.socket, prog: str, fail) -> int:
    from werkzeug.serving import LISTEN_QUEUE

    from ..demo import DemoError
    from ..demo.app import create_app
    from ..demo.translator import Translator

    started = time.monotonic()
    try:
        translator = Translator(args.path, args.data, beam=args.beam, max_len_b=args.max_len_b,
                                tokenizer=args.tokenizer, lowercase=args.lowercase, bpe=args.bpe,
                                bpe_codes=args.bpe_codes, max_chars=args.max_chars,
                                max_response_bytes=args.max_response_bytes, cpu=not args.gpu)
    except DemoError as e:
        return fail(str(e))
    try:
        sock.listen(LISTEN_QUEUE)
        # fd: werkzeug serves a duplicate of the bound socket
        server = make_demo_server(args.host, args.port, create_app(translator), fd=sock.fileno())
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    sock.close()
    address = server.socket.getsockname()
    port = address[1] if isinstance(address, tuple) else args.port
    stop = StopSignal()
    stop.install()

    info = translator.info()
    text = info["text"]
    print(f"{prog}: {info['model']} ({info['parameters']:,} parameters, {info['family']}) from {args.path}, "
          f"loaded in {time.monotonic() - started:.1f} s; input: tokenizer {text['tokenizer']}, "
          f"lowercase {text['lowercase']}, bpe {text['bpe']} {text['bpe_model'] or ''}".rstrip()
          + f" [{text['steps']}; {text['settings_origin']}]", flush=True)
    keys = "SIGTERM" if signal.getsignal(signal.SIGINT) is not stop else "Ctrl-C or SIGTERM"
    print(f"{prog}: serving on http://{args.host}:{port}/ ({keys} to stop)", flush=True)
    try:
        # handle_request, not serve_forever: the loop checks the flag the signal handler sets
        server.timeout = 0.2
        while stop.name is None:
            server.handle_request()
        # connections the kernel accepted before the signal: their clients sent their requests too
        with selectors.DefaultSelector() as pending:
            pending.register(server.socket, selectors.EVENT_READ)
            for _ in range(LISTEN_QUEUE):
                if not pending.select(0):
                    break
                server.handle_request()
    finally:
        server.server_close()  # no new connections
    in_flight = server.in_flight()
    print(f"{prog}: stopping on {stop.name}: finishing {in_flight} request(s) in flight"
          f"{' (signal again to stop at once)' if in_flight else ''}", flush=True)
    left = server.wait(stop)
    if left:
        print(f"{prog}: stopped at once, {left} request(s) unanswered", flush=True)
        sys.stderr.flush()
        # not a return: the interpreter's exit would wait for, or abort in, a thread inside torch
        os._exit(1)
    print(f"{prog}: stopped", flush=True)
    return 0
