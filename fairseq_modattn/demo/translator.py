"""One checkpoint as a sentence translator that also shows what the model did.

``Translator.translate(text)``:

1. encodes the sentence as the data recipe did (``data/text_pipeline.py``: the text settings
   ``prepare`` recorded in the data-bin, or guesses for a data-bin without them);
2. translates it with fairseq's own ``SequenceGenerator`` (``task.build_generator``, beam search
   with incremental decoding: the hypothesis ``fairseq-generate`` / ``fairseq-interactive``
   print for the same tokens and flags);
3. runs the teacher-forced forward of the source and that best hypothesis (prev-output tokens
   </s> y_1 ... y_{T-1}) with the hooks of ``analysis.capture``, and reads out, per layer:

   * the per-head attention weights of encoder self-, decoder self- and encoder-decoder
     attention, (H, T, S); a model whose decoder has one attention (LSTM, RIM-LSTM) gives its
     encoder-decoder attention as one layer with one head;
   * DMA: each head's token-GMM cluster probabilities of the query tokens P^q (T, C) and key
     tokens P^k (S, C), and the semantic mask M = P^q (P^k)^T (T, S) (docs/design.md, "DMA"),
     with the mask weight gamma in force at inference;
   * TIM: the competition c (T, n_s) of every TIM layer;
   * RIMs: the activation of every RIM layer, (T, n), the fraction of directions in which each
     RIM was among the top k at each token.

The tests check that the teacher-forced forward equals incremental decoding (tests of each
family), so the weights shown are those that produced the translation.

Step 3 runs only when the request asks for the views (``attention=True``; the demo page does).
The answer is bounded: its JSON is at most ``max_response_bytes`` bytes. Views that would make
it larger are pooled over blocks of k consecutive tokens, k the smallest that fits (``pool``):
an attention matrix's block averages the rows' weights and sums the columns' (each row still
sums to 1: the attention of a span of queries on a span of keys), the semantic mask averages
both, and the per-token rows (cluster probabilities, competition, activation) are averaged. The
answer says k (``view_pooling``) and labels the pooled rows and columns (``view_tokens``, "first…last"
of each block). An answer over the cap even so (or, without views, text whose tokens alone are
over it) is an ``InputError`` with status 413. Numbers are rounded to ``DECIMALS`` places, so
each takes at most 7 bytes of JSON, which is what the size of the views is bounded with.
"""

import json
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..analysis import AnalysisError
from ..analysis.capture import (
    ATTENTION_TYPES,
    attention_modules,
    describe_module,
    dma_posteriors,
    dma_semantic_mask,
    is_dma_module,
    record_modules,
)
from ..analysis.loading import load_model, model_name
from ..data.text_pipeline import TextPipeline, TextPipelineError
from . import MAX_RESPONSE_BYTES, DemoError

#: decimals of the numbers sent to the page (weights and probabilities in [0, 1])
DECIMALS = 4
#: the most bytes one such number takes in the JSON answer, with its separator ("0.1234,")
NUMBER_BYTES = 7


def rounded(x) -> list:
    return np.round(np.asarray(x, dtype=np.float64), DECIMALS).tolist()


