"""The mixture-of-experts model of the RTP benchmarks (``--experts N``, ``compare.py --preset moe``):
Hugging Face's Mixtral, built locally from a config, with the RTP flags' shape.

``ninp`` is the hidden size, ``nhead`` the attention heads (as many key/value heads), ``nhid`` each
expert's feed-forward width, ``experts`` the experts per layer, of which each token takes ``TOP_K``.
With many experts they are most of each layer's weights, the regime where FSDP2 gathers (and holds the
unsharded gradient of) whole layers of experts and rsdp rotates them in blocks of whole experts.

``MixtureLM`` takes and returns what the fairscale model does (``[seq, batch]`` tokens in,
``[seq, batch, vocab]`` logits out) and names its decoder layers ``layers``, so every strategy's script
shards it as it shards the dense model. Experts run Hugging Face's ``grouped_mm`` implementation (one
grouped GEMM per projection, the one a GPU run would use; its CPU kernel takes float32 and bfloat16).
"""

import torch
import torch.nn as nn

TOP_K = 2  # Mixtral's experts per token


class MixtureLM(nn.Module):
    def __init__(
        self, vocab_size: int, ninp: int, nhead: int, nhid: int, num_decoder_layers: int, max_len: int, experts: int,
        batch_first: bool = False,
    ):
        super().__init__()
        self.batch_first = batch_first  # tokens (batch, seq) in, logits (batch, seq, vocab) out
        import transformers  # only here: the dense benchmarks do not need it

        if ninp % nhead:
            raise ValueError(f"ninp ({ninp}) must be divisible by nhead ({nhead})")
        config = transformers.MixtralConfig(
            vocab_size=vocab_size, hidden_size=ninp, intermediate_size=nhid, num_hidden_layers=num_decoder_layers,
            num_attention_heads=nhead, num_key_value_heads=nhead, head_dim=ninp // nhead, max_position_embeddings=max_len,
            num_local_experts=experts, num_experts_per_tok=min(TOP_K, experts), use_cache=False, tie_word_embeddings=False,
            experts_implementation="grouped_mm", attn_implementation="sdpa",
        )  # fmt: skip
        self.causal_lm = transformers.MixtralForCausalLM(config)

    @property
    def layers(self) -> nn.ModuleList:
        return self.causal_lm.model.layers

    @property
    def ring_plan(self) -> dict:
        """Hugging Face's tensor-parallel plan of the model, as rsdp's ring plan: each attention one ring."""
        return self.causal_lm.config.base_model_tp_plan

    @torch.no_grad()
    def reset_rotary(self) -> None:
        """Compute the rotary inverse frequencies again: a model built on the meta device gets them
        uninitialised from ``to_empty`` (they are buffers, computed at construction)."""
        rotary = self.causal_lm.model.rotary_emb
        inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return self.causal_lm(input_ids=tokens).logits
        return self.causal_lm(input_ids=tokens.t()).logits.transpose(0, 1)
