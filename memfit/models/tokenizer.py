"""A byte-level tokenizer that needs no download: ids 0-255 are bytes, then bos/eos/pad.

It is a real `PreTrainedTokenizerFast`, so it saves and reloads like any Hugging Face
tokenizer and carries a chat template. Used by memfit's own presets (the demo model) and by
random-init models that ship no tokenizer; never for real weights, which learned other ids
(memfit/models/loading.py `tokenizer_source`). Its 259 ids need a vocab_size of at least 259.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# A minimal chat template (role headers, then content), used when a tokenizer has none.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    # Order by the byte each stand-in encodes, so token id == byte value.
    table = {c: i for i, c in enumerate(_byte_to_unicode_order())}
    assert set(table) == set(byte_chars)
    vocab = dict(table)
    vocab.update({BOS: 256, EOS: 257, PAD: 258})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.add_special_tokens({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_to_unicode_order() -> list[str]:
    """GPT-2's byte -> printable-character map, as a list indexed by byte value."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]
