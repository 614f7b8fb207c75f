"""Read per-head attention weights, queries and module inputs out of a model's forward pass.

One mechanism for every attention module the analysis meets: fairseq's ``MultiheadAttention``
(plain transformer checkpoints) and this package's ``MultiheadAttentionBase`` subclasses (DMA,
talking heads, TIM's mechanism attention) share fairseq's ``forward`` contract, so a forward
pre-hook asks each for per-head weights (``need_head_weights=True``) and a forward hook keeps
them and hands the layer exactly what it asked for (nothing, or head-averaged weights).
The layers therefore compute what they compute in ``fairseq-generate``; only the weights are
copied out. Queries are read from the output of each module's ``q_proj``.

Weights are stored (B, H, T, S) in fp32 on the CPU: H query heads (talking heads: the h
softmax heads W), T queries, S keys, per module, for its last call.
"""

import inspect
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Dict, Iterator, List, Tuple, TypeGuard, cast

import torch
import torch.nn as nn
from torch import Tensor

from ..compat.per_head_attention_weights import fairseq_attention_per_head_path

# ATTENTION_TYPES: the names that callers of attention_modules (the demo) iterate over
from ..models.attention_types import ATTENTION_TYPES, ATTRIBUTE_LABELS, layer_attribute, query_stack  # noqa: F401
from . import AnalysisError
from .loading import model_name

if TYPE_CHECKING:  # imported where used at run time: the modules import fairseq
    from ..modules.dma_attention import DisentangledMaskAttention


def attention_modules(model: nn.Module, attention_type: str) -> List[Tuple[str, nn.Module]]:
    """[(name like 'encoder.layers.0.self_attn', module)] of ``attention_type``, one per layer."""
    side, attr = query_stack(attention_type), layer_attribute(attention_type)
    layers = getattr(getattr(model, side, None), "layers", None)
    found = []
    for index, layer in enumerate(layers or []):
        module = getattr(layer, attr, None)
        if module is not None and hasattr(module, "q_proj"):
            found.append((f"{side}.layers.{index}.{attr}", module))
    if not found:
        raise AnalysisError(
            f"this {model_name(model)} model has no multi-head {attention_type} attention "
            f"({side} layers with '{attr}'); redundancy and query analyses need a transformer-family "
            "model (RIM-LSTM and LSTM encoders are recurrent, their decoders' attention has one head)"
        )
    return found


