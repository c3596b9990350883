"""A VLM's two GGUF files checked by llama.cpp's multimodal tool against transformers, on an image.

Reading the projector back (``verify.verify_gguf``) proves its tensors are the checkpoint's; it
cannot prove llama.cpp runs them as transformers does (the image preprocessing, the pooling, the
special tokens around the image, the attention over image positions). So the job runs
``llama-mtmd-cli`` on the text model, the projector, a fixed image (:func:`fixed_image`: a
deterministic RGB pattern drawn at the vision tower's own input size, so neither side resamples
it) and each of two prompts, greedy, and compares its output with transformers' greedy
continuation of the same token sequence.

**The prompts, as people send them** (:func:`prompts`): the image right after BOS, then
:data:`PROMPT` (``image_first``); and one user turn of the checkpoint's own chat template (the
processor's, else the tokenizer's), rendered by transformers with the image and then
:data:`PROMPT` inside the turn and the generation prompt after it (``chat_turn``,
:func:`chat_prompt`). The tool is given the text around the image exactly
(``mtmd_session``), and mtmd wraps the image in the family's markers (:data:`LAYOUTS`; Gemma 3:
``<start_of_image>`` + one embedding per soft token + ``<end_of_image>``; Idefics3: the image as
one tile after ``<fake_token_around_image><row_1_col_1>``, then as the overview after a
two-newline token and ``<fake_token_around_image><global-img>``; Pixtral, under LLaVA or Mistral
3: the rows of patches with an ``[IMG_BREAK]`` after each row but the last, then
``[IMG_END]``). The sequence is llama.cpp's: the text around the image as ``llama-tokenize``
reads it (special tokens parsed, as mtmd does) and the family's layout around the image, and
transformers is given those ids, the image's ``pixel_values`` from the checkpoint's own image
processor (one frame per frame mtmd encodes), and generates greedily in float32, the whole
model in memory: the plan counts it (``gguf.plan``), so a VLM too large for it is refused at
submission.

**The bound, the exact/quality split of the checks.** llama.cpp's output must equal
transformers' :data:`TOKENS` greedy tokens (compared as bytes: llama.cpp prints token pieces,
which may split a UTF-8 character). Where it diverges at a step whose transformers lead (top-1
minus top-2 logit) is at least :data:`NEAR_TIE`, the check fails: an f16 file moves llama.cpp's
logits by about 1e-3 to 1e-2 of their scale against float32 transformers (the text logit checks
measure it, ``service.verification.logits``), so such a lead cannot flip through rounding,
while a wrong projector moves every image-conditioned logit by O(1) (a q8_0 file's bound is
:data:`Q8_0_NEAR_TIE`, :func:`tie_bound`). Where it diverges at a near tie, greedy comparison after it means nothing (each side continues its own text), so the rest
is compared **teacher-forced**: llama-mtmd-cli is given transformers' tokens up to each step
and must choose transformers' token there, or one within :data:`NEAR_TIE` of it
(:func:`teacher_forced`). A continuation llama.cpp cannot be fed as text (it splits a UTF-8
character, or its tokenizer does not read it back as the same ids) is inconclusive: no evidence
either way, so that prompt is run again on the next of :data:`PROBE_IMAGES` fixed images (the
pattern's phase and colours moved), and the job fails typed only when every one is
inconclusive. A disagreement on any image fails it at once; nothing passes without 16
compared tokens.

Why one module of over 450 lines: it is one consumer's check whose parts must agree token for
token: each family's image layout (:data:`LAYOUTS`, a few lines of the table each), the prompts,
transformers' greedy reference built to llama.cpp's sequence and the comparison. Apart, a
family's layout would sit away from the reference that must follow it. The tool's side (the
chat session, ``llama-tokenize``) is ``mtmd_session``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import VerificationFailed, VerificationInconclusive
from service.exporters.gguf.mtmd_session import llama_ids, run_session

TOKENS = 16
"""Greedy tokens generated on each side."""
NEAR_TIE = 0.05
"""transformers' top-1 minus top-2 logit below which a step may legitimately differ."""
Q8_0_NEAR_TIE = 0.3
"""The same for a q8_0 text model (its projector f16): 8-bit blocks move the tiny models' logits by
far more than f16 does (their greedy tokens parted from float32 transformers' at leads of 0.13
and 0.15 on Qwen2.5-VL and SmolVLM, f16 agreeing), still well under the O(1) of a wrong
projector. The q8_0 check is the quality half of the split, the f16 one the exact half."""
PROMPT = "Describe the image."
PROBE_IMAGES = 3
"""Fixed images a prompt is tried on until one comparison is conclusive (:func:`fixed_image`'s
variants): a tiny random model's greedy text is often byte tokens, whose near ties split
characters; a real model's rarely is, and its first image decides."""


