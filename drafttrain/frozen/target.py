"""The frozen target of training: any HF causal LM behind the target interface
(`draftinfer.models.target`): `forward(inputs, slots, features) -> TargetOutput`.

Features are captured with hooks, so only what the drafter's `FeatureSpec` names is kept
(never every layer's hidden states):
- layer-input tap `j` (DESIGN 3.2): a forward pre-hook on decoder layer `j` records the hidden
  state exactly as the layer receives it. For text models this equals HF's
  `output_hidden_states[j]`; for Qwen3-VL it also holds the DeepStack add, which is why we
  hook instead of reading `hidden_states`;
- final hidden: a pre-hook (`pre_norm`) or forward hook (`post_norm`) on the final norm;
- input embeddings: a pre-hook on layer 0 (what entered the decoder stack).

Slots in training: a right-padded batch, `cache_pos` = the position of real tokens and -1 at
padding (there is no KV cache: -1 becomes the attention mask). RoPE positions are the target's
own (`rope_pos`, returned), which the objectives use instead of the collator's.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from draftinfer.conventions.slots import Slots
from draftinfer.files.paths import resolve_path
from draftinfer.models.target import FeatureSpec, TargetInfo, TargetInputs, TargetOutput, as_inputs
from draftinfer.registry import FAMILIES
from drafttrain.frozen.head import HeadLogits, TargetHead, TrainTargetOutput
from drafttrain.jobs.errors import TargetError

if TYPE_CHECKING:  # annotations only
    from drafttrain.jobs.config import TargetConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise TargetError(f"target.dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _is_hub_id(path: str) -> bool:
    """`org/name` with no leading `.`, `/` or `~`: something `from_pretrained` may fetch."""
    return bool(_HUB_ID.match(path))


def is_hub_id(name: str) -> bool:
    """Whether `name` names a Hub repository (`org/name`), not a local path or a zoo name."""
    return _is_hub_id(name) and not Path(name).expanduser().exists()


def resolve_target_path(name_or_path: str) -> str:
    """`zoo:` shorthand resolved; a one-line `TargetError` for a local path that is missing."""
    path = resolve_path(name_or_path)
    if not Path(path).expanduser().exists() and not _is_hub_id(path):
        raise TargetError(
            f"target not found: {name_or_path!r} is neither a local directory "
            "nor a hub id (org/name)"
        )
    return path


def load_tokenizer(name_or_path: str):
    """The target's tokenizer; a one-line `TargetError` when it cannot be loaded."""
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TargetError(f"cannot load the tokenizer of {name_or_path!r}: {first}") from None


def load_target_config(
    name_or_path: str, revision: str | None = None, trust_remote_code: bool = False
):
    """The target's transformers config (no weights); a one-line `TargetError` when it cannot be
    loaded."""
    from transformers import AutoConfig

    path = resolve_target_path(name_or_path)
    try:
        return AutoConfig.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TargetError(f"cannot load the config of {name_or_path!r}: {first}") from None


def read_input_embedding(name_or_path: str) -> torch.Tensor:
    """The target's input embedding `[V, H]`, read from its safetensors alone (no model is
    built): the `embed_tokens.weight` outside any decoder layer (`model.embed_tokens.weight`,
    `model.language_model.embed_tokens.weight`, ...). One-line errors when absent."""
    from safetensors import safe_open

    from draftinfer.files.target_dir import resolve_checkpoint_dir, weight_files

    ckpt = resolve_checkpoint_dir(resolve_target_path(name_or_path))
    for path in weight_files(ckpt):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = [
                n for n in f.keys() if n.endswith("embed_tokens.weight") and ".layers." not in n
            ]
            if names:
                return f.get_tensor(min(names, key=len))
    raise TargetError(
        f"no input embedding (embed_tokens.weight) in the weights of {name_or_path!r}"
    )


