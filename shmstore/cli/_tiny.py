"""`shmstore tiny-model DIR`: a tiny LLaVA-1.5 model with random weights, built offline, to try
the vLLM plugin without downloading a model (and what the vLLM tests serve); or, with
kind="llava_next", a tiny LLaVA-NeXT: the same towers, and the anyres image processor, which
cuts each image into tiles of the grid it fits best plus a resized whole: several crops per
image, so its processor costs more per item).

A 2-layer CLIP vision tower (56x56 images, 14x14 patches: 16 image tokens) and a 2-layer Llama,
a byte-level BPE tokenizer trained here with an `<image>` token, a CLIP image processor and a
chat template. No network. Weights are renamed to what vLLM's LLaVA loader expects
(`vision_tower.vision_model.*`; transformers 5.x saves `vision_tower.*`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

IMAGE_SIZE = 56
PATCH = 14
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def main(args: Any) -> int:
    """Build the model into args.dir and say how to serve it."""
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"shmstore tiny-model: {exc.name} is not installed: install vLLM first (the vLLM "
              "guide, 'Install'), which brings torch and transformers", file=sys.stderr)
        return 2
    out = build(Path(args.dir), image_size=args.image_size, kind=args.kind)
    print(f"a tiny {args.kind} model with random weights is in {out}; serve it with:\n"
          f"  VLLM_CPU_KVCACHE_SPACE=1 shmstore serve {out} --mm-processor-cache-type shm "
          "--max-model-len 256 --enforce-eager --host 127.0.0.1 --port 8000")
    return 0


def build(out: Path, seed: int = 0, image_size: int = IMAGE_SIZE, kind: str = "llava") -> Path:
    """Write the model, tokenizer and processor to `out`; return it. `image_size` (pixels, a
    multiple of 14): 336 is LLaVA-1.5's (576 image tokens, pixel_values of 1.35 MB in fp32).
    `kind`: "llava" (LLaVA-1.5) or "llava_next" (anyres: up to 4 tiles and the whole)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    if kind not in ("llava", "llava_next"):
        raise ValueError(f"kind {kind!r}: llava or llava_next")
    grid = [[image_size, 2 * image_size], [2 * image_size, image_size],
            [2 * image_size, 2 * image_size]]  # anyres: the tile layouts an image may take

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["USER: what is in this image? ASSISTANT: a picture of a cat on a mat.",
              "describe the image in detail please",
              "the quick brown fox jumps over the lazy dog"] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    tokenizer.chat_template = CHAT_TEMPLATE
    crop = {"height": image_size, "width": image_size}
    if kind == "llava":
        processor: Any = LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                               crop_size=crop),
            tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
            chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1)
    else:
        processor = LlavaNextProcessor(
            image_processor=LlavaNextImageProcessor(
                size={"shortest_edge": image_size}, crop_size=crop, image_grid_pinpoints=grid),
            tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
            chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1)
    make_config, make_model = ((LlavaConfig, LlavaForConditionalGeneration) if kind == "llava"
                               else (LlavaNextConfig, LlavaNextForConditionalGeneration))
    extra: dict[str, Any] = {} if kind == "llava" else {"image_grid_pinpoints": grid}
    config = make_config(
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=image_size, patch_size=PATCH, projection_dim=32),
        text_config=LlamaConfig(  # head_dim 64: one vLLM's CPU attention supports
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=len(tokenizer),
            max_position_embeddings=max(512, (2 if kind == "llava" else 12)
                                        * (image_size // PATCH) ** 2),
            bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", **extra)
    torch.manual_seed(seed)
    make_model(config).eval().save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    path = out / "model.safetensors"
    weights = load_file(path)
    prefix = "vision_tower."
    save_file({(prefix + "vision_model." + k[len(prefix):]
                if k.startswith(prefix) and not k.startswith(prefix + "vision_model.") else k): v
               for k, v in weights.items()}, path, metadata={"format": "pt"})
    return out
