"""Training data: chat loading and assistant-only loss masks, batching, the draft vocabulary.

`chat` (conversations -> token ids + loss masks), `batching` (length-bucketed batches,
padding collation) and `vocab` (d2t / t2d). `datasets` is imported lazily, so importing this
package (e.g. for `draft_to_target_ids`) stays cheap.
"""

from drafttrain.data.batching import (
    BatchStream,
    collate,
    held_out_batches,
    length_bucketed_batches,
)
from drafttrain.data.chat import (
    assistant_spans,
    end_of_turn_marker,
    load_chat_dataset,
    load_data,
    normalize_messages,
    tokenize_conversation,
    tokenize_dataset,
)
from drafttrain.data.vocab import (
    build_draft_vocab,
    count_masked_tokens,
    draft_to_target_ids,
    draft_vocab_from_counts,
    load_or_build_draft_vocab,
    map_draft_logits_to_target,
)

__all__ = [
    "BatchStream",
    "assistant_spans",
    "build_draft_vocab",
    "collate",
    "count_masked_tokens",
    "draft_to_target_ids",
    "draft_vocab_from_counts",
    "end_of_turn_marker",
    "held_out_batches",
    "length_bucketed_batches",
    "load_chat_dataset",
    "load_data",
    "load_or_build_draft_vocab",
    "map_draft_logits_to_target",
    "normalize_messages",
    "tokenize_conversation",
    "tokenize_dataset",
]
