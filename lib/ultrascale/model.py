"""The course model: a GPT-2-style decoder, a Llama-style decoder, and their counting.

Both models are plain ``nn.Module``s that know nothing about parallelism: each has
``embed``, a ``blocks`` ModuleList, a final ``norm`` and a ``head``, and
``forward(idx, positions=None) -> logits``. Later chapters shard or wrap these pieces
from outside, and three choices make that possible without touching this file:

* attention has separate ``q``, ``k`` and ``v`` projections and reads its head count
  from the shapes it gets, so a tensor-parallel rank holding a column slice of each
  projection (some of the heads) runs the same code;
* ``positions`` gives RoPE the *global* position of every token, so a rank holding a
  slice of the sequence (context parallelism) rotates its tokens correctly;
* ``embed``, ``norm`` and ``head`` may be set to ``None``: a pipeline stage keeps only
  what it runs, and a stage without ``embed`` takes hidden states instead of token ids.

Counting never builds a model: ``count_params`` and ``training_flops`` work on the
config alone, so they run instantly for Llama 3 405B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .moe import MoE, auxiliary_loss, moe_params_per_layer

RECOMPUTE_MODES = ("none", "selective", "full")
ATTENTION_KINDS = ("eager", "sdpa")


# --------------------------------------------------------------------------- configs
# Neither model learns positional embeddings: the book's parameter formula has no
# position term, and rotary embeddings (RoPE) give positions without adding weights.
@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 64  # default length for FLOP counting; RoPE has no length limit
    attention: str = "eager"  # "eager": explicit softmax(QK^T/sqrt(d))V; "sdpa": fused kernel
    rope_theta: float = 10000.0
    # Mixture of experts (ultrascale.moe): 0 keeps the dense MLP; E > 0 puts E expert MLPs
    # and a router choosing top_k of them per token in every block.
    experts: int = 0
    top_k: int = 1
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss added to the training loss
    expert_groups: int = 1  # experts cut into this many groups (e.g. nodes) ...
    group_limit: int = 0  # ... of which a token may use at most this many (0: no limit)

    def __post_init__(self):
        _validate(self)

    @property
    def kv_heads(self) -> int:  # GPT-2 has one K and one V head per query head
        return self.heads

    @property
    def ffn(self) -> int:  # the MLP widens to 4h
        return 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: heads // kv_heads queries share a K/V
    ffn: int = 176  # SwiGLU inner width
    seq_len: int = 64
    tie_embeddings: bool = False
    attention: str = "eager"
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    experts: int = 0  # mixture of experts: as in GPTConfig, SwiGLU experts
    top_k: int = 1
    aux_loss_coef: float = 0.0
    expert_groups: int = 1
    group_limit: int = 0

    def __post_init__(self):
        _validate(self)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _validate(c) -> None:
    if c.hidden % c.heads:
        raise ValueError(f"hidden={c.hidden} must be divisible by heads={c.heads}")
    if c.heads % c.kv_heads:
        raise ValueError(f"heads={c.heads} must be divisible by kv_heads={c.kv_heads}")
    if c.head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of features: head_dim={c.head_dim} must be even")
    if c.attention not in ATTENTION_KINDS:
        raise ValueError(f"attention={c.attention!r}: choose one of {ATTENTION_KINDS}")
    _validate_experts(c)


def _validate_experts(c) -> None:
    if c.experts < 0:
        raise ValueError(f"experts={c.experts} must be 0 (dense MLP) or a positive number of experts")
    if not c.experts:
        return
    if not 1 <= c.top_k <= c.experts:
        raise ValueError(
            f"top_k={c.top_k} must be between 1 and experts={c.experts}: "
            "a token cannot choose more experts than the layer has"
        )
    if c.expert_groups < 1 or c.experts % c.expert_groups:
        raise ValueError(f"expert_groups={c.expert_groups} must divide experts={c.experts}")
    per_group = c.experts // c.expert_groups
    if c.group_limit and not (1 <= c.group_limit <= c.expert_groups and c.top_k <= c.group_limit * per_group):
        raise ValueError(
            f"group_limit={c.group_limit}: choose 1..{c.expert_groups} groups holding at least "
            f"top_k={c.top_k} experts ({per_group} per group)"
        )


# Published Llama 3 shapes (untied embeddings, 8 KV heads, 128K vocabulary).
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, seq_len=8192)
LLAMA3_70B = LlamaConfig(vocab_size=128256, hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, seq_len=8192)
LLAMA3_405B = LlamaConfig(vocab_size=128256, hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248, seq_len=8192)
LLAMA_TINY = LlamaConfig()  # runs in milliseconds on a CPU


# --------------------------------------------------------------------------- building blocks
def rope_tables(positions, head_dim: int, theta: float, device=None):
    """cos and sin of the rotation angle for each (position, feature pair): (seq, head_dim/2).

    ``positions`` is a length (positions 0..length-1) or a 1-D tensor of the tokens'
    global positions, e.g. a context-parallel rank's slice of the sequence.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = torch.outer(positions.float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate feature pairs (i, i + d/2) of x (batch, heads, seq, d) by a position-dependent angle."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # stay in the activation dtype under autocast
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q, k, v, kind: str = "eager"):
    """softmax(Q K^T / sqrt(d)) V with a causal mask; q, k, v are (batch, heads, seq, d).

    "eager" builds the (seq x seq) score matrix explicitly, so it is saved for backward
    and shows the quadratic activation memory; "sdpa" lets PyTorch pick a fused kernel.
    """
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with separate q, k, v projections.

    Head counts are read from the projections' output shapes, never stored: a layer
    whose projections hold only some of the heads (a tensor-parallel shard) just works.

    The attention *core*, ``core(q, k, v) -> y``, is what comes between RoPE and the
    output projection: softmax(Q K^T / sqrt(d)) V with a causal mask, q of shape
    (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim), y shaped
    like q. Assigning a function to ``attn.core`` on an instance replaces it; context
    parallelism does that from outside (ring attention, ``parallel.context_parallel``).
    Selective recomputation (``recompute_core``) checkpoints whatever the core is.
    """

    def __init__(self, hidden, heads, kv_heads, bias, kind):
        super().__init__()
        self.head_dim, self.kind = hidden // heads, kind
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.out = nn.Linear(heads * self.head_dim, hidden, bias=bias)

    def split_heads(self, t):
        """(batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim), heads from the shape."""
        b, s, _ = t.shape
        return t.view(b, s, -1, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, recompute_core=False):
        b, s, _ = x.shape
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if recompute_core:  # selective recomputation: drop the seq x seq tensors, redo them in backward
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))

    def core(self, q, k, v):
        """Causal attention of the whole sequence (see the class docstring; replaceable)."""
        group = q.shape[1] // k.shape[1]
        if group > 1:  # each K/V head serves a group of query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return causal_attention(q, k, v, self.kind)


class MLP(nn.Module):
    """GPT-2 feed-forward: h -> 4h -> h with biases and GELU."""

    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """Llama feed-forward: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def feed_forward(config, make_expert):
    """The dense MLP, or an MoE layer of ``config.experts`` such MLPs (``ultrascale.moe``)."""
    return MoE(config.hidden, config, make_expert) if config.experts else make_expert()


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, norm1, attn, norm2, mlp):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x, cos, sin, recompute_core=False):
        x = x + self.attn(self.norm1(x), cos, sin, recompute_core)
        return x + self.mlp(self.norm2(x))


