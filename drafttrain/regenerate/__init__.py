"""Regeneration: rewrite the assistant turns of a chat dataset with the target's own responses
(`python -m drafttrain.regenerate`, `conf/drafttrain/regenerate.yaml`).

- `config`: the typed schema (`target:` and `data:` as in training, plus `regenerate:`);
- `job`: `regenerate(cfg)`, the conversation logic (which turns, prompts, skips);
- `backends`: plain decoding of the target alone, native (`draftinfer`) or transformers;
- `manifest`: the output layout, atomic shard commits, the config fingerprint, resume.
"""

from drafttrain.regenerate.config import RegenConfig, RegenerateConfig

__all__ = ["RegenConfig", "RegenerateConfig", "regenerate"]


def regenerate(cfg: RegenConfig) -> dict:
    """`drafttrain.regenerate.job.regenerate` (imported on call: the package stays cheap)."""
    from drafttrain.regenerate.job import regenerate as run

    return run(cfg)
