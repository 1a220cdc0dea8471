"""A zoo of real architectures for coverage tests.

``ZOO`` maps a name to a factory that returns an :class:`~runtime.examples.Example`
(model, positional inputs, loss_fn, keyword inputs). Unlike ``EXAMPLES``, these
models are not chosen to be traceable: they are what users actually train, with
Hugging Face outputs and keyword inputs, dropout, GQA, RoPE, mixture-of-experts
routing, recurrent layers, value-dependent Python loops and layer drop. Every
model is built from a tiny config with random weights (no download), is in train
mode with dropout active, and takes one training step on a CPU well under a
second. The same arguments always give the same weights, inputs and targets; the
global RNG state is left untouched. The ``hf-*`` entries need ``transformers``
(the ``hf`` extra), imported only when such a factory is called.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from remat.runtime.examples import Example, cross_entropy, seeded, unet


# ------------------------------------------------------------------ Hugging Face
def _hf_model(model_cls: str, config_cls: str, attn: str | None, **config):
    """Build ``transformers.<model_cls>`` from a ``<config_cls>(**config)`` with random weights, train mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    if attn is not None:
        config["attn_implementation"] = attn
    cfg = getattr(transformers, config_cls)(**config)
    return getattr(transformers, model_cls)(cfg).train()


def _token_batch(vocab: int, batch: int, seq_len: int, first_token: int = 4):
    """Random ids, an attention mask padding the last quarter of the last row, labels with -100 on the pads."""
    ids = torch.randint(first_token, vocab, (batch, seq_len))
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[-1, seq_len - seq_len // 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)  # pad id 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _hf_loss(out) -> torch.Tensor:
    return out.loss


def hf_gpt2(*, n_layer=4, d_model=128, n_head=4, vocab=1024, batch=4, seq_len=64, dropout=0.1, attn="sdpa", seed=0):
    """GPT2LMHeadModel (lm_head tied to wte); kwargs input_ids, attention_mask, labels."""
    with seeded(seed):
        model = _hf_model(
            "GPT2LMHeadModel", "GPT2Config", attn, n_layer=n_layer, n_embd=d_model, n_head=n_head,
            vocab_size=vocab, n_positions=128, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            use_cache=False,
        )
        ids, mask, labels = _token_batch(vocab, batch, seq_len)
    assert model.lm_head.weight is model.transformer.wte.weight
    return Example(model, (), _hf_loss, dict(input_ids=ids, attention_mask=mask, labels=labels))


def hf_bert(*, n_layer=2, d_model=128, n_head=4, vocab=1024, batch=4, seq_len=64, dropout=0.1, attn="sdpa", seed=0):
    """BertForMaskedLM with 15% of tokens masked; labels are -100 except on masked positions."""
    mask_id = 3
    with seeded(seed):
        model = _hf_model(
            "BertForMaskedLM", "BertConfig", attn, num_hidden_layers=n_layer, hidden_size=d_model,
            num_attention_heads=n_head, intermediate_size=2 * d_model, vocab_size=vocab, max_position_embeddings=128,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=0,
        )
        ids, mask, _ = _token_batch(vocab, batch, seq_len)
        masked = (torch.rand(batch, seq_len) < 0.15) & (mask == 1)
        masked[:, 0] = True  # at least one target per row
        labels = ids.masked_fill(~masked, -100)
        ids = ids.masked_fill(masked, mask_id)
    return Example(model, (), _hf_loss, dict(input_ids=ids, attention_mask=mask, labels=labels))


def hf_llama(*, n_layer=2, d_model=128, n_head=4, n_kv_head=2, vocab=1024, batch=4, seq_len=64, dropout=0.1,
             attn="sdpa", seed=0):
    """LlamaForCausalLM with GQA (4 query / 2 key-value heads), RoPE, SwiGLU, attention dropout."""
    with seeded(seed):
        model = _hf_model(
            "LlamaForCausalLM", "LlamaConfig", attn, num_hidden_layers=n_layer, hidden_size=d_model,
            intermediate_size=2 * d_model, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
            vocab_size=vocab, max_position_embeddings=128, attention_dropout=dropout, use_cache=False,
        )
        ids, mask, labels = _token_batch(vocab, batch, seq_len)
    return Example(model, (), _hf_loss, dict(input_ids=ids, attention_mask=mask, labels=labels))


def hf_t5(*, n_layer=2, d_model=128, n_head=4, vocab=1024, batch=4, seq_len=64, tgt_len=32, dropout=0.1,
          attn="sdpa", seed=0):
    """T5ForConditionalGeneration; decoder inputs are derived from labels (shifted right)."""
    with seeded(seed):
        model = _hf_model(
            "T5ForConditionalGeneration", "T5Config", attn, num_layers=n_layer, num_decoder_layers=n_layer,
            d_model=d_model, d_kv=d_model // n_head, d_ff=2 * d_model, num_heads=n_head, vocab_size=vocab,
            dropout_rate=dropout, pad_token_id=0, decoder_start_token_id=0, use_cache=False,
        )
        ids, mask, _ = _token_batch(vocab, batch, seq_len)
        _, _, labels = _token_batch(vocab, batch, tgt_len)
    return Example(model, (), _hf_loss, dict(input_ids=ids, attention_mask=mask, labels=labels))


def hf_vit(*, n_layer=4, d_model=128, n_head=4, image=32, patch=8, n_classes=10, batch=8, dropout=0.1,
           attn="sdpa", seed=0):
    """ViTForImageClassification on 32x32 images with 8x8 patches; kwargs pixel_values, labels."""
    with seeded(seed):
        model = _hf_model(
            "ViTForImageClassification", "ViTConfig", attn, num_hidden_layers=n_layer, hidden_size=d_model,
            num_attention_heads=n_head, intermediate_size=2 * d_model, image_size=image, patch_size=patch,
            num_labels=n_classes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        )
        pixels = torch.randn(batch, 3, image, image)
        labels = torch.randint(n_classes, (batch,))
    return Example(model, (), _hf_loss, dict(pixel_values=pixels, labels=labels))


def hf_moe(*, n_layer=4, d_model=128, n_head=4, n_kv_head=2, n_experts=4, top_k=2, vocab=1024, batch=4,
           seq_len=64, dropout=0.1, attn="sdpa", experts=None, seed=0):
    """MixtralForCausalLM, 4 experts with top-2 routing; out.loss includes the router aux loss.

    ``experts`` picks the experts implementation: None (transformers' default, "grouped_mm"),
    "batched_mm", or "eager" (a Python loop over the experts hit, with data-dependent shapes).
    """
    extra = {} if experts is None else dict(experts_implementation=experts)
    with seeded(seed):
        model = _hf_model(
            "MixtralForCausalLM", "MixtralConfig", attn, num_hidden_layers=n_layer, hidden_size=d_model,
            intermediate_size=2 * d_model, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
            num_local_experts=n_experts, num_experts_per_tok=top_k, output_router_logits=True,
            vocab_size=vocab, max_position_embeddings=128, attention_dropout=dropout, use_cache=False, **extra,
        )
        ids, mask, labels = _token_batch(vocab, batch, seq_len)
    return Example(model, (), _hf_loss, dict(input_ids=ids, attention_mask=mask, labels=labels))


# -------------------------------------------------------------------- torch-only
class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab: int, d_model: int, nhead: int, n_layer: int, max_len: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.transformer = nn.Transformer(
            d_model, nhead, n_layer, n_layer, dim_feedforward=2 * d_model, dropout=dropout, batch_first=True
        )
        self.out = nn.Linear(d_model, vocab)

    def _embed(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.embed(tokens) * math.sqrt(self.embed.embedding_dim) + self.pos(positions)

    def forward(self, src, tgt):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.transformer(self._embed(src), self._embed(tgt), tgt_mask=causal, tgt_is_causal=True)
        return self.out(h)


def transformer(*, vocab=512, d_model=64, nhead=4, n_layer=2, batch=8, src_len=32, tgt_len=32, dropout=0.1, seed=0):
    """nn.Transformer encoder-decoder (2+2 layers) with a causal target mask built in forward; inputs (src, tgt)."""
    with seeded(seed):
        model = Seq2SeqTransformer(vocab, d_model, nhead, n_layer, max(src_len, tgt_len), dropout).train()
        src = torch.randint(vocab, (batch, src_len))
        tgt = torch.randint(vocab, (batch, tgt_len))
        targets = torch.randint(vocab, (batch, tgt_len))
    return Example(model, (src, tgt), cross_entropy(targets))


class LSTMLM(nn.Module):
    def __init__(self, vocab: int, d_embed: int, d_hidden: int, n_layer: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_embed)
        self.lstm = nn.LSTM(d_embed, d_hidden, n_layer, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_hidden, vocab)

    def forward(self, idx):
        h, _ = self.lstm(self.drop(self.embed(idx)))
        return self.head(self.drop(h))


def lstm_lm(*, vocab=1024, d_embed=64, d_hidden=128, n_layer=2, batch=8, seq_len=32, dropout=0.1, seed=0):
    """Embedding -> 2-layer nn.LSTM (inter-layer dropout) -> Linear language model."""
    with seeded(seed):
        model = LSTMLM(vocab, d_embed, d_hidden, n_layer, dropout).train()
        idx = torch.randint(vocab, (batch, seq_len))
        targets = torch.randint(vocab, (batch, seq_len))
    return Example(model, (idx,), cross_entropy(targets))


class Refine(nn.Module):
    """Residual refinement repeated until the update is small (at most ``max_iter`` times): value-dependent trips."""

    def __init__(self, width: int, tol: float, max_iter: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.tol, self.max_iter = tol, max_iter

    def forward(self, h):
        i = 0
        while i < self.max_iter:
            delta = self.block(self.norm(h))
            h, i = h + delta, i + 1
            if delta.norm() < self.tol * h.norm():
                break
        return h


def dyn_loop(*, width=128, in_features=64, n_classes=10, batch=64, tol=0.25, seed=0) -> Example:
    """Traceable Linear/LayerNorm/GELU layers around a value-dependent while loop (3 of at most 4 trips at seed 0)."""
    with seeded(seed):
        model = nn.Sequential(
            nn.Linear(in_features, width), nn.LayerNorm(width), nn.GELU(),
            Refine(width, tol),
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, n_classes),
        ).train()
        x = torch.randn(batch, in_features)
        targets = torch.randint(n_classes, (batch,))
    return Example(model, (x,), cross_entropy(targets))


class EarlyExit(nn.Module):
    """Residual MLP blocks in the top-level forward, stopping early once the update is small:
    neither fx nor torch.export can capture the model as a whole (planned over its modules)."""

    def __init__(self, in_features: int, width: int, depth: int, n_classes: int, tol: float):
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                          nn.Dropout(0.1))
            for _ in range(depth))
        self.out = nn.Linear(width, n_classes)
        self.tol = tol

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            delta = block(h)
            h = h + delta
            if delta.norm() < self.tol * h.norm():
                break
        return self.out(h)