def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Give the memory an answer with views freed back to the system. glibc keeps what a thread
    freed in that thread's arena, and the server answers each request in a thread of its own,
    so without this a burst of 8 of the largest requests left the server 80 MB larger for good
    (30 MB with it; tests/test_faults_serve_bounds.py)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def to_json(answer: Dict) -> bytes:
    """The answer as the API sends it: compact UTF-8 JSON."""
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def blocks(n: int, k: int) -> int:
    return -(-n // k)


def pool_rows(x: np.ndarray, k: int, reduce: str = "mean") -> np.ndarray:
    """X (..., N, M) with its rows (axis -2) pooled over blocks of K: the block's mean (the last
    block's over the rows it has) or sum."""
    if k == 1:
        return x
    n = x.shape[-2]
    padded = np.zeros(x.shape[:-2] + (blocks(n, k) * k, x.shape[-1]), dtype=np.float64)
    padded[..., :n, :] = x
    total = padded.reshape(x.shape[:-2] + (blocks(n, k), k, x.shape[-1])).sum(-2)
    if reduce == "sum":
        return total
    counts = np.minimum(k, n - k * np.arange(blocks(n, k)))
    return total / counts[:, None]


def pool(x: np.ndarray, k: int, kind: str) -> np.ndarray:
    """A view (..., rows, columns) pooled over blocks of K tokens: ``attention`` (rows are
    distributions over the columns: rows averaged, columns summed), ``mask`` (both averaged) or
    ``rows`` (only the rows, tokens, pooled: averaged)."""
    x = pool_rows(np.asarray(x, dtype=np.float64), k)
    if kind == "rows":
        return x
    return np.swapaxes(pool_rows(np.swapaxes(x, -1, -2), k, "sum" if kind == "attention" else "mean"), -1, -2)


def pooled_labels(tokens: List[str], k: int) -> List[str]:
    """Labels of the blocks of K tokens: the token, or "first…last"."""
    if k == 1:
        return list(tokens)
    return [block[0] if len(block) == 1 else f"{block[0]}…{block[-1]}"
            for block in (tokens[i:i + k] for i in range(0, len(tokens), k))]


class View:
    """One array of the views, (..., rows, columns) with token rows (and, but for KIND ``rows``,
    token columns), and how ``pool`` pools it."""

    def __init__(self, kind: str, array):
        self.kind, self.array = kind, np.asarray(array, dtype=np.float32)

    def bytes_at_most(self, k: int) -> int:
        """An upper bound of its JSON bytes pooled over K, brackets and separators included."""
        a = self.array
        lead, rows = int(np.prod(a.shape[:-2])), blocks(a.shape[-2], k)
        columns = a.shape[-1] if self.kind == "rows" else blocks(a.shape[-1], k)
        return lead * (rows * (columns * NUMBER_BYTES + 3) + 3)


def views_bytes_at_most(tree, k: int) -> int:
    """The bound of ``View.bytes_at_most`` summed over the Views of TREE (dicts and lists)."""
    if isinstance(tree, View):
        return tree.bytes_at_most(k)
    if isinstance(tree, dict):
        return sum(views_bytes_at_most(v, k) for v in tree.values())
    if isinstance(tree, list):
        return sum(views_bytes_at_most(v, k) for v in tree)
    return 0


def render(tree, k: Optional[int]):
    """TREE with each View pooled over K and rounded into nested lists (K None: an empty list)."""
    if isinstance(tree, View):
        return [] if k is None else rounded(pool(tree.array, k, tree.kind))
    if isinstance(tree, dict):
        return {key: render(v, k) for key, v in tree.items()}
    if isinstance(tree, list):
        return [render(v, k) for v in tree]
    return tree


class InputError(ValueError):
    """The request's text cannot be translated: the message says why; ``status`` is the HTTP
    status the API answers with (400, or 413 for text over the documented limits)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Translator:
    """A loaded checkpoint, its text pipeline and a beam-search generator; ``translate`` is
    thread-safe (one sentence at a time: the hooks and the models' last-forward state are
    per-model)."""

    def __init__(self, path, data, *, beam: int = 5, max_len_b: int = 200, tokenizer: str = "auto",
                 lowercase: str = "auto", bpe: str = "auto", bpe_codes: Optional[Path] = None,
                 max_chars: int = 1000, max_response_bytes: int = MAX_RESPONSE_BYTES, cpu: bool = True):
        if beam < 1:
            raise DemoError(f"--beam must be >= 1, got {beam}")
        if max_chars < 1:
            raise DemoError(f"--max-chars must be >= 1, got {max_chars}")
        if max_response_bytes < 1000:
            raise DemoError(f"--max-response-bytes must be >= 1000 (an answer without views holds the tokens "
                            f"and the translation), got {max_response_bytes}")
        try:
            self.model, self.task, cfg = load_model(path, data, cpu=cpu)
        except AnalysisError as e:
            raise DemoError(str(e)) from e
        self.path = Path(path)
        self.max_chars = max_chars
        self.max_response_bytes = max_response_bytes
        self.src_dict, self.tgt_dict = self.task.source_dictionary, self.task.target_dictionary
        src, tgt = self.task.cfg.source_lang, self.task.cfg.target_lang
        data_dir = Path(str(self.task.cfg.data).split(":")[0])

        # the recipe's recorded text settings (or, for a data-bin without them, the guesses)
        try:
            self.text = TextPipeline.from_data_bin(data_dir, self.src_dict, self.tgt_dict, src, tgt,
                                                   tokenizer=tokenizer, lowercase=lowercase, bpe=bpe,
                                                   bpe_codes=bpe_codes)
        except TextPipelineError as e:
            raise DemoError(str(e)) from e

        from fairseq.dataclass.configs import GenerationConfig

        self.beam = beam
        self.generator = self.task.build_generator([self.model], GenerationConfig(beam=beam, max_len_b=max_len_b))
        self.max_source_tokens = self._max_source_tokens()
        self.lock = threading.Lock()
        self.family = self._family()

    # ------------------------------------------------------------------ description
    def _max_source_tokens(self) -> int:
        from fairseq import utils

        limit = utils.resolve_max_positions(self.task.max_positions(), self.model.max_positions())
        source = limit[0] if isinstance(limit, tuple) else limit
        return int(source) if source is not None else 1024

    def _family(self) -> str:
        if any(is_dma_module(m) for m in self.model.modules()):
            return "dma"
        if hasattr(self.model, "competition"):
            return "tim"
        if hasattr(self.model, "rim_activations"):
            return "rim"
        return model_name(self.model)

    def info(self) -> Dict:
        return {
            "checkpoint": str(self.path),
            "model": model_name(self.model),
            "family": self.family,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "beam": self.beam,
            "max_chars": self.max_chars,
            "max_response_bytes": self.max_response_bytes,
            "max_source_tokens": self.max_source_tokens - 1,  # one position is the final </s>
            "text": self.text.describe(),
        }

    # ------------------------------------------------------------------ translation
    def check(self, text) -> None:
        if not isinstance(text, str):
            raise InputError("'text' must be a string")
        if not text.strip():
            raise InputError("the text is empty")
        if len(text) > self.max_chars:
            raise InputError(f"the text has {len(text)} characters; this server translates at most "
                             f"{self.max_chars} (--max-chars)", status=413)

    def translate(self, text: str, attention: bool = False) -> Dict:
        """The answer to TEXT (with the views when ATTENTION), as the API sends it."""
        return json.loads(self.respond(text, attention))

    def respond(self, text: str, attention: bool = False) -> bytes:
        """The API's JSON answer to TEXT, at most ``max_response_bytes`` long (module doc);
        the views (attention, dma / tim / rim) only when ATTENTION."""
        self.check(text)
        if not isinstance(attention, bool):
            raise InputError("'attention' must be true or false")
        with self.lock:  # one answer's arrays and lists at a time; only its bytes leave the lock
            try:
                return self._respond(text, attention)
            finally:
                if attention:
                    release_freed_memory()

    def _respond(self, text: str, attention: bool) -> bytes:
        start = time.perf_counter()
        answer, views = self._translate(text, attention)
        tokens = {"source": answer["source_tokens"], "target": answer["target_tokens"],
                  "decoder_input": answer["decoder_input_tokens"]}
        k = 1
        if views is not None:
            # all but the numbers: the views with empty arrays, the pooled labels (never longer
            # than the tokens' own), the fields set below
            fixed = len(to_json({**answer, **render(views, None), "view_pooling": 10 ** 6, "view_tokens": tokens,
                                 "milliseconds": 1e9}))
            longest = max(len(t) for t in tokens.values())
            while k < longest and fixed + views_bytes_at_most(views, k) > self.max_response_bytes:
                k += 1
            answer.update(render(views, k))
            answer["view_pooling"] = k
            answer["view_tokens"] = {side: pooled_labels(t, k) for side, t in tokens.items()}
            del views
        answer["milliseconds"] = round(1000 * (time.perf_counter() - start), 1)
        body = to_json(answer)
        if len(body) > self.max_response_bytes:
            what = (f"with the attention views pooled over blocks of {k} tokens" if attention
                    else "without the attention views")
            raise InputError(f"the answer is {len(body)} bytes {what}; this server answers at most "
                             f"{self.max_response_bytes} (--max-response-bytes): send a shorter text"
                             + (", ask without the attention views" if attention else "")
                             + " or raise --max-response-bytes", status=413)
        return body

    def _translate(self, text: str, attention: bool) -> Tuple[Dict, Optional[Dict]]:
        """(the answer without views, the views as a tree of ``View`` or None)."""
        encoded = self.text.encode(text)
        if not encoded.subwords:
            raise InputError("the text holds no translatable characters")
        if len(encoded.ids) > self.max_source_tokens:
            raise InputError(f"the text is {len(encoded.ids) - 1} subword tokens long; the model reads at most "
                             f"{self.max_source_tokens - 1}", status=413)
        hypothesis = self.generate(encoded.ids)
        tokens = hypothesis["tokens"]
        views = self.inspect(encoded.ids, tokens) if attention else None
        eos = self.tgt_dict[self.tgt_dict.eos()]
        return {
            "translation": self.text.decode(tokens.tolist()),
            "source": encoded.text,
            "source_tokens": encoded.subwords + [self.src_dict[self.src_dict.eos()]],
            "target_tokens": self.text.target_subwords(tokens.tolist()) + [eos],
            "decoder_input_tokens": [eos] + self.text.target_subwords(tokens[:-1].tolist()),
            "unknown_tokens": encoded.unknown,
            "score": float(hypothesis["score"]),
        }, views

    def sample(self, src_ids: torch.Tensor, prev_output_tokens: Optional[torch.Tensor] = None) -> Dict:
        device = next(self.model.parameters()).device
        net_input = {"src_tokens": src_ids[None].to(device), "src_lengths": torch.tensor([len(src_ids)], device=device)}
        if prev_output_tokens is not None:
            net_input["prev_output_tokens"] = prev_output_tokens[None].to(device)
        return {"id": torch.tensor([0]), "net_input": net_input}

    def generate(self, src_ids: torch.Tensor) -> Dict:
        """The best beam-search hypothesis of fairseq's generator for the source ids."""
        with torch.no_grad():
            hypotheses = self.task.inference_step(self.generator, [self.model], self.sample(src_ids))
        best = hypotheses[0][0]
        return {"tokens": best["tokens"].cpu(), "score": best["score"]}

    def subword_translation(self, subwords: str) -> List[str]:
        """Translate text already split into the dictionary's tokens (no tokenisation or subword
        model): the hypothesis subwords, as ``fairseq-generate`` prints them."""
        ids = self.src_dict.encode_line(subwords, add_if_not_exist=False, append_eos=True).long()
        with self.lock:
            return self.text.target_subwords(self.generate(ids)["tokens"].tolist())

    # ------------------------------------------------------------------ what the model did
    def inspect(self, src_ids: torch.Tensor, tokens: torch.Tensor) -> Dict:
        """Attention and the method's own quantities in the teacher-forced forward of (source,
        hypothesis ``tokens``, which end with </s>)."""
        prev = torch.cat([tokens.new_tensor([self.tgt_dict.eos()]), tokens[:-1]])
        sample = self.sample(src_ids, prev)
        modules = {}
        for attention_type in ATTENTION_TYPES:
            try:
                modules[attention_type] = attention_modules(self.model, attention_type)
            except AnalysisError:
                pass  # not a multi-head attention of this model (LSTM-style encoders and decoders)
        with ExitStack() as stack:
            recorders = {kind: stack.enter_context(record_modules(found, inputs=True))
                         for kind, found in modules.items()}
            with torch.no_grad():
                output = self.model(**sample["net_input"])

        attention = {kind: [View("attention", w[0].float().cpu()) for w in rec.layer_weights()]
                     for kind, rec in recorders.items()}
        layer_names = {kind: [describe_module(name) for name in rec.names()] for kind, rec in recorders.items()}
        if "enc_dec" not in attention and isinstance(output, tuple) and torch.is_tensor(output[1]):
            # fairseq's LSTMDecoder returns its (B, T, S) attention as the second output
            attention["enc_dec"] = [View("attention", output[1][0:1].float().cpu())]
            layer_names["enc_dec"] = ["decoder attention"]
        views = {"attention": attention, "attention_layers": layer_names}
        if self.family == "dma":
            views["dma"] = self.dma_views(modules, recorders)
        if self.family == "tim":
            views["tim"] = [{"layer": describe_module(name), "side": name.split(".")[0],
                             "competition": View("rows", c[0].float().cpu())}
                            for name, c in self.model.competition().items() if c is not None]
        if self.family == "rim":
            views["rim"] = [{"layer": f"encoder layer {i + 1}",
                             "activation": View("rows", a[0].float().mean(dim=1).cpu())}
                            for i, a in self.model.rim_activations().items()]
        return views

    def dma_views(self, modules, recorders) -> Dict:
        """Per attention type with DMA modules: per layer, each head's P^q, P^k and mask M."""
        views = {}
        for kind, found in modules.items():
            layers = []
            for name, module in found:
                if not is_dma_module(module):
                    continue
                x_query, x_key = recorders[kind].inputs[name]
                p_query = dma_posteriors(module, x_query)[0]  # (H, T, C)
                p_key = dma_posteriors(module, x_key)[0]      # (H, S, C)
                layers.append({
                    "layer": describe_module(name),
                    "gamma": float(module.gamma),
                    "query_posteriors": View("rows", p_query.float().cpu()),
                    "key_posteriors": View("rows", p_key.float().cpu()),
                    "mask": View("mask", dma_semantic_mask(p_query, p_key).float().cpu()),
                })
            if layers:
                views[kind] = layers
        return views