def describe_module(name: str) -> str:
    """'decoder.layers.1.encoder_attn' -> 'decoder layer 2 encoder-decoder attention' (1-based,
    as the commands' --layer flags count)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] != "layers" or not parts[2].isdigit():
        return name
    text = f"{parts[0]} layer {int(parts[2]) + 1}"
    return f"{text} {ATTRIBUTE_LABELS.get(parts[3], parts[3])}" if len(parts) > 3 else text


def query_heads(module: nn.Module) -> int:
    """How many heads the module splits its queries into (talking heads: h_k)."""
    # num_heads and key_heads are plain ints; nn.Module's attribute type cannot say so
    return getattr(module, "key_heads", cast(int, module.num_heads))


class AttentionRecorder:
    """Hooks on some attention modules; after each forward, per module name:

    ``weights[name]``  (B, H, T, S) per-head attention weights of its last call;
    ``queries[name]``  (B, H_q, T, d) projected queries (without the 1/sqrt(d) scale), if asked;
    ``inputs[name]``   (query input (T, B, E), key input (S, B, E)) of the module, if asked.
    """

    def __init__(self, modules: List[Tuple[str, nn.Module]], queries: bool = False, inputs: bool = False):
        self.modules = modules
        self.keep_queries, self.keep_inputs = queries, inputs
        self.weights: Dict[str, Tensor] = {}
        self.queries: Dict[str, Tensor] = {}
        self.inputs: Dict[str, Tuple[Tensor, Tensor]] = {}

    def names(self) -> List[str]:
        return [name for name, _ in self.modules]

    def layer_weights(self) -> List[Tensor]:
        """Each module's last weights, in layer order (error if one was not called)."""
        missing = [name for name in self.names() if name not in self.weights]
        if missing:
            raise AnalysisError(f"attention modules {missing} were not called in the forward pass")
        return [self.weights[name] for name in self.names()]

    def install(self, stack: ExitStack):
        for name, module in self.modules:
            stack.enter_context(fairseq_attention_per_head_path(module))
            signature = inspect.signature(module.forward)
            requested: List[Tuple[bool, bool]] = []
            pre = module.register_forward_pre_hook(self._pre_hook(name, signature, requested), with_kwargs=True)
            post = module.register_forward_hook(self._post_hook(name, requested), with_kwargs=True)
            stack.callback(pre.remove)
            stack.callback(post.remove)
            if self.keep_queries:
                q_proj = cast(nn.Module, module.q_proj)
                q_hook = q_proj.register_forward_hook(self._query_hook(name, query_heads(module)))
                stack.callback(q_hook.remove)

    def _pre_hook(self, name, signature, requested):
        def hook(module, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            call = bound.arguments
            requested.append((bool(call["need_weights"]), bool(call["need_head_weights"])))
            call["need_weights"] = call["need_head_weights"] = True
            if self.keep_inputs:
                key = call["key"] if call["key"] is not None else call["query"]
                self.inputs[name] = (call["query"].detach(), key.detach())
            return bound.args, bound.kwargs

        return hook

    def _post_hook(self, name, requested):
        def hook(module, args, kwargs, output):
            need_weights, need_head_weights = requested.pop()
            out, weights = output
            if weights is None:
                raise AnalysisError(f"{name} ({type(module).__name__}) returned no attention weights")
            self.weights[name] = weights.detach().transpose(0, 1).float().cpu()  # (B, H, T, S)
            if need_head_weights:
                return out, weights
            return out, (weights.mean(dim=0) if need_weights else None)

        return hook

    def _query_hook(self, name, heads):
        def hook(module, args, output):
            length, bsz, _ = output.shape
            # a copy: fairseq scales q in place right after q_proj (``q *= self.scaling``)
            queries = output.detach().float().clone().view(length, bsz, heads, -1)
            self.queries[name] = queries.permute(1, 2, 0, 3).cpu()

        return hook


@contextmanager
def record_attention(
    model: nn.Module, attention_type: str, queries: bool = False, inputs: bool = False
) -> Iterator[AttentionRecorder]:
    """Within the block, every forward of ``model`` leaves the per-head weights (and optionally
    the queries and inputs) of its ``attention_type`` modules in the yielded recorder."""
    with record_modules(attention_modules(model, attention_type), queries=queries, inputs=inputs) as recorder:
        yield recorder


@contextmanager
def record_modules(
    modules: List[Tuple[str, nn.Module]], queries: bool = False, inputs: bool = False
) -> Iterator[AttentionRecorder]:
    """``record_attention`` for an explicit list of (name, attention module)."""
    recorder = AttentionRecorder(modules, queries=queries, inputs=inputs)
    with ExitStack() as stack:
        recorder.install(stack)
        yield recorder


def query_padding_mask(sample: dict, attention_type: str, pad: int) -> Tensor:
    """(B, T) True on the real query positions of ``attention_type`` in a fairseq sample."""
    net_input = sample["net_input"]
    tokens = net_input["src_tokens"] if query_stack(attention_type) == "encoder" else net_input["prev_output_tokens"]
    return tokens.ne(pad).cpu()


def dma_posteriors(module: nn.Module, x: Tensor) -> Tensor:
    """Token-GMM cluster probabilities P^h_ic (B, H, N, C) of a DMA module's input x (N, B, E),
    at the input itself (no sampling, as at inference)."""
    from ..modules.dma_attention import DisentangledMaskAttention

    if not isinstance(module, DisentangledMaskAttention):
        raise AnalysisError(f"{type(module).__name__} is not a DMA attention module (no token GMM)")
    length, bsz, _ = x.shape
    z = x.view(length, bsz, module.num_heads, -1).permute(1, 2, 0, 3)
    with torch.no_grad():
        stats = module.token_gmm(z, module.noise_var, sample=False, need_kl=False)
    return stats.log_post.exp().float().cpu()


def dma_semantic_mask(posteriors_q: Tensor, posteriors_k: Tensor) -> Tensor:
    """M_ij = sum_c P^q_ic P^k_jc, (B, H, T, S), from (B, H, T, C) and (B, H, S, C)."""
    return torch.matmul(posteriors_q, posteriors_k.transpose(-1, -2))


def is_dma_module(module: nn.Module) -> TypeGuard["DisentangledMaskAttention"]:
    from ..modules.dma_attention import DisentangledMaskAttention

    return isinstance(module, DisentangledMaskAttention)


def forward_sample(model: nn.Module, sample: dict):
    """The teacher-forced forward fairseq's criterions run, without gradients."""
    with torch.no_grad():
        return model(**sample["net_input"])


def require_dma(model: nn.Module, attention_type: str) -> List[Tuple[str, "DisentangledMaskAttention"]]:
    """The DMA modules of ``attention_type`` (error naming the model when there are none)."""
    found: List[Tuple[str, "DisentangledMaskAttention"]] = [
        (n, m) for n, m in attention_modules(model, attention_type) if is_dma_module(m)]
    if not found:
        raise AnalysisError(
            f"this {model_name(model)} model has no DMA {attention_type} attention: cluster plots need "
            "a dma_transformer checkpoint whose --dma-attention includes " + attention_type
        )
    return found

