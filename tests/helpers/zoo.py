"""Models beyond GPT: BERT, ViT, a user's own ``Net`` with its ``NET_POLICY``, Hugging Face models built from
a config, and their batches."""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F


from colab_kit.datasets import SyntheticTokens
from colab_kit.models import BERT, GPT, BERTConfig, GPTConfig, ViT, ViTConfig
from colab_kit.policy import Attention, Policy

from .references import BATCH


# =========================================================================== models beyond GPT (test_models.py
# and the files that test the same zoo: dropout, memory, precision, placements, clipping)
# --------------------------------------------------------------------------- a user's own model
class Mixer(nn.Module):
    """Causal attention with its own names: ``wqkv`` (head by head), ``wo``, ``heads``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wqkv, self.wo = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        return self.wo(self.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm_a, self.mix, self.norm_b = nn.LayerNorm(d), Mixer(d, heads), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.mix(self.norm_a(x))
        return x + self.ff(self.norm_b(x))


class Net(nn.Module):
    def __init__(self, vocab=64, seq=16, d=32, heads=4, depth=4):
        super().__init__()
        torch.manual_seed(7)  # the same weights on every rank
        self.words, self.where = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(depth))
        self.final, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def embed(self, ids):
        return self.words(ids) + self.where(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.final(x))


NET_POLICY = Policy(
    name="net", blocks="layers",
    layers={"words": "vocab", "where": "positions", "final": "norm", "out": "head",
            "layers.*.norm_a": "norm", "layers.*.norm_b": "norm",
            "layers.*.mix.wqkv": "column", "layers.*.mix.wo": "row",
            "layers.*.ff.0": "column", "layers.*.ff.2": "row"},
    attention={"layers.*.mix": Attention(heads=("heads",), attend="attend")},
    embed=lambda m, ids: m.embed(ids), finish=lambda m, x: m.out(m.final(x)), tail=("final", "out"))


# --------------------------------------------------------------------------- models and their data
BERT_CFG = BERTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
VIT_CFG = ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, d_model=32, n_heads=4, n_layers=4)
ZOO_GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)


def make(name: str, tie: bool = True) -> nn.Module:
    """gpt, bert (its head tied to the token table, or not), vit, gpt2 / llama (Hugging Face's) or net (Net)."""
    if name in ("gpt2", "llama"):
        return make_hf(name)
    if name == "gpt":
        return GPT(ZOO_GPT_CFG)
    if name == "bert":
        return BERT(BERTConfig(**{**BERT_CFG.__dict__, "tie_embeddings": tie}))
    if name == "vit":
        return ViT(VIT_CFG)
    return Net()


def mlm_batch(step: int, rows: int = BATCH):
    """Masked-LM batches: ids in 2..63 with trailing padding (id 0) on some rows, about a quarter of the
    real tokens predicted (their input replaced by id 1), -100 elsewhere: every shard counts differently."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(2, 64, (rows, 16), generator=g)
    lengths = torch.randint(6, 17, (rows, 1), generator=g)
    real = torch.arange(16) < lengths
    ids = torch.where(real, ids, 0)
    picked = (torch.rand(rows, 16, generator=g) < 0.25) & real
    picked[0, 0] = True  # at least one
    targets = torch.where(picked, ids, -100)
    return torch.where(picked, 1, ids), targets


def digits():
    from colab_kit.datasets.images import load_digits  # scikit-learn's digits, without importing it on every rank
    return load_digits()


def batch(name: str, step: int):
    if name == "bert":
        return mlm_batch(step)
    if name == "vit":
        x, y = digits()
        i = torch.arange(step * BATCH, (step + 1) * BATCH)
        return x[i], y[i]
    return SyntheticTokens(64, 16, seed=1).batch(step, BATCH)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


def make_hf(name: str, dropout: float = 0.0):
    """A small Hugging Face model, built from a config (no download), the same weights on every rank: GPT-2,
    Llama, Llama's kin (``mistral`` without a sliding window, ``mistral-window`` with one of 8 tokens, ``qwen2``
    with q/k/v biases, ``qwen3`` with per-head q/k norms), or ``neox`` (GPT-NeoX: no policy, dp and ZeRO only);
    ``dropout``: a GPT-2's residual, embedding and attention dropout."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, n_positions=16, vocab_size=64, resid_pdrop=dropout, embd_pdrop=dropout,
            attn_pdrop=dropout, bos_token_id=0, eos_token_id=0))
    llama = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                 pad_token_id=0)
    if name in ("mistral", "mistral-window"):
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            **llama, sliding_window=8 if name == "mistral-window" else None))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**llama, head_dim=8))
    if name == "neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama))


def assert_params_match(got: dict, want: dict, opt: str, where) -> None:
    """Final parameters equal the single process's, every one of them. AdamW divides each gradient
    by its own running size, so an element whose gradient is at rounding noise can move by a small
    fraction of lr either way: its atol is looser; SGD (which sees the gradient's scale) stays tight.
    Both are far below what three steps move a weight (about 3 lr = 9e-3 for AdamW), so the untrained
    weights fail."""
    assert sorted(got) == sorted(want), where
    atol = 2e-4 if opt == "adamw" else 5e-5
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=atol, msg=lambda m: f"{where} {name}: {m}")
