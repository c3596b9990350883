"""A VLM's two GGUF files checked by llama.cpp's multimodal tool against transformers, on an image.

Reading the projector back (``verify.verify_gguf``) proves its tensors are the checkpoint's; it
cannot prove llama.cpp runs them as transformers does (the image preprocessing, the pooling, the
special tokens around the image, the attention over image positions). So the job runs
``llama-mtmd-cli`` on the text model, the projector, a fixed image (:func:`fixed_image`: a
deterministic RGB pattern drawn at the vision tower's own input size, so neither side resamples
it) and a fixed prompt, greedy, and compares its output with transformers' greedy continuation
of the same token sequence.

The sequence is llama.cpp's, built on the transformers side by the family's layout
(:data:`LAYOUTS`): ``llama-mtmd-cli`` gets a chat template that returns the user's text as it is,
so its prompt is ``<bos>`` + the image + the prompt text, and mtmd wraps the image in the
family's markers (Gemma 3: ``<start_of_image>`` + one embedding per soft token +
``<end_of_image>``; Idefics3: the image as one tile after
``<fake_token_around_image><row_1_col_1>``, then as the overview after a two-newline token and
``<fake_token_around_image><global-img>``; Pixtral, under LLaVA or Mistral 3: the rows of
patches with an ``[IMG_BREAK]`` after each row but the last, then ``[IMG_END]``). transformers is given those ids, the image's
``pixel_values`` from the checkpoint's own image processor (one frame per frame mtmd encodes),
and generates greedily in float32, the whole model in memory: the plan
counts it (``gguf.plan``), so a VLM too large for it is refused at submission.

**The bound.** llama.cpp's output must equal transformers' first :data:`TOKENS` greedy tokens
(compared as bytes: llama.cpp prints token pieces, which may split a UTF-8 character), except that
comparison stops at the first step where transformers' top-1 logit leads its top-2 by less than
:data:`NEAR_TIE` (that step's token may differ, and nothing after it is comparable). Why 0.05: an
f16 file moves llama.cpp's logits by about 1e-3 to 1e-2 of their scale against float32 transformers
(the text logit checks measure it, ``service.verification.logits``), so a lead of 0.05 cannot flip
through rounding, while a wrong projector moves every image-conditioned logit by O(1). A comparison
left with fewer than :data:`MIN_COMPARED` tokens is reported inconclusive rather than passed.

Why one module of over 450 lines: it is one consumer's check whose parts must agree token for
token: each family's image layout (:data:`LAYOUTS`, a few lines of the table each),
transformers' greedy reference built to llama.cpp's sequence, the tool's run and the
comparison. Apart, a family's layout would sit away from the reference that must follow it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import VerificationFailed
from service.exporters.common.child_process import run_child
from service.shims.llama_cpp import TOOL_ENV, llama_cpp_tool

TOKENS = 16
"""Greedy tokens generated on each side."""
NEAR_TIE = 0.05
"""transformers' top-1 minus top-2 logit below which a step may legitimately differ."""
MIN_COMPARED = 4
"""Fewer comparable tokens than this and the check is inconclusive (reported, not passed)."""
PROMPT = "Describe the image."
PASS_THROUGH_TEMPLATE = "{{ messages[0]['content'] }}"
"""Chat template given to llama-mtmd-cli: the user's text as it is, so both sides see one
sequence whatever the checkpoint's own template says."""
MEDIA_MARKER = "<__media__>"
"""mtmd's default media marker (``mtmd_default_marker()``)."""


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

IDEFICS3_ONE_TILE = ("<fake_token_around_image>", "<row_1_col_1>", IMAGE, "\n\n",
                     "<fake_token_around_image>", "<global-img>", IMAGE,
                     "<fake_token_around_image>")  # fmt: skip

IDEFICS3_LAYOUT = Layout(
    IDEFICS3_ONE_TILE, "<image>", _idefics3_per_frame, (("do_image_splitting", False),)
)

PIXTRAL_LAYOUT = Layout(
    (IMAGE, "[IMG_END]"),
    "[IMG]",
    lambda config: _pixtral_side(config) ** 2,
    row_break="[IMG_BREAK]",
    rows=_pixtral_side,
)