def early_exit(*, width=128, in_features=64, depth=6, n_classes=10, batch=256, tol=0.05, seed=0) -> Example:
    """Residual MLP stack whose top-level forward exits early on a value-dependent test (module-tree path)."""
    with seeded(seed):
        model = EarlyExit(in_features, width, depth, n_classes, tol).train()
        x = torch.randn(batch, in_features)
        targets = torch.randint(n_classes, (batch,))
    return Example(model, (x,), cross_entropy(targets))


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """timm-style stochastic depth: zero whole samples with probability ``p``, rescale the rest (no branching)."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class Residual(nn.Module):
    """Pre-norm residual block (attention or MLP) with layer drop (``mode="layerdrop"``) or drop path."""

    def __init__(self, width: int, n_head: int, kind: str, mode: str, p: float, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.kind, self.mode, self.p = kind, mode, p
        if kind == "attn":
            self.f = nn.MultiheadAttention(width, n_head, dropout=dropout, batch_first=True)
        else:
            hidden = 4 * width
            self.f = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width), nn.Dropout(dropout))

    def forward(self, x):
        if self.mode == "layerdrop" and self.training and torch.rand(()) < self.p:
            return x  # skip the whole block. fx runs torch.rand(()) at trace time and bakes in the draw
        h = self.norm(x)
        h = self.f(h, h, h, need_weights=False)[0] if self.kind == "attn" else self.f(h)
        return x + (drop_path(h, self.p, self.training) if self.mode == "droppath" else h)


class LayerDropNet(nn.Module):
    def __init__(self, vocab: int, width: int, n_head: int, p: float, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        plan = [("attn", "layerdrop"), ("mlp", "layerdrop")] * 2 + [("attn", "droppath"), ("mlp", "droppath")]
        self.blocks = nn.Sequential(*(Residual(width, n_head, k, m, p, dropout) for k, m in plan))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        return self.head(self.norm(self.blocks(self.embed(idx))))


def layerdrop(*, vocab=512, width=64, n_head=4, batch=8, seq_len=32, p=0.2, dropout=0.1, seed=0) -> Example:
    """Residual attention/MLP stack: 4 blocks with layer drop (``torch.rand(()) < p`` branch), 2 with drop path."""
    with seeded(seed):
        model = LayerDropNet(vocab, width, n_head, p, dropout).train()
        idx = torch.randint(vocab, (batch, seq_len))
        targets = torch.randint(vocab, (batch, seq_len))
    return Example(model, (idx,), cross_entropy(targets))


ZOO: dict[str, Callable[..., Example]] = {
    "hf-gpt2": hf_gpt2,
    "hf-bert": hf_bert,
    "hf-llama": hf_llama,
    "hf-t5": hf_t5,
    "hf-vit": hf_vit,
    "hf-moe": hf_moe,
    "transformer": transformer,
    "lstm-lm": lstm_lm,
    "unet": unet,
    "dyn-loop": dyn_loop,
    "layerdrop": layerdrop,
    "early-exit": early_exit,
}
