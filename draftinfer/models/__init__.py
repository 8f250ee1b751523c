"""The models' shared pieces: the native decoder every target family subclasses, its KV cache,
the layers and rotary embeddings drafters and targets share, the target interface (seam 2)
and the serving transforms."""
