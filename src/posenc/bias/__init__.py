"""Encodings that add a bias to attention scores: ALiBi and T5's relative buckets."""

from posenc.bias.alibi import ALiBi, alibi_bias, alibi_slopes
from posenc.bias.t5 import T5Bias, t5_relative_bucket

__all__ = ["ALiBi", "T5Bias", "alibi_bias", "alibi_slopes", "t5_relative_bucket"]
