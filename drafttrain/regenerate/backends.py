"""Generation backends of regeneration: plain decoding of the target alone (no drafter).

Both take token-id prompts and return, per prompt, the new tokens (the stop token kept last
when the turn stopped) and a finish reason:

- `"stop"`: the target emitted one of the stop ids (its generation config's EOS ids, the
  tokenizer's EOS, and the chat template's end-of-turn token);
- `"length"`: `max_new_tokens` reached, or prompt + response reached `max_model_len`.

`NativeBackend` runs `draftinfer`'s native target (Llama / Qwen2 / Qwen3) through the
runner's plain batched decoding (`greedy_generate`, or `sample_generate` when sampling:
each turn's randomness is keyed by its own seed and positions, so a row's sample does not
depend on the batch). `HFBackend` runs `transformers`' `generate` on left-padded batches
(sampling seeded once per batch with `torch.manual_seed`, so reproducible for the same
batches, which the shard layout fixes). Greedy outputs of the two agree token for token
(tests/train/test_regenerate.py).
"""

from __future__ import annotations

from typing import Any

import torch

from draftinfer.decoding.sampling import SamplingParams
from drafttrain.jobs.errors import ConfigError, TargetError

# A backend's answer for one prompt: (new token ids, finish reason).
Generation = tuple[list[int], str]


def finish(tokens: list[int], stop_ids: set[int]) -> Generation:
    """`tokens` cut after the first stop id, with its finish reason."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def native_supported(target_path: str) -> bool:
    """Whether `draftinfer` has a native class for the target's architecture."""
    import json
    from pathlib import Path

    from draftinfer.files.errors import ConfigError as InferConfigError
    from draftinfer.files.loading import native_class_for
    from draftinfer.files.target_dir import resolve_checkpoint_dir

    try:
        ckpt = resolve_checkpoint_dir(target_path)
        native_class_for(json.loads((Path(ckpt) / "config.json").read_text()))
    except (InferConfigError, OSError, ValueError):
        return False
    return True


class NativeBackend:
    name = "native"

    def __init__(
        self,
        target_path: str,
        device: torch.device,
        dtype: torch.dtype,
        batch_size: int,
        max_model_len: int,
        stop_ids: list[int],
    ):
        from draftinfer.files.loading import load_native_target

        self.model = load_native_target(
            target_path, device, dtype, max_batch=batch_size, max_seq_len=max_model_len
        )
        self.stop_ids = list(stop_ids)
        self.max_model_len = max_model_len

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], max_new_tokens: int
    ) -> list[Generation]:
        from draftinfer.decoding.baseline import greedy_generate, sample_generate

        if all(p.is_greedy for p in params):
            outs = greedy_generate(self.model, prompts, max_new_tokens, self.stop_ids)
        else:
            outs = sample_generate(self.model, prompts, max_new_tokens, self.stop_ids, params)
        stops = set(self.stop_ids)
        return [finish(o, stops) for o in outs]


class HFBackend:
    name = "hf"

    def __init__(
        self,
        target_path: str,
        tcfg: Any,  # drafttrain.jobs.config.TargetConfig
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        stop_ids: list[int],
        pad_id: int,
    ):
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                target_path,
                dtype=dtype,
                trust_remote_code=tcfg.trust_remote_code,
                revision=tcfg.revision,
                attn_implementation=tcfg.attn_implementation,
            )
        except (OSError, ValueError, ImportError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TargetError(f"cannot load target {tcfg.name_or_path!r}: {first}") from None
        self.model = model.to(device).eval().requires_grad_(False)
        self.device, self.max_model_len = device, max_model_len
        self.stop_ids, self.pad_id = list(stop_ids), pad_id

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], max_new_tokens: int
    ) -> list[Generation]:
        from transformers import GenerationConfig

        # Each row may emit up to its own cap; the batch runs to the largest and rows are cut.
        caps = [min(max_new_tokens, self.max_model_len - len(p)) for p in prompts]
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every prompt ends in the last column
            ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p) :] = 1
        p0 = params[0]
        sample = not p0.is_greedy
        gen = GenerationConfig(
            max_new_tokens=max(caps),
            do_sample=sample,
            temperature=p0.temperature if sample else None,
            top_p=p0.top_p if sample else None,
            top_k=(p0.top_k if p0.top_k > 0 else None) if sample else None,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
        )
        if sample:
            torch.manual_seed(p0.seed if p0.seed is not None else 0)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=gen,
        )
        table = out[:, P:].tolist()
        stops = set(self.stop_ids)
        return [finish(row[:cap], stops) for row, cap in zip(table, caps)]


def model_eos_ids(target_path: str, tcfg: Any) -> list[int]:
    """`eos_token_id` of the target's generation config (what `generate` stops on), else of
    its model config; an int or a list in either."""
    from transformers import AutoConfig, GenerationConfig

    kw = {"revision": tcfg.revision, "trust_remote_code": tcfg.trust_remote_code}
    eos = None
    try:
        eos = GenerationConfig.from_pretrained(target_path, revision=tcfg.revision).eos_token_id
    except OSError:  # no generation_config.json
        pass
    if eos is None:
        try:
            eos = AutoConfig.from_pretrained(target_path, **kw).eos_token_id
        except (OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TargetError(f"cannot load the config of {tcfg.name_or_path!r}: {first}") from None
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def pick_backend(name: str, target_path: str, trust_remote_code: bool, revision: str | None) -> str:
    """The backend `regenerate.backend` resolves to (checked before anything is loaded)."""
    if name == "hf":
        return "hf"
    native = not trust_remote_code and revision is None and native_supported(target_path)
    if name == "native" and not native:
        from draftinfer.registry import FAMILIES

        if trust_remote_code:
            why = "target.trust_remote_code is set"
        elif revision is not None:
            why = "target.revision is set (the native loader reads the local snapshot only)"
        else:
            why = f"its architecture is not native ({', '.join(FAMILIES.native_architectures())})"
        raise ConfigError(
            f"regenerate.backend=native cannot run {target_path!r}: {why}; "
            "use regenerate.backend=hf or auto"
        )
    return "native" if native else "hf"
