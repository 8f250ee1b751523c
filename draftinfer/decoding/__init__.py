"""The round: the speculative decoding loop (`engine`), proposers, verification and
sampling, CUDA graphs and compiled pieces, the reference loop and the plain decode baseline."""
