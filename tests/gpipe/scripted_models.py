"""Models written in Python for tests/gpipe/torchscript_test.cc: a ResNet-like and a GPT-like
nn.Sequential in float64, scripted and saved, and trained here as the oracle of gpipe's training.

  python3 scripted_models.py make <folder>
      writes <model>.pt (the scripted model, untrained), <model>_trained.pt (the same after
      STEPS steps) and <model>_losses.txt (each step's loss) for each model;
  python3 scripted_models.py check <saved.pt> <trained.pt>
      loads both with torch.jit.load and exits 0 when every parameter and buffer agrees to 1e-9.

Each step: SGD (lr 0.05) on a batch of BATCH rows split into CHUNKS micro-batches, each
micro-batch's mean squared error weighted by its rows (as a pipeline of CHUNKS micro-batches
computes the mini-batch's loss, batch norm normalising each micro-batch by itself). The data is
a formula both sides compute: sin(0.1 * arange(n) + step), in the batch's shape.
"""
import math
import sys

import torch
from torch import nn

BATCH, CHUNKS, STEPS = 4, 2, 3


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and the input added back."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Block(nn.Module):
    """A GPT block: causal self-attention and an MLP, each after a layer norm, each residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = q.matmul(k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = att.matmul(v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


def models():
    """Each model with its input's and target's shapes (the batch first)."""
    torch.manual_seed(0)
    resnet = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Residual(4), Residual(4),
                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    gpt = nn.Sequential(nn.Linear(5, 8), Block(8, 2), Block(8, 2), nn.LayerNorm(8),
                        nn.Linear(8, 5))
    return {"resnet": (resnet, (BATCH, 2, 6, 6), (BATCH, 3)),
            "gpt": (gpt, (BATCH, 4, 5), (BATCH, 4, 5))}


def data(shape, step: int, shift: float):
    n = 1
    for s in shape:
        n *= s
    return torch.sin(0.1 * torch.arange(n, dtype=torch.float64) + (step + shift)).reshape(shape)


def make(folder: str):
    for name, (model, x_shape, y_shape) in models().items():
        scripted = torch.jit.script(model.double())
        scripted.save(f"{folder}/{name}.pt")
        sgd = torch.optim.SGD(scripted.parameters(), lr=0.05)
        losses = []
        for step in range(STEPS):
            x, y = data(x_shape, step, 0.0), data(y_shape, step, 0.5)
            sgd.zero_grad()
            total = 0.0
            for xc, yc in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
                loss = nn.functional.mse_loss(scripted(xc), yc) * (xc.size(0) / BATCH)
                loss.backward()
                total += loss.item()
            sgd.step()
            losses.append(total)
        scripted.save(f"{folder}/{name}_trained.pt")
        with open(f"{folder}/{name}_losses.txt", "w") as f:
            f.write("\n".join(repr(v) for v in losses) + "\n")


def check(saved: str, trained: str) -> int:
    a, b = torch.jit.load(saved), torch.jit.load(trained)
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        print(f"the names differ: {sorted(sa.keys() ^ sb.keys())}")
        return 1
    worst = max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)
    print(f"{len(sa)} tensors, the largest difference {worst:.3g}")
    return 0 if worst <= 1e-9 else 1


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit(check(sys.argv[2], sys.argv[3]))
