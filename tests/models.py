"""Models and data shared by the tests."""
import math

import torch
from torch import nn


class MixedNet(nn.Module):
    """Embedding, conv, layernorm and linear layers, a one-element parameter,
    sizes that no world size divides, and a registration order that differs
    from the forward order (head is registered before fc)."""

    VOCAB, LENGTH, CLASSES = 17, 6, 3

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 7)
        self.head = nn.Linear(13, self.CLASSES)
        self.conv = nn.Conv1d(7, 5, kernel_size=3)
        self.norm = nn.LayerNorm(5)
        self.fc = nn.Linear(5 * (self.LENGTH - 2), 13)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, tokens):
        x = self.embed(tokens).transpose(1, 2)          # (B, 7, L)
        x = self.norm(self.conv(x).transpose(1, 2))     # (B, L-2, 5)
        x = torch.relu(self.fc(x.flatten(1))) * self.scale
        return self.head(x)


def batches(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, MixedNet.VOCAB, (global_batch, MixedNet.LENGTH), generator=g)
        labels = torch.randint(0, MixedNet.CLASSES, (global_batch,), generator=g)
        yield tokens, labels


def global_batch(world_size: int, base: int = 12) -> int:
    """The smallest multiple of `base` that every rank gets an equal share of
    (12 at 2, 3 and 4 ranks; 24 at 8): with a remainder some ranks would
    train on fewer samples than the reference."""
    return base * world_size // math.gcd(base, world_size)


def local_slice(tensor, rank: int, world_size: int):
    if tensor.shape[0] % world_size:
        raise ValueError(f"a global batch of {tensor.shape[0]} does not split evenly over {world_size} ranks; "
                         f"use tests.models.global_batch(world_size)")
    n = tensor.shape[0] // world_size
    return tensor[rank * n:(rank + 1) * n]


def step_on_slice(model, optimizer, x, y, rank: int, world_size: int, float_loss: bool = False):
    """One data-parallel step: this rank's slice of the global batch
    (float_loss: compute the loss in fp32, for low-precision models)."""
    out = model(local_slice(x, rank, world_size))
    torch.nn.functional.cross_entropy(out.float() if float_loss else out, local_slice(y, rank, world_size)).backward()
    optimizer.step()
    optimizer.zero_grad()


def step_on_global_batch(reference, optimizer, x, y):
    """The single-process reference: one step on the whole global batch."""
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
