"""Plain PyTorch models for `test_plain_models`, written without transformers: a nanoGPT GPT, a
torchtitan-style LLaMA, a ViT, and torchvision's VisionTransformer where torchvision imports.
Each `Case` says how a user names its blocks, computes its loss and builds its batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]


# ------------------------------------------------------------------ nanoGPT (karpathy/nanoGPT)
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: ``forward(idx, targets)`` returns ``(logits, loss)``; tied embeddings."""

    def __init__(self, vocab: int = 256, block_size: int = 64, n_layer: int = 3, n_embd: int = 64):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block(n_embd, 4) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# ------------------------------------------------------------------ torchtitan's LLaMA
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    x = x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
    return x.reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings (torchtitan's ``wq / wk / wv / wo``)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_rep, self.head_dim = n_heads // n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden_dim: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's LLaMA: layers in a ModuleDict, complex RoPE table as a buffer, logits out."""

    def __init__(self, vocab: int = 256, dim: int = 64, n_layers: int = 3, max_len: int = 64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        freqs = precompute_freqs_cis(dim // 4, max_len * 2)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, 4, 2, 2 * dim) for i in range(n_layers)}
        )
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# ------------------------------------------------------------------ ViT (timm's layout)
class ViTAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ViTAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding, class token, encoder blocks, a classifier head on the class token."""

    def __init__(self, image: int = 32, patch: int = 4, dim: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([EncoderBlock(dim, 4) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def torchvision_vit() -> nn.Module:
    """torchvision's VisionTransformer, tiny (its blocks use nn.MultiheadAttention)."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    )  # fmt: skip


def torchvision_missing() -> str | None:
    """Why torchvision cannot be used here (None: it can). A CUDA build of torchvision beside
    a CPU torch raises RuntimeError at import, not ImportError."""
    try:
        import torchvision.models  # noqa: F401
    except Exception as e:  # any failure to import means: skip
        return f"torchvision does not import: {type(e).__name__}: {str(e)[:80]}"
    return None


# ------------------------------------------------------------------ cases
def cross_entropy(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The loss= of the models returning logits: over tokens, or over images."""
    return F.cross_entropy(out.flatten(0, -2), batch["labels"].flatten())


@dataclass
class Case:
    """How a user runs one plain model: its blocks= and loss=, a batch, and the step's loss."""

    name: str
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], Any]  # the model -> what the user passes as blocks=
    loss: Callable[[Any, Batch], torch.Tensor] | None
    batch: Callable[[torch.Generator], Batch]

    def step_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """What the loop computes: the forward on its inputs, then the loss (the output dropped:
        a loop that keeps nanoGPT's logits through backward holds more than any plan counts)."""
        if self.loss is None:
            return model(**batch)[1]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.loss(model(**inputs), batch)


def _tokens(key: str, rows: int = 4, length: int = 64) -> Callable[[torch.Generator], Batch]:
    def make(g: torch.Generator) -> Batch:
        ids = torch.randint(0, 256, (rows, length), generator=g)
        return {key: ids, ("targets" if key == "idx" else "labels"): ids.roll(-1, 1)}

    return make


def _images(key: str, rows: int = 8) -> Callable[[torch.Generator], Batch]:
    def make(g: torch.Generator) -> Batch:
        images = torch.randn(rows, 3, 32, 32, generator=g)
        return {key: images, "labels": torch.randint(0, 10, (rows,), generator=g)}

    return make


CASES = {
    "nanogpt": Case("nanogpt", GPT, lambda m: "transformer.h.*", None, _tokens("idx")),
    "torchtitan_llama": Case(
        "torchtitan_llama", Transformer, lambda m: "layers.*", cross_entropy, _tokens("tokens")
    ),
    "vit": Case("vit", ViT, lambda m: m.blocks, cross_entropy, _images("pixel_values")),
    "torchvision_vit": Case(
        "torchvision_vit",
        torchvision_vit,
        lambda m: "encoder.layers.*",
        cross_entropy,
        _images("x"),
    ),
}