IMAGE = None
"""In a :class:`Layout`'s pieces: where one frame's embeddings go."""


@dataclass(frozen=True)
class Layout:
    """How mtmd lays out one image of a family in the token sequence, on the fixed image."""

    pieces: tuple[str | None, ...]
    """Token texts around the image's embeddings, in order, :data:`IMAGE` for each frame the
    vision tower encodes (each text is one token, looked up as mtmd's ``lookup_token`` does)."""
    placeholder: str
    """The token transformers replaces with one image embedding."""
    per_frame: Callable[[dict[str, Any]], int]
    """Embeddings per frame, from the config."""
    processor_kwargs: tuple[tuple[str, Any], ...] = ()
    """Given to the image processor with the image."""
    type_ids: str | None = None
    """The keyword under which the model takes a mask marking the image tokens with 1 (Gemma 3's
    ``token_type_ids``; Qwen2-VL's ``mm_token_type_ids``, from which it places the image's
    M-RoPE positions; without it every position would be a text one), None if it takes none."""
    row_break: str | None = None
    """The token after every row of a frame's embeddings but the last (Pixtral's
    ``[IMG_BREAK]``: mtmd writes its embedding, copied into the projector, inside the image),
    None when a frame is one run of embeddings."""
    rows: Callable[[dict[str, Any]], int] | None = None
    """Rows of embeddings per frame (with :attr:`row_break`), from the config."""
    chat_image: str = ""
    """What the family's chat template writes for one image (the text its processor expands
    into the image's tokens): where the ``chat_turn`` prompt puts mtmd's image."""

    @property
    def frames(self) -> int:
        return sum(p is IMAGE for p in self.pieces)


def _idefics3_per_frame(config: dict[str, Any]) -> int:
    vision = config.get("vision_config") or {}
    patches = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
    return patches // int(config.get("scale_factor", 2)) ** 2


def _qwen2vl_per_frame(config: dict[str, Any]) -> int:
    vision = config.get("vision_config") or {}
    side = image_size(config) // int(vision.get("patch_size", 14))
    return side * side // int(vision.get("spatial_merge_size", 2)) ** 2


GEMMA4_SOFT_TOKENS = 140
"""The soft-token budget Gemma 4's image processor is given: it resizes every image to fill
its budget (a square one to ``isqrt(140)`` = 11 pooled patches a side), so the fixed image is
drawn at that size, which mtmd (70 to 1120 tokens) keeps as it is."""


def _gemma4_side(config: dict[str, Any]) -> int:
    """Pooled patches a side of Gemma 4's fixed image."""
    return math.isqrt(GEMMA4_SOFT_TOKENS)


def _pixtral_side(config: dict[str, Any]) -> int:
    """Embeddings per row (and rows) of Pixtral's fixed image: the tower's side in patches,
    merged ``spatial_merge_size`` x ``spatial_merge_size`` by Mistral 3's patch merger."""
    vision = config.get("vision_config") or {}
    merge = int(config.get("spatial_merge_size", 1))
    return image_size(config) // int(vision.get("patch_size", 16)) // merge


QWEN2VL_PIECES = ("<|vision_start|>", IMAGE, "<|vision_end|>")
QWEN2VL_CHAT_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"

