"""Real models from torchvision, timm, Hugging Face transformers and torch.nn,
built from configs (nothing is downloaded), tiny, with dropout 0 so that
training is deterministic; each with its random data and its loss.

Libraries are imported inside the builders: only the worker processes that
train a model import its library.

A ModelSpec gives:
  build()               -> the model (call it under a fixed seed)
  batch(generator, n)   -> a tuple of n-sample tensors (dim 0 is the batch)
  loss(model, batch)    -> (training loss, per-sample losses detached); the
                           training loss is the mean of the per-sample losses,
                           so the loss of a slice of the global batch can be
                           read off the per-sample losses of a reference that
                           ran the whole global batch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

IMAGE = (3, 32, 32)
CLASSES = 10
VOCAB, SEQ = 101, 16


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], Tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, Tuple[torch.Tensor, ...]], Tuple[torch.Tensor, torch.Tensor]]
    optimizers: Tuple[str, ...] = ("adamw",)
    batch_norm: bool = False  # data-parallel training differs from one process: DDP is the yardstick
    amplifies_rounding: bool = False  # see PARAMETER_UPDATE_RTOL in test_real_models.py


# ---- data and losses -----------------------------------------------------------------

def image_batch(g, n):
    return torch.randn(n, *IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def token_batch(g, n):
    return (torch.randint(0, VOCAB, (n, SEQ), generator=g),)


def labelled_token_batch(g, n):
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, 3, (n,), generator=g)


def classifier_loss(model, batch):
    x, y = batch
    per_sample = F.cross_entropy(model(x), y, reduction="none")
    return per_sample.mean(), per_sample.detach()


def causal_lm_loss(model, batch):
    """Hugging Face's own loss from labels=input_ids (mean over every predicted
    token; all sequences have the same length, so it is the mean of the
    per-sequence means computed here from the logits)."""
    (ids,) = batch
    out = model(input_ids=ids, labels=ids)
    vocab = out.logits.shape[-1]
    per_token = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab).detach(), ids[:, 1:].reshape(-1),
                                reduction="none")
    return out.loss, per_token.view(ids.shape[0], -1).mean(1)


def hf_classifier_loss(model, batch):
    ids, y = batch
    out = model(input_ids=ids, labels=y)
    return out.loss, F.cross_entropy(out.logits.detach(), y, reduction="none")


# ---- models --------------------------------------------------------------------------

def resnet18():
    import torchvision
    return torchvision.models.resnet18(num_classes=CLASSES)


def torchvision_vit():
    """Its nn.MultiheadAttention reads out_proj's parameters without calling out_proj."""
    import torchvision
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                                mlp_dim=64, num_classes=CLASSES, dropout=0.0, attention_dropout=0.0)


def timm_vit():
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=CLASSES,
                             drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0,
                             drop_path_rate=0.0)


class TokenTransformer(nn.Module):
    """nn.TransformerEncoder (nn.MultiheadAttention inside) between an
    embedding and a classification head over the mean token."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.randn(SEQ, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids) + self.pos).mean(1))


def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def gpt2():
    """Tied input embedding and LM head."""
    transformers = _quiet_transformers()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2's embeddings should be tied"
    return model


def bert():
    transformers = _quiet_transformers()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0,
                                     problem_type="single_label_classification")
    return transformers.BertForSequenceClassification(config)


SPECS = {spec.name: spec for spec in [
    ModelSpec("resnet18", resnet18, image_batch, classifier_loss, batch_norm=True, amplifies_rounding=True),
    ModelSpec("torchvision-vit", torchvision_vit, image_batch, classifier_loss),
    ModelSpec("timm-vit", timm_vit, image_batch, classifier_loss),
    ModelSpec("nn-transformer-encoder", TokenTransformer, labelled_token_batch, classifier_loss,
              optimizers=("sgd", "adamw")),
    ModelSpec("hf-gpt2", gpt2, token_batch, causal_lm_loss),
    ModelSpec("hf-bert", bert, labelled_token_batch, hf_classifier_loss),
]}

# One set of worker processes per group and world size (spawning and importing are the slow part).
GROUPS = {
    "vision": ("resnet18", "torchvision-vit", "timm-vit"),
    "text": ("nn-transformer-encoder", "hf-gpt2", "hf-bert"),
}


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    # eps 1e-6, not 1e-8: Adam steps by lr * m / (sqrt(v) + eps), which turns
    # float32 rounding noise in a gradient that is zero in exact arithmetic into
    # a step of up to lr * noise / eps. An attention layer's key bias has such a
    # gradient (softmax is invariant to it): its noise, 1e-12..1e-10, differs
    # between one process on the global batch and p ranks averaging. With
    # lr 1e-2 and eps 1e-8, torch DDP itself ends up to 190x the tolerance away
    # from the single process (torchvision's ViT); with lr 1e-3 and eps 1e-6,
    # DDP stays within 0.22x of it on every model here, at 2 and 3 ranks.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, eps=1e-6)