LAYOUTS: dict[str, Layout] = {
    # mtmd.cpp PROJECTOR_TYPE_GEMMA3: <start_of_image> (soft tokens) <end_of_image>
    "Gemma3ForConditionalGeneration": Layout(
        ("<start_of_image>", IMAGE, "<end_of_image>"),
        "<image_soft_token>",
        lambda config: int(config.get("mm_tokens_per_image", 256)),
        type_ids="token_type_ids",
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
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids"
    ),
    "Qwen2_5_VLForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids"
    ),
    "Qwen3VLForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids"
    ),
    "Qwen3VLMoeForConditionalGeneration": Layout(
        QWEN2VL_PIECES, "<|image_pad|>", _qwen2vl_per_frame, type_ids="mm_token_type_ids"
    ),
    # mtmd.cpp PROJECTOR_TYPE_GLM4V: <|begin_of_image|> (merged patches) <|end_of_image|>,
    # the image at the tower's image_size, a multiple of the 28-pixel merged patch; M-RoPE
    # positions as Qwen2-VL's, from mm_token_type_ids
    "Glm4vForConditionalGeneration": Layout(
        ("<|begin_of_image|>", IMAGE, "<|end_of_image|>"), "<|image|>", _qwen2vl_per_frame,
        type_ids="mm_token_type_ids",
    ),
    # mtmd.cpp PROJECTOR_TYPE_PIXTRAL (Pixtral under LLaVA, Mistral 3 with its patch merger):
    # the rows of (merged) patches, the [IMG_BREAK] embedding after each but the last, then
    # [IMG_END]; the image at the tower's image_size, a multiple of the (merged) patch, so
    # neither side resizes it; transformers also takes the image's size (2-D RoPE positions)
    # mtmd.cpp PROJECTOR_TYPE_JANUS_PRO: the embeddings alone, no marker around them
    "JanusForConditionalGeneration": Layout(
        (IMAGE,), "<image_placeholder>",
        lambda config: int((config.get("vision_config") or {}).get("num_image_tokens", 576)),
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


def fixed_image(path: Path, size: int) -> Path:
    """Write the fixed image: a deterministic RGB pattern (gradients and a checkerboard, so
    every patch differs from its neighbours) of ``size`` x ``size`` pixels, as PNG."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    step = max(1, size // 16)
    red = (x * 256) // size
    green = (y * 256) // size
    blue = np.where(((x // step) + (y // step)) % 2 == 0, 230, 25)
    pixels = np.stack([red, green, blue], axis=-1).astype(np.uint8)
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


@dataclass
class Greedy:
    ids: list[int]
    margins: list[float]
    pieces: list[bytes]


def reference_greedy(root: Path, config: dict[str, Any], image: Path, tokens: int) -> Greedy:
    """transformers' greedy continuation of llama.cpp's sequence (see the module doc)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    arch = str((config.get("architectures") or [""])[0])
    layout = LAYOUTS[arch]
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
    ids = [int(tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []
    for piece in layout.pieces:
        if piece is IMAGE:
            ids += _frame(tokenizer, config, layout, placeholder)
        else:
            ids.append(lookup_token(tokenizer, piece))
    ids += tokenizer(PROMPT, add_special_tokens=False).input_ids
    model: Any = AutoModelForImageTextToText.from_pretrained(
        str(root), dtype=torch.float32, local_files_only=True
    )
    model.eval()
    input_ids = torch.tensor([ids])
    marks = (input_ids == placeholder).long()
    extra = {layout.type_ids: marks} if layout.type_ids is not None else {}
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixels.to(torch.float32),
            **grid,
            max_new_tokens=tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
    new = [int(t) for t in out.sequences[0, len(ids) :]]
    margins = []
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    eos = set(_ids(getattr(model.generation_config, "eos_token_id", None)))
    if new and new[-1] in eos:  # llama.cpp stops before printing an end-of-generation token
        new, margins = new[:-1], margins[: len(new) - 1]
    return Greedy(new, margins, [token_bytes(tokenizer, t) for t in new])


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


CHAT_SESSION = r"""
log="$1"; image="$2"; prompt="$3"; shift 3
fifo="$log.stdin"; rm -f "$fifo" "$log" "$log.hwm"; mkfifo "$fifo" || exit 1
"$@" --log-file "$log" < "$fifo" > /dev/null &
tool=$!
exec 3> "$fifo"
printf '/image %s\n%s\n' "$image" "$prompt" >&3
while kill -0 "$tool" 2>/dev/null; do
  hwm=$(sed -n 's/^VmHWM:[^0-9]*\([0-9]*\) kB$/\1/p' "/proc/$tool/status" 2>/dev/null)
  [ -n "$hwm" ] && echo "$hwm" > "$log.hwm"
  case "$(tail -c 3 "$log" 2>/dev/null | od -An -c | tr -d ' ')" in
    '\n>') [ "$(grep -c '^> ' "$log")" -ge 3 ] && break ;;
  esac
  sleep 0.1
done
exec 3>&-
wait "$tool"; status=$?
rm -f "$fifo"; exit "$status"
"""
"""Runs llama-mtmd-cli as a chat of two lines (the image, the prompt) and ends it once the tool
asks for a third, recording the tool's own peak RSS (``VmHWM`` of ``/proc/<tool>/status``,
read every 0.1 s while it runs, the last read once the reply is whole) in ``<log>.hwm``. Why
there too: ``run_child`` samples its child's tree every 0.25 s, and on a small model the tool
can start and end between two looks (it then reported the shell's 1.7 MiB). Why not
``-p``/``--image`` (one turn, then exit): the tool prints through
llama.cpp's log thread, whose logger is never flushed at exit (llama.cpp #22142), so under load
the end of the reply was lost (16 tokens generated, 1 printed). The request for the next line
(``> ``) follows the reply in the same ordered queue, so once it is in the log file the reply is
whole; then stdin closes and the tool ends. The log file, not stdout: the console echoes the
lines it reads to stdout directly, out of order with the queue."""

LOG_LINE = re.compile(rb"^\d+\.\d{2}\.\d{3}\.\d{3} [IWED] [^\n]*\n", re.MULTILINE)
"""A log line of llama.cpp's own (``--log-prefix --log-timestamps``), not the reply's."""


def run_mtmd(
    text_gguf: Path,
    mmproj: Path,
    image: Path,
    tokens: int,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> tuple[bytes, int]:
    """llama-mtmd-cli's greedy reply (bytes, as printed) and its peak RSS."""
    log = work / "mtmd-session.log"
    tool = str(llama_cpp_tool("llama-mtmd-cli", bin_dir))
    argv = [
        tool, "-m", str(text_gguf), "--mmproj", str(mmproj), "--jinja",
        "--chat-template", PASS_THROUGH_TEMPLATE, "-n", str(tokens), "--temp", "0",
        "--seed", "0", "-t", "1", "-c", "1024", "--no-warmup", "--log-prefix",
        "--log-timestamps", "--log-colors", "off",
    ]  # fmt: skip
    # run_child's peak is the largest of the shell's tree it saw; the session's record is the
    # tool's own whenever it ran (see CHAT_SESSION)
    shell = ["/bin/sh", "-c", CHAT_SESSION, "sh", str(log), str(image), PROMPT, *argv]
    peak = run_child(shell, work, "llama-mtmd-cli", check_abort, TOOL_ENV, timeout=1800.0).rss
    return reply(log.read_bytes()), max(peak, tool_peak(log))


def tool_peak(log: Path) -> int:
    """llama-mtmd-cli's own peak RSS in bytes, as the chat session recorded it."""
    try:
        return int((log.parent / (log.name + ".hwm")).read_text().strip()) * 1024
    except (OSError, ValueError):
        raise VerificationFailed(
            "llama-mtmd-cli's peak RSS was not recorded (no VmHWM in /proc/<pid>/status)"
        ) from None


def reply(session: bytes) -> bytes:
    """The reply in a chat session's log: after the second request for a line (the image
    loaded) up to the third, without llama.cpp's own log lines."""
    turns = session.split(b"\n> ")
    if len(turns) < 4:
        raise VerificationFailed(
            f"llama-mtmd-cli ended before replying to the prompt: {session[-300:]!r}"
        )
    return LOG_LINE.sub(b"", b"\n> ".join(turns[2:-1]))


def compare(printed: bytes, reference: Greedy) -> dict[str, Any]:
    """The stated bound (module doc) on llama.cpp's output against transformers' greedy tokens;
    VerificationFailed beyond it."""
    text = printed.strip(b"\n")  # the tool prints a newline before and after the response
    comparable = next(
        (i for i, m in enumerate(reference.margins) if m < NEAR_TIE), len(reference.ids)
    )
    agreed = 0
    prefix = b""
    for piece in reference.pieces:
        # llama.cpp prints through C strings: a NUL byte (the <0x00> byte token) prints nothing
        prefix += piece.replace(b"\x00", b"")
        if not text.startswith(prefix):
            break
        agreed += 1
    report = {
        "tokens": len(reference.ids),
        "agreed_tokens": agreed,
        "comparable_tokens": comparable,
        "near_tie": NEAR_TIE,
        "min_margin": round(min(reference.margins), 4) if reference.margins else None,
        "llama_cpp_output": text[:200].decode("utf-8", "replace"),
    }
    if agreed < comparable:
        raise VerificationFailed(
            f"llama-mtmd-cli's greedy output diverges from transformers' at token {agreed} of "
            f"{comparable} comparable ones (transformers' lead there "
            f"{reference.margins[agreed]:.3g} >= {NEAR_TIE}): the projector or the text model "
            f"does not run in llama.cpp as in transformers; llama.cpp printed "
            f"{text[:120]!r}, transformers {b''.join(reference.pieces)[:120]!r}"
        )
    report["result"] = "agree" if comparable >= MIN_COMPARED else "inconclusive"
    return report


def check_mtmd(
    text_gguf: Path,
    mmproj: Path,
    root: Path,
    config: dict[str, Any],
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> dict[str, Any]:
    """Run both sides on the fixed image and prompt and apply the bound; the report."""
    work.mkdir(parents=True, exist_ok=True)
    image = fixed_image(work / "fixed-image.png", image_size(config))
    printed, peak = run_mtmd(text_gguf, mmproj, image, TOKENS, work, check_abort, bin_dir)
    reference = reference_greedy(root, config, image, TOKENS)
    report = compare(printed, reference)
    report |= {"image": f"{image_size(config)}x{image_size(config)} fixed pattern",
               "prompt": PROMPT, "peak_rss_bytes": peak}  # fmt: skip
    return report