IDEFICS3_ONE_TILE = ("<fake_token_around_image>", "<row_1_col_1>", IMAGE, "\n\n",
                     "<fake_token_around_image>", "<global-img>", IMAGE,
                     "<fake_token_around_image>")  # fmt: skip

IDEFICS3_LAYOUT = Layout(
    IDEFICS3_ONE_TILE, "<image>", _idefics3_per_frame, (("do_image_splitting", False),),
    chat_image="<image>",
)

PIXTRAL_LAYOUT = Layout(
    (IMAGE, "[IMG_END]"),
    "[IMG]",
    lambda config: _pixtral_side(config) ** 2,
    row_break="[IMG_BREAK]",
    rows=_pixtral_side,
    chat_image="[IMG]",
)

LAYOUTS: dict[str, Layout] = {
    # mtmd.cpp PROJECTOR_TYPE_GEMMA3: <start_of_image> (soft tokens) <end_of_image>
    "Gemma3ForConditionalGeneration": Layout(
        ("<start_of_image>", IMAGE, "<end_of_image>"),
        "<image_soft_token>",
        lambda config: int(config.get("mm_tokens_per_image", 256)),
        type_ids="token_type_ids", chat_image="<start_of_image>",
    ),
    # mtmd.cpp PROJECTOR_TYPE_IDEFICS3 on an image of one tile (the fixed image is drawn at the
    # preprocessor's longest edge, the tile size, so mtmd resizes nothing): the tile as slice
    # 1x1, then the overview, which is the same pixels; transformers gets the same two frames
    # (its own processor, unsplit, gives the one tile; it would not slice a one-tile image)
    "Idefics3ForConditionalGeneration": IDEFICS3_LAYOUT,
    # SmolVLM2: the same projector type, tokens and processor keys as Idefics3
    "SmolVLMForConditionalGeneration": IDEFICS3_LAYOUT,
    # mtmd.cpp PROJECTOR_TYPE_QWEN2VL / QWEN25VL: <|vision_start|> (merged patches)
    # <|vision_end|>; the image at the tower's 224 pixels, a multiple of the 28-pixel merged
    # patch, so neither side resizes it; transformers also takes the image's grid (M-RoPE)
    "Qwen2VLForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids",
        chat_image=QWEN2VL_CHAT_IMAGE,
    ),
    "Qwen2_5_VLForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids",
        chat_image=QWEN2VL_CHAT_IMAGE,
    ),
    "Qwen3VLForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids",
        chat_image=QWEN2VL_CHAT_IMAGE,
    ),
    "Qwen3VLMoeForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids",
        chat_image=QWEN2VL_CHAT_IMAGE,
    ),
    # mtmd.cpp PROJECTOR_TYPE_GLM4V: <|begin_of_image|> (merged patches) <|end_of_image|>,
    # the image at the tower's image_size, a multiple of the 28-pixel merged patch; M-RoPE
    # positions as Qwen2-VL's, from mm_token_type_ids
    "Glm4vForConditionalGeneration": Layout(
        ("<|begin_of_image|>", IMAGE, "<|end_of_image|>"), "<|image|>", _qwen2vl_per_frame,
        type_ids="mm_token_type_ids", chat_image="<|begin_of_image|><|image|><|end_of_image|>",
    ),
    # mtmd.cpp PROJECTOR_TYPE_PIXTRAL (Pixtral under LLaVA, Mistral 3 with its patch merger):
    # the rows of (merged) patches, the [IMG_BREAK] embedding after each but the last, then
    # [IMG_END]; the image at the tower's image_size, a multiple of the (merged) patch, so
    # neither side resizes it; transformers also takes the image's size (2-D RoPE positions)
    # mtmd.cpp PROJECTOR_TYPE_JANUS_PRO: the embeddings alone, no marker around them
    "JanusForConditionalGeneration": Layout(
        (IMAGE,), "<image_placeholder>",
        lambda config: int((config.get("vision_config") or {}).get("num_image_tokens", 576)),
        chat_image="<image_placeholder>",
    ),
    "LlavaForConditionalGeneration": PIXTRAL_LAYOUT,
    "Mistral3ForConditionalGeneration": PIXTRAL_LAYOUT,
    # mtmd.cpp PROJECTOR_TYPE_GEMMA4V: <|image> (pooled patches) <image|>, attended
    # bidirectionally (mtmd_decode_use_non_causal: every width but E2B's and E4B's, whose
    # configs say use_bidirectional_attention "vision" as transformers reads it from
    # mm_token_type_ids); transformers also takes the patches' positions (image_position_ids)
    "Gemma4ForConditionalGeneration": Layout(
        ("<|image>", IMAGE, "<image|>"), "<|image|>", lambda config: _gemma4_side(config) ** 2,
        (("max_soft_tokens", GEMMA4_SOFT_TOKENS),), type_ids="mm_token_type_ids",
        chat_image="<|image|>",
    ),
}
"""The sequence layout of every family in ``mmproj.VLM_FAMILIES``."""


