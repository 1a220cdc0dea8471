"""The benchmark's models: the built-in examples, a 2-layer GPT-2 small enough for the exact ILP,
a compute-bound GPT (d=512, sequence 512: matmuls, not Python overhead, decide its step time on
CPU), and (when `transformers` is installed) a Hugging Face GPT-2 with random weights."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from remat.runtime import examples
from remat.runtime.examples import Example


def hf_gpt2(*, batch=4, seq_len=128, seed=0) -> Example:
    """transformers' GPT2LMHeadModel, 2 layers, d=128, random weights (nothing is downloaded)."""
    import transformers  # optional: ImportError when not installed
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(cfg).train()
        idx = torch.randint(cfg.vocab_size, (batch, seq_len))
        targets = torch.randint(cfg.vocab_size, (batch, seq_len))
    return Example(model, (idx,), lambda out: F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size),
                                                              targets.reshape(-1)))


MODELS = {**examples.EXAMPLES, "gpt2-2l": partial(examples.gpt2, n_layer=2),
          "gpt-512": partial(examples.gpt2, n_layer=2, d_model=512, n_head=8, seq_len=512, batch=1),
          "hf-gpt2": hf_gpt2}
