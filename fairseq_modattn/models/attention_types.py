"""The three attentions of an encoder-decoder transformer, under the names that every flag,
command and result of this package uses (Vaswani et al. 2017, section 3.2.3):

    name       attention                    queries from    keys from    fairseq layer attribute
    enc_self   encoder self-attention       the encoder     the encoder  self_attn
    dec_self   decoder self-attention       the decoder     the decoder  self_attn
    enc_dec    encoder-decoder attention    the decoder     the encoder  encoder_attn

The encoder's positions are the source tokens and the decoder's the target tokens (the decoder
input, the target shifted right). The models' ``--<family>-attention`` flags choose among these
names (``parse_attention_types``); the analysis finds the modules through ``layer_attribute``.
"""

from typing import List, Tuple

#: name -> (stack of its queries, stack of its keys, attribute of a fairseq transformer layer);
#: the queries' stack is also the one whose layers hold the module
_PLACES = {
    "enc_self": ("encoder", "encoder", "self_attn"),
    "dec_self": ("decoder", "decoder", "self_attn"),
    "enc_dec": ("decoder", "encoder", "encoder_attn"),
}

ATTENTION_TYPES: Tuple[str, ...] = tuple(_PLACES)

#: how results name the attention a fairseq layer attribute holds ("encoder layer 1 self-attention")
ATTRIBUTE_LABELS = {"self_attn": "self-attention", "encoder_attn": "encoder-decoder attention"}


def _place(attention_type: str) -> Tuple[str, str, str]:
    if attention_type not in _PLACES:
        raise ValueError(f"unknown attention type {attention_type!r}; choose from {', '.join(ATTENTION_TYPES)}")
    return _PLACES[attention_type]


def query_stack(attention_type: str) -> str:
    """'encoder' or 'decoder': whose positions are the queries, and whose layers hold the module."""
    return _place(attention_type)[0]


def key_stack(attention_type: str) -> str:
    """'encoder' or 'decoder': whose positions are the keys."""
    return _place(attention_type)[1]


def layer_attribute(attention_type: str) -> str:
    """The attribute of a fairseq transformer layer that holds the module: 'self_attn' or 'encoder_attn'."""
    return _place(attention_type)[2]


def parse_attention_types(value: str, flag: str) -> List[str]:
    """The attention types given on a model's ``flag``: comma-separated names, or 'none'."""
    types = [t.strip() for t in value.split(",") if t.strip()] if value.strip().lower() != "none" else []
    unknown = [t for t in types if t not in _PLACES]
    if unknown:
        raise ValueError(
            f"{flag}: unknown attention type(s) {unknown}; "
            f"expected a comma-separated subset of {','.join(ATTENTION_TYPES)} or 'none'"
        )
    return types
