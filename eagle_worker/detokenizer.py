"""Incremental detokenization that is correct across multi-byte tokens (vLLM's offset scheme).

Decoding token by token breaks characters split over several byte tokens; instead decode a short
window twice (with and without the new tokens) and emit the difference once it no longer ends in
a replacement character.
"""
from __future__ import annotations

from eagle_worker.sequence import Sequence


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append newly decodable text of `seq`'s output to `seq.text`; return the new text."""
    out_ids = seq.output_token_ids
    if seq.read_offset > len(out_ids):   # restart after output was rolled back (never expected)
        seq.prefix_offset = seq.read_offset = 0
    prefix = tokenizer.decode(out_ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(out_ids[seq.prefix_offset:], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new_text = full[len(prefix):]
        seq.text += new_text
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(out_ids)
        return new_text
    return ""


def finalize_text(tokenizer, seq: Sequence, drop_last: bool = False) -> str:
    """Flush text held back at the end (a dangling partial character) when the sequence ends;
    `drop_last`: the last token's text is not part of the output (a stop token id)."""
    ids = seq.output_token_ids
    rest = tokenizer.decode(ids[:-1] if drop_last else ids, skip_special_tokens=True)
    if rest.startswith(seq.text) and len(rest) > len(seq.text):
        extra = rest[len(seq.text):]
        seq.text = rest
        return extra
    return ""
