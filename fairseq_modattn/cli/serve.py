"""``fairseq-modattn serve``: the translation demo with attention views on 127.0.0.1.

    fairseq-modattn serve --path CKPT --data DATA-BIN [--port 8000] [--bpe auto] [--beam 5]

Loads the checkpoint (any model of this package, or a plain fairseq transformer / LSTM), finds
the subword model the data recipe copied into DATA-BIN, and serves the page and the JSON API
of ``fairseq_modattn/demo/app.py`` until interrupted. Bad start-up input (a missing
checkpoint, data-bin or subword model, a port in use, Flask or plotly not installed) is one
line on stderr and exit status 1.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import List

from ..demo.text import LOWERCASE, SUBWORDS, TOKENIZERS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn serve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
    p.add_argument("--bpe", choices=SUBWORDS, default="auto",
                   help="the subword model: auto finds code / code.SRC (subword_nmt) or spm.model / spm.SRC.model "
                        "(sentencepiece) in --data, where `fairseq-modattn prepare` puts them")
    p.add_argument("--bpe-codes", type=Path, help="the subword model file, with --bpe subword_nmt or sentencepiece")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="auto",
                   help="auto: jieba for Chinese, none before sentencepiece, Moses otherwise (as the data recipes)")
    p.add_argument("--lowercase", choices=LOWERCASE, default="auto",
                   help="auto: lower-case the input when the source dictionary holds no upper-case letter")
    p.add_argument("--gpu", action="store_true", help="run the model on CUDA when it is available")
    return p


def serve(argv: List[str]) -> int:
    args = parser().parse_args(argv)
    prog = "fairseq-modattn serve"

    def fail(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1

    # checked before Flask and the checkpoint are loaded, so that a typo fails within seconds
    if not args.path.is_file():
        return fail(f"checkpoint {args.path} does not exist (pass the .pt file fairseq-train saved)")
    if not args.data.is_dir():
        return fail(f"data-bin {args.data} does not exist (pass the folder fairseq-preprocess wrote)")
    if not 0 <= args.port <= 65535:
        return fail(f"--port must lie in 0..65535, got {args.port}")
    try:
        import flask  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as e:
        return fail(f"the demo needs Flask and plotly ({e}): pip install 'fairseq-modattn[demo]'")

    from werkzeug.serving import make_server

    from ..demo import DemoError
    from ..demo.app import create_app
    from ..demo.translator import Translator

    started = time.monotonic()
    try:
        translator = Translator(args.path, args.data, beam=args.beam, max_len_b=args.max_len_b,
                                tokenizer=args.tokenizer, lowercase=args.lowercase, bpe=args.bpe,
                                bpe_codes=args.bpe_codes, max_chars=args.max_chars, cpu=not args.gpu)
    except DemoError as e:
        return fail(str(e))
    try:
        server = make_server(args.host, args.port, create_app(translator), threaded=True)
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e}")
    info = translator.info()
    text = info["text"]
    print(f"{prog}: {info['model']} ({info['parameters']:,} parameters, {info['family']}) from {args.path}, "
          f"loaded in {time.monotonic() - started:.1f} s; input: tokenizer {text['tokenizer']}, "
          f"lowercase {text['lowercase']}, bpe {text['bpe']} {text['bpe_model'] or ''}".rstrip(), flush=True)
    print(f"{prog}: serving on http://{args.host}:{server.server_port}/ (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()  # werkzeug's returns on Ctrl-C (it catches KeyboardInterrupt itself)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print(f"{prog}: stopped", flush=True)
    return 0
