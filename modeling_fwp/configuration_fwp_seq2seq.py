"""Configuration of the fast-weight encoder-decoder (Schlag et al. 2021, sec. 6.2 and appendix E: machine
translation)."""
from __future__ import annotations

from .configuration_fwp import FastWeightConfig

CROSS_ATTENTIONS = ("linear", "softmax")


class FastWeightSeq2SeqConfig(FastWeightConfig):
    r"""A pre-LN encoder-decoder Transformer whose softmax attentions are replaced by fast weights.

    Schlag et al. 2021 (sec. 6.2, Table 1; appendix E) train Vaswani et al.'s "big" translation model (6 + 6 layers,
    d 1024, 16 heads, d_key 64, FF 4096) in FAIRSEQ and "compare phi functions" (Linear = ELU + 1, FAVOR+, DPFP) at
    equal dot-product dimension d_dot (Table 6: FAVOR+ ``d_dot = 2 m``, DPFP ``d_dot = 2 d_key nu``), with the
    same training configuration for every model: the softmax kernel ``exp(q . k)`` of the attention is replaced by
    ``phi(q) . phi(k)``. The paper names no attention that keeps the softmax, so every attention here uses phi:

    - encoder self-attention: non-causal linear attention, ``y_i = sum_j (phi(q_i) . phi(k_j)) v_j / sum_j phi(q_i)
      . phi(k_j)`` (eqs. 17-19 with every key written before any query reads: ``W = sum_j v_j phi(k_j)^T``,
      ``z = sum_j phi(k_j)``, ``y_i = W phi(q_i) / (z . phi(q_i))``); padded source keys write nothing.
    - decoder self-attention: causal fast weights, ``update_rule`` "sum" (eqs. 17-19) or "delta" (eqs. 20-28), the
      package's ``FastWeightLinearAttention`` with its constant-size recurrent state.
    - cross-attention (``cross_attention="linear"``, the default, the paper's setup as read above): the same
      non-causal linear attention, queries from the decoder, keys/values from the encoder output. The encoder
      programs one fast weight ``W = sum_j v_j phi(k_j)^T`` and ``z`` per source and head, computed once per source
      and kept in the cache (constant in source length); each decoder step reads it. ``"softmax"`` keeps
      Vaswani et al.'s softmax cross-attention (keys/values cached per source position) for comparison.

    Fields beyond ``FastWeightConfig``'s (which give the model width, heads, FF size, feature map, update rule,
    normalisations and kernel mode of the decoder's fast weights; ``num_hidden_layers`` is the default depth):
        encoder_layers, decoder_layers: the depths (None: ``num_hidden_layers``).
        cross_attention: "linear" or "softmax", see above.
        scale_embedding: multiply token embeddings by sqrt(hidden_size) (Vaswani et al. 2017).
        decoder_start_token_id: the first decoder input (None: ``pad_token_id``, as in Marian / fairseq).

    The encoder and the linear cross-attention always normalise (eq. 19), so the feature map must be non-negative
    ("identity" is refused); ``sum_normalization`` (eq. 29) applies to their keys and queries too. Positions:
    linear attention without positions is permutation invariant, so ``position_embedding_type`` defaults to
    "sinusoidal" (Vaswani et al.'s encoding, as in the paper's FAIRSEQ model).
    """

    model_type = "fwp_seq2seq"
    supported_feature_maps = ("elu", "dpfp", "favor", "relu")

    position_embedding_type: str = "sinusoidal"
    encoder_layers: int | None = None
    decoder_layers: int | None = None
    cross_attention: str = "linear"
    scale_embedding: bool = True
    is_encoder_decoder: bool = True
    # decoder_start_token_id: transformers' generic keyword (kept as an attribute, not declared here: a declared
    # field would count as this family's and be refused by the causal families' configs)

    def __post_init__(self, **kwargs):
        if self.cross_attention not in CROSS_ATTENTIONS:
            raise ValueError(f"`cross_attention` must be one of {CROSS_ATTENTIONS}, got {self.cross_attention!r}")
        for name in ("encoder_layers", "decoder_layers"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, self.num_hidden_layers)
            elif not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1 (or None), got {value!r}")
        super().__post_init__(**kwargs)
        if getattr(self, "decoder_start_token_id", None) is None:
            self.decoder_start_token_id = self.pad_token_id
