"""The tiny GQA GPT that the data-parallel, ZeRO and gradient-norm tests train (vocab padded 60 -> 64)."""

TINY_GQA_GPT = dict(
    vocab_size=60,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_multiple_of=32,
    max_seq_len=16,
    pad_vocab_to_multiple_of=64,
)
