"""Typical scales of LLM training (the book's appendix A2): how many numbers, how many FLOPs.

Back-of-the-envelope counts for a decoder with hidden size ``h``. Everything is counted
in *elements*; multiply by the bytes of the element type (``memory.BYTES_PER_ELEMENT``)
to get bytes. All functions are plain integer arithmetic on their arguments, so they
also accept numpy arrays, and sympy symbols (the overlap chapter derives its ratios by
calling them with symbols).

* Activations: a micro-batch of ``mbs`` sequences of ``seq`` tokens is ``seq * mbs``
  tokens; the hidden state passed from one layer to the next has ``seq * mbs * h``
  elements.
* Weights: a weight matrix is about ``h^2``; its gradient has the same size. Adam keeps,
  per weight element, a momentum and a variance, and mixed precision adds an fp32
  master copy: 3 fp32 elements per weight (``optimizer_state_elements``).
* A bias-free block: attention q, k, v (``3h^2``) and output (``h^2``); a GLU MLP with
  gate and up (two ``h x 4h``) and down (``4h x h``) is ``12h^2``, a plain MLP ``8h^2``.
  So ``16h^2`` per block with GLU, ``12h^2`` without (``block_params``).
* Around the blocks: the input embedding ``vocab * h``, an untied LM head another
  ``vocab * h``, learned positions ``max_seq_len * h`` if used (``embedding_params``).
* FLOPs: each parameter does one multiply-add (2 FLOPs) per token in forward, and
  backward does twice that: ``2 T N`` forward, ``4 T N`` backward, ``6 T N`` together
  (``forward_flops``, ``backward_flops``; ``model.training_flops`` adds attention).

``scale_row(config, seq, mbs)`` puts these side by side for a real configuration (the
Llama 3 presets of ``ultrascale.model``), next to the exact counts of the course model.
"""

from __future__ import annotations

from .memory import BYTES_PER_ELEMENT
from .model import LlamaConfig, count_params, matmul_params

# The three fp32 tensors the optimizer keeps for every weight element (Adam, mixed precision).
OPTIMIZER_STATES = ("momentum", "variance", "master weights")
# The book's wording gives the optimizer's total per weight matrix as 6h^2; its parts add
# to 3h^2 fp32 elements (12h^2 bytes). Kept here only to be quoted, never used.
BOOK_OPTIMIZER_TOTAL_AS_PRINTED = 6


# --------------------------------------------------------------------------- activations
def tokens(seq, mbs):
    """Tokens in one micro-batch: ``seq * mbs``."""
    return seq * mbs


def hidden_state_elements(seq, mbs, h):
    """Elements of the hidden state between two layers: ``seq * mbs * h``."""
    return seq * mbs * h


# --------------------------------------------------------------------------- weights and states
def weight_elements(h):
    """Elements of one ``h x h`` weight matrix (and of its gradient): ``h^2``."""
    return h * h


def optimizer_state_elements(num_params) -> dict:
    """The fp32 elements the optimizer keeps for ``num_params`` weights, by state.

    Adam's momentum and variance (``2 N``) and the fp32 master weights of mixed precision
    (``N``): ``3 N`` fp32 elements, 12 bytes per weight. For one ``h x h`` matrix,
    ``optimizer_state_elements(h * h)`` adds up to ``3h^2``.
    """
    return {state: num_params for state in OPTIMIZER_STATES}


# --------------------------------------------------------------------------- one block
def block_matrices(h, glu: bool = True) -> dict:
    """Parameters of each weight matrix of a bias-free transformer block, by role.

    The MLP widens to ``4h``; a GLU MLP has two input matrices (gate and up), a plain one
    has one. Norm weights (``2h`` or ``4h`` per block) are left out, as in the book.
    """
    mlp_in = {"mlp gate + up": 2 * 4 * h * h} if glu else {"mlp up": 4 * h * h}
    return {"attention q, k, v": 3 * h * h, "attention out": h * h, **mlp_in, "mlp down": 4 * h * h}


