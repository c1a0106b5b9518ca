"""Train a small causal transformer with PyTorch SDPA and with cuflash's drop-in, side by side.

    python examples/train_transformer_block.py [--steps 30]

The only difference between the two runs is the attention function: swapping
``F.scaled_dot_product_attention`` for ``cuflash.torch.scaled_dot_product_attention`` is one line.
Both runs start from the same weights and see the same batches, in bfloat16 autocast; the script
prints both loss curves and their largest relative gap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash.torch as cft  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block with grouped-query causal self-attention."""

    def __init__(self, dim: int, heads: int, kv_heads: int, attention) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        a = self.attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, attention, vocab: int = 512, dim: int = 256, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, 8, 2, attention) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(steps: int, batch: int = 8, seq: int = 256, vocab: int = 512, seed: int = 0):
    """A learnable toy language: each token is a fixed function of the two before it."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, vocab), generator=gen)
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        for t in range(2, seq + 1):
            x[:, t] = table[x[:, t - 2], x[:, t - 1]]
        yield x[:, :-1], x[:, 1:]


def train(attention, steps: int = 30, seed: int = 0, device: str = "cuda") -> list[float]:
    torch.manual_seed(seed)
    model = TinyLM(attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for inputs, targets in batches(steps, seed=seed):
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    sdpa = train(F.scaled_dot_product_attention, args.steps)
    ours = train(cft.scaled_dot_product_attention, args.steps)
    for step, (a, b) in enumerate(zip(sdpa, ours, strict=True)):
        print(f"step {step:3d}  SDPA {a:.4f}  cuflash {b:.4f}")
    gap = max(abs(a - b) / a for a, b in zip(sdpa, ours, strict=True))
    print(f"largest relative gap between the loss curves: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
