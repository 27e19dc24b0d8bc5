"""Models of the end-to-end benchmark, defined here (no downloads)."""
import torch
from torch import nn
import torch.nn.functional as F


class WideMLP(nn.Module):
    def __init__(self, width=2048, depth=4, classes=10):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                      for _ in range(depth)])
        self.head = nn.Linear(width, classes)
        self.width = width

    def forward(self, x):
        return self.head(self.layers(x))

    def batch(self, n, g):
        return torch.randn(n, self.width, generator=g), torch.randint(0, 10, (n,), generator=g)


class WideInputMLP(nn.Module):
    """One large tensor over half of all parameters: a wide first layer
    (inputs x width, 16 MiB at the defaults: 67% of the 6.3 M parameters)
    and a narrow body. Bucket 0 in forward order then holds one tensor that
    a schedule cannot start sooner than backward's very end unless it is
    partitioned."""

    def __init__(self, inputs=4096, width=1024, depth=2, classes=10):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(inputs, width), nn.GELU())
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                      for _ in range(depth)])
        self.head = nn.Linear(width, classes)
        self.inputs = inputs

    def forward(self, x):
        return self.head(self.layers(self.first(x)))

    def batch(self, n, g):
        return torch.randn(n, self.inputs, generator=g), torch.randint(0, 10, (n,), generator=g)


class Block(nn.Module):
    def __init__(self, channels, stride):
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.skip = nn.Sequential() if stride == 1 else nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False),
                                                                      nn.BatchNorm2d(out))

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.skip(x))


class ResNetish(nn.Module):
    """A small ResNet for 32x32 images: stem, three stages of two blocks."""

    def __init__(self, width=32, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(Block(width, 1), Block(width, 1), Block(width, 2), Block(2 * width, 1),
                                    Block(2 * width, 2), Block(4 * width, 1))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))

    def batch(self, n, g):
        return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


class TinyGPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm causal
    self-attention blocks, a tied output head."""

    def __init__(self, vocab=8192, dim=256, layers=4, heads=4, context=64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.vocab, self.context = vocab, context
        mask = torch.triu(torch.full((context, context), float("-inf")), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx):
        h = self.tokens(idx) + self.positions[: idx.shape[1]]
        h = self.norm(self.blocks(h, mask=self.mask, is_causal=True))
        return (h @ self.tokens.weight.t()).flatten(0, 1)

    def batch(self, n, g):
        idx = torch.randint(0, self.vocab, (n, self.context + 1), generator=g)
        return idx[:, :-1], idx[:, 1:].flatten()


MODELS = {"mlp": WideMLP, "resnet": ResNetish, "gpt": TinyGPT, "widein": WideInputMLP}


def fresh(name: str, **overrides) -> nn.Module:
    """A fresh MODELS[name], the same on every rank (seed 0)."""
    torch.manual_seed(0)
    return MODELS[name](**overrides)
