"""The model-shaped case of the DCP benchmark: a GPT-like transformer under FSDP2 + AdamW.

``12,768,21120`` (layers, hidden, vocab; untied head, biases, LayerNorms) has 117.5 M
parameters; with AdamW's two moments, the saved state is 1.31 GiB of fp32. Every rank
builds the same model (seeded), shards each block and then the root with ``fully_shard``
on a 1-D mesh of all ranks, and takes one AdamW step on a few tokens so the optimizer
state exists. The state dict is ``{"model": ..., "optim": ...}`` from
``torch.distributed.checkpoint.state_dict.get_state_dict``, put back with
``set_state_dict`` after a load.
"""

from __future__ import annotations

from typing import Any


def parse_model(text: str) -> tuple[int, int, int]:
    """``"12,768,21120"`` -> (layers, hidden, vocab)."""
    try:
        layers, hidden, vocab = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--model wants LAYERS,HIDDEN,VOCAB (e.g. 12,768,21120), got {text!r}") from None
    if hidden % 64:
        raise ValueError(f"hidden size {hidden} must be a multiple of 64 (heads of 64)")
    return layers, hidden, vocab


def param_count(layers: int, hidden: int, vocab: int) -> int:
    h = hidden
    return layers * (12 * h * h + 13 * h) + 2 * h + 2 * vocab * h


def build(layers: int, hidden: int, vocab: int, seed: int = 0):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
            self.heads = h // 64

        def forward(self, x):
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    return GPT()


def sharded_model_and_optimizer(spec: tuple[int, int, int], ws: int) -> tuple[Any, Any]:
    """FSDP2 over all ``ws`` ranks, AdamW stepped once (so its state exists)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers, hidden, vocab = spec
    model = build(layers, hidden, vocab)
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (1, 16), generator=g)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.view(-1, vocab), tokens.view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_dict_of(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def apply_state_dict(model: Any, opt: Any, sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def local_tensors(sd: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor leaf (a DTensor's local shard), by dotted path."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    if isinstance(sd, DTensor):
        out[prefix] = sd._local_tensor
    elif isinstance(sd, torch.Tensor):
        out[prefix] = sd
    elif isinstance(sd, dict):
        for k, v in sd.items():
            out.update(local_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(local_tensors(v, f"{prefix}.{i}"))
    return out


def local_bytes(sd: Any) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(sd).values())