# --------------------------------------------------------------------------- models
class _Decoder(nn.Module):
    """What GPT and Llama share: embed -> blocks -> norm -> head, and recomputation."""

    def __init__(self, config, blocks, norm, tie_embeddings):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if tie_embeddings:  # one matrix both looks up tokens and scores them
            self.head.weight = self.embed.weight
        self.recompute = "none"  # "none" | "selective" | "full"; see set_recompute
        self.apply(_init_weights)

    def set_recompute(self, mode: str) -> "_Decoder":
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={mode!r}: choose one of {RECOMPUTE_MODES}")
        self.recompute = mode
        return self

    def forward(self, idx, positions=None):
        """Token ids (batch, seq) -> logits (batch, seq, vocab).

        Without ``embed`` (a later pipeline stage) ``idx`` is already the hidden state
        (batch, seq, hidden); without ``norm`` and ``head`` the hidden state is returned.
        ``positions``: the tokens' global positions for RoPE (default 0..seq-1).
        """
        c = self.config
        x = self.embed(idx) if self.embed is not None else idx
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        for block in self.blocks:
            if self.recompute == "full":  # keep only the block input; redo the block in backward
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin, self.recompute == "selective")
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x

    def loss(self, idx, targets, positions=None):
        """The training loss: next-token cross-entropy plus any MoE load-balancing loss."""
        return lm_loss(self(idx, positions), targets) + auxiliary_loss(self)


