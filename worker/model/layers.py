"""Math shared by the Llama-family layers: RMSNorm, RoPE, attention over a cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like the reference implementation, then cast back.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class Rotary:
    """Rotary position embedding (non-interleaved halves, as in HF Llama/Qwen2)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
        self.inv_freq = 1.0 / (theta**exponent)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[tokens, heads, head_dim]``; cos/sin are ``[tokens, head_dim]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int) -> torch.Tensor:
    """Attention of ``n`` new queries over ``past + n`` cached positions.

    q: ``[heads, n, head_dim]``; keys/values: ``[kv_heads, past + n, head_dim]``.
    Returns ``[n, heads * head_dim]``.
    """
    heads, n, head_dim = q.shape
    groups = heads // keys.shape[0]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=0)
        values = values.repeat_interleave(groups, dim=0)
    if n == 1:
        out = F.scaled_dot_product_attention(q, keys, values)
    elif past == 0:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        total = past + n
        rows = torch.arange(n, device=q.device)[:, None] + past
        cols = torch.arange(total, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=cols <= rows)
    return out.transpose(0, 1).reshape(n, heads * head_dim)
