"""Images into a prompt: loading (PIL images, bytes, local paths, data URLs, http(s) URLs), the checkpoint's own image
processor (transformers', named by its preprocessor_config.json), the placeholder tokens each image expands to, and
the M-RoPE positions of the whole prompt.

A prompt holds one `<|image_pad|>` per image (the chat template writes `<|vision_start|><|image_pad|><|vision_end|>`
for each image part); each becomes as many image tokens as the image has merged patches, t * h * w / merge^2 for
its (t, h, w) patch grid. The model puts one vision-tower feature row in place of each image token's embedding.

Positions (transformers' `get_rope_index`): three rows (t, h, w). A text token at offset i after the previous item
has all three at p + i; an image starting at p takes (p + t', p + h', p + w') over its merged grid (t', h', w'), and
the text after it starts at p + max(h', w'). After the prompt every row is the token's index plus `delta` (the
prompt's largest position + 1 - its length).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import VisionConfig

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
HTTP_TIMEOUT_S = 10.0
MAX_IMAGE_BYTES = 64 << 20


class ImageError(ValueError):
    """An image could not be used; `field` names where it came from (e.g. messages[0].content[1].image_url)."""

    def __init__(self, field_name: str, reason: str):
        self.field, self.reason = field_name, reason
        super().__init__(f"{field_name}: {reason}")


def load_image(source, field_name: str = "image"):
    """A PIL image (RGB) from a PIL image, bytes, a local path, a `data:image/...;base64,` URL, a `file://` URL or an
    http(s) URL. Raises ImageError naming `field_name` and the problem."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif isinstance(source, str):
            data = _read_url_or_path(source, field_name)
        else:
            raise ImageError(field_name, f"expected a PIL image, bytes, a path or a URL, got {type(source).__name__}")
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise ImageError(field_name, f"the data is not a readable image ({type(e).__name__}: {e})") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def _read_url_or_path(url: str, field_name: str) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        head, sep, payload = url.partition(",")
        if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
            raise ImageError(field_name, "a data URL must be data:image/<format>;base64,<data>")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(field_name, f"the data URL's base64 is invalid ({e})") from None
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
                data = r.read(MAX_IMAGE_BYTES + 1)
        except (OSError, ValueError) as e:
            raise ImageError(field_name, f"could not fetch {url!r} ({e})") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(field_name, f"the image at {url!r} is larger than {MAX_IMAGE_BYTES} bytes")
        return data
    if scheme == "file":
        url = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    elif scheme:
        raise ImageError(field_name, f"unsupported URL scheme {scheme!r} (expected data, http, https or file)")
    if not os.path.isfile(url):
        raise ImageError(field_name, f"no such file {url!r}")
    with open(url, "rb") as f:
        return f.read()