class GPT(_Decoder):
    """GPT-2-style decoder whose size is exactly h*v + L*(12h^2 + 13h) + 2h."""

    def __init__(self, config: GPTConfig):
        h = config.hidden
        blocks = [
            Block(
                nn.LayerNorm(h),
                Attention(h, config.heads, config.heads, True, config.attention),
                nn.LayerNorm(h),
                feed_forward(config, lambda: MLP(h)),
            )
            for _ in range(config.layers)
        ]
        super().__init__(config, blocks, nn.LayerNorm(h), tie_embeddings=True)


class Llama(_Decoder):
    """Llama-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU, no biases."""

    def __init__(self, config: LlamaConfig):
        h, eps = config.hidden, config.norm_eps
        blocks = [
            Block(
                nn.RMSNorm(h, eps=eps),
                Attention(h, config.heads, config.kv_heads, False, config.attention),
                nn.RMSNorm(h, eps=eps),
                feed_forward(config, lambda: SwiGLU(h, config.ffn)),
            )
            for _ in range(config.layers)
        ]
        super().__init__(config, blocks, nn.RMSNorm(h, eps=eps), config.tie_embeddings)


def build_model(config):
    """GPT for a GPTConfig, Llama for a LlamaConfig."""
    return GPT(config) if isinstance(config, GPTConfig) else Llama(config)


def _init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_loss(logits, targets):
    """Mean next-token cross-entropy; logits (batch, seq, vocab), targets (batch, seq).

    Computed in at least fp32: 16-bit logits are upcast (a softmax over a large
    vocabulary loses too much in bf16), fp64 ones are kept as they are."""
    logits = logits.flatten(0, 1)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, targets.flatten())


# --------------------------------------------------------------------------- counting
def count_params(config) -> int:
    """Number of parameters, from the config alone (never builds the model)."""
    h, v, L = config.hidden, config.vocab_size, config.layers
    moe = L * _moe_extra_params(config)
    if isinstance(config, GPTConfig):
        # per block: two LayerNorms (2h each), q, k, v (3h^2 + 3h), out (h^2 + h),
        # fc (4h^2 + 4h), proj (4h^2 + h)  ->  12h^2 + 13h; final LayerNorm 2h; tied embedding h*v
        return h * v + L * (12 * h * h + 13 * h) + 2 * h + moe
    per_layer = _llama_matmul_params_per_layer(config) + 2 * h  # + two RMSNorm weights
    embeddings = h * v if config.tie_embeddings else 2 * h * v  # input table (+ separate head)
    return embeddings + L * per_layer + h + moe  # + final RMSNorm


