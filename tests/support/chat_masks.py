"""Expected assistant-only loss masks written out by hand (test R2): a test writes the rendered
conversation literally as segments flagged generated (1) or not (0); walking the tokens of the
full text, each decoded on its own, gives every token's segment and so its expected mask bit
(and checks that no token straddles a segment boundary). Segments are not tokenized separately:
byte-level BPE merges differently at a string's end ("\\n\\n" alone is one token, before a word
it is two), as real tokenizers do. Independent of `drafttrain.data.chat`, which it checks."""

from __future__ import annotations

from drafttrain.data import assistant_spans, tokenize_conversation


def expected_from_segments(tokenizer, segments):
    """(ids, mask) expected for the conversation written out as `segments`."""
    text = "".join(seg for seg, _ in segments)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ends, flags, pos = [], [], 0
    for seg, generated in segments:
        pos += len(seg)
        ends.append(pos)
        flags.append(generated)
    mask, pos, k = [], 0, 0
    for tok_id in ids:
        piece = tokenizer.decode([tok_id])
        while pos >= ends[k]:
            k += 1
        assert pos + len(piece) <= ends[k], f"token {piece!r} straddles a segment boundary"
        mask.append(flags[k])
        pos += len(piece)
    assert pos == len(text)
    return ids, mask


def assert_mask_matches(tokenizer, messages, segments):
    text, spans = assistant_spans(tokenizer, messages)
    assert text == "".join(s for s, _ in segments)
    assert [text[a:b] for a, b in spans] == [s for s, g in segments if g]

    out = tokenize_conversation(tokenizer, messages, max_length=10_000)
    ids, mask = expected_from_segments(tokenizer, segments)
    assert out["input_ids"] == ids
    assert out["loss_mask"] == mask  # token by token
    # And read back: the masked tokens decode to exactly the generated strings.
    runs, current = [], []
    for tok_id, m in zip(out["input_ids"], out["loss_mask"]):
        if m:
            current.append(tok_id)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    assert runs == [s for s, g in segments if g]
    return out
