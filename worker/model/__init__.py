"""The load_weights core: a Llama / Qwen2 causal LM in serving-engine layout."""

from router.dataplane.digest import digest_named_tensors, rank_checksum, tensor_digest
from worker.model.causal_lm import CausalLM, SeqInput
from worker.model.checkpoint import checkpoint_files, load_model, read_checkpoint
from worker.model.config import ModelConfig, ModelConfigError
from worker.model.kv_cache import KVCache
from worker.model.lora import LoadedLora, LoraAdapter, LoraAdapters, LoraLoadError, LoraNotFoundError
from worker.model.tiny import write_tiny_checkpoint
from worker.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from worker.model.weight_map import WeightLoadError

__all__ = [
    "ByteTokenizer",
    "CausalLM",
    "KVCache",
    "LoadedLora",
    "LoraAdapter",
    "LoraAdapters",
    "LoraLoadError",
    "LoraNotFoundError",
    "ModelConfig",
    "ModelConfigError",
    "SeqInput",
    "Tokenizer",
    "WeightLoadError",
    "checkpoint_files",
    "digest_named_tensors",
    "load_model",
    "load_tokenizer",
    "rank_checksum",
    "read_checkpoint",
    "tensor_digest",
    "write_tiny_checkpoint",
]