def active_params(config) -> int:
    """Parameters one token uses: all of them for a dense model; for an MoE model the
    router and the ``top_k`` experts it is sent to, not all E (the 6N of ``training_flops``)."""
    idle = config.experts - config.top_k if config.experts else 0
    return count_params(config) - config.layers * idle * _ffn_params(config)


def _ffn_params(c) -> int:
    """Parameters of one dense feed-forward (one expert): GPT's MLP with biases, or SwiGLU."""
    h = c.hidden
    return 8 * h * h + 5 * h if isinstance(c, GPTConfig) else 3 * h * c.ffn


def _moe_extra_params(c) -> int:
    """What an MoE layer adds to a dense block: its router and E - 1 more feed-forwards."""
    return moe_params_per_layer(c.hidden, c.experts, _ffn_params(c)) - _ffn_params(c) if c.experts else 0


def _llama_matmul_params_per_layer(c: LlamaConfig) -> int:
    kv = c.kv_heads * c.head_dim
    attention = 2 * c.hidden * c.hidden + 2 * c.hidden * kv  # q and out are h x h; k and v h x kv
    return attention + 3 * c.hidden * c.ffn  # gate, up, down


def matmul_params(config) -> int:
    """Parameters used in a matrix multiply (2 FLOPs per token each in forward).

    Excludes norms and biases (element-wise) and an untied input embedding (a lookup);
    the head always multiplies, tied or not. In an MoE layer a token multiplies with the
    router (h x E) and its ``top_k`` experts only.
    """
    h, v, L = config.hidden, config.vocab_size, config.layers
    ffn = 8 * h * h if isinstance(config, GPTConfig) else 3 * h * config.ffn  # one feed-forward's matmuls
    moe = L * (h * config.experts + (config.top_k - 1) * ffn) if config.experts else 0
    if isinstance(config, GPTConfig):
        return h * v + L * 12 * h * h + moe
    return h * v + L * _llama_matmul_params_per_layer(config) + moe


def attention_flops_per_token(config, seq_len=None, causal=False) -> int:
    """FLOPs of QK^T and (scores)V per token for forward + backward.

    Per layer and token, forward: the query meets seq keys over h features (2*seq*h) and
    the scores weight seq values (2*seq*h), so 4*seq*h; backward costs twice the forward,
    giving 12*L*h*seq (PaLM's 12*L*H*Q*T). Eager attention computes the full matrix, so that
    is our default; a causal kernel that skips the masked half does 6*L*h*seq.
    """
    seq = seq_len or config.seq_len
    full = 12 * config.layers * config.hidden * seq
    return full // 2 if causal else full


def training_flops(config, tokens, seq_len=None, causal=False) -> int:
    """Forward + backward FLOPs for `tokens` tokens: 6*N per token plus the attention term
    (N: the parameters a token uses, ``active_params``; all of them in a dense model).

    6N: each parameter does a multiply-add (2 FLOPs) per token in forward, and backward
    needs twice that (gradients with respect to inputs and to weights).
    """
    return tokens * (6 * active_params(config) + attention_flops_per_token(config, seq_len, causal))


def mfu(tokens_per_s, config, peak_flops, seq_len=None, causal=False) -> float:
    """Model FLOPs utilization: the model's useful FLOPs per second over the hardware peak."""
    return training_flops(config, tokens_per_s, seq_len, causal) / peak_flops


def hfu(tokens_per_s, config, peak_flops, recompute="full", seq_len=None, causal=False) -> float:
    """Hardware FLOPs utilization: also counts FLOPs spent recomputing activations.

    Full recomputation repeats the forward (a third of fwd+bwd: +2N per token), so
    HFU/MFU = 8/6; selective recomputation repeats only the attention-score forward.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE_MODES}")
    model = training_flops(config, tokens_per_s, seq_len, causal)
    extra = {
        "none": 0,
        "full": model / 3,
        "selective": tokens_per_s * attention_flops_per_token(config, seq_len, causal) / 3,
    }
    return (model + extra[recompute]) / peak_flops
