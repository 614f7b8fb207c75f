"""The demo's HTTP API and page (Flask).

    GET  /               the page (static/index.html, static/demo.js, static/demo.css)
    GET  /vendor/plotly.min.js
                         Plotly, served from the installed ``plotly`` Python package: no CDN,
                         no build step, works without internet access
    GET  /info           the model: name, family, parameters, beam, limits, text pipeline
    POST /translate      {"text": "..."} -> the translation and its tokens;
                         {"text": "...", "attention": true} -> also what the model did: the
                         attention and the method's views, pooled over blocks of tokens where
                         they would make the answer longer than --max-response-bytes
                         (``translator.Translator.respond``)

Errors are JSON ``{"error": message}``: 400 for a body that is not a JSON object with a string
``text`` (JSON nested too deeply for Python's parser included), an ``attention`` that is not
true or false, or text with nothing to translate; 413 for text over ``--max-chars`` characters
or over the model's source positions (and for bodies too large to hold such text), and for an
answer over ``--max-response-bytes`` even with its views pooled; 404 / 405 for other paths and
methods; 500 (logged with its traceback) for a failure inside the model.

The translator serialises its work with a lock (the hooks and the models' "last forward"
state belong to one sentence at a time), so the threaded server answers concurrent requests
one after another.
"""

import logging
from pathlib import Path

from flask import Flask, Response, jsonify, request, send_file, send_from_directory
from werkzeug.exceptions import HTTPException

from .translator import InputError, Translator

STATIC = Path(__file__).parent / "static"
logger = logging.getLogger("fairseq_modattn.demo")


def plotly_bundle() -> Path:
    """plotly.min.js of the installed plotly package (its offline bundle)."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the installed plotly package has no offline bundle")
    return path


def create_app(translator: Translator) -> Flask:
    app = Flask(__name__, static_folder=str(STATIC), static_url_path="/static")
    # a JSON string holds at most 12 bytes per character (a surrogate pair as two \\uXXXX)
    app.config["MAX_CONTENT_LENGTH"] = 12 * translator.max_chars + 4096
    app.json.sort_keys = False
    bundle = plotly_bundle()

    @app.get("/")
    def index():
        return send_from_directory(STATIC, "index.html")

    @app.get("/vendor/plotly.min.js")
    def plotly_js():
        return send_file(bundle, mimetype="text/javascript", max_age=86400)

    @app.get("/info")
    def info():
        return jsonify(translator.info())

    @app.post("/translate")
    def translate():
        try:
            body = request.get_json(silent=True)  # silent: None for a body that is not JSON
        except RecursionError:  # valid JSON nested deeper than Python's recursion limit (~1000)
            return error("the JSON body is nested too deeply; send a JSON object {\"text\": \"...\"}", 400)
        if not isinstance(body, dict) or "text" not in body:
            return error('send a JSON object {"text": "..."} with Content-Type: application/json', 400)
        try:
            return Response(translator.respond(body["text"], body.get("attention", False)),
                            mimetype="application/json")
        except InputError as e:
            return error(str(e), e.status)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        if e.code == 413:
            return error(f"the request body is over {app.config['MAX_CONTENT_LENGTH']} bytes; this server "
                         f"translates at most {translator.max_chars} characters (--max-chars)", 413)
        return error(f"{e.name}: {e.description}", e.code)

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        logger.exception("translation failed")
        return error(f"internal error: {type(e).__name__}: {e}", 500)

    return app


def error(message: str, status: int):
    response = jsonify({"error": message})
    response.status_code = status
    return response