class ImageProcessor:
    """The checkpoint's image processor (transformers' class named by its preprocessor_config.json), resizing and
    normalizing as the model was trained."""

    def __init__(self, processor, vision: VisionConfig):
        self.processor, self.vision = processor, vision

    @classmethod
    def from_dir(cls, model_dir: str, vision: VisionConfig) -> ImageProcessor:
        from transformers import AutoImageProcessor

        if not os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            raise FileNotFoundError(f"no preprocessor_config.json in {model_dir!r}: the vision tower needs the "
                                    f"checkpoint's image processor")
        return cls(AutoImageProcessor.from_pretrained(model_dir), vision)

    def __call__(self, images: list) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """(pixel_values [patches, patch_dim] fp32, (t, h, w)) of each PIL image."""
        if not images:
            return []
        out = self.processor(images=images, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        pixels = out["pixel_values"]
        if pixels.shape[-1] != self.vision.patch_dim:
            raise ValueError(f"preprocessor_config.json: patches of {pixels.shape[-1]} values, the vision tower "
                             f"takes {self.vision.patch_dim}")
        sizes = [t * h * w for t, h, w in grids]
        return list(zip(torch.split(pixels, sizes), grids))


class MultiModalProcessor:
    """A prompt's token ids and images -> the expanded token ids and their MultiModalState."""

    def __init__(self, vision: VisionConfig, processor: ImageProcessor | None, limit: int | None = None):
        """limit: the most images of one prompt (--limit-mm-per-prompt), None for any number."""
        self.vision, self.processor, self.limit = vision, processor, limit

    def prepare(self, token_ids: list[int], images: list, field_name: str = "multi_modal_data.image",
                image_fields: list[str] | None = None) -> tuple[list[int], MultiModalState]:
        """images: PIL images, bytes, paths or URLs; image_fields: the field each came from (errors name it)."""
        if self.limit is not None and len(images) > self.limit:
            raise ImageError(field_name, f"{len(images)} images in one prompt, more than the {self.limit} that "
                                         f"--limit-mm-per-prompt allows")
        if self.processor is None:
            raise ImageError(field_name, "the model has no image processor (preprocessor_config.json)")
        fields_ = image_fields or [f"{field_name}[{i}]" if len(images) > 1 else field_name
                                   for i in range(len(images))]
        pil = [load_image(x, f) for x, f in zip(images, fields_)]
        return expand_placeholders(token_ids, self.processor(pil), self.vision, field_name)


@dataclass
class ImageItem:
    offset: int  # first image token of the image in the prompt
    length: int  # its image tokens (merged patches)
    pixel_values: torch.Tensor  # [patches, patch_dim]
    grid_thw: tuple[int, int, int]
    content_hash: str  # of the pixels and grid: the same image gives the same features


@dataclass
class MultiModalState:
    """A request's images and M-RoPE positions, and the features of images whose tokens the prefill has not consumed
    yet (computed once per image by the vision tower, dropped once its last token is in the caches)."""

    images: list[ImageItem]
    positions: np.ndarray  # [3, prompt_len] int64
    delta: int  # positions of token i >= prompt_len are i + delta
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> [length, hidden]

    def rope_positions(self, logical: np.ndarray) -> np.ndarray:
        """[3, n] positions of the tokens at logical indices `logical`."""
        p = self.positions.shape[1]
        out = np.empty((3, len(logical)), dtype=np.int64)
        inside = logical < p
        out[:, inside] = self.positions[:, logical[inside]]
        out[:, ~inside] = logical[~inside] + self.delta
        return out

    def images_in(self, start: int, end: int) -> list[int]:
        """Indices of the images with tokens in [start, end)."""
        return [i for i, im in enumerate(self.images) if im.offset < end and im.offset + im.length > start]

    def extra_keys(self, start: int, end: int) -> tuple[str, ...]:
        """What besides token ids determines the cache content of tokens [start, end): the content hashes of the
        images among them (image tokens all have the same id). A prefix cache keys its pages on these too."""
        return tuple(self.images[i].content_hash for i in self.images_in(start, end))

    def release_consumed(self, computed: int) -> None:
        """Drops the features of images whose tokens are all before `computed`."""
        for i in [i for i in self.features if self.images[i].offset + self.images[i].length <= computed]:
            del self.features[i]


def mrope_positions(token_ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                    merge: int) -> tuple[np.ndarray, int]:
    """([3, len] positions, delta) of a prompt whose runs of image_token_id are the images of `grids` in order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    is_image = ids == image_token_id
    pos, i, k = 0, 0, 0
    n = len(ids)
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = np.arange(j - i) + pos
            pos += j - i
            i = j
            continue
        t, h, w = grids[k]
        k += 1
        gt, gh, gw = t, h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        length = gt * gh * gw
        out[0, i:i + length] = tt.reshape(-1) + pos
        out[1, i:i + length] = hh.reshape(-1) + pos
        out[2, i:i + length] = ww.reshape(-1) + pos
        pos += max(gh, gw)
        i += length
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta


def expand_placeholders(token_ids: list[int], items: list[tuple[torch.Tensor, tuple[int, int, int]]],
                        vision: VisionConfig, field_name: str = "prompt") -> tuple[list[int], MultiModalState]:
    """The prompt with each image's one image token repeated to its feature count, and its MultiModalState.
    Raises ImageError when the prompt's placeholders and the images differ in number."""
    pad = vision.image_token_id
    places = [i for i, t in enumerate(token_ids) if t == pad]
    if len(places) != len(items):
        raise ImageError(field_name, f"{len(places)} image placeholders ({IMAGE_PLACEHOLDER}) for {len(items)} "
                                     f"images: the prompt needs one per image")
    merge2 = vision.spatial_merge_size ** 2
    out: list[int] = []
    images = []
    prev = 0
    for place, (pixels, grid) in zip(places, items):
        out += token_ids[prev:place]
        length = grid[0] * grid[1] * grid[2] // merge2
        digest = hashlib.sha256(repr(grid).encode())
        digest.update(pixels.contiguous().numpy().tobytes())
        images.append(ImageItem(len(out), length, pixels, grid, digest.hexdigest()))
        out += [pad] * length
        prev = place + 1
    out += token_ids[prev:]
    positions, delta = mrope_positions(out, [im.grid_thw for im in images], pad, vision.spatial_merge_size)
    return out, MultiModalState(images, positions, delta)
