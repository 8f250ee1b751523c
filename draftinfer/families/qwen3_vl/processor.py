"""Image+text conversations -> the inputs of a vision-language target (Qwen3-VL), through the
target's own processor: shared by training (`drafttrain.families.qwen3_vl.data`) and the runner's prompts.

    processor = load_processor("zoo:qwen3-vl-tiny")
    enc = conversation_inputs(processor, messages, add_generation_prompt=True,
                              base_dir=Path(resolve_path("zoo:vl_caption")), sample="test row 3")
    enc["input_ids"]          # list[int] [T], image pads already expanded by the processor
    enc["pixel_values"]       # Tensor [sum(t*h*w), C * temporal_patch * patch**2] or None
    enc["image_grid_thw"]     # Tensor [n_images, 3] or None
    enc["mm_token_type_ids"]  # list[int] [T]: 0 text, 1 image, 2 video

A conversation is a list of messages in the `messages` format (`draftinfer.evaluation.chat`); a message's
`content` is a string or a list of parts `{"type": "text", "text": ...}` /
`{"type": "image", "image": REF}`. An image REF is a local path (relative paths are relative
to `base_dir`, the folder of the data file), a PIL image, or a Hugging Face `datasets` Image
feature (a decoded PIL image, or `{"bytes": ..., "path": ...}` when not decoded). Remote URLs
are not fetched (training and the runner work offline). Every image is decoded the way
transformers' `load_image` does (EXIF orientation, RGB).

The text is the processor's chat template rendered as a string (`apply_chat_template(...,
tokenize=False)`), then the processor proper (`processor(text=..., images=...)`) runs the
image processor, repeats each image placeholder to the image's token count and tokenizes,
without adding special tokens (the template writes them): exactly what
`apply_chat_template(..., tokenize=True)` gives, with the rendered text kept so training can
map character spans to tokens (`encode_conversation(..., offsets=True)`).

Errors a user can cause (a missing or unreadable image, a placeholder/image count mismatch)
are one-line `DataError`s that name the sample.
"""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftinfer.files.errors import DataError

# Part keys that may hold an image, in the order processors read them.
_IMAGE_KEYS = ("image", "url", "path", "image_url")
# What an image part carries while the template renders it: the template only tests that
# the part is an image, so the (possibly large) image object never enters jinja.
_RENDER_REF = "<image>"


