"""Block drafter (`dflash`) architecture: what a checkpoint's `config.json` describes.

Serving format: the z-lab native layout that vLLM (`method: dflash`) and SGLang (`DFLASH`) load
as-is (REFERENCES A3): Qwen3 decoder fields at the top level, `architectures`
`DFlashDraftModel` (or `DFlash2DraftModel` with the conv and selector), `num_target_layers`,
`block_size` (top level and in `dflash_config`, as older and newer checkpoints put it),
`dflash_config{mask_token_id, target_layer_ids, block_size, [causal], [conv_*, selector_*]}`,
and `eagle_aux_hidden_state_layer_ids` = `target_layer_ids + 1` (what vLLM reads first;
convention 13, `draftinfer.kinds.dflash.taps`).

Options of the one kind (K2 pins that each default reproduces plain DFlash):
- `causal_block` (JetSpec): slot i of a block sees slots <= i only (`dflash_config.causal`);
- `layer_types` / `sliding_window`: sliding-window layers, causal inside the block (the rule
  vLLM, SpecForge and speculators apply to `sliding_attention` layers);
- `conv_kernel_size > 0` (DFlash2): a grouped dynamic causal conv around each sublayer;
- `selector_top_k > 0` (DFlash2): the low-rank candidate selector over the top-k;
- DSpark (`sample_from_anchor`, `markov_rank > 0`, `confidence_head`): the anchor slot drafts
  too (a block of B slots gives B drafts, `first_draft_slot`), a low-rank first-order Markov
  bias on each draft's logits from the token before it (`markov_head_type` `vanilla`:
  `markov_w2(markov_w1[prev])`), and a per-slot acceptance predictor. Written as vLLM's
  `dspark` method reads them: top-level `markov_rank`, `markov_head_type`,
  `dflash_config.sample_from_anchor` (REFERENCES A1/A3).
- `lilicorr_top_k > 0` (LiLiCorr, arXiv 2608.20530, ModelOpt #2342): a lattice of each drafting
  slot's top-k candidates, a small transformer (`lilicorr_layers`, width `lilicorr_rank`,
  `lilicorr_heads`) over the block's slots giving each slot a context vector, transitions
  between candidates of adjacent slots scored bilinearly, and a walk from the anchor
  (`module.LatticeCorrelator`). Combines with the conv (`conv_kernel_size`), not with the
  selector, the Markov head or `sample_from_anchor`. Written as ModelOpt's `projector_type:
  lilicorr` on `dflash_config` plus our `lilicorr_*` geometry, architecture
  `LiLiCorrDraftModel` (the name vLLM's open PR #57934 loads); no merged engine serves it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from draftinfer.files.checkfields import require
from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.kinds.dflash.taps import (
    check_dflash_ids,
    dflash_id_of_tap,
    tap_of_dflash_id,
)
from draftinfer.models.rope import parse_rope
from draftinfer.models.target import FeatureSpec

LAYER_TYPES = ("full_attention", "sliding_attention")
# `gated` is training-only (no engine serves it; speculators 0.9.0's definition, module.py):
# the z-lab / vLLM layout refuses it (`DFlashSpec.hf_config`). `rnn` is not implemented.
MARKOV_HEAD_TYPES = ("vanilla", "gated")
# dflash_config fields of other DFlash-family variants this code does not implement: a
# checkpoint that sets them to anything but the identity is refused, never half-served.
_IDENTITY_FIELDS = {
    "output_multiplier": 1.0,
    "input_embedding_scale": 1.0,
    "final_logit_softcapping": None,
    "projector_type": "dflash",
    "attention_sink_bias": None,
}


@dataclass
class DFlashConfig:
    kind: ClassVar[str] = "dflash"
    speculators_type: ClassVar[str] = "dflash"
    speculators_architecture: ClassVar[str] = "DFlashSpeculator"

    hidden_size: int  # = the target's (the block embeds with the target's embedding)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (the head is the target's)
    num_target_layers: int
    # Our taps: inputs of target layers j (convention 2), concatenated in this order; the
    # checkpoint writes them as DFlash ids t = j - 1.
    tap_layer_ids: list[int] = field(default_factory=list)
    num_hidden_layers: int = 5
    block_size: int = 16
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    # Per layer "full_attention" / "sliding_attention" (empty: all full).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    causal_block: bool = False
    conv_kernel_size: int = 0  # 0: no conv (DFlash2: 2)
    conv_group_size: int = 16
    selector_top_k: int = 0  # 0: no candidate selector (DFlash2: 16)
    selector_rank: int = 256
    # DSpark: the anchor slot drafts too (slot s drafts token anchor + s + 1).
    sample_from_anchor: bool = False
    markov_rank: int = 0  # 0: no Markov head (DSpark: 256)
    markov_head_type: str = "vanilla"
    confidence_head: bool = False  # DSpark's per-slot accept-rate predictor
    # The confidence head reads `[h, markov_w1[prev]]` (H + r) instead of h (REFERENCES A1).
    confidence_head_with_markov: bool = False
    # LiLiCorr: the candidate lattice over each drafting slot's top-k (0: off; published: 16).
    lilicorr_top_k: int = 0
    lilicorr_rank: int = 64  # the correlator's width d
    lilicorr_layers: int = 2  # the published scorer is a two-layer transformer
    lilicorr_heads: int = 4

    def __post_init__(self) -> None:
        self.rope_theta, self.rope_scaling = parse_rope(
            {"rope_theta": self.rope_theta, **(self.rope_scaling or {})},
            self.head_dim,
            f"{self.kind} drafter",
        )
        self.tap_layer_ids = [int(j) for j in self.tap_layer_ids]
        check_dflash_ids(
            [dflash_id_of_tap(j) for j in self.tap_layer_ids],
            self.num_target_layers,
            "target_layer_ids (DFlash ids of the taps)",
        )
        if self.num_hidden_layers < 1:
            raise ConfigError(f"a block drafter needs >= 1 layer, got {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (anchor + 1 mask), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        self.layer_types = list(self.layer_types) or ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types {bad} not in {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ConfigError("sliding_attention layers need sliding_window > 0")
        if self.conv_kernel_size < 0 or (
            self.conv_kernel_size and self.hidden_size % self.conv_group_size
        ):
            raise ConfigError(
                f"conv_kernel_size {self.conv_kernel_size} / conv_group_size "
                f"{self.conv_group_size}: the group size must divide hidden_size {self.hidden_size}"
            )
        if not 0 <= self.selector_top_k <= self.vocab_size:
            raise ConfigError(
                f"selector_top_k {self.selector_top_k} must be in 0..{self.vocab_size}"
            )

        if self.markov_rank < 0 or self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"markov_rank {self.markov_rank} must be >= 0 and markov_head_type "
                f"{self.markov_head_type!r} one of {MARKOV_HEAD_TYPES}"
            )
        if self.confidence_head_with_markov and not (self.confidence_head and self.markov_rank):
            raise ConfigError("confidence_head_with_markov needs the confidence and Markov heads")
        if self.markov_rank and self.selector_top_k:
            raise ConfigError("a Markov head and DFlash2's candidate selector do not combine")
        if self.lilicorr_top_k:
            if not 0 < self.lilicorr_top_k <= self.vocab_size:
                raise ConfigError(
                    f"lilicorr_top_k {self.lilicorr_top_k} must be in 1..{self.vocab_size}"
                )
            heads = self.lilicorr_heads
            if self.lilicorr_layers < 1 or heads < 1 or self.lilicorr_rank % max(1, heads):
                raise ConfigError(
                    f"lilicorr: {self.lilicorr_layers} layers (>= 1), rank "
                    f"{self.lilicorr_rank} a multiple of {self.lilicorr_heads} heads"
                )
            if self.selector_top_k or self.markov_rank or self.sample_from_anchor:
                raise ConfigError(
                    "LiLiCorr's lattice re-ranks the drafts itself: it does not combine with "
                    "DFlash2's selector, DSpark's Markov head or sample_from_anchor (the conv does)"
                )

    # -- what every drafter config provides -----------------------------------------------
    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def features(self) -> FeatureSpec:
        """The inputs of the tapped target layers, concatenated (`fc`'s input)."""
        return FeatureSpec(layer_inputs=tuple(self.tap_layer_ids))

    @property
    def dflash2(self) -> bool:
        return bool(self.conv_kernel_size or self.selector_top_k)

    @property
    def lilicorr(self) -> bool:
        return bool(self.lilicorr_top_k)

    @property
    def dspark(self) -> bool:
        return bool(self.sample_from_anchor or self.markov_rank or self.confidence_head)

    @property
    def first_draft_slot(self) -> int:
        """The block slot of draft 1: 1 (the anchor slot only feeds the block), 0 with
        `sample_from_anchor`. Draft j (1..K) sits at slot `j - 1 + first_draft_slot` and
        predicts `x[anchor + j]` whatever the layout: training's labels and the runner's
        drafts both read this (and `block_slots`)."""
        return 0 if self.sample_from_anchor else 1

    def block_slots(self, k: int) -> int:
        """Slots of a block that drafts k tokens: `k + 1`, or `k` with `sample_from_anchor`."""
        return k + self.first_draft_slot

    @property
    def max_drafts(self) -> int:
        """Drafts one block of `block_size` slots gives."""
        return self.block_size - self.first_draft_slot

    @property
    def architecture(self) -> str:
        if self.lilicorr:
            return "LiLiCorrDraftModel"
        return "DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"

    @property
    def target_layer_ids(self) -> list[int]:
        """The taps in DFlash semantics (what `dflash_config.target_layer_ids` holds)."""
        return [dflash_id_of_tap(j) for j in self.tap_layer_ids]

    def layer_causal(self, i: int) -> bool:
        """Whether layer i is causal inside the block: the JetSpec option, or a sliding layer."""
        return self.causal_block or self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf(self) -> dict[str, Any]:
        """The engine-facing config.json fields (ours go under `drafttrain`)."""
        t = self.target_layer_ids
        sliding = "sliding_attention" in self.layer_types
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": t}
        dflash["block_size"] = self.block_size
        if self.causal_block:
            # Only `true` is written: vLLM's precedence (is_causal -> dflash_config.causal ->
            # sliding layer => causal) would let an explicit `false` override the sliding
            # layers' causality.
            dflash["causal"] = True
        if self.conv_kernel_size:
            dflash.update(
                conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size
            )
        if self.selector_top_k:
            dflash.update(selector_top_k=self.selector_top_k, selector_rank=self.selector_rank)
        if self.sample_from_anchor:
            dflash["sample_from_anchor"] = True
        if self.layer_types and all(t == "sliding_attention" for t in self.layer_types):
            # vLLM's `use_swa` / `swa_window_size` make *every* layer a window layer: written
            # only when that is true per layer (a mixed drafter says it by `layer_types`).
            dflash.update(use_swa=True, swa_window_size=self.sliding_window)
        if self.lilicorr:
            dflash.update(
                projector_type="lilicorr",
                lilicorr_top_k=self.lilicorr_top_k,
                lilicorr_rank=self.lilicorr_rank,
                lilicorr_layers=self.lilicorr_layers,
                lilicorr_heads=self.lilicorr_heads,
            )
        d = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": dflash,
            # vLLM reads this first and uses it as capture slots: t + 1 (convention 13).
            "eagle_aux_hidden_state_layer_ids": [tap_of_dflash_id(x) for x in t],
        }
        if self.markov_rank:
            d.update(markov_rank=self.markov_rank, markov_head_type=self.markov_head_type)
        if self.confidence_head:
            d["confidence_head"] = True
        if self.confidence_head_with_markov:
            d["confidence_head_with_markov"] = True
        if self.rope_scaling and "mrope_section" in self.rope_scaling:
            d["rope_parameters"] = {"rope_theta": self.rope_theta, **self.rope_scaling}
        return d

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> DFlashConfig:
        """Parse a z-lab layout config.json: the fields engines read, by their rules."""
        try:
            return cls(**cls.hf_fields(d, where))
        except ConfigError as e:
            raise CheckpointError(f"{where}: {e}") from None

    @classmethod
    def hf_fields(cls, d: dict[str, Any], where: str) -> dict[str, Any]:
        dc = require(d, "dflash_config", where)
        if not isinstance(dc, dict):
            raise CheckpointError(f"{where}: dflash_config must be a mapping")
        lilicorr = dc.get("projector_type") == "lilicorr"
        for key, identity in _IDENTITY_FIELDS.items():
            value = dc.get(key, d.get(key, identity))
            if key == "projector_type" and lilicorr:
                continue
            if value != identity:
                raise CheckpointError(
                    f"{where}: {key}={value!r} (a DFlash-family variant this code does not run)"
                )
        if d.get("is_neox_style", True) is not True:
            raise CheckpointError(f"{where}: is_neox_style false (GPT-J RoPE) is not supported")
        if d.get("markov_rank") and d.get("markov_head_type", "vanilla") != "vanilla":
            raise CheckpointError(
                f"{where}: markov_head_type {d['markov_head_type']!r}: vLLM's `dspark` layout "
                "holds the vanilla Markov head only"
            )
        L = int(require(d, "num_target_layers", where))
        t = [int(x) for x in require(dc, "target_layer_ids", f"{where} [dflash_config]")]
        taps = [tap_of_dflash_id(x) for x in t]
        aux = d.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and [int(x) for x in aux] != taps:
            raise CheckpointError(
                f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} != target_layer_ids + 1 "
                f"{taps} (vLLM reads the first, SGLang the second: they must name the same layers)"
            )
        blocks = {int(x) for x in (d.get("block_size"), dc.get("block_size")) if x is not None}
        if len(blocks) != 1:
            raise CheckpointError(
                f"{where}: block_size missing or inconsistent "
                f"(top level {d.get('block_size')}, dflash_config {dc.get('block_size')})"
            )
        num_layers = int(require(d, "num_hidden_layers", where))
        layer_types = list(d.get("layer_types") or ["full_attention"] * num_layers)
        window = d.get("sliding_window")
        if dc.get("use_swa"):  # vLLM: use_swa / swa_window_size force every layer to SWA
            layer_types = ["sliding_attention"] * num_layers
            window = int(require(dc, "swa_window_size", f"{where} [dflash_config]"))
        elif "sliding_attention" not in layer_types:
            window = None
        causal = bool(d.get("is_causal", dc.get("causal", False)))
        names = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
        )
        out = {n: require(d, n, where) for n in names}
        out["rope_scaling"] = d.get("rope_scaling")
        return {
            **out,
            "num_target_layers": L,
            "tap_layer_ids": taps,
            "num_hidden_layers": num_layers,
            "block_size": blocks.pop(),
            "mask_token_id": int(require(dc, "mask_token_id", f"{where} [dflash_config]")),
            "layer_types": layer_types,
            "sliding_window": window,
            "causal_block": causal,
            "conv_kernel_size": int(dc.get("conv_kernel_size", 0)),
            "conv_group_size": int(dc.get("conv_group_size", 16)),
            "selector_top_k": int(dc.get("selector_top_k", 0)),
            "selector_rank": int(dc.get("selector_rank", 256)),
            "sample_from_anchor": bool(dc.get("sample_from_anchor", False)),
            "markov_rank": int(d.get("markov_rank", 0) or 0),
            "markov_head_type": str(d.get("markov_head_type", "vanilla")),
            "confidence_head": bool(d.get("confidence_head", False)),
            "confidence_head_with_markov": bool(d.get("confidence_head_with_markov", False)),
            **(
                {
                    "lilicorr_top_k": int(
                        require(dc, "lilicorr_top_k", f"{where} [dflash_config]")
                    ),
                    "lilicorr_rank": int(require(dc, "lilicorr_rank", f"{where} [dflash_config]")),
                    "lilicorr_layers": int(dc.get("lilicorr_layers", 2)),
                    "lilicorr_heads": int(dc.get("lilicorr_heads", 4)),
                }
                if lilicorr
                else {}
            ),
        }