PIXTRAL_SIDE = 16
"""The fixed image's side in (merged) patches at most for a Pixtral tower (see
:func:`image_size`)."""


def image_size(config: dict[str, Any]) -> int:
    """The fixed image's side in pixels: the vision tower's input side, except that a Pixtral
    tower's ``image_size`` is its largest (1024 on Pixtral 12B, 1540 on Mistral Small 3.1),
    more embeddings than mtmd takes of one image (1024: it would shrink it and transformers
    would not), so there :data:`PIXTRAL_SIDE` (merged) patches at most."""
    vision = config.get("vision_config") or {}
    if vision.get("model_type") == "gemma4_vision":  # no image_size: see GEMMA4_SOFT_TOKENS
        pooled = int(vision.get("patch_size", 16)) * int(vision.get("pooling_kernel_size", 3))
        return _gemma4_side(config) * pooled
    side = int(vision.get("image_size", 224))
    if vision.get("model_type") == "pixtral":
        merged = int(vision.get("patch_size", 16)) * int(config.get("spatial_merge_size", 1))
        side = min(side, PIXTRAL_SIDE * merged)
    return side


def fixed_image(path: Path, size: int, variant: int = 0) -> Path:
    """Write the fixed image: a deterministic RGB pattern (gradients and a checkerboard, so
    every patch differs from its neighbours) of ``size`` x ``size`` pixels, as PNG; ``variant``
    moves the checkerboard's phase and rotates the colour channels (:data:`PROBE_IMAGES`)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    step = max(1, size // 16)
    red = (x * 256) // size
    green = (y * 256) // size
    blue = np.where(((x // step) + (y // step) + variant) % 2 == 0, 230, 25)
    pixels = np.roll(np.stack([red, green, blue], axis=-1), variant, axis=-1).astype(np.uint8)
    Image.fromarray(pixels, "RGB").save(path, format="PNG")
    return path


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes llama.cpp prints for a token: SentencePiece pieces (``▁`` is a space,
    ``<0xNN>`` a byte) or byte-level BPE pieces (GPT-2's byte-to-unicode table undone)."""
    piece = str(tokenizer.convert_ids_to_tokens(int(token_id)))
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ == "ByteLevel":
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        table = {v: k for k, v in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
        return bytes(table[c] for c in piece if c in table)
    return piece.replace("\u2581", " ").encode("utf-8")


def lookup_token(tokenizer: Any, text: str) -> int:
    """The id mtmd's ``lookup_token`` finds for ``text``: the first whose piece is ``text``."""
    vocab = tokenizer.get_vocab()
    if text in vocab:
        return int(vocab[text])
    wanted = text.encode("utf-8")
    for token_id in sorted(vocab.values()):
        if token_bytes(tokenizer, token_id) == wanted:
            return int(token_id)
    raise VerificationFailed(f"the tokenizer has no token {text!r}, which mtmd puts around images")


@dataclass(frozen=True)
class Prompt:
    """One way of prompting: the text between BOS and the image, and after the image."""

    style: str
    before: str
    after: str


IMAGE_FIRST = Prompt("image_first", "", PROMPT)
"""The image right after BOS, then the request."""

CHAT_TURN = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
"""One user turn holding the image, then the request (as the families' model cards show)."""


def _template_owner(root: Path) -> Any | None:
    """What holds the checkpoint's chat template: its processor (``chat_template.jinja``,
    ``processor_config.json``), else its tokenizer; None when neither has one."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        processor: Any = AutoProcessor.from_pretrained(str(root), local_files_only=True)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        processor = None  # a processor transformers cannot build from these files
    if getattr(processor, "chat_template", None):
        return processor
    tokenizer: Any = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    return tokenizer if getattr(tokenizer, "chat_template", None) else None


def chat_prompt(root: Path, config: dict[str, Any]) -> Prompt | None:
    """The ``chat_turn`` prompt: :data:`CHAT_TURN` rendered by transformers with the
    checkpoint's template and the generation prompt; what the template writes for the image
    (the family's :attr:`Layout.chat_image`, which the processor would expand) is where mtmd's
    image goes, and a leading BOS text is dropped (llama.cpp adds BOS itself, and strips one a
    template writes: ``common_chat_templates_apply``). None when the checkpoint has no chat
    template; VerificationFailed when the template does not write the image as the family's
    text, once."""
    owner = _template_owner(root)
    if owner is None:
        return None
    layout = LAYOUTS[str((config.get("architectures") or [""])[0])]
    rendered = str(owner.apply_chat_template(CHAT_TURN, add_generation_prompt=True, tokenize=False))
    parts = rendered.split(layout.chat_image) if layout.chat_image else []
    if len(parts) != 2:
        raise VerificationFailed(
            f"the checkpoint's chat template writes an image in a user turn as {rendered[:300]!r}, "
            f"not as one {layout.chat_image!r}, so the check cannot place mtmd's image in the turn"
        )
    before, after = parts
    tokenizer = getattr(owner, "tokenizer", owner)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and before.startswith(bos):
        before = before[len(bos) :]
    return Prompt("chat_turn", before, after)


def prompts(root: Path, config: dict[str, Any]) -> list[Prompt]:
    """The prompts the check runs: image first, and the chat turn where there is a template."""
    chat = chat_prompt(root, config)
    return [IMAGE_FIRST] if chat is None else [IMAGE_FIRST, chat]


@dataclass
class Greedy:
    """transformers' greedy continuation of one sequence."""

    ids: list[int]
    margins: list[float]
    """Top-1 minus top-2 logit at each step (one more than ``ids`` when it ended with EOS)."""
    pieces: list[bytes]
    near: list[set[int]]
    """At each step, the tokens within :data:`NEAR_TIE` of the top one (it included)."""
    ended: bool = False
    """Whether it chose an end-of-generation token before :data:`TOKENS` (not in ``ids``)."""
    tie: float = NEAR_TIE
    """The lead below which a step is a near tie (:func:`tie_bound`)."""
    eos: frozenset[int] = frozenset()
    """The model's end-of-generation tokens."""


def sequence_ids(
    tokenizer: Any, config: dict[str, Any], before: list[int], after: list[int]
) -> list[int]:
    """llama.cpp's sequence: BOS, ``before``, the family's image layout, ``after``."""
    layout = LAYOUTS[str((config.get("architectures") or [""])[0])]
    placeholder = lookup_token(tokenizer, layout.placeholder)
    ids = [int(tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []
    ids += before
    for piece in layout.pieces:
        if piece is IMAGE:
            ids += _frame(tokenizer, config, layout, placeholder)
        else:
            ids.append(lookup_token(tokenizer, piece))
    return ids + after


def reference_greedy(
    root: Path,
    config: dict[str, Any],
    image: Path,
    sequences: list[list[int]],
    tokens: int,
    tie: float = NEAR_TIE,
) -> list[Greedy]:
    """transformers' greedy continuation of each of llama.cpp's sequences (module doc), the
    model loaded once."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    layout = LAYOUTS[str((config.get("architectures") or [""])[0])]
    tokenizer: Any = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    processor: Any = AutoImageProcessor.from_pretrained(str(root), local_files_only=True)  # type: ignore[no-untyped-call]
    with Image.open(image) as img:
        processed = processor(
            images=[img.convert("RGB")], return_tensors="pt", **dict(layout.processor_kwargs)
        )
    pixels = processed["pixel_values"]
    # Qwen2-VL's patches come flat with their grid (t, h, w), which M-RoPE positions need;
    # Pixtral's image comes with its size, from which its 2-D RoPE positions are taken, Gemma
    # 4's with its patches' positions
    grid = {k: processed[k] for k in ("image_grid_thw", "image_sizes", "image_position_ids")
            if k in processed}  # fmt: skip
    if pixels.ndim == 5:  # frames per image (Idefics3): mtmd's frames, each the same tile
        pixels = pixels[:, :1].repeat(1, layout.frames, 1, 1, 1)
    placeholder = lookup_token(tokenizer, layout.placeholder)
    model: Any = AutoModelForImageTextToText.from_pretrained(
        str(root), dtype=torch.float32, local_files_only=True
    )
    model.eval()
    eos = set(_ids(getattr(model.generation_config, "eos_token_id", None)))
    out = []
    for ids in sequences:
        input_ids = torch.tensor([ids])
        marks = (input_ids == placeholder).long()
        extra = {layout.type_ids: marks} if layout.type_ids is not None else {}
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                pixel_values=pixels.to(torch.float32), **grid, max_new_tokens=tokens,
                do_sample=False, output_scores=True, return_dict_in_generate=True, **extra,
            )  # fmt: skip
        new = [int(t) for t in generated.sequences[0, len(ids) :]]
        margins, near = [], []
        for scores in generated.scores:
            row = scores[0].float()
            top = row.topk(2).values
            margins.append(float(top[0] - top[1]))
            near.append({int(i) for i in torch.nonzero(row >= top[0] - tie).flatten()})
        ended = bool(new) and new[-1] in eos
        if ended:  # llama.cpp stops before printing an end-of-generation token
            new = new[:-1]
        pieces = [token_bytes(tokenizer, t) for t in new]
        out.append(Greedy(new, margins, pieces, near, ended, tie, frozenset(eos)))
    return out


def _frame(tokenizer: Any, config: dict[str, Any], layout: Layout, placeholder: int) -> list[int]:
    """One frame's ids: its embeddings' placeholders, with the row breaks where it has them."""
    count = layout.per_frame(config)
    if layout.row_break is None or layout.rows is None:
        return [placeholder] * count
    rows = layout.rows(config)
    row = [placeholder] * (count // rows)
    brk = lookup_token(tokenizer, layout.row_break)
    return [i for r in range(rows) for i in (row if r == rows - 1 else [*row, brk])]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _printed(piece: bytes) -> bytes:
    """What llama.cpp prints of a piece: through C strings, a NUL byte prints nothing."""
    return piece.replace(b"\x00", b"")


def compare(printed: bytes, reference: Greedy) -> dict[str, Any]:
    """llama.cpp's greedy output against transformers' tokens: the report, with ``result``
    ``agree``, or ``near_tie`` when they part at a near tie (:func:`teacher_forced` judges the
    rest); VerificationFailed where they part at a clear lead."""
    text = printed.removeprefix(b"\n")  # the tool prints a newline before the response
    agreed = 0
    prefix = b""
    for piece in reference.pieces:
        prefix += _printed(piece)
        if not text.startswith(prefix):
            break
        agreed += 1
    whole = agreed == len(reference.ids)
    # transformers ended with EOS: llama.cpp must end there too (it prints a newline at EOG)
    overran = whole and reference.ended and text not in (prefix, prefix + b"\n")
    report = {
        "tokens": len(reference.ids),
        "agreed_tokens": agreed,
        "near_tie": reference.tie,
        "min_margin": round(min(reference.margins), 4) if reference.margins else None,
        "llama_cpp_output": text[:200].decode("utf-8", "replace"),
        "transformers_output": b"".join(reference.pieces)[:200].decode("utf-8", "replace"),
        "result": "agree",
    }
    if whole and not overran:
        return report
    lead = reference.margins[agreed] if agreed < len(reference.margins) else math.inf
    if lead >= reference.tie:
        raise VerificationFailed(
            f"llama-mtmd-cli's greedy output diverges from transformers' at token {agreed} of "
            f"{len(reference.ids)} (transformers' lead there {lead:.3g} >= {reference.tie}): the "
            "projector or the text model does not run in llama.cpp as in transformers; "
            f"llama.cpp printed {text[:120]!r}, transformers {b''.join(reference.pieces)[:120]!r}"
        )
    report |= {"result": "near_tie", "near_tie_at": agreed}
    return report


def forced_texts(reference: Greedy, start: int) -> list[str]:
    """transformers' tokens before each step from ``start`` on, as text to feed llama.cpp;
    VerificationFailed (inconclusive) where they split a UTF-8 character."""
    out = []
    for step in range(start, len(reference.ids) + int(reference.ended)):
        raw = b"".join(reference.pieces[:step])
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise VerificationInconclusive(
                f"inconclusive: llama.cpp's and transformers' greedy tokens part at a near tie "
                f"(step {start}), and transformers' tokens up to step {step} split a UTF-8 "
                "character, so llama.cpp cannot be fed them to compare the rest teacher-forced"
            ) from None
    return out


def teacher_forced(
    replies: list[bytes], reference: Greedy, start: int, tokenizer: Any
) -> dict[str, Any]:
    """Each step from ``start`` on, llama.cpp given transformers' tokens before it: its token
    must be transformers' or one within :data:`NEAR_TIE` of it; VerificationFailed otherwise."""
    for step, reply in zip(range(start, start + len(replies)), replies, strict=True):
        allowed = reference.near[step]
        choices = {_printed(token_bytes(tokenizer, t)) for t in allowed}
        got = reply.removeprefix(b"\n")
        # an end of generation prints a newline and no piece
        ends = got in (b"", b"\n") and bool(allowed & reference.eos)
        if got not in choices and not ends:
            wanted = reference.pieces[step] if step < len(reference.pieces) else b"<end>"
            raise VerificationFailed(
                f"teacher-forced on transformers' tokens, llama-mtmd-cli chose {got!r} at step "
                f"{step}, transformers {wanted!r} (lead {reference.margins[step]:.3g}; tokens "
                f"within {reference.tie}: {sorted(choices)[:4]}): after the near tie at step "
                f"{start}, llama.cpp does not run the model as transformers does"
            )
    return {"teacher_forced_from": start, "teacher_forced_steps": len(replies),
            "result": "agree (teacher-forced after a near tie)"}  # fmt: skip


def tie_bound(text_gguf: Path) -> float:
    """:data:`Q8_0_NEAR_TIE` for a q8_0 text model (beside its f16 projector), else
    :data:`NEAR_TIE`."""
    from gguf import LlamaFileType

    from service.exporters.gguf.directory import read_directory

    # the directory alone: GGUFReader would materialize the whole vocabulary to read one number
    file_type = int(read_directory(text_gguf).metadata.get("general.file_type", -1))
    return Q8_0_NEAR_TIE if file_type == int(LlamaFileType.MOSTLY_Q8_0) else NEAR_TIE


def _judge(
    prompt: Prompt,
    printed: bytes,
    reference: Greedy,
    after_ids: list[int],
    tokenizer: Any,
    text_gguf: Path,
    mmproj: Path,
    image: Path,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None,
) -> dict[str, Any]:
    """One prompt's report: :func:`compare`, then :func:`teacher_forced` after a near tie."""
    report = compare(printed, reference)
    own = tokenizer(prompt.after, add_special_tokens=False).input_ids
    report["text_tokenized_alike"] = own == after_ids
    if report["result"] != "near_tie":
        return report
    start = int(report["near_tie_at"])
    forced = forced_texts(reference, start)
    fed = llama_ids(text_gguf, [prompt.after + f for f in forced], work, check_abort, bin_dir)
    for step, ids in zip(range(start, start + len(forced)), fed, strict=True):
        if ids != after_ids + reference.ids[:step]:
            raise VerificationInconclusive(
                f"inconclusive: llama.cpp's and transformers' greedy tokens part at a near tie "
                f"(step {start}), and llama.cpp's tokenizer does not read transformers' tokens "
                f"up to step {step} back as the same ids, so the rest cannot be compared "
                "teacher-forced"
            )
    replies, peak = run_session(
        text_gguf, mmproj, image, [(prompt.before, prompt.after + f) for f in forced], 1, work,
        check_abort, bin_dir,
    )  # fmt: skip
    return report | teacher_forced(replies, reference, start, tokenizer) | {
        "forced_peak_rss_bytes": peak
    }


def check_mtmd(
    text_gguf: Path,
    mmproj: Path,
    root: Path,
    config: dict[str, Any],
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> dict[str, Any]:
    """Run both sides on the fixed image and every prompt and apply the bound; the report."""
    from transformers import AutoTokenizer

    work.mkdir(parents=True, exist_ok=True)
    asked = prompts(root, config)
    texts = llama_ids(
        text_gguf, [t for p in asked for t in (p.before, p.after)], work, check_abort, bin_dir
    )
    tokenizer: Any = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    sequences = [
        sequence_ids(tokenizer, config, texts[2 * i], texts[2 * i + 1]) for i in range(len(asked))
    ]
    reports: dict[str, dict[str, Any]] = {}
    pending, peak, size = list(range(len(asked))), 0, image_size(config)
    unsettled: dict[int, str] = {}
    for variant in range(PROBE_IMAGES):
        image = fixed_image(work / f"fixed-image-{variant}.png", size, variant)
        printed, ran = run_session(
            text_gguf, mmproj, image, [(asked[i].before, asked[i].after) for i in pending],
            TOKENS, work, check_abort, bin_dir,
        )  # fmt: skip
        peak = max(peak, ran)
        references = reference_greedy(root, config, image, [sequences[i] for i in pending],
                                      TOKENS, tie_bound(text_gguf))  # fmt: skip
        for i, out, reference in zip(pending, printed, references, strict=True):
            prompt = asked[i]
            try:
                report = _judge(prompt, out, reference, texts[2 * i + 1], tokenizer, text_gguf,
                                mmproj, image, work, check_abort, bin_dir)  # fmt: skip
            except VerificationInconclusive as exc:
                unsettled[i] = str(exc)
                continue
            except VerificationFailed as exc:
                raise VerificationFailed(f"{prompt.style} prompt: {exc}") from exc
            unsettled.pop(i, None)
            peak = max(peak, report.pop("forced_peak_rss_bytes", 0))
            report["prompt"] = prompt.before + "<image>" + prompt.after
            report["image_variant"] = variant
            reports[prompt.style] = report
        pending = sorted(unsettled)
        if not pending:
            break
    if pending:
        i = pending[0]
        raise VerificationInconclusive(
            f"{asked[i].style} prompt, on each of {PROBE_IMAGES} fixed images: {unsettled[i]}"
        )
    return {
        "result": "agree",
        "tokens": min(r["tokens"] for r in reports.values()),
        "agreed_tokens": min(r["agreed_tokens"] for r in reports.values()),
        "prompts": reports,
        **({} if "chat_turn" in reports else {"chat_turn": "not run: no chat template"}),
        "image": f"{size}x{size} fixed pattern",
        "peak_rss_bytes": peak,
    }