def block_params(h, glu: bool = True):
    """Parameters of one bias-free block: ``16h^2`` with a GLU MLP, ``12h^2`` without."""
    return sum(block_matrices(h, glu).values())


def embedding_params(vocab, h, tied: bool = True, max_seq_len=0):
    """Input embedding ``vocab * h``, plus ``vocab * h`` for an untied LM head, plus
    ``max_seq_len * h`` for learned positional embeddings (0: none, e.g. RoPE)."""
    return vocab * h * (1 if tied else 2) + max_seq_len * h


def model_params(h, layers, vocab, glu: bool = True, tied: bool = True, max_seq_len=0):
    """The book's estimate of a whole model: ``layers * block_params + embedding_params``."""
    return layers * block_params(h, glu) + embedding_params(vocab, h, tied, max_seq_len)


# --------------------------------------------------------------------------- FLOPs
def forward_flops(num_tokens, num_params):
    """Forward FLOPs: one multiply-add (2 FLOPs) per parameter per token, ``2 T N``."""
    return 2 * num_tokens * num_params


def backward_flops(num_tokens, num_params):
    """Backward FLOPs, ``4 T N``: a gradient for the inputs and one for the weights, each
    costing as much as the forward."""
    return 4 * num_tokens * num_params


# --------------------------------------------------------------------------- a real configuration
def _a2_block(config):
    """A2's ``16h^2`` block for a model with a gated MLP (Llama), ``12h^2`` for the GPT."""
    return block_params(config.hidden, glu=isinstance(config, LlamaConfig))


def scale_row(config, seq=None, mbs: int = 1, param_dtype: str = "bf16", activation_dtype: str = "bf16") -> dict:
    """A2's counts for one model configuration and micro-batch, in elements and bytes.

    Returns a dict with
    * ``tokens`` (``seq * mbs``) and ``hidden state`` (elements per layer);
    * ``weight matrix`` (``h^2``), ``block (A2)`` (``16h^2``, or ``12h^2`` for the GPT) and
      ``block (exact)``, the matrix parameters of one layer of the course model;
    * ``parameters (A2)``: ``layers * block (A2) + embeddings``; ``parameters``: the exact
      ``model.count_params``; ``gradients`` (as many); ``optimizer states`` (3 fp32 per
      parameter);
    * ``bytes``: a dict of the bytes of ``hidden state``, ``parameters``, ``gradients``
      (in ``param_dtype``) and ``optimizer states`` (fp32);
    * ``forward FLOPs`` and ``backward FLOPs`` of the micro-batch (``2TN``, ``4TN``) with
      ``N = parameters``.
    """
    seq = seq or config.seq_len
    h, layers, vocab = config.hidden, config.layers, config.vocab_size
    tied = getattr(config, "tie_embeddings", True)  # the course GPT always ties
    a2_block = _a2_block(config)
    n = count_params(config)
    exact_block = (matmul_params(config) - vocab * h) // layers if layers else 0
    states = sum(optimizer_state_elements(n).values())
    t = tokens(seq, mbs)
    row = {
        "tokens": t,
        "hidden state": hidden_state_elements(seq, mbs, h),
        "weight matrix": weight_elements(h),
        "block (A2)": a2_block,
        "block (exact)": exact_block,
        "parameters (A2)": layers * a2_block + embedding_params(vocab, h, tied),
        "parameters": n,
        "gradients": n,
        "optimizer states": states,
        "forward FLOPs": forward_flops(t, n),
        "backward FLOPs": backward_flops(t, n),
    }
    p, a = BYTES_PER_ELEMENT[param_dtype], BYTES_PER_ELEMENT[activation_dtype]
    row["bytes"] = {
        "hidden state": a * row["hidden state"],
        "parameters": p * n,
        "gradients": p * n,
        "optimizer states": BYTES_PER_ELEMENT["fp32"] * states,
    }
    return row
