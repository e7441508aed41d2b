"""Tiny Llama checkpoints that a real vLLM server loads, written by ``transformers`` with a byte tokenizer.

vLLM's CPU attention refuses a head size below 32, so these are wider than the main suite's tiny model
(``worker.model.tiny``, head_dim 16). The tokenizer maps each byte to its own id (0..255, through the
byte-level alphabet GPT-2 uses), ``<s>`` = 256 and ``</s>`` = 257; ids 258..511 exist in the model's
vocabulary but decode to nothing, so tests compare token ids, not text.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The shape every engine-tier checkpoint shares: head_dim 32 (vLLM's CPU attention needs at least 32).
CONFIG = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "tie_word_embeddings": False,
}
BOS, EOS = 256, 257


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable-character table (what a byte-level BPE stores its tokens as)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def write_tokenizer(out: Path) -> None:
    """A byte-level ``tokenizer.json`` (no merges: one token per byte) and its ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab.update({"<s>": BOS, "</s>": EOS})
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 512}))


def write_checkpoint(out: Path, seed: int) -> Path:
    """A random float32 Llama at ``out`` (``config.json``, ``model.safetensors``, the tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, torch_dtype="float32"))
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def hf_greedy(path: Path | str, prompt: list[int], tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` by ``transformers`` on the checkpoint at ``path`` (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]