def _one_line(text: Any, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --------------------------------------------------------------------------- processor


@functools.cache
def _image_only_class() -> type:
    from transformers import Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        """`Qwen3VLProcessor` without a video processor (its attributes come from `__init__`'s
        parameters, so `ProcessorMixin` expects only these two)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(
                image_processor, tokenizer, None, chat_template=chat_template, **kwargs
            )

    ImageOnlyQwen3VLProcessor.__module__ = __name__
    ImageOnlyQwen3VLProcessor.__qualname__ = "ImageOnlyQwen3VLProcessor"
    return ImageOnlyQwen3VLProcessor


def __getattr__(name: str):
    # The class is built on first use (transformers' Qwen3-VL import is not free) and found by
    # name, so a processor instance pickles (datasets' multiprocess map, fingerprints).
    if name == "ImageOnlyQwen3VLProcessor":
        return _image_only_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _image_only_processor(path: str):
    """A `Qwen3VLProcessor` without its video processor: transformers 5 cannot build the video
    processor without torchvision, and nothing here feeds videos. Same tokenizer, image
    processor and chat template as `AutoProcessor` would load."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.utils import cached_file

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    template = None
    for name in ("chat_template.jinja", "chat_template.json"):
        file = cached_file(path, name, _raise_exceptions_for_missing_entries=False)
        if file:
            text = Path(file).read_text(encoding="utf-8")
            if name.endswith(".json"):
                import json

                text = json.loads(text)["chat_template"]
            template = text
            break
    template = template or getattr(tokenizer, "chat_template", None)
    return _image_only_class()(image_processor, tokenizer, chat_template=template)


def load_processor(name_or_path: str):
    """The target's processor (`AutoProcessor`), from a local directory, `zoo:<name>` or a hub
    id. Where `AutoProcessor` fails only for want of a video processor (transformers 5 needs
    torchvision for it), the same processor without video support. A one-line `DataError`
    when neither loads."""
    from transformers import AutoProcessor

    from draftinfer.files.paths import resolve_path

    path = os.path.expanduser(resolve_path(name_or_path))
    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as auto_err:  # noqa: BLE001 - many types (OSError, ValueError, ImportError)
        try:
            return _image_only_processor(path)
        except Exception:  # noqa: BLE001
            raise DataError(
                f"cannot load the processor of {name_or_path!r}: {_one_line(auto_err)}"
            ) from None


# --------------------------------------------------------------------------- images


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image parts of a conversation, in prompt order (videos are refused)."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "video" or (kind is None and "video" in part):
                raise DataError("video parts are not supported (images only)")
            if kind == "image" or (kind is None and any(k in part for k in _IMAGE_KEYS)):
                out.append(part)
    return out


def image_ref(part: dict[str, Any]) -> Any:
    for key in _IMAGE_KEYS:
        if part.get(key) is not None:
            ref = part[key]
            if key == "image_url" and isinstance(ref, dict):  # OpenAI {"url": ...}
                ref = ref.get("url")
            return ref
    return None


def _describe(ref: Any) -> str:
    if isinstance(ref, (str, os.PathLike)):
        return repr(str(ref))
    if isinstance(ref, dict):
        return repr(ref.get("path")) if ref.get("path") else "embedded bytes"
    return type(ref).__name__


def load_image(ref: Any, base_dir: Path | None, sample: str):
    """An image REF (module docstring) decoded to an RGB PIL image; `DataError` naming the
    sample when it is missing or unreadable."""
    from PIL import Image, ImageOps

    try:
        if isinstance(ref, dict) and ref.get("bytes") is not None:
            img = Image.open(io.BytesIO(ref["bytes"]))
        elif isinstance(ref, dict) and ref.get("path"):
            return load_image(ref["path"], base_dir, sample)
        elif isinstance(ref, (str, os.PathLike)):
            text = str(ref)
            if text.startswith(("http://", "https://")):
                raise DataError(f"{sample}: remote image {text!r} is not fetched (offline)")
            path = Path(text.removeprefix("file://")).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise DataError(f"{sample}: image {text!r} not found (looked at {str(path)!r})")
            img = Image.open(path)
        elif isinstance(ref, Image.Image):
            img = ref
        else:
            raise DataError(
                f"{sample}: an image part holds {type(ref).__name__}; expected a path, a PIL "
                "image or a datasets Image feature"
            )
        img.load()  # decode now: a truncated file fails here, naming the sample
        return ImageOps.exif_transpose(img).convert("RGB")
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad files
        raise DataError(f"{sample}: cannot read image {_describe(ref)}: {_one_line(e)}") from None


def conversation_images(messages: list[dict[str, Any]], base_dir: Path | None, sample: str):
    """The decoded images of a (normalized) conversation, in prompt order."""
    try:
        parts = image_parts(messages)
    except DataError as e:
        raise DataError(f"{sample}: {e}") from None
    images = []
    for part in parts:
        ref = image_ref(part)
        if ref is None:
            raise DataError(f"{sample}: an image part has no image (keys: {sorted(part)})")
        images.append(load_image(ref, base_dir, sample))
    return images


# --------------------------------------------------------------------------- encoding


@dataclass
class Encoded:
    """A conversation through the processor.

    text: the chat template's rendering (image placeholders not yet expanded);
    input_ids / mm_token_type_ids: `[T]`; offsets: `[T]` (start, end) character spans of the
    *expanded* text (placeholders repeated), when asked for; pixel_values
    `[sum(t*h*w), D]` and image_grid_thw `[n_images, 3]`, None without images;
    image_token: the placeholder string the processor expands."""

    text: str
    input_ids: list[int]
    mm_token_type_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    offsets: list[tuple[int, int]] | None
    image_token: str

    def as_inputs(self) -> dict[str, Any]:
        return {
            "input_ids": self.input_ids,
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": self.mm_token_type_ids,
        }


def render_conversation(
    processor,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
):
    """The chat template's text for `messages` (images stand as placeholders); `template_kwargs`
    go to the template (e.g. `enable_thinking`)."""
    if getattr(processor, "chat_template", None) is None:
        raise DataError("the processor has no chat template; VL data needs one")
    shown = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            content = [
                {**p, **{k: _RENDER_REF for k in _IMAGE_KEYS if k in p}}
                if isinstance(p, dict)
                else p
                for p in content
            ]
            msg = {**msg, "content": content}
        shown.append(msg)
    return processor.apply_chat_template(
        shown,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )


def encode_conversation(
    processor,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    base_dir: Path | None,
    sample: str,
    offsets: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> Encoded:
    """`messages` rendered, its images loaded and the whole run through the processor."""
    from draftinfer.evaluation.chat import normalize_messages

    try:
        messages = normalize_messages(messages)
    except DataError as e:
        raise DataError(f"{sample}: {e}") from None
    images = conversation_images(messages, base_dir, sample)
    try:
        text = render_conversation(processor, messages, add_generation_prompt, template_kwargs)
    except DataError as e:
        raise DataError(f"{sample}: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja errors
        raise DataError(f"{sample}: the chat template failed: {_one_line(e)}") from None
    kwargs: dict[str, Any] = {"add_special_tokens": False}
    if offsets:
        kwargs["return_offsets_mapping"] = True
    try:
        enc = processor(text=[text], images=images or None, **kwargs)
    except Exception as e:  # noqa: BLE001 - e.g. placeholder count != image count
        raise DataError(f"{sample}: the processor refused it: {_one_line(e)}") from None
    ids = [int(t) for t in enc["input_ids"][0]]
    if "mm_token_type_ids" in enc:
        types = [int(t) for t in enc["mm_token_type_ids"][0]]
    else:  # a processor that does not return them: the ids say it (0 text, 1 image)
        types = [int(t == processor.image_token_id) for t in ids]
    pixels = grid = None
    if images:
        pixels = torch.as_tensor(enc["pixel_values"])
        grid = torch.as_tensor(enc["image_grid_thw"]).long()
    return Encoded(
        text=text,
        input_ids=ids,
        mm_token_type_ids=types,
        pixel_values=pixels,
        image_grid_thw=grid,
        offsets=[(int(a), int(b)) for a, b in enc["offset_mapping"][0]] if offsets else None,
        image_token=processor.image_token,
    )


def conversation_inputs(
    processor,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    base_dir: Path | None,
    sample: str,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`input_ids` (list[int] [T]), `pixel_values` (Tensor [N, D] or None), `image_grid_thw`
    (Tensor [n_images, 3] or None) and `mm_token_type_ids` (list[int] [T]) of a conversation
    (module docstring); `sample` names it in errors (e.g. "test row 3")."""
    return encode_conversation(
        processor,
        messages,
        add_generation_prompt=add_generation_prompt,
        base_dir=base_dir,
        sample=sample,
        template_kwargs=template_kwargs,
    ).as_inputs()


class ProcessorPromptEncoder:
    """The runner's prompts one conversation at a time through the target's processor, loaded
    once (`FamilySpec.prompt_encoder`): `encode` gives a `draftinfer.evaluation.prompts.Prompt` whose
    `mm_inputs` hold the image inputs (None for a text-only conversation)."""

    def __init__(self, target_path: str):
        self.processor = load_processor(target_path)
        self.tokenizer = self.processor.tokenizer

    def encode(
        self,
        conv: list[dict[str, Any]],
        name: str = "",
        template_kwargs: dict[str, Any] | None = None,
        base_dir: Path | None = None,
    ):
        from draftinfer.evaluation.prompts import Prompt

        enc = conversation_inputs(
            self.processor,
            conv,
            add_generation_prompt=True,
            base_dir=base_dir,
            sample=name,
            template_kwargs=template_kwargs,
        )
        ids = [int(t) for t in enc.pop("input_ids")]
        return Prompt(ids, enc if enc["pixel_values"] is not None else None, name)