def load_target_model(
    cfg: TargetConfig, device: torch.device, auto_class: str = "AutoModelForCausalLM"
) -> nn.Module:
    """`from_pretrained` of transformers' `auto_class` in eval mode with grads off; a one-line
    `TargetError` on failure."""
    import transformers

    path = resolve_target_path(cfg.name_or_path)
    try:
        model = getattr(transformers, auto_class).from_pretrained(
            path,
            dtype=resolve_dtype(cfg.dtype, device),
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision,
            attn_implementation=cfg.attn_implementation,
        )
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot load target {cfg.name_or_path!r}: {first}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM (Llama, Qwen2/3, Mistral, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TargetError(f"target {type(model).__name__} has no decoder `layers`; unsupported")
    return layers


def batch_slots(batch: dict[str, torch.Tensor]) -> Slots:
    """Slots of a right-padded training batch: real tokens at their positions, -1 at padding."""
    B = batch["input_ids"].shape[0]
    rows = torch.arange(B, device=batch["input_ids"].device)
    return Slots(rows, torch.where(batch["attention_mask"].bool(), batch["position_ids"], -1))


class FrozenTarget:
    """Frozen HF target + feature capture. Call it on a padded batch of slots.

    A target family (`drafttrain.families`) subclasses it for what differs: the transformers
    auto class that loads it, where its text decoder and text config live, the extra batch
    inputs it takes (`input_keys`), the RoPE positions it uses and which slots hold encoder
    embeddings (`model_positions`, `multimodal_mask`). `config` is the *text* config (sizes,
    rope) a drafter is derived from."""

    auto_class = "AutoModelForCausalLM"
    # Batch keys passed to the model besides `input_ids` (`TargetInputs.extra`).
    input_keys: tuple[str, ...] = ()

    def __init__(self, cfg: TargetConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.model = load_target_model(cfg, device, self.auto_class)
        self.config = self.text_config()
        self.layers = decoder_layers(self.model)
        self.final_norm = getattr(self.model.get_decoder(), "norm", None)
        # RoPE axes only (the HF model applies its own rotary, whatever its type): a drafter
        # that re-implements the rotary parses it strictly itself (`draftinfer.models.rope`).
        params = getattr(self.config, "rope_parameters", None) or {}
        scaling = getattr(self.config, "rope_scaling", None) or {}
        mrope = "mrope_section" in params or "mrope_section" in scaling
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos is None:
            raise TargetError(f"target {cfg.name_or_path!r}: config has no max_position_embeddings")
        archs = getattr(self.model.config, "architectures", None) or [type(self.model).__name__]
        architecture = archs[0]
        self.info = TargetInfo(
            vocab_size=int(self.model.get_output_embeddings().weight.shape[0]),
            hidden_size=int(self.config.hidden_size),
            num_layers=len(self.layers),
            max_position_embeddings=int(max_pos),
            rope_axes=3 if mrope else 1,
            architecture=architecture,
            family=FAMILIES.for_architectures([architecture]).name,
        )
        # The head training computes the target's distribution with (`batch_output`); None:
        # the model's own logits are used (no final norm to hook, or a head with a bias).
        self.head = None
        if self.final_norm is not None:
            try:
                self.head = TargetHead.of(self, "post_norm")
            except TargetError:
                pass
        self._head_checked = False
        self._takes_logits_to_keep = (
            "logits_to_keep" in inspect.signature(self.model.forward).parameters
        )

    def text_config(self):
        """The config of the text decoder (the whole model's config for a causal LM)."""
        return self.model.config

    # -- shared weights -------------------------------------------------------------------
    def shared_weights(self) -> dict[str, torch.Tensor]:
        return {
            "input_embeddings": self.model.get_input_embeddings().weight,
            "output_embeddings": self.model.get_output_embeddings().weight,
        }

    def final_norm_weight(self) -> torch.Tensor | None:
        return None if self.final_norm is None else self.final_norm.weight

    # -- the target interface ---------------------------------------------------------------
    def batch_output(self, batch: dict[str, torch.Tensor], features: FeatureSpec) -> TargetOutput:
        """The output for a collated training batch (`input_ids`, `attention_mask`,
        `position_ids`, plus the family's `input_keys`; `index` = dataset rows, which only a
        feature cache reads): a `TrainTargetOutput` whose logits are left to its `head` (the
        final hidden state and the output embedding, `drafttrain.frozen.head`), so no
        `[B, T, V]` logits are ever computed for training."""
        extra = {k: batch[k] for k in self.input_keys if k in batch}
        inputs, slots = TargetInputs(batch["input_ids"], extra), batch_slots(batch)
        return self._run(inputs, slots, features, full_logits=self.head is None)

    def for_split(self, split: str) -> FrozenTarget:
        """The target for the rows of a dataset split: the live target answers any batch (a
        feature cache, `drafttrain.cache.CachedTarget`, answers only the splits it stored)."""
        return self

    def rope_positions(self, cache_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        pos = cache_pos.clamp(min=0)
        return pos if self.info.rope_axes == 1 else pos[None].expand(3, *pos.shape)

    def model_positions(self, inputs: TargetInputs, slots: Slots) -> torch.Tensor:
        """The RoPE positions the model runs at when the slots carry none: `[B, T]` (or
        `[3, B, T]`), handed to the model as `position_ids` and returned as used."""
        return self.rope_positions(slots.cache_pos, slots.rows)

    def multimodal_mask(self, inputs: TargetInputs, slots: Slots) -> torch.Tensor | None:
        """`[B, T]` bool: slots whose input embedding an encoder wrote (`TargetOutput.mm_mask`);
        None for a text target."""
        return None

    @torch.no_grad()
    def forward(
        self,
        inputs: TargetInputs | torch.Tensor,
        slots: Slots,
        features: FeatureSpec | None = None,
    ) -> TargetOutput:
        """Logits `[B, T, V]` fp32, the requested features `[B, T, F]`, the RoPE positions
        used and the input embeddings, for a right-padded batch (`cache_pos` -1 = padding)."""
        return self._run(as_inputs(inputs), slots, features, full_logits=True)

    @torch.no_grad()
    def _run(
        self,
        inp: TargetInputs,
        slots: Slots,
        features: FeatureSpec | None,
        full_logits: bool,
    ) -> TargetOutput:
        """`forward`, or (`full_logits=False`) a `TrainTargetOutput` carrying the post-norm
        final hidden state and the head instead of logits (the model's head then runs on the
        last position only, `logits_to_keep=1`)."""
        if features is not None:
            features.check(self.info.num_layers)
            if features.final_hidden is not None and self.final_norm is None:
                raise TargetError(f"target {type(self.model).__name__} has no final `norm`")
        rope_pos = slots.rope_pos
        if rope_pos is None:
            rope_pos = self.model_positions(inp, slots)
        captured: dict[object, torch.Tensor] = {}

        def pre_hook(key):
            def hook(_mod, args, kwargs):
                captured[key] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

            return hook

        def post_hook(key):
            return lambda _m, _a, out: captured.__setitem__(key, out)

        handles = [self.layers[0].register_forward_pre_hook(pre_hook("embeds"), with_kwargs=True)]
        wanted = features.layer_inputs if features is not None else ()
        for j in set(wanted):
            handles.append(self.layers[j].register_forward_pre_hook(pre_hook(j), with_kwargs=True))
        final = features.final_hidden if features is not None else None
        if final == "pre_norm":
            handles.append(
                self.final_norm.register_forward_pre_hook(pre_hook(final), with_kwargs=True)
            )
        elif final == "post_norm":
            handles.append(self.final_norm.register_forward_hook(post_hook(final)))
        kwargs = {}
        if not full_logits:
            handles.append(self.final_norm.register_forward_hook(post_hook("head")))
            if self._takes_logits_to_keep:
                kwargs["logits_to_keep"] = 1
        try:
            out = self.model(
                input_ids=inp.input_ids,
                attention_mask=(slots.cache_pos >= 0).long(),
                position_ids=rope_pos,
                use_cache=False,
                **inp.extra,
                **kwargs,
            )
        finally:
            for h in handles:
                h.remove()
        feats = None
        if features is not None:
            parts = [captured[j] for j in wanted] + ([captured[final]] if final else [])
            feats = torch.cat(parts, dim=-1)
        rest = (feats, rope_pos, captured["embeds"], self.multimodal_mask(inp, slots))
        if full_logits:
            return TargetOutput(out.logits.float(), *rest)
        head = HeadLogits(captured["head"], self.head)
        if not self._head_checked:
            self._check_head(head, out.logits[:, -1])
        return TrainTargetOutput(None, *rest, head=head)

    def _check_head(self, head: HeadLogits, last: torch.Tensor) -> None:
        """Once: the head's logits at the last position equal the model's own (`last`
        `[B, V]`), i.e. the model's logits are `lm_head(final_norm output)` (a head that does
        more, e.g. a logit scale, cannot be recomputed from the final hidden state)."""
        got = head.head.logits(head.hidden[:, -1]).float()
        ref = last.float()
        err = float((got - ref).abs().max()) if ref.numel() else 0.0
        if err > 1e-2 * float(ref.abs().max()) + 1e-4:
            raise TargetError(
                f"the target's logits are not lm_head(final_norm(h)) (max difference {err:.3g}):"
                " its head does more (scaling) than drafttrain.frozen.head computes"
            )
        self._head_checked = True

    __call__ = forward
