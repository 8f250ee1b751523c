"""Builders of the target zoo (DESIGN 5): small targets trained here, offline, so acceptance
numbers mean something. The built assets ship in `draftinfer/zoo/` (package data; `zoo:<name>`
resolves there) and are committed: rebuilding them changes the golden numbers.

- `build_text` (CLI): chat data from the standard library's source (`text_data`), a BPE
  tokenizer, a trained tiny Llama-3.1-shaped target (`text_train`) -> `llama-tiny/`, `chat/`;
- `build_vl` (CLI): synthetic image-caption chat (`vl_data`, also a CLI), a tokenizer with
  Qwen3-VL's special tokens, a trained tiny Qwen3-VL (`vl_train`) -> `qwen3-vl-tiny/`,
  `vl_caption/`.
- `build_moe` (CLI): the MoE targets `gpt-oss-tiny` (harmony chat, `chat_harmony/`),
  `qwen3-moe-tiny` (Qwen3 chat), and `deepseek-tiny` / `glm-tiny` with their own MTP layer
  trained jointly (`deepseek_target`, `glm_target`, `mtp_joint`) on the zoo chat
  (`moe_targets` says what each is); the steps every text build shares are `target_build`.

Every target trains on the project's trainer (`target_train`: the optimizer loop of drafter
training, `drafttrain.trainer.loop`, with the zoo's next-token objective and token-budget batches).

`python -m drafttrain.zoo.build_text --out DIR` / `build_vl --out DIR` / `build_moe --out DIR`;
`draftinfer/zoo/README.md` gives the recipes and what each build measured.
"""
