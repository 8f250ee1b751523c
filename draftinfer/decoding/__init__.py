"""The round: the speculative decoding loop (`engine`), proposers, verification and
sampling, the KV cache, CUDA graphs and compiled pieces, the reference loop and the plain
decode baseline."""
