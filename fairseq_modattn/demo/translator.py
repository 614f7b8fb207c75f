"""One checkpoint as a sentence translator that also shows what the model did.

``Translator.translate(text)``:

1. encodes the sentence as the data recipe did (``text.TextPipeline``: the text settings
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
"""

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional

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
from . import DemoError
from .text import TextPipeline

#: decimals of the numbers sent to the page (weights and probabilities in [0, 1])
DECIMALS = 4


def rounded(x) -> list:
    return np.round(np.asarray(x, dtype=np.float64), DECIMALS).tolist()


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
                 max_chars: int = 1000, cpu: bool = True):
        if beam < 1:
            raise DemoError(f"--beam must be >= 1, got {beam}")
        if max_chars < 1:
            raise DemoError(f"--max-chars must be >= 1, got {max_chars}")
        try:
            self.model, self.task, cfg = load_model(path, data, cpu=cpu)
        except AnalysisError as e:
            raise DemoError(str(e)) from e
        self.path = Path(path)
        self.max_chars = max_chars
        self.src_dict, self.tgt_dict = self.task.source_dictionary, self.task.target_dictionary
        src, tgt = self.task.cfg.source_lang, self.task.cfg.target_lang
        data_dir = Path(str(self.task.cfg.data).split(":")[0])

        # the recipe's recorded text settings (or, for a data-bin without them, the guesses)
        self.text = TextPipeline.from_data_bin(data_dir, self.src_dict, self.tgt_dict, src, tgt, tokenizer=tokenizer,
                                               lowercase=lowercase, bpe=bpe, bpe_codes=bpe_codes)

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

    def translate(self, text: str) -> Dict:
        self.check(text)
        with self.lock:
            return self._translate(text)

    def _translate(self, text: str) -> Dict:
        start = time.perf_counter()
        encoded = self.text.encode(text)
        if not encoded.subwords:
            raise InputError("the text holds no translatable characters")
        if len(encoded.ids) > self.max_source_tokens:
            raise InputError(f"the text is {len(encoded.ids) - 1} subword tokens long; the model reads at most "
                             f"{self.max_source_tokens - 1}", status=413)
        hypothesis = self.generate(encoded.ids)
        tokens = hypothesis["tokens"]
        views = self.inspect(encoded.ids, tokens)
        eos = self.tgt_dict[self.tgt_dict.eos()]
        return {
            "translation": self.text.decode(tokens.tolist()),
            "source": encoded.text,
            "source_tokens": encoded.subwords + [self.src_dict[self.src_dict.eos()]],
            "target_tokens": self.text.target_subwords(tokens.tolist()) + [eos],
            "decoder_input_tokens": [eos] + self.text.target_subwords(tokens[:-1].tolist()),
            "unknown_tokens": encoded.unknown,
            "score": float(hypothesis["score"]),
            **views,
            "milliseconds": round(1000 * (time.perf_counter() - start), 1),
        }

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
            recorders = {kind: stack.enter_context(record_modules(found, inputs=True)) for kind, found in modules.items()}
            with torch.no_grad():
                output = self.model(**sample["net_input"])

        attention = {kind: [rounded(w[0]) for w in rec.layer_weights()] for kind, rec in recorders.items()}
        layer_names = {kind: [describe_module(name) for name in rec.names()] for kind, rec in recorders.items()}
        if "enc_dec" not in attention and isinstance(output, tuple) and torch.is_tensor(output[1]):
            # fairseq's LSTMDecoder returns its (B, T, S) attention as the second output
            attention["enc_dec"] = [[rounded(output[1][0].float().cpu())]]
            layer_names["enc_dec"] = ["decoder attention"]
        views = {"attention": attention, "attention_layers": layer_names}
        if self.family == "dma":
            views["dma"] = self.dma_views(modules, recorders)
        if self.family == "tim":
            views["tim"] = [{"layer": describe_module(name), "side": name.split(".")[0],
                             "competition": rounded(c[0].float().cpu())}
                            for name, c in self.model.competition().items() if c is not None]
        if self.family == "rim":
            views["rim"] = [{"layer": f"encoder layer {i + 1}", "activation": rounded(a[0].float().mean(dim=1).cpu())}
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
                    "query_posteriors": rounded(p_query),
                    "key_posteriors": rounded(p_key),
                    "mask": rounded(dma_semantic_mask(p_query, p_key)),
                })
            if layers:
                views[kind] = layers
        return views
